"""The one prepared GPU check: what one H100/H200 without vLLM can tell about the GPU path, in one command and one
JSON, within 8 minutes.

    python -m bench.gpu_check --out DIR            (on the GPU machine; `--sections` to run fewer)
    python -m bench.gpu_check --dry-run            (anywhere: the sections, what each checks, its expected seconds)
    python -m bench.gpu_check --device cpu --quick --out DIR   (a check of the script itself on a CPU)

The GPU machines lent to this project have torch, triton and transformers but no vLLM, Ray, ZeroMQ, msgspec,
OmegaConf or DeepSpeed, and no network: `make gpu-check-bundle` puts the wheels the sections import and the built-in
models under `runs/gpu_bundle/`, which travels with the working tree (docs/benchmarks.md, "The GPU check", gives the
exact command). Every section runs in a `try`: one that fails records its error and the others still run.

Sections:
- `sampler`: the coupled sampler's noise and samples on the GPU equal the CPU's; its milliseconds and workspace at
  rollout shapes (rows x a 151,936-token vocabulary), bench/gpu_torch.py's `noise` and `sampler`.
- `draft_lm`: `drafters/draft_lm.DraftLM` on the device in bf16, batched drafting of 4 tokens for 1/8/32/128
  requests whose histories grow by one accepted token a step: milliseconds per draft position, for the built-in
  draft LM and a Qwen3-0.6B-shaped one (random weights: what drafting costs, not what it accepts), with its
  one-token passes as CUDA graphs (`drafters/draft_lm_graphs.py`) and eager, and how many proposals the two agree
  on; and the same layers' weight matmuls for as many tokens replayed as one CUDA graph (a graphed pass's floor).
- `step_cost`: a step verifying 4 drafts against a decode step (bench/step_cost.py's weight matmuls as one CUDA
  graph) for Qwen3-8B's shape and the `gpu` rollout preset's target, 1-128 requests.
- `learner`: the built-in policy in bf16 on the device: a GRPO group decoded with the coupled sampler (one token
  per forward, KV cache), then the learner's teacher-forced forward over the whole group (`learner.grpo`'s logprobs
  and loss, `learner.optim.FiniteAdamW`'s step; DeepSpeed is not on that machine): the largest and mean gap between
  the learner's logprob and the decode's, and the step's seconds.
- `overlap`: decoupled drafting on the engine's GPU: the Qwen3-0.6B-shaped draft LM drafting 4 tokens for 8/32/128
  requests from a thread of its own on a CUDA stream of its own (as `speculation.decoupled` drafts), while the engine's
  stream replays a Qwen3-8B-shaped verify step (5 tokens a request, weight matmuls as one CUDA graph): each one's
  milliseconds alone and side by side, so whether drafting there is off the critical path or slows verification.
- `weight_copy`: moving a weight version between two processes on one GPU (two processes on one GPU cannot form
  an NCCL group): a device-to-device copy, and a CUDA IPC handle opened by a second process that copies from it
  (on a CPU: a shared-memory tensor instead).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

# name: (seconds expected on one H100/H200, what it checks)
SECTIONS = {
    "sampler": (45, "coupled sampler: GPU noise and samples equal the CPU's; ms and workspace at rollout shapes"),
    "draft_lm": (75, "the draft LM on the GPU in bf16: ms per draft position at 1/8/32/128 requests"),
    "step_cost": (60, "verify 4 drafts / decode step, Qwen3-8B and gpu-preset shapes, 1-128 requests"),
    "learner": (60, "a bf16 learner step: its logprobs against the decode's, loss and optimizer step seconds"),
    "overlap": (45, "decoupled drafting on the engine's GPU: verify step and draft LM alone and side by side"),
    "weight_copy": (30, "GPU->GPU weight bandwidth on one GPU: device copy and CUDA IPC"),
}
START_S = 60  # the interpreter, CUDA's initialisation, installing the carried wheels
LIMIT_S = 480  # the whole check must fit here on one GPU


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def sampler(device: str, quick: bool) -> dict:
    if device != "cuda":
        return {"skipped": "compares the GPU's sampler with the CPU's: needs CUDA"}
    from bench.gpu_torch import noise, sampler as timed_sampler

    rows = (16, 256) if quick else (256, 1024, 4096)
    return {"noise": noise(rows[0]), "timing": [timed_sampler(n, top_p) for n in rows for top_p in (False, True)]}


def draft_lm(device: str, quick: bool) -> dict:
    from bench.gpu_torch import draft_of_shape
    from bench.step_cost import step_cost as weight_matmuls
    from drafters.draft_lm import DraftLM

    dtype = "bfloat16" if device == "cuda" else "float32"
    shapes = {"builtin_draft": None, "qwen3_0.6b_shape": (128, 2) if quick else (1024, 28)}
    counts, steps, out = ((1, 8) if quick else (1, 8, 32, 128)), (3 if quick else 10), {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, shape in shapes.items():
            path = "builtin:draft" if shape is None else str(Path(scratch) / name)
            if shape is not None:
                draft_of_shape(*shape, Path(path))
            drafter = DraftLM(model=path, dtype=dtype, device=device)
            # eager passes, then (on a GPU) the same drafting with its one-token passes as CUDA graphs
            modes = {"eager": None, **({} if drafter.graphs is None else {"graphed": drafter.graphs})}
            drafted, out[name] = {}, {}
            for mode, graphs in modes.items():
                drafter.graphs = graphs
                try:
                    out[name][mode], drafted[mode] = timed_drafting(drafter, counts, steps, device)
                except Exception as e:  # noqa: BLE001 -- one mode's failure keeps the other's figures
                    out[name][mode] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
            if len(drafted) == 2:
                pairs = list(zip(drafted["graphed"], drafted["eager"]))
                out[name]["graphed_drafts_equal_eager"] = sum(a == b for a, b in pairs) / max(len(pairs), 1)
            if "graphed" in modes:
                out[name]["graph_capture_failed"] = modes["graphed"].failed
            c = drafter.model.config  # its layers' weight matmuls (one CUDA graph on a GPU): a graphed pass's floor
            shape = (c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
                     c.intermediate_size, c.num_hidden_layers, c.vocab_size)
            out[name].update(parameters=sum(p.numel() for p in drafter.model.parameters()), dtype=dtype,
                             weight_matmuls_ms_by_requests=weight_matmuls(shape, counts, device,
                                                                          drafter.model.dtype)["ms_by_tokens"])
    return out


def timed_drafting(drafter, counts: tuple[int, ...], steps: int, device: str) -> tuple[dict, list]:
    """Milliseconds per proposal of 4 and per draft position, per request count, for requests whose histories grow
    by one accepted draft a step (as a verify step accepting one does), and per proposal ahead from every request's
    all-accepted outcome (as `speculation.decoupled` asks while the engine verifies; a `commit` after it, where the
    engine would be idle, makes the graphs it missed); and every proposal's drafts, in order."""
    from dataclasses import replace

    rng, vocab, per_count, drafted = random.Random(0), drafter.model.config.vocab_size, {}, []
    for n in counts:
        histories = [[rng.randrange(vocab) for _ in range(256)] for _ in range(n)]
        drafts, seconds, ahead = drafter.propose(requests_for(histories), 4), [], []  # the prefill, untimed
        for _ in range(steps):
            histories = [h + d[:1] for h, d in zip(histories, drafts)]
            sync(device)
            start = time.perf_counter()
            drafts = drafter.propose(requests_for(histories), 4)
            sync(device)
            seconds.append(time.perf_counter() - start)
            drafted.append(drafts)
            outcomes = [replace(r, token_ids=list(r.token_ids) + d, unverified=len(d), position=r.position + len(d))
                        for r, d in zip(requests_for(histories), drafts)]
            start = time.perf_counter()
            drafter.propose_ahead(outcomes, 4)
            sync(device)
            ahead.append(time.perf_counter() - start)
            drafter.commit(outcomes[0].request_id, [])
        for r in requests_for(histories):
            drafter.remove(r.request_id)
        per_count[n] = {"ms_per_proposal": round(1e3 * statistics.median(seconds), 3),
                        "ms_per_draft_position": round(1e3 * statistics.median(seconds) / 4, 3),
                        "ms_per_proposal_ahead": round(1e3 * statistics.median(ahead), 3)}
    return per_count, drafted


