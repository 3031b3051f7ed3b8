"""SpecActor launcher:  python launch.py --config NAME_OR_PATH [section.key=value ...]

The whole algorithm, top to bottom: validate the config, start Ray, place L learner ranks and R rollout actors,
let the actors stream GRPO groups while the learner takes `trainer.steps` steps (each one pulls fresh-enough
groups, trains on them across its ranks, publishes weights that the actors apply between engine steps), log to
TensorBoard, checkpoint, shut down.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="SpecActor: asynchronous RL post-training with speculative rollouts")
    parser.add_argument("--config", required=True, help="a name in configs/ (e.g. grpo_tiny) or a YAML path")
    parser.add_argument("overrides", nargs="*", help="section.key=value, validated like the file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from configs.load import ConfigError, load_config

    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)  # every check runs before any process starts
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from actor.engine import set_env_defaults

    env = set_env_defaults({"DS_ACCELERATOR": cfg.cluster.device.value, "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"})

    import ray
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import trange

    from actor.pool import RolloutPool
    from learner.base import find_checkpoint
    from learner.group import LearnerGroup
    from models.zoo import resolve

    model_dir = str(resolve(cfg.model.path))  # builds the built-in models on first use
    checkpoint, state = None, {"version": 0, "data_cursor": 0}
    if cfg.trainer.resume_from:  # continue: same step counter, same data cursor, optimizer state restored
        checkpoint = find_checkpoint(cfg.trainer.resume_from)
        state = json.loads((checkpoint / "state.json").read_text())
        model_dir = str(checkpoint / "hf")
        print(f"resuming from {checkpoint}: step {state['version']}, data cursor {state['data_cursor']}")
    processes = cfg.learner.num_ranks + cfg.rollout.num_actors
    ray.init(address=cfg.cluster.address, include_dashboard=False, log_to_driver=True,
             num_cpus=None if cfg.cluster.address else max(cfg.cluster.num_cpus or os.cpu_count(), processes),
             runtime_env={"env_vars": {k: os.environ[k] for k in env}, "working_dir": None})
    gpus = 1 if cfg.cluster.device.value == "cuda" else 0
    learner = LearnerGroup(cfg, model_dir, None if checkpoint is None else str(checkpoint), num_gpus=gpus)
    rollout = RolloutPool(cfg, model_dir, learner, state["version"], state["data_cursor"],
                          num_gpus=gpus * cfg.rollout.tensor_parallel_size)
    writer = SummaryWriter(cfg.logging.dir)
    interrupted = False

    try:
        first = state["version"]
        for step in (bar := trange(first, cfg.trainer.steps, initial=first, total=cfg.trainer.steps, desc="GRPO")):
            start = time.time()
            steps = learner.all("step")  # rank 0 pulls groups; every rank trains its share; weights v+1 go out
            metrics = rollout.wait(steps)[0]  # a rollout actor that dies meanwhile is replaced; a rank's error raised
            metrics["rollout/tokens_per_s"] = metrics["rollout/tokens"] / (time.time() - start)
            for tag, value in metrics.items():
                writer.add_scalar(tag, value, step)
            bar.set_postfix(reward=f"{metrics['rl/reward_mean']:.3f}", loss=f"{metrics['rl/loss']:.4f}")
            every = cfg.trainer.checkpoint_every
            if (every and (step + 1) % every == 0) or step + 1 == cfg.trainer.steps:
                ray.get(learner.all("save_checkpoint", os.path.join(cfg.logging.dir, "checkpoints")))
        ray.get(learner.all("save_pretrained", os.path.join(cfg.logging.dir, "final")))
    except KeyboardInterrupt:  # Ctrl-C: stop every actor and rank, keep the counters and the last checkpoint
        interrupted = True
    finally:
        try:
            stats = rollout.stop(timeout_s=120)
            summary = {**ray.get(learner.rank0.summary.remote(), timeout=60), "actor_restarts": rollout.restarts}
        finally:
            writer.close()
            ray.shutdown()
    with open(os.path.join(cfg.logging.dir, "summary.json"), "w") as f:
        json.dump({"learner": summary, "actors": stats}, f, indent=2)
    print(f"learner: {summary}\nactors: {stats}\nTensorBoard: tensorboard --logdir {cfg.logging.dir}")
    if interrupted:
        print(f"interrupted at step {summary['version']}; every process is shut down", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
