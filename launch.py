"""SpecActor launcher:  python launch.py --config NAME_OR_PATH [section.key=value ...]

The whole algorithm, top to bottom: validate the config, start Ray, place one learner and R rollout actors,
let the actors stream GRPO groups while the learner takes `trainer.steps` steps (each one pulls fresh-enough
groups, trains, publishes weights that the actors apply between engine steps), log to TensorBoard, shut down.
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
    if cfg.learner.num_ranks != 1:
        print("config error: learner.num_ranks > 1 is not supported yet (one DeepSpeed rank per run)", file=sys.stderr)
        return 2
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "DS_ACCELERATOR": cfg.cluster.device.value,
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
           "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}
    for key, value in env.items():
        os.environ.setdefault(key, value)

    import ray
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import trange

    from actor.rollout import RolloutActor
    from learner.base import find_checkpoint
    from learner.learner import Learner
    from models.zoo import resolve

    model_dir = str(resolve(cfg.model.path))  # builds the built-in models on first use
    checkpoint, state = None, {"version": 0, "data_cursor": 0}
    if cfg.trainer.resume_from:  # continue: same step counter, same data cursor, optimizer state restored
        checkpoint = find_checkpoint(cfg.trainer.resume_from)
        state = json.loads((checkpoint / "state.json").read_text())
        model_dir = str(checkpoint / "hf")
        print(f"resuming from {checkpoint}: step {state['version']}, data cursor {state['data_cursor']}")
    ray.init(address=cfg.cluster.address, num_cpus=cfg.cluster.num_cpus, include_dashboard=False,
             runtime_env={"env_vars": {k: os.environ[k] for k in env}, "working_dir": None}, log_to_driver=True)
    gpus = 1 if cfg.cluster.device.value == "cuda" else 0
    learner = ray.remote(num_cpus=1, num_gpus=gpus, max_concurrency=2)(Learner).remote(
        cfg, model_dir, resume=None if checkpoint is None else str(checkpoint))
    inbox, weights = ray.get(learner.endpoints.remote())
    actor_cls = ray.remote(num_cpus=1, num_gpus=gpus * cfg.rollout.tensor_parallel_size, max_concurrency=2)(RolloutActor)
    actors = [actor_cls.options(name=f"rollout-{i}").remote(cfg, i, model_dir, inbox, weights, state["version"],
                                                            state["data_cursor"]) for i in range(cfg.rollout.num_actors)]
    runs = [a.run.remote() for a in actors]
    restarts = 0
    writer = SummaryWriter(cfg.logging.dir)

    try:
        first = state["version"]
        for step in (bar := trange(first, cfg.trainer.steps, initial=first, total=cfg.trainer.steps, desc="GRPO")):
            start = time.time()
            step_ref = learner.step.remote()  # pull groups, train, publish weights v+1
            while (ready := ray.wait([step_ref, *runs], num_returns=1)[0][0]) != step_ref:
                i = runs.index(ready)  # rollout actor i died: replace it and re-issue its unfinished groups
                try:
                    ray.get(ready)
                    error = "its run() returned"
                except Exception as e:  # noqa: BLE001 -- any failure of the actor is handled the same way
                    error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                if restarts == cfg.rollout.max_restarts:
                    raise RuntimeError(f"rollout actor {i} stopped ({error}) after {restarts} restarts "
                                       "(rollout.max_restarts)")
                restarts += 1
                ray.kill(actors[i])
                cursor = ray.get(learner.reissue.remote(i))
                weights_dir = os.path.join(cfg.logging.dir, "restarts", f"actor{i}-{restarts}")
                version = ray.get(learner.snapshot.remote(weights_dir))
                print(f"rollout actor {i} stopped ({error}); replacement {restarts} starts at weights v{version}, "
                      f"data cursor {cursor + i}", file=sys.stderr)
                actors[i] = actor_cls.options(name=f"rollout-{i}-r{restarts}").remote(
                    cfg, i, weights_dir, inbox, weights, version, cursor)
                runs[i] = actors[i].run.remote()
            metrics = ray.get(step_ref)
            metrics["rollout/tokens_per_s"] = metrics["rollout/tokens"] / (time.time() - start)
            for tag, value in metrics.items():
                writer.add_scalar(tag, value, step)
            bar.set_postfix(reward=f"{metrics['rl/reward_mean']:.3f}", loss=f"{metrics['rl/loss']:.4f}")
            every = cfg.trainer.checkpoint_every
            if (every and (step + 1) % every == 0) or step + 1 == cfg.trainer.steps:
                ray.get(learner.save_checkpoint.remote(os.path.join(cfg.logging.dir, "checkpoints")))
        ray.get(learner.save_pretrained.remote(os.path.join(cfg.logging.dir, "final")))
    finally:
        for a in actors:
            a.stop.remote()
        stats = ray.get(runs, timeout=120)
        summary = {**ray.get(learner.summary.remote()), "actor_restarts": restarts}
        writer.close()
        ray.shutdown()
    with open(os.path.join(cfg.logging.dir, "summary.json"), "w") as f:
        json.dump({"learner": summary, "actors": stats}, f, indent=2)
    print(f"learner: {summary}\nactors: {stats}\nTensorBoard: tensorboard --logdir {cfg.logging.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