def requests_for(histories: list[list[int]]) -> list:
    """The check's drafting requests, one per history (ids `<requests>-<i>`: one set per request count), sampling at
    T = 1 from 200 tokens before each history's end."""
    from drafters.base import DraftRequest

    return [DraftRequest(f"{len(histories)}-{i}", seed=i, position=len(h) - 200, token_ids=h, temperature=1.0)
            for i, h in enumerate(histories)]


def step_cost(device: str, quick: bool) -> dict:
    from bench.step_cost import CPU_SHAPES, SHAPES, step_cost as weight_matmuls

    requests = (1, 8) if quick else (1, 8, 16, 32, 64, 128)
    tokens = tuple(sorted({n for b in requests for n in (b, 5 * b)}))
    if device != "cuda":
        return {name: weight_matmuls(shape, tokens, "cpu", torch.float32) for name, shape in CPU_SHAPES.items()}
    return {name: weight_matmuls(SHAPES[name], tokens) for name in ("qwen3_8b", "gpu_preset_target")}


def learner(device: str, quick: bool) -> dict:
    from transformers import AutoModelForCausalLM

    from bench.gpu_torch import decode
    from learner.grpo import policy_loss
    from learner.optim import FiniteAdamW
    from models.zoo import resolve
    from sampling.coupled import processed_logprobs

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(resolve("builtin:dense")), dtype=dtype).to(device).eval()
    eos, rng, size = model.config.eos_token_id, random.Random(1), 4 if quick else 16
    prompt = [rng.randrange(3, model.config.vocab_size) for _ in range(24)]
    with torch.no_grad():  # a GRPO group, one token per forward as an engine decodes
        group = [decode(model, prompt, seed, 1.0, 16 if quick else 64, eos, None, 0) for seed in range(size)]
    behaviour = [torch.log_softmax(torch.stack(rows), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
                 for tokens, rows in group]
    width = max(len(tokens) for tokens, _ in group)
    ids = torch.tensor([prompt + t + [eos] * (width - len(t)) for t, _ in group], device=device)
    mask = torch.tensor([[1.0] * len(t) + [0.0] * (width - len(t)) for t, _ in group], device=device)
    old = torch.stack([torch.cat([b, b.new_zeros(width - len(b))]) for b in behaviour]).to(device)
    model.train()
    optimizer = FiniteAdamW(model.parameters(), lr=1e-5)
    sync(device)
    start = time.perf_counter()
    logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1]
    logprobs = processed_logprobs(logits, 1.0).gather(-1, ids[:, len(prompt):, None])[..., 0]
    advantages = torch.randn(size, device=device)
    loss, _ = policy_loss(logprobs, old, advantages, mask, 0.2, 0.28, "token_mean", width, None, 0.0)
    loss.backward()
    optimizer.step()
    sync(device)
    gap = (logprobs.detach().float() - old).abs()[mask.bool()]
    return {"dtype": str(dtype).removeprefix("torch."), "sequences": size, "tokens": int(mask.sum()),
            "logprob_gap_max": float(gap.max()), "logprob_gap_mean": float(gap.mean()),
            "step_s": time.perf_counter() - start, "loss": loss.item()}


