"""End-to-end benchmark: whole GRPO runs of the launcher, side by side, one fresh process per run.

    python -m bench.e2e --preset smoke|full --out PATH      (on the 2-core CPU host: smoke ~5 min, full ~35)
                        [--systems sync fastest_of_n ...] [--reference sync|async] [--repeats N] [--staleness S]
                        [--set KEY=VALUE ...]

Systems, fixed before the run, in this order, each `launch.py --config grpo_tiny` with the same seed:
- `sync`: rollout, then train, then the next rollout (`algorithm.max_staleness: 0`: an actor starts a step's groups
  only with the weights of that step), no speculation: the schedule of verl-style colocated loops; bit-reproducible
  (`trainer.deterministic`), its trajectories logged (`logging.rollouts`) for the oracle;
- `async`: the asynchronous loop (`max_staleness: 1`), no speculation;
- `frozen`: the async loop speculating with the built-in draft LM, never updated;
- `distilled`: the same draft LM distilled online from the policy (learner/distill.py), a new version offered
  every 4 policy versions and swapped in by the actors when it replays at least as well;
- `fastest_of_n`: the async loop with fastest-of-N over the suffix (history) drafter, the distilled draft LM and
  n-gram;
- `oracle`: the ceiling of speculation on this host, measured beside them: `sync` again, speculating with
  bench/oracle.py, which replays the tokens `sync` sampled in the same repeat (run just before it) at no drafting
  cost, under the same planner. Deterministic runs sample the same tokens whatever drafts, so every draft it makes
  is accepted (its acceptance length says so). The asynchronous loop has no such ceiling to measure: which weights
  sample a token depends on timing, so no earlier run knows its tokens.
The asynchronous systems run at `algorithm.max_staleness` S (`--staleness`, 1 unless asked). Each repeat runs every
system (rotating order) and the reference (`--reference`: `sync`, or `async` to measure what turning speculation on
does to the asynchronous loop without spending each repeat's longest run on `sync`); speed-ups are paired per repeat
over `sync` and over `async`, each where it ran. Per system: seconds per step (the run's wall time from its first
step's TensorBoard event to its last over the steps between: the first step holds the engines' start; a mean, since
at staleness 1 the gaps alternate between a long and a short one and their median is either), the actors' engine
seconds per step (`rollout_s`) and of those its engine steps and the seconds of the coupled sampler, the drafter
bridge and the drafter (`engine_profile`), a profile of where a step's time goes (means per step: the learner's GRPO
step and its wait for the step's groups; the actors' idle seconds, nothing admissible to run until new weights; the
share of rows with zero advantage, which get no backward pass), acceptance length per step (live; for fastest-of-N
also each member's token acceptance on every proposal it made, chosen or not; and for the distilled draft LM,
replayed on each step's trajectories beside the run's starting draft LM), and the final held-out reward (T = 1),
which must agree across the asynchronous systems within the noise between repeats of one system: the coupled sampler
makes the trajectories independent of the drafter, but asynchrony makes them depend on when weights arrive. JSON,
with a PNG of acceptance over steps beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.stats import paired
from configs.load import ConfigError
from driver.preflight import load_run_config

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {
    # learner.lr=1e-3 (10x grpo_tiny's): the policy drifts away from the draft LM within ~20 steps (its reward falls),
    # which is what a draft LM must keep up with; at 1e-4 the policy's short answers stay where the frozen draft
    # LM already agrees with nearly every token (replayed acceptance at its ceiling), and distillation cannot show
    "smoke": {"steps": 16, "repeats": 1, "overrides": ["rollout.prompts_per_step=8", "data.eval_size=64",
                                                       "learner.lr=1e-3"]},
    "full": {"steps": 60, "repeats": 3, "overrides": ["data.eval_size=256", "learner.lr=1e-3"]},
}
SYNCHRONOUS = ["algorithm.max_staleness=0", "trainer.deterministic=true"]
SYSTEMS = {  # the asynchronous ones also get algorithm.max_staleness (--staleness, 1 unless asked)
    "sync": [*SYNCHRONOUS, "speculation.method=none", "logging.rollouts=true"],
    "async": ["speculation.method=none"],
    "frozen": ["speculation.method=draft_lm"],
    "distilled": ["speculation.method=draft_lm", "speculation.distill.every_versions=4"],
    "fastest_of_n": ["speculation.method=fastest_of_n", "speculation.drafters=[suffix,draft_lm,ngram]",
                     "speculation.distill.every_versions=4"],
    "oracle": [*SYNCHRONOUS, "speculation.method=bench.oracle.OracleDrafter"],  # + the replay: `oracle_replay`
}


def system_overrides(system: str, staleness: int) -> list[str]:
    """What `system` adds to grpo_tiny: its own overrides, and the asynchronous systems' staleness bound."""
    synchronous = system in ("sync", "oracle")
    return SYSTEMS[system] if synchronous else [f"algorithm.max_staleness={staleness}", *SYSTEMS[system]]


