"""What drafting beside the engine costs the engine's own step on a CPU host, from a thread and from a process:

    python -m bench.draft_contention [--triples 150] [--out runs/bench/draft_contention.json]

Decoupled speculation (actor/draft_ahead.py) prepares the next step's drafts from a thread of the engine's process
while the engine verifies. The engine runs one thread, so on a 2-core host the drafting has the other core to
itself; what a drafting thread still shares with the engine is the interpreter's lock (the GIL), which each takes
between torch calls. One engine (the long-tail preset's cost-padded target, plain decoding) steps 8 long requests,
and as each step starts a thread of the engine's process is set off on one call of the draft LM's `propose_ahead`
for `OUTCOMES` outcomes of 5 tokens (a decoupled long-tail step prepares 47 to 66), or none is: the draft LM in
the engine's process (`thread`: what a GPU engine does), in a process of its own called over its socket
(`process`: actor/drafter_process.py, what a CPU engine does), or no drafting at all. Three consecutive steps form a
triple, one of each, in an order that rotates; each triple's ratios of a drafting step to its undrafted one are the
result (median and a distribution-free 95% interval), beside the drafting call's own seconds. A busy host drifts
over seconds, not over three ~50 ms steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from actor.engine import set_env_defaults
from bench.engine_process import in_fresh_process
from bench.stats import median_ci

OUTCOMES = 48  # outcomes a drafting call prepares (a decoupled long-tail step prepares 47-66: docs/benchmarks.md)
MODES = ("none", "thread", "process")


def _drafting(go, done, seconds, own_process: bool) -> None:
    """A drafting thread: one `propose_ahead` call of the built-in draft LM (`own_process`: in a process of its own)
    each time `go` is set, its seconds into `seconds`, then `done`; returns once `go` is set with `seconds`
    negative."""
    import numpy as np

    from actor.drafter_process import start_drafter_process
    from drafters.base import DraftRequest
    from drafters.draft_lm import DraftLM

    drafter = start_drafter_process("draft_lm", {}, "cpu") if own_process else DraftLM()
    outcomes = [DraftRequest(request_id=f"o{i}", seed=i, position=40, max_tokens=5, temperature=1.0, top_k=0,
                             top_p=1.0, token_ids=np.arange(3 + i % 7, 53 + i % 7, dtype=np.int64) % 50)
                for i in range(OUTCOMES)]
    drafter.propose_ahead(outcomes, 5)  # (its first call pays what later ones do not)
    done.set()
    while go.wait() and seconds.value >= 0:
        go.clear()
        start = time.perf_counter()
        drafter.propose_ahead(outcomes, 5)
        seconds.value = time.perf_counter() - start
        done.set()


def _measure(triples: int) -> dict:
    """The engine's step seconds per mode, by triple, and the drafting calls' seconds per worker."""
    from vllm import SamplingParams
    from vllm.inputs.engine import tokens_input

    from actor.engine import close_engine
    from bench.padded_target import build_padded_target
    from bench.rollout import PRESETS, TARGETS, make_llm, workload
    from models.zoo import resolve

    workers = {mode: (threading.Event(), threading.Event(), SimpleNamespace(value=0.0))
               for mode in ("thread", "process")}
    drafting = [threading.Thread(target=_drafting, args=(*worker, mode == "process"), daemon=True)
                for mode, worker in workers.items()]
    for thread in drafting:
        thread.start()
    target = Path(tempfile.mkdtemp()) / "target"
    build_padded_target(resolve("builtin:dense"), target, **TARGETS["cpu"], seed=0)
    llm = make_llm("vanilla", target, resolve("builtin:draft"), None, "cpu", 4)
    steps = {mode: [] for mode in MODES}
    calls = {"thread": [], "process": []}
    try:
        for _, done, _ in workers.values():
            done.wait()
        prompts, _ = workload(PRESETS["longtail"], 0)
        prompt = llm.get_tokenizer()(prompts[-1], add_special_tokens=False).input_ids  # the longest group's
        engine, rounds = llm.llm_engine, 0
        while len(steps["none"]) < triples:  # (whole rounds: the last may add a few triples more)
            for i in range(8):
                engine.add_request(f"r{rounds}-{i}", tokens_input(prompt), SamplingParams(
                    seed=1000 * rounds + i, temperature=1.0, max_tokens=150, ignore_eos=True, detokenize=False))
            step, triple = 0, {}
            while engine.has_unfinished_requests():
                mode = MODES[(step + rounds) % 3]
                if mode != "none":
                    workers[mode][1].clear()
                    workers[mode][0].set()
                start = time.perf_counter()
                engine.step()
                triple[mode] = time.perf_counter() - start
                if mode != "none":
                    workers[mode][1].wait()  # (after the step: the next starts with no drafting in flight)
                    calls[mode].append(workers[mode][2].value)
                step += 1
                if len(triple) == 3:
                    if step > 3:  # (the first triple's steps prefill)
                        for m, s in triple.items():
                            steps[m].append(s)
                    triple = {}
            rounds += 1
    finally:
        for go, _, seconds in workers.values():
            seconds.value = -1.0
            go.set()
        for thread in drafting:
            thread.join(10)
        close_engine(llm)
    return {"steps": steps, "calls": calls}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--triples", type=int, default=150, help="triples of adjacent steps measured")
    parser.add_argument("--out", default="runs/bench/draft_contention.json")
    args = parser.parse_args(argv)
    if args.triples < 1:
        parser.error(f"--triples must be 1 or more, got {args.triples}")
    set_env_defaults()  # one engine thread, as a rollout actor's (inherited by the fresh process)
    out = Path(args.out)
    measured = in_fresh_process(out.with_suffix(".log"), _measure, args.triples)
    steps, calls = measured["steps"], measured["calls"]
    result = {"target": "long-tail preset's cost-padded target (bench/rollout.py), one engine thread, 8 requests",
              "outcomes_per_call": OUTCOMES, "triples": len(steps["none"]),
              "step_ms_without_drafting": round(1000 * statistics.median(steps["none"]), 3)}
    for mode in ("thread", "process"):
        ratios = median_ci([x / y for x, y in zip(steps[mode], steps["none"])])
        added = median_ci([1000 * (x - y) for x, y in zip(steps[mode], steps["none"])])
        result[mode] = {"step_ratio": [round(v, 4) for v in ratios], "ms_added": [round(v, 3) for v in added],
                        "drafting_call_ms": round(1000 * statistics.median(calls[mode]), 3)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
