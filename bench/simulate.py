"""Trace-driven rollout simulator: what speculation gives on hardware this project cannot run vLLM on, computed from
a recorded rollout (bench/trace.py) and measured step-cost curves.

    python -m bench.simulate --trace TRACE --validate [--out PATH]
    python -m bench.simulate --trace TRACE --costs bench/results/step_cost_h100.json [--shape qwen3_8b]
                             [--context 2048] [--gpu-draft-ms-per-pass 1.5] [--out PATH]

Every coupled system commits the same tokens, so a request's schedule is fixed by how many tokens each step commits
for it: `1 + min(drafts, match)`, `match` being the trace's match length of the drafter there (the oracle matches
everywhere). What is left is time. The simulator steps a continuous batch on a simulated clock (the trace's prefill,
then decode steps until each request has its tokens); per step the real draft planner (`actor/draft_planner.py`, fed
the simulated steps as the engine feeds it measured ones) chooses each request's drafts, and the step costs the
engine's seconds for its tokens plus drafting's (serial) or the drafting the engine waits for (decoupled).

- `--validate`: costs fitted from the trace (the engine's seconds per step against its tokens, pooled over the
  systems; each drafter's seconds per step against its requests and drafts), then vanilla, oracle and specactor
  simulated against the makespans measured in the same run: trusted where they agree (within 10%; speed-ups 0.05x).
- `--costs FILE`: a `bench.step_cost` result for another device (decode and verify-4 step times by requests at
  `--context` tokens of context); the projected speed-up of each system over vanilla, drafting on the host CPU (the
  trace's drafting cost), on the GPU (`--gpu-draft-ms-per-pass`, measured by bench.gpu_check) and decoupled, and the
  speed-up against mean acceptance length (a fixed per-token rate): what a drafter must reach.

Decoupled drafting prepares step t+1's drafts while step t verifies: `decoupled_chain`, ready only where all the last
drafts were accepted and the drafter's next token was the target's; `decoupled_outcomes` (`--past-rejection P`), as
built for the draft LM: also past a rejected draft where a guess was right (rate P), and (`--chain-second-guess Q`)
where the second guess was (rate Q of first-guess misses); the bound `decoupled_every_outcome`, every outcome ready.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from actor.draft_planner import Acceptance, DraftCost, Explore, Rest, StepCost, Survival, geometric, plan
from drafters.calibration import Calibration


@dataclass
class Costs:
    """What a simulated step costs: `engine(requests, drafts)` seconds, drafting's seconds as
    `draft_fixed + draft_per_request * requests + draft_per_pass * passes + draft_per_token * drafts +
    draft_per_unseen * unseen` when it drafts (unseen: history tokens the drafter sees for the first time, its
    catch-up; `bridge_per_request * requests` when it does not draft: the planner's own work), and the prefill's."""

    engine: object  # (requests, drafts) -> seconds
    prefill_s: float
    draft_fixed: float = 0.0
    draft_per_request: float = 0.0
    draft_per_pass: float = 0.0
    draft_per_token: float = 0.0
    bridge_per_request: float = 0.0
    draft_per_unseen: float = 0.0

    def drafting(self, requests: int, drafts: int, passes: int, unseen: int = 0) -> float:
        if drafts == 0:
            return self.bridge_per_request * requests
        return (self.draft_fixed + self.draft_per_request * requests + self.draft_per_pass * passes
                + self.draft_per_token * drafts + self.draft_per_unseen * unseen)


def monotone_curve(points: dict[int, float], steps: dict[int, int] | None = None):
    """Seconds against tokens (the median per count), never falling: counts out of order pooled into their mean by
    `steps` (pool-adjacent-violators; a running maximum let 2 slow steps at 7 tokens lift 992 at 8 by a third),
    interpolated linearly, extrapolated along the last two counts' slope."""
    pools: list[list[float]] = []  # [seconds, steps, counts]
    for t in sorted(points):
        pools.append([points[t], (steps or {}).get(t, 1), 1])
        while len(pools) > 1 and pools[-2][0] > pools[-1][0]:
            (y2, w2, n2), (y1, w1, n1) = pools.pop(), pools.pop()
            pools.append([(y1 * w1 + y2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    x, y = np.array(sorted(points), dtype=float), np.repeat([p[0] for p in pools], [p[2] for p in pools])
    slope = (y[-1] - y[-2]) / (x[-1] - x[-2]) if len(x) > 1 else 0.0

    def seconds(tokens: float) -> float:
        return float(np.interp(tokens, x, y)) if tokens <= x[-1] else float(y[-1] + slope * (tokens - x[-1]))

    return seconds


def decode_steps(run: dict, k: int) -> tuple[list[list[float]], int]:
    """A run's steps after its prefill (the leading steps that computed more tokens than `k + 1` per request: prompt
    tokens), and how many those were."""
    steps, first = run["steps"], 0
    while first < len(steps) and steps[first][1] > (k + 1) * steps[first][2]:
        first += 1
    return steps[first:], first


def fit_costs(trace: dict, drafter: str | None) -> Costs:
    """Costs from the trace: the engine curve pooled over every coupled system's decode steps, the prefill from
    vanilla's; drafting from `drafter`'s own steps (None: vanilla, which never drafts)."""
    k, by_tokens = trace["config"]["num_speculative_tokens"], {}
    for runs in trace["systems"].values():
        for run in runs:
            for wall, tokens, requests, _, bridge, drafter_s, *_ in decode_steps(run, k)[0]:
                by_tokens.setdefault(int(tokens), []).append(wall - bridge - drafter_s)
    medians, steps = {t: statistics.median(v) for t, v in by_tokens.items()}, {t: len(v) for t, v in by_tokens.items()}
    curve = monotone_curve(medians, steps)  # the prefill: vanilla's (the same prompts in every system)
    prefill = statistics.median(sum(s[0] for s in r["steps"][: decode_steps(r, k)[1]]) for r in trace["systems"][
        "vanilla"])
    costs = Costs(engine=lambda requests, drafts: curve(requests + drafts), prefill_s=prefill)
    if drafter is None:
        return costs
    rows, spent = [], []
    for run in trace["systems"][drafter]:
        steps = decode_steps(run, k)[0]
        for step, after in zip(steps, steps[1:]):  # a step's drafting makes the next step's drafts
            drafted = after[1] - after[2]
            unseen = step[6] if len(step) > 6 else 0.0  # (a trace recorded without it: no catch-up term)
            rows.append([1.0 if drafted else 0.0, step[2] if drafted else 0.0, drafted, unseen if drafted else 0.0,
                         0.0 if drafted else step[2]])
            spent.append(step[4] + step[5])
    coef = np.clip(np.linalg.lstsq(np.array(rows), np.array(spent), rcond=None)[0], 0.0, None)
    costs.draft_fixed, costs.draft_per_request, costs.draft_per_token, costs.draft_per_unseen, \
        costs.bridge_per_request = coef
    return costs


def simulate(lengths: list[int], match: list[list[int]] | None, costs: Costs, k: int, drafting: bool,
             decoupled: str | None = None, confidence: list[list[list[float]]] | None = None,
             prompts: list[int] | None = None, past_rejection: float = 0.0, chain_second: float = 0.0) -> dict:
    """Makespan and batch curve of one rollout: `lengths` tokens per request, drafts accepted by `match` (None: the
    oracle, every draft), drafting decided by the real planner when `drafting`. `decoupled` (None: serial): "chain",
    "outcomes" (at the measured rates `past_rejection` and `chain_second`) or "every_outcome", as the module says; a
    miss is drafted now only where the cost model says it pays, and preparing fits beside the verify step, as the
    bridge sizes it. `confidence`: the drafter's per token, where it gives them: each proposal is then verified only as
    far as its calibrated gains pay (learned from the simulated outcomes). `prompts`: each request's prompt tokens,
    which a drafter catches up on the first time it drafts for it, as the bridge weighs it (None: no catch-up)."""
    n = len(lengths)
    prompt, shown = prompts or [0] * n, [0] * n  # shown: history tokens the drafter has seen, per request
    position = [1] * n  # the prefill samples every request's first token
    clock, curve, waited = costs.prefill_s, [], 0.0
    step_cost, draft_cost, acceptance, calibration = StepCost(), DraftCost(), Acceptance(), Calibration()
    survival = Survival(2 * max(lengths, default=0) + k)  # as the bridge's, whose longest is the model's length
    ready = [False] * n  # decoupled: this request's next drafts were prepared during the last step
    guesses = random.Random(0)  # "outcomes": which guesses past a rejected draft were right, the same every run
    explore, rest = Explore(acceptance), Rest()
    while True:
        running = [i for i in range(n) if position[i] < lengths[i]]
        if not running:
            break
        ids = [str(i) for i in running]
        drafts = [0] * len(running)
        unseen = [prompt[i] + position[i] - shown[i] for i in running]  # what drafting now would catch up on
        exploring = explore.due()  # (once a step, as the bridge decides it)
        plans = drafting and (exploring or not rest.keeps(len(running)))
        if plans:
            survive = survival.factors([position[i] for i in running], k)
            gains = geometric(acceptance.rates(ids), k) * survive
            # decoupled: planned as if drafting were free (prepared drafts are), misses re-planned below, as the bridge
            budgets = [k] * len(running) if decoupled and confidence is not None and not exploring and rest.idle < 2 \
                else plan(gains, len(running), step_cost, None if decoupled else draft_cost, explore=exploring,
                          unseen=unseen)[0]  # (k each: a rated drafter, decoupled, as the bridge plans it)
            drafts = [min(b, lengths[i] - position[i] - 1) for b, i in zip(budgets, running)]
        planned = list(drafts)  # decoupled: the requests whose next drafts the bridge prepares, drafted now or not
        missed = [m for m, i in enumerate(running) if drafts[m] and not ready[i]] \
            if decoupled in ("chain", "outcomes") else []
        if missed:  # as the bridge: drafted now where that pays at the serial cost over the whole step, else plainly
            ready_now = set(range(len(running))) - set(missed)
            elsewhere = len(running) - len(missed) + sum(float(gains[m][: drafts[m]].sum()) for m in ready_now)
            budgets, _ = plan([list(gains[m][: drafts[m]]) for m in missed],
                              len(running) + sum(drafts) - sum(drafts[m] for m in missed), step_cost, draft_cost,
                              unseen=[unseen[m] for m in missed], elsewhere=elsewhere)
            for m, b in zip(missed, budgets):
                drafts[m] = b
        asked = list(drafts)  # what the drafter proposes (and is paid for); `drafts`: what the engine verifies
        if confidence is not None and any(drafts) and not exploring:  # (as the bridge: exploring verifies all)
            rated = [confidence[i][position[i]][:d] for d, i in zip(drafts, running)]
            keep, _ = plan([calibration.gains(c) * survive[m, : len(c)] for m, c in enumerate(rated)], len(running),
                           step_cost, None)
            drafts = [min(d, kept) for d, kept in zip(drafts, keep)]
        total, passes = sum(drafts), max(asked, default=0)
        unseen_asked = sum(u for u, a in zip(unseen, asked) if a)  # what the drafter catches up on this step
        engine = costs.engine(len(running), total)
        if decoupled in ("chain", "outcomes"):  # drafted on the critical path: the misses the planner drafts now
            now = [asked[m] for m in missed if asked[m]]
            unseen_now = sum(unseen[m] for m in missed if asked[m])
        else:
            now = [] if decoupled else asked
            unseen_now = 0 if decoupled else unseen_asked
        drafting_now = costs.drafting(len(now), sum(now), max(now), unseen_now) if sum(now) else 0.0
        waited_here = drafting_now
        if decoupled:  # the prepared drafting runs beside the verify step: only what outlasts it is waited for
            prepared = costs.drafting(len(running), sum(planned), max(planned, default=0),  # every planned request's
                                      sum(u for u, p in zip(unseen, planned) if p))  # (misses skipped now too)
            waited_here += max(0.0, prepared - waited_here - engine)
        clock += engine + waited_here
        waited += waited_here
        for d, proposed, wanted, i, rid in zip(drafts, asked, planned, running, ids):
            if proposed or decoupled and wanted:  # the drafter has seen this request's history (prepared from it)
                shown[i] = prompt[i] + position[i]
            reach = k + 1 if match is None else match[i][position[i]]
            accepted = min(d, reach)
            if confidence is not None and proposed:  # labels as the verifier gives them: up to the first miss
                labels = min(accepted + 1, proposed)
                calibration.observe(confidence[i][position[i]][:labels], [0] * labels,
                                    [0 if j < reach else 1 for j in range(labels)])
            # prepared for the requests the plan gave drafts (as the bridge): ready where all were accepted and the next
            # guess is the target's, or ("outcomes", at the measured rates) a guess past a rejection or all accepted
            ready[i] = bool(wanted) and (reach > d or decoupled == "outcomes" and guesses.random() < (
                past_rejection if reach < d else chain_second))
            if position[i] + accepted + 1 >= lengths[i]:  # it ends: as the bridge, which saw it a step before
                survival.ended(position[i] + 1)
            position[i] = min(lengths[i], position[i] + accepted + 1)
            if d:
                acceptance.observe(rid, d, accepted)
        step_cost.observe(len(running) + total, engine)
        if sum(now):  # the drafting cost the planner learns: what the engine waits for when it drafts now
            draft_cost.observe(max(now), sum(now), unseen_now, drafting_now)
        if drafting and exploring:  # it explored, at that cost
            explore.explored(sum(map(bool, drafts)), drafting_now + engine - costs.engine(len(running), 0))
        explore.stepped(total > 0)
        explore.took(engine)  # (after `stepped`: as the bridge, which hears of a step's engine seconds later)
        curve.append((round(clock, 4), len(running)))
    return {"makespan_s": clock, "steps": len(curve), "drafting_waited_s": waited, "batch_curve": curve}


def matches_at_rate(lengths: list[int], k: int, rate: float, seed: int = 0) -> list[list[int]]:
    """Match lengths of a drafter whose every token is accepted with probability `rate` given the ones before it."""
    rng = random.Random(seed)  # a position matches m tokens: the first m draws below `rate`, the next one not (or k)
    return [[next(m for m in range(k + 1) if m == k or rng.random() >= rate) for _ in range(length)]
            for length in lengths]


def validate(trace: dict) -> dict:
    """Simulated against measured makespans of vanilla, oracle and specactor, costs fitted from the same trace."""
    k, lengths = trace["config"]["num_speculative_tokens"], [r["tokens"] for r in trace["requests"]]
    prompts = [r["prompt_tokens"] for r in trace["requests"]]
    cases = {"vanilla": (None, None, False), "oracle": ("oracle", None, True),
             "specactor": ("specactor", trace["match"]["draft_lm"], True)}
    rated = trace.get("confidence", {}).get("draft_lm")  # (a trace recorded without them: acceptance rates only)
    out, vanilla = {}, None
    for name, (drafter, match, drafting) in cases.items():
        if name not in trace["systems"]:
            continue
        measured = statistics.median(r["makespan_s"] for r in trace["systems"][name])
        simulated = simulate(lengths, match, fit_costs(trace, drafter), k, drafting,
                             confidence=rated if name == "specactor" else None, prompts=prompts)["makespan_s"]
        out[name] = {"measured_s": round(measured, 3), "simulated_s": round(simulated, 3),
                     "error": round(simulated / measured - 1, 3)}
        if name == "vanilla":
            vanilla = out[name]
        elif vanilla is not None:
            out[name]["measured_speedup"] = round(vanilla["measured_s"] / measured, 3)
            out[name]["simulated_speedup"] = round(vanilla["simulated_s"] / simulated, 3)
    return out


def attention_curve(step_cost_file: Path, shape: str, context: int):
    """(requests, drafts) -> seconds from a `bench.step_cost` result: decode and verify-4 times measured per number
    of requests at `context` tokens of context, interpolated in requests (log scale) and linearly in drafts."""
    result = json.loads(step_cost_file.read_text())["shapes"][shape]
    table = next(c for c in result["with_attention"] if c["context"] == context)["by_requests"]
    b = np.array(sorted(int(r) for r in table), dtype=float)
    decode = np.array([table[str(int(r))]["decode_ms"] for r in b]) / 1e3
    verify = np.array([table[str(int(r))]["verify_k4_ms"] for r in b]) / 1e3

    def seconds(requests: int, drafts: int) -> float:
        x = np.log(max(requests, 1))
        plain = float(np.interp(x, np.log(b), decode))
        full = float(np.interp(x, np.log(b), verify))
        return plain + (full - plain) * drafts / (4 * max(requests, 1))

    return seconds


def project(trace: dict, costs_file: Path, shape: str, context: int, gpu_draft_s_per_pass: float,
            past_rejection: float | None = None, chain_second: float = 0.0) -> dict:
    """Projected speed-ups over vanilla on `costs_file`'s device, per system and drafting placement (decoupled
    "outcomes" where `past_rejection` is given), and the speed-up against mean acceptance length."""
    k, requests = trace["config"]["num_speculative_tokens"], trace["requests"]
    lengths, prompts = [r["tokens"] for r in requests], [r["prompt_tokens"] for r in requests]
    engine = attention_curve(costs_file, shape, context)
    by_tokens = json.loads(costs_file.read_text())["shapes"][shape]["ms_by_tokens"]
    prefill = monotone_curve({int(t): ms / 1e3 for t, ms in by_tokens.items()})(sum(prompts))
    host = fit_costs(trace, "specactor")  # the draft LM's drafting as measured on this CPU
    placements = {
        "host_cpu": Costs(engine, prefill, host.draft_fixed, host.draft_per_request, 0.0, host.draft_per_token,
                          host.bridge_per_request, host.draft_per_unseen),
        "gpu": Costs(engine, prefill, draft_per_pass=gpu_draft_s_per_pass)}
    vanilla = simulate(lengths, None, Costs(engine, prefill), k, drafting=False)
    systems = {"vanilla": vanilla, "oracle": simulate(lengths, None, Costs(engine, prefill), k, drafting=True)}
    for where, costs in placements.items():
        for decoupled in (None, "chain", *(["outcomes"] if past_rejection is not None else []), "every_outcome"):
            name = f"specactor_{where}" + (f"_decoupled_{decoupled}" if decoupled else "")
            systems[name] = simulate(lengths, trace["match"]["draft_lm"], costs, k, True, decoupled,
                                     trace.get("confidence", {}).get("draft_lm"), prompts, past_rejection or 0.0,
                                     chain_second)
    out = {"systems": {name: {"makespan_s": round(r["makespan_s"], 4),
                              "speedup": round(vanilla["makespan_s"] / r["makespan_s"], 3),
                              "drafting_waited_share": round(r["drafting_waited_s"] / r["makespan_s"], 4)}
                       for name, r in systems.items()}}
    oracle_gain = out["systems"]["oracle"]["speedup"] - 1
    for name, row in out["systems"].items():
        if name.startswith("specactor") and oracle_gain > 0:
            row["share_of_oracle_gain"] = round((row["speedup"] - 1) / oracle_gain, 3)
    out["sensitivity"] = []
    for rate in (0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95):
        match = matches_at_rate(lengths, k, rate)
        row = {"token_acceptance": rate,
               "mean_acceptance_length": round(1 + sum(rate ** j for j in range(1, k + 1)), 3)}
        for decoupled in (None, "every_outcome"):
            r = simulate(lengths, match, placements["gpu"], k, True, decoupled)
            row["speedup" + ("_decoupled" if decoupled else "")] = round(vanilla["makespan_s"] / r["makespan_s"], 3)
        out["sensitivity"].append(row)
    out["batch_curves"] = {name: r["batch_curve"][:: max(1, len(r["batch_curve"]) // 300)]
                           for name, r in systems.items()}
    return out


def plot(projection: dict, path: Path) -> None:
    """Running requests over simulated time per system, and the speed-up against mean acceptance length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2))
    for name, curve in projection["batch_curves"].items():
        t, b = zip(*curve)
        left.step(t, b, where="post", label=f"{name} {projection['systems'][name]['speedup']:.2f}x")
    left.set_xlabel("simulated seconds")
    left.set_ylabel("running requests")
    left.legend(fontsize=7)
    rows = projection["sensitivity"]
    lengths = [r["mean_acceptance_length"] for r in rows]
    right.plot(lengths, [r["speedup"] for r in rows], marker="o", label="drafting on the GPU, serial")
    right.plot(lengths, [r["speedup_decoupled"] for r in rows], marker="o", label="decoupled, every outcome")
    right.axhline(1.0, color="k", lw=0.8)
    right.set_xlabel("mean acceptance length (tokens a verify step commits, every draft asked)")
    right.set_ylabel("projected speed-up over vanilla")
    right.legend(fontsize=8)
    fig.suptitle(f"projection: {projection['shape']} on {Path(projection['costs']).stem}, context "
                 f"{projection['context']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, required=True, help="a bench.rollout --trace file")
    parser.add_argument("--validate", action="store_true", help="simulate the trace's own run and compare")
    parser.add_argument("--costs", type=Path, help="a bench.step_cost result: project onto its device")
    parser.add_argument("--shape", default="qwen3_8b", help="the step-cost file's shape to project with")
    parser.add_argument("--context", type=int, default=2048, help="the step-cost file's context to project at")
    parser.add_argument("--gpu-draft-ms-per-pass", type=float, default=3.8,
                        help="drafting on the GPU: ms per sequential draft pass (the built-in draft LM's on an H200 "
                             "at 32 requests, bench/results/gpu_check_h200.json: 3.5-4.3 ms from 1 to 128)")
    parser.add_argument("--past-rejection", type=float, default=None,
                        help="projects decoupled drafting as built (`outcomes`): the share of prepared outcomes "
                             "with a rejected draft where a guess was right (guess_accuracy.rejection)")
    parser.add_argument("--chain-second-guess", type=float, default=0.0,
                        help="with --past-rejection: the share of first-guess misses past every accepted draft "
                             "the second guess covered (guess_accuracy: chain_second / (1 - chain + chain_second))")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/simulate.json"))
    args = parser.parse_args(argv)
    if not args.validate and args.costs is None:
        parser.error("say what to do: --validate, --costs FILE, or both")
    for flag, value in (("--past-rejection", args.past_rejection), ("--chain-second-guess", args.chain_second_guess)):
        if value is not None and not 0 <= value <= 1:
            parser.error(f"{flag} {value}: a share, in [0, 1]")
    trace = json.loads(args.trace.read_text())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"trace": str(args.trace), "preset": trace["config"].get("preset")}
    if args.validate:
        result["validation"] = validate(trace)
        for name, row in result["validation"].items():
            print(f"{name:10s} measured {row['measured_s']:7.2f} s  simulated {row['simulated_s']:7.2f} s  "
                  f"error {row['error']:+.1%}" + (f"  speed-up {row['measured_speedup']:.2f}x measured, "
                                                  f"{row['simulated_speedup']:.2f}x simulated"
                                                  if "measured_speedup" in row else ""))
    if args.costs is not None:
        result["projection"] = {"costs": str(args.costs), "shape": args.shape, "context": args.context,
                                "gpu_draft_ms_per_pass": args.gpu_draft_ms_per_pass,
                                "past_rejection": args.past_rejection, "chain_second_guess": args.chain_second_guess,
                                **project(trace, args.costs, args.shape, args.context,
                                          args.gpu_draft_ms_per_pass / 1e3, args.past_rejection,
                                          args.chain_second_guess)}
        for name, row in result["projection"]["systems"].items():
            print(f"{name:30s} {row['speedup']:5.2f}x  drafting waited {row['drafting_waited_share']:.1%}"
                  + (f"  {row['share_of_oracle_gain']:.0%} of the oracle's gain" if "share_of_oracle_gain" in row
                     else ""))
        plot(result["projection"], args.out.with_suffix(".png"))
        for row in result["projection"]["sensitivity"]:
            print(f"acceptance length {row['mean_acceptance_length']:.2f}: {row['speedup']:.2f}x serial, "
                  f"{row['speedup_decoupled']:.2f}x decoupled")
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
