"""`python -m driver.dashboard RUN_DIR [--out PNG]`: the main curves of a run, from its TensorBoard event files, in
one PNG (the README's "Reading the dashboard" figure is made by this from a real `make run`)."""

from __future__ import annotations

import argparse
from pathlib import Path

PANELS = [  # (title, tags): what a person watching an RL run looks at first
    ("reward: training batch vs held-out", ["rl/reward_mean", "eval/reward_mean", "eval/reward_greedy"]),
    ("policy entropy (nats per token)", ["rl/entropy"]),
    ("gradient norm before clipping", ["rl/grad_norm"]),
    ("importance ratio extremes", ["rl/ratio_max", "rl/ratio_min"]),
    ("response length (tokens)", ["rollout/response_length", "rollout/response_length_p90",
                                  "rollout/response_length_max"]),
    ("truncated fraction / staleness", ["rollout/truncated_fraction", "rl/staleness_max"]),
]


def smooth(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
            for i in range(len(values))]


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--out", help="PNG path (default: RUN_DIR/dashboard.png)")
    parser.add_argument("--smooth", type=int, default=10, help="moving-average window over steps (1: raw)")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(args.run_dir, size_guidance={"scalars": 0}).Reload()
    present = set(events.Tags()["scalars"])
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for ax, (title, tags) in zip(axes.flat, PANELS):
        for tag in (t for t in tags if t in present):
            points = events.Scalars(tag)
            steps, values = [p.step for p in points], [p.value for p in points]
            window = 1 if tag.startswith("eval/") else args.smooth  # evaluations are already averages
            ax.plot(steps, smooth(values, window), marker="o" if tag.startswith("eval/") else None, label=tag)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("learner step")
        ax.legend(fontsize=7)
    fig.suptitle(f"{args.run_dir} (moving average over {args.smooth} steps; eval points raw)", fontsize=10)
    fig.tight_layout()
    out = Path(args.out or Path(args.run_dir) / "dashboard.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