@torch.no_grad()
def overlap(device: str, quick: bool) -> dict:
    import threading

    from bench.gpu_torch import draft_of_shape
    from bench.step_cost import CPU_SHAPES, SHAPES, decoder, random_layers
    from drafters.draft_lm import DraftLM

    cuda, dtype = device == "cuda", torch.bfloat16 if device == "cuda" else torch.float32
    shape = SHAPES["qwen3_8b"] if cuda else CPU_SHAPES["cpu_preset_target"]
    stack, head = random_layers(shape, device, dtype)
    rng, out = random.Random(2), {}
    with tempfile.TemporaryDirectory() as scratch:
        draft_of_shape(*((128, 2) if quick else (1024, 28)), Path(scratch))
        drafter = DraftLM(model=scratch, dtype=str(dtype).removeprefix("torch."), device=device)
        for n in (4,) if quick else (8, 32, 128):
            x = torch.randn(5 * n, shape[0], device=device, dtype=dtype)
            verify = verify_step(lambda: decoder(x, stack, head, lambda _, rows: rows[:, :shape[1]]), device)
            histories = [[rng.randrange(drafter.model.config.vocab_size) for _ in range(256)] for _ in range(n)]

            def draft() -> float:  # one proposal of 4 a request, each history one accepted draft longer
                start = time.perf_counter()
                drafts = drafter.propose(requests_for(histories), 4)  # on the draft LM's own CUDA stream
                if cuda:
                    drafter.stream.synchronize()
                histories[:] = [h + d[:1] for h, d in zip(histories, drafts)]
                return time.perf_counter() - start

            draft()  # each prompt's prefill, untimed
            alone = {"verify": [verify() for _ in range(20)], "draft": [draft() for _ in range(8)]}
            together, done = {"verify": [], "draft": []}, threading.Event()

            def drafting() -> None:
                while not done.is_set():
                    together["draft"].append(draft())

            thread = threading.Thread(target=drafting)
            thread.start()
            while len(together["draft"]) < 8 or len(together["verify"]) < 20:
                together["verify"].append(verify())
            done.set()
            thread.join()
            for r in requests_for(histories):
                drafter.remove(r.request_id)
            ms = {f"{what}_ms_{when}": round(1e3 * statistics.median(times[what]), 3)
                  for when, times in (("alone", alone), ("side_by_side", together)) for what in times}
            out[n] = {**ms, "verify_slowdown": round(ms["verify_ms_side_by_side"] / ms["verify_ms_alone"], 3)}
    return {"target": "qwen3_8b" if cuda else "cpu_preset_target", "by_requests": out}