def shared_overrides(system: str, overrides: list[str]) -> list[str]:
    """The preset's and `--set`'s `overrides` as `system` takes them: speculation keys only where it speculates (the
    launcher refuses drafting keys without a drafter: they would do nothing)."""
    plain = "speculation.method=none" in SYSTEMS[system]
    return [o for o in overrides if not (plain and o.startswith("speculation."))]


def system_config(system: str, overrides: list[str], staleness: int, steps: int):
    """The launcher's config of `system` over `overrides`, for a run of `steps` (the oracle's replay file, written
    during the benchmark, named by a placeholder): a system checked before any run starts."""
    replay = ["speculation.options.path=replay.json"] if system == "oracle" else []
    return load_run_config("grpo_tiny", [f"trainer.steps={steps}", *shared_overrides(system, overrides),
                                         *system_overrides(system, staleness), *replay])


def oracle_replay(sync_logdir: Path, path: Path) -> str:
    """Writes bench/oracle.py's replay of a `sync` run ({seed: response tokens}, from its logging.rollouts) to `path`;
    returns the override that points the oracle at it."""
    lines = [json.loads(line) for line in (sync_logdir / "rollouts.jsonl").read_text().splitlines()]
    path.write_text(json.dumps({r["seed"]: r["response_ids"] for r in lines}))
    return f"speculation.options.path={path}"


def order(names: list[str], repeat: int) -> list[str]:
    """A repeat's running order: the systems rotated by one per repeat, the oracle right after the `sync` run whose
    tokens it replays."""
    rotated = [name for name in names if name != "oracle"]
    rotated = rotated[repeat % len(rotated):] + rotated[: repeat % len(rotated)]
    if "oracle" in names:
        rotated.insert(rotated.index("sync") + 1, "oracle")
    return rotated


