"""Contract of `driver/`: the processes of one run, and nothing of training or rollout logic.

`Run(cfg)` decides where the run starts (fresh, or a checkpoint's step and data cursor), writes the resolved
config to `logging.dir/config.yaml`, starts Ray, places the learner ranks (`learners.LearnerGroup`) and rollout
actors (`rollouts.RolloutPool`), and hands them what they share: endpoints, the data-cursor plan, the starting
weight version. While it waits on any learner call it supervises the actors (one that dies is replaced and its
work re-issued). `close()` stops every process and writes `summary.json` however the loop ended."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


class Run:
    """`launch.py` calls, in order: `collect`, `train`, `publish`, `log`, `checkpoint_if_due` per step, then
    `save_final`, and `close` however the loop ended (it writes `summary.json`)."""

    def __init__(self, cfg: DictConfig):
        from actor.engine import set_env_defaults

        env = set_env_defaults({"DS_ACCELERATOR": cfg.cluster.device.value, "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"})
        import ray
        from torch.utils.tensorboard import SummaryWriter

        from driver.learners import LearnerGroup
        from driver.rollouts import RolloutPool
        from learner.base import checkpoint_state
        from models.zoo import resolve
        from tasks.schedule import CursorPlan

        self.cfg, self.dir = cfg, Path(cfg.logging.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, self.dir / "config.yaml", resolve=True)  # the resolved config, beside the event files
        reference_dir = policy_dir = str(resolve(cfg.model.path))  # builds the built-in models on first use
        checkpoint, state = None, {"version": 0, "data_cursor": 0}
        if cfg.trainer.resume_from:  # continue: same step counter, same data cursor, optimizer state restored
            checkpoint, state = checkpoint_state(cfg.trainer.resume_from)
            policy_dir = str(checkpoint / "hf")
            print(f"resuming from {checkpoint}: step {state['version']}, data cursor {state['data_cursor']}")
        self.first_step = state["version"]
        plan = CursorPlan(state["data_cursor"], cfg.rollout.num_actors, cfg.rollout.prompts_per_step)
        processes = cfg.learner.num_ranks + cfg.rollout.num_actors
        ray.init(address=cfg.cluster.address, include_dashboard=False, log_to_driver=True,
                 num_cpus=None if cfg.cluster.address else max(cfg.cluster.num_cpus or os.cpu_count(), processes),
                 runtime_env={"env_vars": {k: os.environ[k] for k in env}, "working_dir": None})
        self.ray, self.interrupted = ray, False
        try:
            gpus = 1 if cfg.cluster.device.value == "cuda" else 0
            self.learners = LearnerGroup(cfg, policy_dir, reference_dir, plan,
                                         None if checkpoint is None else str(checkpoint), num_gpus=gpus)
            self.rollouts = RolloutPool(cfg, policy_dir, self.learners, state["version"], plan,
                                        num_gpus=gpus * cfg.rollout.tensor_parallel_size)
        except BaseException:
            ray.shutdown()
            raise
        self.writer = SummaryWriter(str(self.dir))
        self.step_started = time.time()

    def collect(self) -> dict[str, float]:
        """Rank 0 pulls the step's whole, fresh-enough groups (a rollout actor that dies meanwhile is replaced)."""
        self.step_started = time.time()
        return self.rollouts.wait([self.learners.rank0.collect.remote()])[0]

    def train(self) -> dict[str, float]:
        """Every rank trains on its share; DeepSpeed all-reduces the gradients."""
        return self.rollouts.wait(self.learners.all("train"))[0]

    def publish(self) -> dict[str, float]:
        """The new weights go out in buckets; actors apply them between engine steps."""
        return self.rollouts.wait(self.learners.all("publish"))[0]

    def log(self, step: int, metrics: dict[str, float]) -> None:
        metrics["rollout/tokens_per_s"] = metrics["rollout/tokens"] / (time.time() - self.step_started)
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)

    def checkpoint_if_due(self, step: int) -> None:
        every = self.cfg.trainer.checkpoint_every
        if (every and (step + 1) % every == 0) or step + 1 == self.cfg.trainer.steps:
            self.ray.get(self.learners.all("save_checkpoint", str(self.dir / "checkpoints")))

    def save_final(self) -> None:
        self.ray.get(self.learners.all("save_pretrained", str(self.dir / "final")))

    def close(self) -> dict:
        """Stops every actor and rank, shuts Ray down and writes `summary.json`; returns the summary."""
        ray = self.ray
        summary: dict = {"interrupted": self.interrupted, "actor_restarts": self.rollouts.restarts}
        try:
            try:
                summary["actors"] = self.rollouts.stop(timeout_s=120)
            finally:
                summary["learner"] = ray.get(self.learners.rank0.summary.remote(), timeout=60)
        finally:
            self.writer.close()
            ray.shutdown()
            (self.dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"learner: {summary['learner']}\nactors: {summary['actors']}\n"
              f"TensorBoard: tensorboard --logdir {self.dir}")
        if self.interrupted:
            print(f"interrupted at step {summary['learner']['version']}; every process is shut down", file=sys.stderr)
        return summary