def verify_step(forward, device: str):
    """A timed call of `forward` on the current stream: one CUDA graph's replay on a GPU, an eager call on a CPU;
    waits for that stream only, not for others at work beside it."""
    from bench.step_cost import graphed

    run = graphed(forward, device)

    def timed() -> float:
        start = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.current_stream().synchronize()
        return time.perf_counter() - start
    return timed


def copy_seconds(source: torch.Tensor, repeats: int) -> list[float]:
    """Seconds of each of `repeats` copies of `source` into a tensor of its own on its device."""
    device = "cuda" if source.is_cuda else "cpu"
    target, seconds = torch.empty_like(source), []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        target.copy_(source)
        sync(device)
        seconds.append(time.perf_counter() - start)
    return seconds


def _copy_from(handles: mp.Queue, results: mp.Queue, repeats: int) -> None:
    """The second process: opens the first's tensor (CUDA IPC, or shared memory on a CPU) and copies from it."""
    results.put(copy_seconds(handles.get(), repeats))
    handles.get()  # the first process keeps its tensor alive until this one is done with it


def weight_copy(device: str, quick: bool) -> dict:
    nbytes, repeats = (64 << 20) if quick else (4 << 30), 5
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    seconds = copy_seconds(source, repeats)
    if device == "cpu":
        source.share_memory_()
    from bench import gpu_check  # by its module's name, however this one was started (`-m`: as __main__)

    context = mp.get_context("spawn")
    handles, results = context.Queue(), context.Queue()
    child = context.Process(target=gpu_check._copy_from, args=(handles, results, repeats))
    child.start()
    handles.put(source)
    ipc = results.get(timeout=120)
    handles.put(None)
    child.join(30)
    return {"bytes": nbytes, "device_copy_gb_per_s": round(nbytes / statistics.median(seconds) / 1e9, 2),
            "other_process_gb_per_s": round(nbytes / statistics.median(ipc) / 1e9, 2),
            "other_process_by": "CUDA IPC handle" if device == "cuda" else "shared memory"}


RUN = {"sampler": sampler, "draft_lm": draft_lm, "step_cost": step_cost, "learner": learner,
       "overlap": overlap, "weight_copy": weight_copy}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/gpu_check"))
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes and counts (a check of the script)")
    parser.add_argument("--dry-run", action="store_true", help="list the sections and their expected seconds")
    args = parser.parse_args(argv)
    expected = START_S + sum(SECTIONS[s][0] for s in args.sections)
    if args.dry_run:
        for name in args.sections:
            print(f"{name:12s} ~{SECTIONS[name][0]:4d} s  {SECTIONS[name][1]}")
        print(f"{'start':12s} ~{START_S:4d} s  interpreter, CUDA, carried wheels\n"
              f"total ~{expected} s of the {LIMIT_S} s one GPU check may take")
        return 0 if expected <= LIMIT_S else 1
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (--dry-run lists the sections; --device cpu --quick checks the script)",
              file=sys.stderr)
        return 2
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "quick": args.quick, "sections": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.sections:
        start = time.perf_counter()
        try:
            entry = {"result": RUN[name](args.device, args.quick)}
        except Exception as e:  # noqa: BLE001 -- one failing section must not cost the others their one run
            entry = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
        entry.update(seconds=round(time.perf_counter() - start, 1), expected_s=SECTIONS[name][0])
        report["sections"][name] = entry
        print(f"{name}: {'error ' + entry['error'] if 'error' in entry else 'done'} in {entry['seconds']} s",
              flush=True)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))  # after each: a timeout keeps it
    print(f"wrote {args.out / 'gpu_check.json'}")
    return 1 if any("error" in e for e in report["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
