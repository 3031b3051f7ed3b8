"""SpecActor launcher:  python launch.py --config NAME_OR_PATH [section.key=value ...] [--plan [--cluster 2x8:80]]

The whole algorithm, top to bottom: validate the config, start the run's processes (Ray, L learner ranks, R
rollout actors that stream GRPO groups from the moment they start), then `trainer.steps` times: collect the
step's fresh-enough groups, train on them across the ranks, publish the new weights (the actors apply them between
engine steps, requests in flight), log to TensorBoard and checkpoint when due. The processes, their placement,
supervision and summary live in `driver/`. With `--plan` it only prints where the processes would go and what each
GPU would hold, and says whether the cluster can hold the run.
"""

from __future__ import annotations

import argparse
import sys

from driver.logs import progress_line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from driver.plan import described, gib

    parser = argparse.ArgumentParser(description="SpecActor: asynchronous RL post-training with speculative rollouts")
    parser.add_argument("--config", required=True, help="a name in configs/ (e.g. grpo_tiny) or a YAML path")
    parser.add_argument("overrides", nargs="*", help="section.key=value, validated like the file")
    parser.add_argument("--plan", action="store_true", help="print where every process goes, the memory each GPU "
                        "holds and the weight-sync cost; start nothing (exit 3 if the cluster cannot hold the run)")
    parser.add_argument("--cluster", metavar="NODESxGPUS[:GIB]", type=described, help="--plan on a described "
                        "cluster, e.g. 2x8:80, instead of cluster.address or this machine")
    parser.add_argument("--gpu-gib", type=gib, default=80.0, help="--plan on cluster.address: memory per GPU")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from configs.load import ConfigError
    from driver.preflight import load_run_config

    args = parse_args(argv)
    try:
        cfg = load_run_config(args.config, args.overrides)  # every check runs before any process starts
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.plan:  # nothing starts: placement, memory per GPU and sync cost, checked against the cluster
        from driver.plan import plan

        try:
            return plan(cfg, args.cluster, args.gpu_gib)
        except ConfigError as e:  # what only the model can tell: a prompt too long for it
            print(f"config error: {e}", file=sys.stderr)
            return 2
    from driver.run import LearnerLost, Run

    try:
        run = Run(cfg)  # Ray, learner ranks (rank 0: trajectory inbox + weight publisher), rollout actors generating
    except ConfigError as e:  # what only the model or the cluster can tell: a prompt too long, an unreachable host
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the processes start: whatever had started is shut down
        print("interrupted while starting; every process is shut down", file=sys.stderr)
        return 130
    except LearnerLost as e:  # the learner ranks never started, restarts included
        print(f"stopped: {e}; every process is shut down", file=sys.stderr)
        return 1
    try:
        steps = cfg.trainer.steps
        with progress_line(run.step, steps) as bar:  # other lines print above it
            while (step := run.step) < steps:
                try:
                    run.evaluate_if_due(step)  # held-out set, answered by the actors beside training
                    metrics = run.collect()  # rank 0: the next prompts_per_step whole groups within max_staleness
                    metrics |= run.train()  # every rank: GRPO on its share, gradients all-reduced (weights v -> v+1)
                    metrics |= run.publish()  # weights v+1 to every actor in size-bounded buckets
                    bar.set_postfix(run.log(step, metrics))  # TensorBoard; the progress line
                    run.checkpoint_if_due(step)
                    run.step += 1
                except LearnerLost as e:  # a rank's process died: every process again from the newest checkpoint
                    run.restart(e)  # (trainer.max_learner_restarts times; then the error stands)
                bar.n = run.step
                bar.refresh()
        run.evaluate_if_due(steps)  # the final weights, once they are on the actors
        run.save_final()
    except KeyboardInterrupt:  # Ctrl-C: stop every actor and rank, keep the counters and the last checkpoint
        run.interrupted = True
    finally:
        run.close()  # every process stopped, summary.json written, however the loop ended
    return 130 if run.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