def run(system: str, steps: int, overrides: list[str], logdir: Path, log: Path) -> dict:
    """One launch in a fresh process; its per-step numbers read back from TensorBoard and summary.json."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    command = [sys.executable, "launch.py", "--config", "grpo_tiny", f"trainer.steps={steps}",
               f"trainer.eval_every={steps}", f"logging.dir={logdir}", *overrides]
    with log.open("a") as out:
        done = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{system}: launch exited {done.returncode} (log: {log})")
    summary = json.loads((logdir / "summary.json").read_text())
    failed = [a for a in summary["actors"] if "error" in a]  # its counters are lost with it: no honest rollout_s
    if failed:
        raise RuntimeError(f"{system}: rollout actor {failed[0]['actor']} ended with {failed[0]['error']} (log: {log})")
    events = EventAccumulator(str(logdir)).Reload()
    times = [e.wall_time for e in events.Scalars("rl/reward_mean")]

    def mean(tag: str) -> float:  # per step, the first step excluded (it holds the engines' start)
        return statistics.fmean(e.value for e in events.Scalars(tag)[1:])

    return {
        "step_s": seconds_per_step(times),
        "rollout_s": sum(a["generate_seconds"] for a in summary["actors"]) / steps,
        # of the actors' engine time per step: its engine steps, and the seconds of the coupled sampler, the drafter
        # bridge (planning, bookkeeping) and the drafter itself (0 for the last two without speculation)
        "engine_profile": {"engine_steps": sum(a["engine_steps"] for a in summary["actors"]) / steps,
                           **{f"{part}_s": sum(a[f"{part}_seconds"] for a in summary["actors"]) / steps
                              for part in ("sampler", "bridge", "drafter")}},
        # where a step's time goes: the learner's GRPO step, the learner waiting for the step's groups, and the
        # actors waiting for weights with nothing admissible to run (the staleness bound), per actor and step
        "profile": {"train_s": mean("rl/train_seconds"), "learner_wait_s": mean("rl/wait_seconds"),
                    "zero_advantage_fraction": mean("rl/zero_advantage_fraction"),  # rows with no backward pass
                    "actor_idle_s": sum(a["idle_seconds"] for a in summary["actors"]) / len(summary["actors"]) / steps},
        # how much the actors drafted, per step: draft tokens the planner allowed per request and engine step, and
        # the step's trajectories' draft tokens verified and accepted
        "drafting": {key: mean(f"spec/{key}") for key in ("planned_tokens", "draft_tokens", "accepted_tokens")}
        if "spec/planned_tokens" in events.Tags()["scalars"] else {},
        "acceptance_by_step": [] if "speculation.method=none" in SYSTEMS[system] else
        [round(e.value, 3) for e in events.Scalars("spec/acceptance_length")],
        # each member of fastest-of-N, scored on every proposal it made, chosen or not: [step, token acceptance]
        "member_acceptance_by_step": {tag.split("/")[2]: [[e.step, round(e.value, 3)] for e in events.Scalars(tag)]
                                      for tag in events.Tags()["scalars"] if tag.startswith("spec/member/")},
        "heldout_reward": events.Scalars("eval/reward_mean")[-1].value,
        # the draft LM's acceptance replayed by the learner on each step's trajectories, and its version
        # and the run's starting (frozen) draft LM replayed on the same trajectories: a paired comparison
        **({"replayed_acceptance_by_step": [round(e.value, 3) for e in events.Scalars("draft/replayed_acceptance")],
            "initial_replayed_acceptance_by_step": [round(e.value, 3) for e in
                                                    events.Scalars("draft/initial_replayed_acceptance")],
            "draft_version_by_step": [int(e.value) for e in events.Scalars("draft/version")]}
           if "draft/version" in events.Tags()["scalars"] else {}),
        "reward_by_step": [round(e.value, 4) for e in events.Scalars("rl/reward_mean")],
        "trained": summary["learner"]["trained"],
        "dropped_stale": summary["learner"]["dropped_stale"],  # generated, then too old to train: wasted rollouts
    }


def seconds_per_step(times: list[float]) -> float:
    """Mean seconds per step from the steps' wall times, the first step's gap left out (it holds the engines'
    start). Not the median gap: asynchronous steps come in pairs (a long gap while the learner waits for a step's
    groups, then a short one for the next step's, generated meanwhile), and the median of such gaps is whichever of
    the two modes has one more member: 0.64 s for a run whose steps took 0.96 s on average."""
    if len(times) < 3:
        raise ValueError(f"seconds_per_step: {len(times)} step times, need 3 or more")
    return (times[-1] - times[1]) / (len(times) - 2)


def trend(series: list[float]) -> float | None:
    """Median of the last quarter of `series` over the median of its first quarter (None: too short)."""
    quarter = len(series) // 4
    if quarter == 0:
        return None
    return round(statistics.median(series[-quarter:]) / statistics.median(series[:quarter]), 3)


def late_gain(run: dict) -> float | None:
    """The distilled draft LM's replayed acceptance over the run's starting one's on the same tokens, medians of the
    last quarter (None: too short). A trend's size is mostly how far that run's policy drifted, which asynchrony
    makes differ from run to run; this ratio is what distillation gained, paired."""
    mine, start = run["replayed_acceptance_by_step"], run["initial_replayed_acceptance_by_step"]
    quarter = len(mine) // 4
    if quarter == 0:
        return None
    return round(statistics.median(mine[-quarter:]) / statistics.median(start[-quarter:]), 3)


def median_trend(runs: list[dict], key: str) -> float | None:
    """The median over repeats of `trend(run[key])` (None: too short)."""
    trends = [t for t in (trend(r[key]) for r in runs) if t is not None]
    return statistics.median(trends) if trends else None


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, members, middle, right) = plt.subplots(1, 4, figsize=(21, 4))
    for name, system in result["systems"].items():
        if system["acceptance_by_step"]:
            left.plot(system["acceptance_by_step"], label=name)
    left.set(xlabel="step", ylabel="acceptance length (tokens per verify step)", title="drafters over the run (live)")
    if left.lines:
        left.legend()
    for name, system in result["systems"].items():
        for member, series in system.get("member_acceptance_by_step", {}).items():
            members.plot(*zip(*series), label=f"{name}: {member}")
    members.set(xlabel="step", ylabel="token acceptance (every proposal it made)", title="fastest-of-N's members")
    if members.lines:
        members.legend()
    distilled = result["systems"].get("distilled", {})
    if "replayed_acceptance_by_step" in distilled:  # the same trajectories, two draft LMs
        middle.plot(distilled["replayed_acceptance_by_step"], label="distilled (running)")
        middle.plot(distilled["initial_replayed_acceptance_by_step"], label="frozen (the run's start)")
        middle.legend()
    middle.set(xlabel="step", ylabel="replayed acceptance length", title="draft LM replayed on each step's rollouts")
    names = list(result["systems"])
    right.bar(names, [result["systems"][n]["step_s"] for n in names])
    right.set(ylabel="seconds per step (median)", title="end-to-end step time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS),
                        help="a subset (the reference always runs)")
    parser.add_argument("--reference", choices=["sync", "async"], default="sync",
                        help="the system that always runs; speed-ups are paired per repeat over sync and over async, "
                             "each where it ran")
    parser.add_argument("--repeats", type=int, help="override the preset's number of interleaved repeats")
    parser.add_argument("--staleness", type=int, default=1,
                        help="algorithm.max_staleness of the asynchronous systems (sync always runs at 0)")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="config overrides for every system, after the preset's (e.g. learner.lr=3e-4); "
                        "speculation keys reach the systems that speculate")
    args = parser.parse_args(argv)
    if args.staleness < 1:  # 0 is `sync`'s schedule: the asynchronous systems would not be asynchronous
        parser.error(f"--staleness must be 1 or more, got {args.staleness}")
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be 1 or more, got {args.repeats}")
    preset = {**PRESETS[args.preset], **({"repeats": args.repeats} if args.repeats else {})}
    preset["overrides"] = [*preset["overrides"], *args.set]
    names = [name for name in SYSTEMS if name == args.reference or name in args.systems]
    if "oracle" in names and "sync" not in names:
        parser.error("the oracle replays the tokens of the same repeat's `sync` run: list sync among --systems")
    for name in names:  # a misspelt --set key fails here, naming it, not minutes into the benchmark
        try:
            system_config(name, preset["overrides"], args.staleness, preset["steps"])
        except ConfigError as e:
            parser.error(f"--set: {e}")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    log = args.out.with_suffix(".log")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(preset["repeats"]):
            for name in order(names, repeat):
                replay = [oracle_replay(Path(tmp) / f"sync-{repeat}", Path(tmp) / f"replay-{repeat}.json")] \
                    if name == "oracle" else []
                runs[name].append(run(name, preset["steps"], [*shared_overrides(name, preset["overrides"]),
                                                              *system_overrides(name, args.staleness), *replay],
                                      Path(tmp) / f"{name}-{repeat}", log))
                print(f"repeat {repeat + 1}: {name} {runs[name][-1]['step_s']:.2f} s/step, held-out reward "
                      f"{runs[name][-1]['heldout_reward']:.3f}, dropped stale {runs[name][-1]['dropped_stale']}",
                      flush=True)
    systems = {}
    for name in names:
        first = runs[name][0]
        systems[name] = {
            "step_s": statistics.median(r["step_s"] for r in runs[name]),
            "rollout_s": statistics.median(r["rollout_s"] for r in runs[name]),
            "profile": {key: round(statistics.median(r["profile"][key] for r in runs[name]), 3)
                        for key in first["profile"]},
            "engine_profile": {key: round(statistics.median(r["engine_profile"][key] for r in runs[name]), 4)
                               for key in first["engine_profile"]},
            "drafting": {key: round(statistics.median(r["drafting"][key] for r in runs[name]), 3)
                         for key in first["drafting"]},
            # live acceptance length: each repeat's mean over its steps, median over the repeats (1: no drafts)
            "acceptance": round(statistics.median(statistics.fmean(r["acceptance_by_step"]) for r in runs[name]
                                                  if r["acceptance_by_step"]), 3)
            if first["acceptance_by_step"] else 1.0,
            "acceptance_by_step": first["acceptance_by_step"],
            **({"member_acceptance_by_step": first["member_acceptance_by_step"],
                # per member: its token acceptance over the run (mean over steps), median over repeats
                "member_token_acceptance": {m: round(statistics.median(
                    statistics.fmean(v for _, v in r["member_acceptance_by_step"][m]) for r in runs[name]
                    if r["member_acceptance_by_step"].get(m)), 3) for m in first["member_acceptance_by_step"]}}
               if first["member_acceptance_by_step"] else {}),
            # acceptance over the run's last quarter / its first quarter (median over repeats; 1: no drift)
            "acceptance_trend": median_trend(runs[name], "acceptance_by_step"),
            **{key: first[key] for key in ("replayed_acceptance_by_step", "initial_replayed_acceptance_by_step",
                                           "draft_version_by_step") if key in first},
            # replayed acceptance, last quarter / first quarter: the distilled draft LM and the frozen one, paired
            **({"replayed_trend": median_trend(runs[name], "replayed_acceptance_by_step"),
                "initial_replayed_trend": median_trend(runs[name], "initial_replayed_acceptance_by_step"),
                "late_gain_over_initial": [late_gain(r) for r in runs[name]]}
               if "replayed_acceptance_by_step" in first else {}),
            "heldout_reward": statistics.median(r["heldout_reward"] for r in runs[name]),
            **({"speedup_over_sync": paired([r["step_s"] for r in runs["sync"]], [r["step_s"] for r in runs[name]])}
               if "sync" in runs else {}),
            # the asynchronous loop without speculation, paired: what turning speculation on does to the main job
            **({"speedup_over_async": paired([r["step_s"] for r in runs["async"]], [r["step_s"] for r in runs[name]])}
               if "async" in runs and name not in ("sync", "oracle") else {}),
            "runs": runs[name],
        }
    result = {"systems": systems,
              "config": {"preset": args.preset, **preset, "config": "grpo_tiny",
                         "staleness": args.staleness,
                         "systems": {name: system_overrides(name, args.staleness) for name in names},
                         "host_cpus": os.cpu_count()}}
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print("| system | s/step | rollout s/step | train s | learner wait s | actor idle s | speed-up over sync | "
          "over async | mean acceptance | held-out reward |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, s in systems.items():
        p = s["profile"]
        print(f"| {name} | {s['step_s']:.2f} | {s['rollout_s']:.2f} | {p['train_s']:.2f} | {p['learner_wait_s']:.2f} "
              f"| {p['actor_idle_s']:.2f} | {over(s, 'speedup_over_sync')} | {over(s, 'speedup_over_async')} | "
              f"{s['acceptance']:.2f} | "
              f"{s['heldout_reward']:.3f} |")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return result


def over(system: dict, key: str) -> str:
    """A speed-up cell of the console table: the paired median with its interval, '-' where not measured."""
    if key not in system:
        return "-"
    low, high = system[key].get("speedup_ci95", (None, None))
    return f"{system[key]['speedup']:.2f}" + ("" if low is None else f" ({low:.2f}-{high:.2f})")


if __name__ == "__main__":
    main()
