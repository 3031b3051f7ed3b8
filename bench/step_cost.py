"""What an engine step costs on one CUDA GPU as a function of the tokens it computes: the curve that decides where
speculation pays (verifying k drafts for each of B requests computes B (k + 1) tokens where decoding computes B),
and that the draft planner (actor/draft_planner.StepCost) learns online from the engine's own steps.

    python -m bench.step_cost --out runs/bench/step_cost.json      (~2 min on an H100; exits at once without CUDA)
    python -m bench.step_cost --device cpu --out PATH              (~3 min: the CPU presets' target, fp32, 1 thread)

Per weight shape, the step's weight matmuls (every layer's QKV, output, gate/up and down projections, then the LM
head) on random weights, replayed as one CUDA graph (as vLLM runs decode steps: no launch overhead), median of
20 replays per token count: how the weights' cost grows with the tokens. Then the same step with attention over a
KV cache (`--contexts`, tokens each request already holds, each layer its own cache, head dimension 128, a query
head group's rows attending together so each key and value is read once, as decoding kernels do), timed per number
of requests B for a decode step (one query each) and a step verifying 4 drafts each (five queries attending to all
context + 5 keys: the causal mask over the last five changes none of the cost; the step's own keys are not written
back); combinations whose caches would pass `--cache-gib` are skipped. Layer norms, rotary embeddings and the
sampler are left out. Shapes: the rollout benchmark's `gpu` preset target (bench/rollout.py `TARGETS`), a narrow
alternative to it (a 128-wide residual stream beside 81,920 MLP units), and Qwen3-1.7B's and Qwen3-8B's;
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


HEAD_DIM = 128
REQUESTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def random_layers(shape: tuple[int, ...], device: str, dtype) -> tuple[list, torch.Tensor]:
    hidden, q, kv, inter, layers, vocab = shape

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device=device, dtype=dtype) * cols ** -0.5

    return ([(weight(q + 2 * kv, hidden), weight(hidden, q), weight(2 * inter, hidden), weight(hidden, inter))
             for _ in range(layers)], weight(vocab, hidden))


def decoder(h: torch.Tensor, stack: list, head: torch.Tensor, attend) -> torch.Tensor:
    """The step's layers on the rows `h`: `attend(layer, qkv rows)` gives the rows the output projection takes."""
    for layer, (qkv, out, gate_up, down) in enumerate(stack):
        h = h + F.linear(attend(layer, F.linear(h, qkv)), out)
        g, u = F.linear(h, gate_up).chunk(2, dim=-1)
        h = h + F.linear(F.silu(g) * u, down)
    return F.linear(h, head)


def graphed(forward, device: str):
    """`forward` captured as one CUDA graph (its replay returned) on a GPU, as vLLM runs decode steps: no launch
    overhead; `forward` itself on the CPU."""
    if device != "cuda":
        return forward
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return graph.replay


def replay_ms(forward, device: str) -> float:
    """Median milliseconds of `forward`: one CUDA graph's replays on a GPU, eager calls on the CPU."""
    run = graphed(forward, device)
    run()
    return 1e3 * statistics.median(timed(run, device) for _ in range(20 if device == "cuda" else 3))


@torch.no_grad()
def step_cost(shape: tuple[int, ...], tokens: tuple[int, ...], device: str = "cuda", dtype=torch.bfloat16) -> dict:
    """Milliseconds of the weight matmuls of one step per token count, and per B requests the cost of a step that
    verifies 4 drafts each (5B tokens) over one that decodes (B tokens), where both were measured."""
    hidden, q, kv, inter, layers, vocab = shape
    stack, head = random_layers(shape, device, dtype)
    ms = {}
    for n in tokens:
        x = torch.randn(n, hidden, device=device, dtype=dtype)
        ms[n] = replay_ms(lambda: decoder(x, stack, head, lambda _, rows: rows[:, :q]), device)
    parameters = layers * hidden * (2 * q + 2 * kv + 3 * inter) + vocab * hidden
    return {"parameters": parameters, "dtype": str(dtype).removeprefix("torch."),
            "ms_by_tokens": {n: round(m, 4) for n, m in ms.items()},
            "verify_k4_over_decode_by_requests": {b: round(ms[5 * b] / ms[b], 3) for b in tokens if 5 * b in ms}}


@torch.no_grad()
def step_cost_with_attention(shape: tuple[int, ...], requests: tuple[int, ...], context: int, cache_gib: float,
                             device: str = "cuda", dtype=torch.bfloat16) -> dict:
    """Per B requests holding `context` tokens each: milliseconds of a decode step and of a step verifying 4 drafts
    each, weights and attention over the KV cache, and their ratio."""
    hidden, q, kv, inter, layers, vocab = shape
    heads, kv_heads = q // HEAD_DIM, kv // HEAD_DIM
    group = heads // kv_heads
    stack, head = random_layers(shape, device, dtype)
    rows, skipped, keys = {}, [], context + 5
    for b in requests:
        cache_bytes = layers * 2 * b * kv_heads * keys * HEAD_DIM * torch.finfo(dtype).bits // 8
        if cache_bytes > cache_gib * 2 ** 30:
            skipped.append(b)
            continue
        caches = [torch.randn(2, b, kv_heads, keys, HEAD_DIM, device=device, dtype=dtype) for _ in range(layers)]
        row = {}
        for name, queries in (("decode_ms", 1), ("verify_k4_ms", 5)):
            x = torch.randn(b * queries, hidden, device=device, dtype=dtype)
            cached = [cache[:, :, :, : context + queries] for cache in caches]

            def attend(layer: int, rows: torch.Tensor) -> torch.Tensor:
                query = rows[:, :q].view(b, queries, kv_heads, group, HEAD_DIM)
                query = query.permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * queries, HEAD_DIM)
                mixed = F.scaled_dot_product_attention(query, cached[layer][0], cached[layer][1])
                return mixed.view(b, kv_heads, group, queries, HEAD_DIM).permute(0, 3, 1, 2, 4).reshape(-1, q)

            row[name] = round(replay_ms(lambda: decoder(x, stack, head, attend), device), 4)
        row["verify_k4_over_decode"] = round(row["verify_k4_ms"] / row["decode_ms"], 3)
        rows[b] = row
        del caches, cached
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"context": context, "by_requests": rows, "skipped_requests_over_cache_gib": skipped}


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
    parser.add_argument("--contexts", type=int, nargs="*", default=None,
                        help="tokens each request holds for the steps with attention (default: 512 2048 on a GPU; "
                             "none on the CPU, whose engine's attention kernels are not torch's)")
    parser.add_argument("--cache-gib", type=float, default=40.0, help="the largest KV cache to allocate")
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
    contexts = args.contexts if args.contexts is not None else ((512, 2048) if cuda else ())
    for name, shape in (SHAPES if cuda else CPU_SHAPES).items():
        tokens, dtype = (TOKENS, torch.bfloat16) if cuda else (TOKENS[:TOKENS.index(640) + 1], torch.float32)
        result["shapes"][name] = {"shape": dict(zip(("hidden", "q", "kv", "mlp", "layers", "vocab"), shape)),
                                  **step_cost(shape, tokens, args.device, dtype)}
        print(name, result["shapes"][name], flush=True)
        requests = REQUESTS if cuda else REQUESTS[:REQUESTS.index(128) + 1]
        result["shapes"][name]["with_attention"] = [
            step_cost_with_attention(shape, requests, context, args.cache_gib, args.device, dtype)
            for context in contexts]
        for row in result["shapes"][name]["with_attention"]:
            print(name, row, flush=True)
        if cuda:
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
