"""What an engine step costs on one CUDA GPU as a function of the tokens it computes: the curve that decides where
speculation pays (verifying k drafts for each of B requests computes B (k + 1) tokens where decoding computes B),
and that the draft planner (actor/draft_planner.StepCost) learns online from the engine's own steps.

    python -m bench.step_cost --out runs/bench/step_cost.json      (~1 min on an H200; exits at once without CUDA)
    python -m bench.step_cost --device cpu --out PATH              (~1 min: the CPU presets' target, fp32, 1 thread)

Per weight shape, the step's weight matmuls (every layer's QKV, output, gate/up and down projections, then the LM
head) on random bf16 weights, replayed as one CUDA graph (as vLLM runs decode steps: no launch overhead), median of
20 replays per token count. Attention and the rest of a step are left out: what is measured is how the weights'
cost grows with the tokens. Shapes: the rollout benchmark's `gpu` preset target (bench/rollout.py `TARGETS`), the
narrower one it had before (a 128-wide residual stream beside 81,920 MLP units), and Qwen3-1.7B's and Qwen3-8B's;
with `--device cpu`, the CPU presets' target in fp32 on one thread, as the rollout benchmark runs it (eagerly).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# hidden, query dim, key/value dim (each), MLP units, layers, vocabulary
SHAPES = {"gpu_preset_target": (2048, 2048, 1024, 6144, 28, 272),
          "gpu_preset_target_narrow": (128, 2048, 1024, 81920, 32, 272),
          "qwen3_1.7b": (2048, 2048, 1024, 6144, 28, 151936),
          "qwen3_8b": (4096, 4096, 1024, 12288, 36, 151936)}
CPU_SHAPES = {"cpu_preset_target": (128, 1024, 512, 8192, 20, 272)}
TOKENS = (1, 2, 4, 8, 16, 32, 40, 64, 80, 128, 160, 256, 320, 512, 640, 1024, 1280)


@torch.no_grad()
def step_cost(shape: tuple[int, ...], tokens: tuple[int, ...], device: str = "cuda", dtype=torch.bfloat16) -> dict:
    """Milliseconds of the weight matmuls of one step per token count, and per B requests the cost of a step that
    verifies 4 drafts each (5B tokens) over one that decodes (B tokens), where both were measured."""
    hidden, q, kv, inter, layers, vocab = shape

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device=device, dtype=dtype) * cols ** -0.5

    stack = [(weight(q + 2 * kv, hidden), weight(hidden, q), weight(2 * inter, hidden), weight(hidden, inter))
             for _ in range(layers)]
    head = weight(vocab, hidden)
    seconds = {}
    for n in tokens:
        x = torch.randn(n, hidden, device=device, dtype=dtype)

        def forward():
            h = x
            for qkv, out, gate_up, down in stack:
                h = h + F.linear(F.linear(h, qkv)[:, :q], out)
                g, u = F.linear(h, gate_up).chunk(2, dim=-1)
                h = h + F.linear(F.silu(g) * u, down)
            return F.linear(h, head)

        run = forward
        if device == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    forward()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward()
            run = graph.replay
        run()
        seconds[n] = statistics.median(timed(run, device) for _ in range(20 if device == "cuda" else 3))
    parameters = layers * hidden * (2 * q + 2 * kv + 3 * inter) + vocab * hidden
    return {"parameters": parameters, "dtype": str(dtype).removeprefix("torch."),
            "ms_by_tokens": {n: round(1e3 * s, 4) for n, s in seconds.items()},
            "verify_k4_over_decode_by_requests": {b: round(seconds[5 * b] / seconds[b], 3)
                                                  for b in tokens if 5 * b in seconds}}


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/step_cost.json"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench.step_cost needs a CUDA GPU; this machine has none (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    if not cuda:
        torch.set_num_threads(1)  # as a rollout actor's engine runs (actor/engine.py ENGINE_ENV)
    result = {"device": torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} thread)",
              "torch": torch.__version__, "shapes": {}}
    for name, shape in (SHAPES if cuda else CPU_SHAPES).items():
        tokens, dtype = (TOKENS, torch.bfloat16) if cuda else (TOKENS[:TOKENS.index(640) + 1], torch.float32)
        result["shapes"][name] = {"shape": dict(zip(("hidden", "q", "kv", "mlp", "layers", "vocab"), shape)),
                                  **step_cost(shape, tokens, args.device, dtype)}
        print(name, result["shapes"][name], flush=True)
        if cuda:
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
