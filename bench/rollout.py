"""Rollout benchmark: the same GRPO groups, seeds and cores, every system in one run, paired and interleaved.

    python -m bench.rollout [--preset smoke|full|longtail|gpu|policy] [--epochs-before N] [--warm-up] [--out PATH]

Systems (fixed before the run; `specactor` is the configured default, never the best of several afterwards)
- `vllm`: plain vLLM with its own sampler, no speculation, unseeded requests: what RL frameworks run;
- `vanilla`: vLLM with SpecActor's coupled sampler, no speculation (the tokens every coupled system must equal);
- `vllm_spec_draft`, `vllm_spec_ngram`, `vllm_spec_suffix`: vLLM's own speculative decoding as a user would
  configure it (the last, vLLM's suffix decoding, runs where `make vllm-suffix` built its suffix tree);
- `oracle`: coupled speculation with a drafter that replays vanilla's tokens at no cost (same planner): the ceiling;
- `specactor`: coupled speculation as configured by default (draft LM, the cost-model draft planner);
- `specactor_ngram`, `specactor_suffix`, `specactor_fastest`: the same with the n-gram drafter, the history
  (suffix) drafter, fastest-of-N over suffix and the draft LM (listed, not chosen); `specactor_decoupled`,
  `specactor_fastest_decoupled`: the draft LM, fastest-of-N with `speculation.decoupled`.
The target is a cost-padded copy of the trained policy (bench/padded_target.py): 70.8M parameters of cost in fp32 on
CPU presets; for `gpu` (the long-tail workload on one CUDA GPU, bf16, CUDA graphs as vLLM uses them by default)
~1.41B with Qwen3-1.7B's matmul shapes, so that decoding is memory-bound as on real rollout GPUs (the preset refuses
to start without CUDA); `policy` runs the end-to-end benchmark's own rollout, the unpadded 0.8M policy on
grpo_tiny's prompt mix. Every repeat runs every system in a rotating order (vanilla first in the first repeat); a
system's speed-up is the median over repeats of vanilla's makespan over its own in the same repeat, with a 95%
t-interval of that paired ratio (`vllm` samples other tokens: compare it with vanilla in tokens/s). The JSON also
holds the workload's shape (length quantiles, the last 10% of requests' share of the makespan, running batch over
time), a per-step profile (engine forward + scheduler, coupled sampler, drafter bridge, drafter; decoupled: the
drafter's thread, the outcomes it prepared, its guesses' accuracy), the draft planner's choices (tokens allowed per
request and step, its relative error on step seconds), for fastest-of-N each member's share of the drafts and its
token acceptance on every proposal it made, and the speed-up at fixed batch sizes (the sweep: the preset's hardest
prompt, `SWEEP_TOKENS` tokens per request); a PNG beside it, the engines' logs in the same name with .log.
`--epochs-before N` measures a later epoch of training, as GRPO revisits its prompts: every engine first generates
the same prompts N times with the seeds of the earlier epochs, unmeasured, so the history (suffix) drafter holds each
prompt's earlier outputs (the policy does not change between epochs here: the best case for history). `--warm-up`
first generates another draw of the workload, unmeasured, so every planner (the oracle's too) starts warm.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from actor.engine import engine_preload, set_env_defaults
from bench.engine_process import in_fresh_process
from bench.rollout_report import plot, profile_medians, speculation_report, table
from bench.stats import paired
from configs.schema import Device
from transport.messages import total

PRESETS = {
    # `ops`: the number of operations of each prompt's problem (a group of `group_size` samples per prompt)
    "smoke": dict(ops=[1, 1, 2, 3, 8, 16], group_size=4, max_tokens=256, repeats=1, sweep=[1, 16]),
    "full": dict(ops=[1] * 6 + [2] * 4 + [3, 3, 4, 5, 6, 8], group_size=8, max_tokens=400, repeats=3,
                 sweep=[1, 2, 4, 8, 16, 32, 64, 128]),
    # most groups answer in a line or two; a few need a long scratchpad: the tail that runs at small batch
    "longtail": dict(ops=[1] * 8 + [2] * 5 + [3, 6, 24], group_size=8, max_tokens=400, repeats=3,
                     sweep=[1, 2, 4, 8, 16, 32, 64, 128]),
    "gpu": dict(ops=[1] * 8 + [2] * 5 + [3, 6, 24], group_size=8, max_tokens=400, repeats=3,
                sweep=[1, 2, 4, 8, 16, 32, 64, 128, 256], device="cuda"),
    # the end-to-end benchmark's rollout in isolation: grpo_tiny's own 0.8M-parameter policy, unpadded, on its
    # operation mix (data.max_ops 4, power law 1.5), where an engine step is mostly vLLM's and the bridge's
    # overhead: speculation's per-step costs, not the forward, decide whether it pays
    "policy": dict(ops=[1] * 9 + [2] * 3 + [3] * 2 + [4] * 2, group_size=8, max_tokens=400, repeats=5,
                   sweep=[1, 16, 128], padded=False),
}
TARGETS = {"cpu": dict(zero_layers=16, num_heads=32, intermediate_size=8192),  # 70.8M parameters of cost
           # ~1.41B, Qwen3-1.7B's matmul shapes (its 2048-wide residual stream too): memory-bound decode, and
           # verifying 4 drafts for each of 8-32 requests costs a decode step's 1.06-1.16x on an H200, as with the
           # real model (bench/step_cost.py, bench/results/step_cost_h200_context8192.json); a 128-wide stream
           # beside wide MLPs would make it 1.4-2.2x, its activations rather than its weights the memory moved
           "cuda": dict(zero_layers=24, num_heads=64, intermediate_size=6144, hidden_size=2048)}
ENGINE = {"cpu": [], "cuda": ["cluster.device=cuda", "model.dtype=bfloat16", "rollout.kv_cache_mib=16384"]}  # overrides
SYSTEMS = ["vllm", "vanilla", "vllm_spec_draft", "vllm_spec_ngram", "vllm_spec_suffix", "oracle", "specactor",
           "specactor_decoupled", "specactor_ngram", "specactor_suffix", "specactor_fastest",
           "specactor_fastest_decoupled"]
COUPLED = {"vanilla": "none", "oracle": "bench.oracle.OracleDrafter", "specactor": "draft_lm",
           "specactor_decoupled": "draft_lm", "specactor_ngram": "ngram", "specactor_suffix": "suffix",
           "specactor_fastest": "fastest_of_n", "specactor_fastest_decoupled": "fastest_of_n"}
FASTEST_OF = "[suffix,draft_lm]"  # specactor_fastest's members
SPECULATIVE_TOKENS = 4
TEMPERATURE = 1.0  # GRPO samples at T = 1
SWEEP_TOKENS = 64


def workload(preset: dict, seed: int, epoch: int = 0) -> tuple[list[str], list[int]]:
    """The preset's prompts (the same every epoch) and the sample seeds of epoch `epoch` (the data cursor runs on
    across epochs, as in training, so every epoch samples with other seeds)."""
    from sampling.coupled import group_seed
    from tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask(seed=seed)
    prompts, seeds, n = [], [], preset["group_size"]
    for cursor, ops in enumerate(preset["ops"]):
        for i in range(n):
            prompts.append(task.with_ops(ops, cursor).prompt)
            seeds.append(group_seed(seed, epoch * len(preset["ops"]) + cursor, n) + i)
    return prompts, seeds


def make_llm(name: str, target: Path, draft: Path, oracle: Path | None, device: str, k: int):
    """The engine of system `name` (in the calling process), drafting at most `k` tokens per request and step."""
    from vllm import LLM

    from actor.engine import engine_kwargs, make_engine
    from actor.vllm_hooks import fix_cpu_rejection_sampler
    from configs.load import load_config

    # 2 GiB of KV cache: 204 of vLLM-CPU's 128-token blocks on the padded target, room for every request of a preset
    # at once (1 GiB holds 102: the long-tail preset's last 27 requests, its longest group among them, would wait)
    overrides = [f"model.path={target}", "model.max_model_len=1024", "rollout.kv_cache_mib=2048",
                 f"speculation.num_speculative_tokens={k}", *ENGINE[device]]
    if name in COUPLED:
        overrides.append(f"speculation.method={COUPLED[name]}")
        if name == "oracle":
            overrides.append(f"speculation.options.path={oracle}")
        if name.startswith("specactor_fastest"):
            overrides.append(f"speculation.drafters={FASTEST_OF}")
        if name.endswith("_decoupled"):  # its drafter, in a process of its own, takes the core the engine leaves
            overrides.append("speculation.decoupled=true")
        return make_engine(load_config("grpo_tiny", overrides), target)
    kwargs = engine_kwargs(load_config("grpo_tiny", overrides), target)
    if name == "vllm_spec_draft":
        kwargs["speculative_config"] = {"method": "draft_model", "model": str(draft),
                                        "num_speculative_tokens": k}
    elif name == "vllm_spec_ngram":
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k,
                                        "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    elif name == "vllm_spec_suffix":  # its other settings at vLLM's defaults
        kwargs["speculative_config"] = {"method": "suffix", "num_speculative_tokens": k}
    llm = LLM(**kwargs, disable_log_stats=False)
    if name.startswith("vllm_spec") and device == "cpu":
        llm.collective_rpc(fix_cpu_rejection_sampler)  # else vLLM-CPU rejects nearly every draft at T > 0
    return llm


def generate(llm, prompt_ids: list[list[int]], params: list, records: list | None = None) -> dict:
    """Steps the engine by hand over every request: makespan, per-request finish times and tokens, batch curve.
    `records`: a coupled engine's counters before the first step, then its steps, are appended to it
    (bench/trace.py)."""
    from vllm.inputs.engine import tokens_input

    from bench.trace import step_record

    engine = llm.llm_engine
    for i, (ids, p) in enumerate(zip(prompt_ids, params)):
        engine.add_request(f"r{i}", tokens_input(ids), p)
    finish, tokens, curve = [0.0] * len(params), [[] for _ in params], []
    if records is not None:
        records.append([0.0, *llm.collective_rpc(step_record)[0]])
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        begin = time.perf_counter()
        outputs = engine.step()
        if records is not None:
            records.append([time.perf_counter() - begin, *llm.collective_rpc(step_record)[0]])
        for out in outputs:
            if out.finished:
                finish[int(out.request_id[1:])] = time.perf_counter() - start
                tokens[int(out.request_id[1:])] = list(out.outputs[0].token_ids)
        curve.append((round(time.perf_counter() - start, 4), engine.get_num_unfinished_requests()))
    return {"makespan_s": time.perf_counter() - start, "finish_s": finish, "sequences": tokens, "batch_curve": curve}


def run_system(name: str, target: Path, draft: Path, prompts: list[str], seeds: list[int], max_tokens: int,
               oracle: Path | None, sweep: list[int], device: str, earlier: list[tuple[list[str], list[int]]], k: int,
               trace: bool = False) -> dict:
    from vllm import SamplingParams

    from actor.engine import close_engine
    from actor.vllm_hooks import profile, take_records

    llm = make_llm(name, target, draft, oracle, device, k)
    try:
        tokenizer = llm.get_tokenizer()
        prompt_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        llm.generate(prompts[:2], SamplingParams(temperature=TEMPERATURE, max_tokens=8), use_tqdm=False)  # warm-up
        coupled = name in COUPLED

        def sampling(epoch_seeds: list[int]) -> list:  # token ids only, no text: as the rollout actor asks
            return [SamplingParams(seed=None if name == "vllm" else s, temperature=TEMPERATURE, max_tokens=max_tokens,
                                   detokenize=False) for s in epoch_seeds]

        request_ids = [f"r{i}" for i in range(len(seeds))]  # as `generate` names them
        earlier_sequences = []  # earlier batches, unmeasured: the engine (its planner, its drafter's history) saw them
        for batch_prompts, batch_seeds in earlier:
            batch = [tokenizer(p, add_special_tokens=False).input_ids for p in batch_prompts]
            earlier_sequences += generate(llm, batch, sampling(batch_seeds))["sequences"]
            if coupled:
                llm.collective_rpc(take_records, args=(request_ids,))
        before = llm.collective_rpc(profile)[0] if coupled else {}
        records = [] if coupled and trace else None
        run = generate(llm, prompt_ids, sampling(seeds), records)
        if records is not None:
            run.update(step_records=records, prompt_ids=prompt_ids)
        run["earlier_sequences"] = earlier_sequences
        steps = len(run["batch_curve"])
        if coupled:  # where the time of a step went
            after = llm.collective_rpc(profile)[0]
            grew = {k: after[k] - before[k] for k in after}
            spent = {k: v for k, v in grew.items() if k.endswith("_s")}
            # the step's own parts (a decoupled drafter's thread runs beside them; its wait is in drafter_s)
            spent["engine_s"] = run["makespan_s"] - sum(spent[k] for k in ("sampler_s", "bridge_s", "drafter_s"))
            run["profile_ms_per_step"] = {k.removesuffix("_s"): round(1000 * v / steps, 3) for k, v in spent.items()}
        if name.startswith("vllm_spec"):
            counters = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
            verify, accepted = counters["vllm:spec_decode_num_drafts"], counters["vllm:spec_decode_num_accepted_tokens"]
        else:
            records = llm.collective_rpc(take_records, args=(request_ids,))[0].values() if coupled else []
            spec = total(r.stats for r in records)
            verify, accepted = spec.verify_steps, spec.accepted_tokens
            run.update(speculation_report(spec, grew if coupled else {}, verify, steps))
        run.update(steps=steps, verify_steps=verify, tokens=sum(len(t) for t in run["sequences"]),
                   acceptance_length=round((accepted + verify) / verify, 3) if verify else 1.0)
        if sweep:  # equal-length requests at each concurrency: the hardest prompt (its answers run far longer than
            # SWEEP_TOKENS), other seeds, cut at SWEEP_TOKENS; real text, not the noise past an ignored EOS
            run["sweep_s"] = {}
            hardest = prompt_ids[-1]
            for size in sweep:
                fixed = [SamplingParams(seed=7_000 + i, temperature=TEMPERATURE, max_tokens=SWEEP_TOKENS,
                                        detokenize=False) for i in range(size)]
                run["sweep_s"][size] = generate(llm, [hardest] * size, fixed)["makespan_s"]
        return run
    finally:
        close_engine(llm)


def shape(run: dict) -> dict:
    """How long-tailed a rollout is: length quantiles and the makespan share of the last 10% of requests."""
    lengths = sorted(len(s) for s in run["sequences"])
    finish = sorted(run["finish_s"])
    p90_done = finish[math.ceil(0.9 * len(finish)) - 1]
    q = lambda f: lengths[min(len(lengths) - 1, int(f * len(lengths)))]  # noqa: E731
    return {"response_length": {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": lengths[-1]},
            "max_over_median": round(lengths[-1] / max(1, q(0.5)), 2),
            "tail_share_last_10pct": round((run["makespan_s"] - p90_done) / run["makespan_s"], 3)}


@contextlib.contextmanager
def preloaded(libraries: list[Path]):
    """The engine processes started meanwhile load `libraries` first (LD_PRELOAD; a spawned process inherits it)."""
    before = os.environ.get("LD_PRELOAD")
    if libraries:
        os.environ["LD_PRELOAD"] = ":".join(str(lib.resolve()) for lib in libraries)
    try:
        yield
    finally:
        os.environ.pop("LD_PRELOAD", None)
        if before is not None:
            os.environ["LD_PRELOAD"] = before


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    parser.add_argument("--out", default="runs/bench/rollout.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, help="override the preset's number of interleaved repeats")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS,
                        help="a subset to run (vanilla always runs: it is the reference); default: all, "
                             "vllm_spec_suffix where `make vllm-suffix` built its dependency")
    parser.add_argument("--speculative-tokens", type=int, default=SPECULATIVE_TOKENS,
                        help="k: the most draft tokens per request and step of every speculating system")
    parser.add_argument("--no-sweep", action="store_true", help="skip the fixed-batch sweep")
    parser.add_argument("--trace", type=Path, help="also write the run's trace (bench/trace.py) here")
    parser.add_argument("--preload", nargs="+", type=Path, default=[], metavar="LIB",
                        help="measure preloading: every system runs without the library the actors' engines preload "
                             "(actor/engine.py engine_preload), and vanilla+preload, specactor+preload with these "
                             "in LD_PRELOAD instead, paired with the runs without")
    parser.add_argument("--epochs-before", type=int, default=0,
                        help="measure epoch N+1: each engine first generates the same prompts N times with the "
                             "seeds of earlier epochs, unmeasured (the history a training run's drafters hold)")
    parser.add_argument("--warm-up", action="store_true",
                        help="each engine first generates the workload drawn with another task seed (other prompts "
                             "and seeds), unmeasured: its planner is warm, as a training actor's after its first steps")
    args = parser.parse_args(argv)
    suffix_tree = importlib.util.find_spec("arctic_inference") is not None
    if "vllm_spec_suffix" in (args.systems or []) and not suffix_tree:
        parser.error("vllm_spec_suffix needs arctic-inference's suffix tree: run `make vllm-suffix` first")
    args.systems = args.systems or [n for n in SYSTEMS if n != "vllm_spec_suffix" or suffix_tree]
    if args.epochs_before < 0:
        parser.error(f"--epochs-before must be 0 or more, got {args.epochs_before}")
    if args.speculative_tokens < 1:
        parser.error(f"--speculative-tokens must be 1 or more, got {args.speculative_tokens}")
    device = PRESETS[args.preset].get("device", "cpu")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(f"bench.rollout --preset {args.preset} needs a CUDA GPU; this machine has none "
                  "(torch.cuda.is_available() is False)", file=sys.stderr)
            raise SystemExit(2)
    set_env_defaults()  # one engine thread, no OpenMP busy-waiting

    from bench.padded_target import build_padded_target, parameter_count
    from models.zoo import resolve

    preset = dict(PRESETS[args.preset], repeats=args.repeats or PRESETS[args.preset]["repeats"])
    policy, draft = resolve("builtin:dense"), resolve("builtin:draft")
    prompts, seeds = workload(preset, args.seed, epoch=args.epochs_before)
    earlier = [(prompts, workload(preset, args.seed, epoch=e)[1]) for e in range(args.epochs_before)]
    if args.warm_up:  # first of all: another draw of the workload (the task's seed + 1 draws other prompts)
        earlier.insert(0, workload(preset, args.seed + 1))
    others = [n for n in SYSTEMS if n in args.systems and n != "vanilla"]
    engine_libs = [Path(lib) for lib in [engine_preload(Device(device))] if lib]  # as a rollout actor's engine
    sweep = [] if args.no_sweep else preset["sweep"]
    out, log = Path(args.out), Path(args.out).with_suffix(".log")
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        padded = preset.get("padded", True)
        target = Path(tmp) / "target" if padded else policy
        target_config = build_padded_target(policy, target, **TARGETS[device], seed=args.seed) if padded else \
            json.loads((policy / "config.json").read_text())
        oracle = Path(tmp) / "oracle.json"
        for repeat in range(preset["repeats"]):
            # every system in a rotated order, vanilla too (always first would hide a position bias); the first
            # repeat starts with vanilla, whose tokens the oracle replays
            names = ["vanilla", *others, *(f"{n}+preload" for n in ("vanilla", "specactor")
                                            if args.preload and n in ("vanilla", *others))]
            order = names[repeat % len(names):] + names[: repeat % len(names)]
            for name in order:  # one fresh process per engine: vLLM keeps global state between engines
                with preloaded(args.preload if name.endswith("+preload") else [] if args.preload else engine_libs):
                    run = in_fresh_process(log, run_system, name.removesuffix("+preload"), target, draft, prompts,
                                           seeds, preset["max_tokens"], oracle,
                                           sweep if name in ("vanilla", "specactor") else [], device, earlier,
                                           args.speculative_tokens, args.trace is not None)
                if name == "vanilla" and repeat == 0:  # the oracle replays every batch it sees
                    replay = zip([*(s for _, batch in earlier for s in batch), *seeds],
                                 [*run["earlier_sequences"], *run["sequences"]])
                    oracle.write_text(json.dumps({s: t for s, t in replay}))
                if name != "vllm" and runs.get(name) and run["sequences"] != runs[name][0]["sequences"]:
                    raise RuntimeError(f"{name}: repeat {repeat + 1} generated other tokens than repeat 1")
                runs.setdefault(name, []).append(run)
                print(f"{name:16s} makespan {run['makespan_s']:7.2f} s  acceptance {run['acceptance_length']:.2f}"
                      f"  ({repeat + 1}/{preset['repeats']})", flush=True)
    reference = runs["vanilla"][0]["sequences"]
    vanilla_s = [r["makespan_s"] for r in runs["vanilla"]]
    systems, identical = {}, {}
    for name, repeats in runs.items():
        first = repeats[0]
        makespans = [r["makespan_s"] for r in repeats]
        systems[name] = {"makespan_s": round(statistics.median(makespans), 3),
                         "tokens_per_s": round(first["tokens"] / statistics.median(makespans), 1),
                         "makespans_s": [round(m, 3) for m in makespans], **paired(vanilla_s, makespans),
                         "tokens": first["tokens"], "acceptance_length": first["acceptance_length"],
                         "verify_steps": first["verify_steps"], "engine_steps": first["steps"]}
        for key in ("planner", "choice_shares", "member_token_acceptance", "prepared_hit_rate",
                    "prepared_outcomes_per_step", "busy_steps", "guess_accuracy"):
            if key in first:
                systems[name][key] = first[key]
        if "profile_ms_per_step" in first:
            systems[name].update(profile_medians(repeats))
        if name in ("vanilla", "oracle", "specactor"):
            systems[name]["batch_curve"] = first["batch_curve"][:: max(1, len(first["batch_curve"]) // 400)]
        identical[name] = sum(a == b for a, b in zip(first["sequences"], reference)) / len(reference)
    result = {"systems": systems, "identical_fraction": identical, "workload": shape(runs["vanilla"][0])}
    if "oracle" in systems and "specactor" in systems and systems["oracle"]["speedup"] > 1:
        result["share_of_oracle_speedup"] = round((systems["specactor"]["speedup"] - 1)
                                                  / (systems["oracle"]["speedup"] - 1), 3)
    if args.preload:  # each system against itself without the libraries, repeat by repeat
        result["preload"] = {"libraries": [str(lib) for lib in args.preload], **{
            name: paired([r["makespan_s"] for r in runs[name]], [r["makespan_s"] for r in runs[f"{name}+preload"]])
            for name in ("vanilla", "specactor") if f"{name}+preload" in runs}}
    if sweep and "specactor" in runs:
        result["sweep"] = {size: paired([r["sweep_s"][size] for r in runs["vanilla"]],
                                        [r["sweep_s"][size] for r in runs["specactor"]]) for size in sweep}
    result["config"] = {
        "preset": args.preset, **preset, "sequences": len(reference), "temperature": TEMPERATURE, "seed": args.seed,
        "engine_preload": [] if args.preload else [lib.name for lib in engine_libs],  # LD_PRELOAD of every engine
        "epochs_before": args.epochs_before, "warm_up": args.warm_up,
        "num_speculative_tokens": args.speculative_tokens, "specactor": "draft_lm, cost-model draft planner",
        "target": (f"cost-padded built-in policy: {TARGETS[device]['zero_layers']} zero-output layers in front of "
                   f"the 4 trained ones, widened to {TARGETS[device]['num_heads']} heads / "
                   f"{TARGETS[device]['intermediate_size']} MLP units / a "
                   f"{target_config['hidden_size']}-wide residual stream (bench/padded_target.py)") if padded else
                  "the built-in policy itself (builtin:dense, unpadded)",
        "target_params": parameter_count(target_config), "draft": "builtin:draft",
        "device": "one CUDA GPU, bf16" if device == "cuda" else "CPU, one engine thread (OMP_NUM_THREADS=1), fp32",
        "sweep_tokens": SWEEP_TOKENS,
    }
    if args.trace is not None:
        from bench.trace import write

        write(args.trace, result["config"], runs["vanilla"][0]["prompt_ids"], seeds, runs, draft,
              args.speculative_tokens, TEMPERATURE)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(table(result))
    print(f"wrote {out} and {out.with_suffix('.png')} (engine logs: {log})")
    return result


if __name__ == "__main__":
    main()
