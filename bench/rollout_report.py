"""How a rollout benchmark's result is shown: what a coupled system's speculation did (`speculation_report`), the
table on the console and the PNG (bench/rollout.py)."""

from __future__ import annotations

import statistics
from pathlib import Path


def speculation_report(spec, grew: dict, verify: int, steps: int) -> dict:
    """A coupled system's run, from its requests' summed speculation stats (`spec`), what its engine's profile
    counters grew by (`grew`), its verify steps and engine steps: for decoupled drafting, the verify steps whose
    drafts were ready, the outcomes prepared a step, the steps that did not wait longer for them and, per kind, the
    share of prepared outcomes that came about whose guess was the target's token; the draft planner's tokens
    allowed per request and step and its step-cost error; for a composite drafter, each member's share of the draft
    steps and its token acceptance on every proposal it made."""
    run = {}
    if spec.prepared_steps:
        run["prepared_hit_rate"] = round(spec.prepared_steps / max(verify, 1), 3)
        run["prepared_outcomes_per_step"] = round(grew["ahead_outcomes"] / steps, 2)
        run["busy_steps"] = grew["ahead_busy_steps"]  # steps that went on without drafts: the drafter still prepared
        kinds = ("chain", "rejection", "chain_second", "rejection_second")
        run["guess_accuracy"] = {kind: round(grew[f"ahead_{kind}_hits"] / max(
            grew[f"ahead_{kind.removesuffix('_second')}_reached"], 1), 3) for kind in kinds}
    if spec.planned_steps:
        run["planner"] = {"planned_tokens": round(spec.planned_tokens / spec.planned_steps, 3),
                          "cost_error": round(spec.cost_error / spec.planned_steps, 3)}
    choices = spec.drafter_choices
    if choices:
        run["choice_shares"] = {s: round(n / sum(choices.values()), 3) for s, n in sorted(choices.items())}
    if spec.drafter_labels:
        run["member_token_acceptance"] = {m: round(yes / max(yes + no, 1), 3)
                                          for m, (yes, no) in sorted(spec.drafter_labels.items())}
    return run


def profile_medians(repeats: list[dict]) -> dict:
    """A coupled system's profile over its repeats: the median of each part's milliseconds a step, and the median
    share of the makespan the drafter took on the engine's critical path (`critical_draft_share`)."""
    median = lambda f: statistics.median(map(f, repeats))  # noqa: E731
    return {"profile_ms_per_step": {k: round(median(lambda r: r["profile_ms_per_step"][k]), 3)
                                    for k in repeats[0]["profile_ms_per_step"]},
            "critical_draft_share": round(median(
                lambda r: r["profile_ms_per_step"]["drafter"] * r["steps"] / 1000 / r["makespan_s"]), 4)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = result["systems"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    names = list(systems)
    speed = [systems[n]["speedup"] for n in names]
    errors = [[s - systems[n].get("speedup_ci95", [s, s])[0] for n, s in zip(names, speed)],
              [systems[n].get("speedup_ci95", [s, s])[1] - s for n, s in zip(names, speed)]]
    axes[0].bar(names, speed, yerr=errors, color=["#888" if n in ("vanilla", "oracle") else "#4878a8" for n in names])
    axes[0].axhline(1.0, color="k", lw=0.8)
    for i, n in enumerate(names):
        axes[0].annotate(f"acc {systems[n]['acceptance_length']:.2f}\nid {result['identical_fraction'][n]:.2f}",
                         (i, speed[i]), ha="center", va="bottom", fontsize=7)
    axes[0].set_ylabel("speed-up over vanilla (median, 95% CI)")
    axes[0].tick_params(axis="x", rotation=30, labelsize=7)
    for n in ("vanilla", "oracle", "specactor"):
        if "batch_curve" in systems.get(n, {}):
            t, b = zip(*systems[n]["batch_curve"])
            axes[1].step(t, b, where="post", label=n)
    axes[1].set_xlabel("seconds")
    axes[1].set_ylabel("running requests")
    axes[1].legend(fontsize=8)
    sweep = result.get("sweep", {})
    if sweep:
        sizes = [int(s) for s in sweep]
        axes[2].plot(sizes, [sweep[s]["speedup"] for s in sweep], marker="o")
        axes[2].axhline(1.0, color="k", lw=0.8)
        axes[2].set_xscale("log", base=2)
        axes[2].set_xlabel(f"concurrent requests ({result['config']['sweep_tokens']} tokens each)")
        axes[2].set_ylabel("specactor speed-up over vanilla")
    else:
        axes[2].axis("off")
        axes[2].text(0.5, 0.5, "no fixed-batch sweep in this run (--no-sweep)", ha="center", va="center")
    c = result["config"]
    epoch = f" (epoch {c['epochs_before'] + 1})" if c.get("epochs_before") else ""
    fig.suptitle(f"{c['preset']}{epoch}: {c['sequences']} sequences, target {c['target_params'] / 1e6:.1f}M params, "
                 f"tail share {result['workload']['tail_share_last_10pct']:.2f}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(result: dict) -> str:
    rows = ["| system | makespan s | tokens/s | speed-up (95% CI) | acceptance | identical |",
            "|---|---|---|---|---|---|"]
    for name, s in result["systems"].items():
        ci = s.get("speedup_ci95")
        rows.append(f"| {name} | {s['makespan_s']:.2f} | {s['tokens_per_s']:.0f} | {s['speedup']:.2f}"
                    + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")
                    + f" | {s['acceptance_length']:.2f} | {result['identical_fraction'][name]:.2f} |")
    w = result["workload"]
    rows.append(f"workload: lengths {w['response_length']}, max/median {w['max_over_median']}, "
                f"last 10% of requests take {w['tail_share_last_10pct']:.0%} of vanilla's makespan")
    if "share_of_oracle_speedup" in result:
        rows.append(f"specactor takes {result['share_of_oracle_speedup']:.0%} of the oracle's speed-up")
    if "sweep" in result:
        rows.append("sweep (specactor / vanilla): " + ", ".join(f"{b}: {s['speedup']:.2f}x"
                                                                for b, s in result["sweep"].items()))
    return "\n".join(rows)
