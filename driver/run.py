"""Contract of `driver/`: the processes of one run, and nothing of training or rollout logic.

`Run(cfg)` decides where the run starts (fresh, or a checkpoint's step and data cursor), writes the resolved
config to `logging.dir/config.yaml`, starts Ray, places the learner ranks (`learners.LearnerGroup`) and rollout
actors (`rollouts.RolloutPool`), and hands them what they share: endpoints, the data-cursor plan, the starting
weight version. While it waits on any learner call it supervises the actors (one that dies is replaced and its
work re-issued). A learner rank whose process dies, or hangs in a step or while starting, ends the step (or the
start) with `LearnerLost`; `restart()` then starts every process again from the run's newest checkpoint
(`trainer.max_learner_restarts`). `close()` stops every process and writes `summary.json` however the loop
ended."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
import uuid
from collections import deque
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from actor.engine import set_env_defaults
from driver.logs import LOG_FILE, Scalars, route, unroute, worker_env
from driver.preflight import check_prompts_fit, data_digest
from learner.checkpoint import checkpoint_state, is_branch, last_run, mark_run, passed_over
from learner.rollout_log import FILE as ROLLOUTS
from models.zoo import resolve
from tasks.schedule import CursorPlan
from transport.auth import keypair


def interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


class LearnerLost(RuntimeError):
    """A learner rank's process died (killed, out of memory, its node gone) or made no progress (stopped, hung in a
    step or while starting): `Run.restart` can go on from a checkpoint. An exception raised by training code, or by
    a rank's constructor, is not this: it would only happen again."""


class Run:
    """`launch.py` calls, in order: `evaluate_if_due`, `collect`, `train`, `publish`, `log`, `checkpoint_if_due` per
    step (`step`: the next one; after `LearnerLost`, `restart` sets it back to a checkpoint's), then `save_final`,
    and `close` however the loop ended (it writes `summary.json`)."""

    def __init__(self, cfg: DictConfig):
        reference_dir = policy_dir = str(resolve(cfg.model.path))  # builds the built-in models on first use
        check_prompts_fit(cfg, Path(policy_dir))  # with the model's tokenizer: before anything starts or is written
        self.cfg, self.dir = cfg, Path(cfg.logging.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        log_file, level = str((self.dir / LOG_FILE).resolve()), cfg.logging.engine_level.value
        self.log_handlers = route(log_file, level)
        run_env = worker_env(log_file, level)
        os.environ.update(run_env)  # this run's, whatever an earlier run in this process set
        env = [*set_env_defaults({"DS_ACCELERATOR": cfg.cluster.device.value, "RAY_AUTH_MODE": "token",  # said: no notice
                                  "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}), *run_env]  # what every worker gets
        import ray

        OmegaConf.save(cfg, self.dir / "config.yaml", resolve=True)  # the resolved config, beside the event files
        checkpoint, state = self._take_run_dir()
        self.first_step = state["version"]
        self.origin = checkpoint, state  # where a restart goes back to while this run has written no checkpoint
        self.env, self.reference_dir, self.ray, self.interrupted = env, reference_dir, ray, False
        self.learner_restarts = self.earlier_actor_restarts = 0
        self.drafters_off: dict[int, str] = {}  # actor -> why it decodes without its drafter (it hung an engine)
        self.learners = self.rollouts = None
        self.distiller = (0, False)  # restarts, off: the run's as rank 0's metrics last said (a new rank 0 goes on)
        try:
            try:
                self._start(checkpoint, state)
            except LearnerLost as e:  # ranks that hung while starting: every process again, as after a step
                self.restart(e)
        except BaseException:
            unroute(self.log_handlers)
            raise
        self.writer = Scalars(str(self.dir))
        self.step_started = time.time()
        self.rewards = RewardWindows(window=max(1, min(10, (cfg.trainer.steps - self.first_step) // 2)))
        self._announce(log_file)

    def _take_run_dir(self) -> tuple[Path | None, dict]:
        """The checkpoint to start from (None: the run's first step) and its state; the run's id written to the
        directory (an earlier run's checkpoints and logs there deleted first when `logging.overwrite` asks)."""
        cfg, checkpoint, state = self.cfg, None, {"version": 0, "data_cursor": 0}
        if cfg.trainer.resume_from:  # continue: same step counter, same data cursor, optimizer state restored
            checkpoint, state = checkpoint_state(cfg.trainer.resume_from)
            print(f"resuming from {checkpoint}: step {state['version']}, data cursor {state['data_cursor']}")
            for newer in passed_over(cfg.trainer.resume_from, checkpoint):  # said, not silently redone
                print(f"warning: passed over {newer}: damaged or incomplete (see its manifest)", file=sys.stderr)
        # a run's checkpoints carry its id, and the directory names the run that writes it: resuming from it never
        # picks up an earlier run's checkpoints. A resume from a run's newest checkpoint keeps its id; from an older
        # one it is a branch with an id of its own, so a restart never jumps onto the abandoned timeline's checkpoints
        branch = checkpoint is None or is_branch(checkpoint)
        self.run_id = (None if branch else state.get("run_id")) or uuid.uuid4().hex
        # (checked at load: asked for; a branch of the directory's own run keeps the checkpoint it resumes from, and
        # nothing is deleted where that checkpoint is one of the directory's, whichever run wrote it)
        inside = checkpoint is not None and (self.dir / "checkpoints").resolve() in checkpoint.resolve().parents
        if cfg.logging.overwrite and not inside and last_run(self.dir) not in (None, self.run_id, state.get("run_id")):
            shutil.rmtree(self.dir / "checkpoints", ignore_errors=True)
            for old in [*self.dir.glob("events.out.tfevents.*"), self.dir / "summary.json", self.dir / ROLLOUTS]:
                old.unlink(missing_ok=True)
        mark_run(self.dir, self.run_id, data_digest(cfg))
        return checkpoint, state

    def _announce(self, log_file: str) -> None:
        """The console's configuration lines, once."""
        cfg = self.cfg
        rollout, learner, speculation = cfg.rollout, cfg.learner, cfg.speculation
        weights = f"weights {self.learners.weight_endpoint}" if cfg.transport.weights.value == "zmq" else \
            (f"weight headers {self.learners.weight_endpoint}, weight bytes over "
             f"{'NCCL' if cfg.cluster.device.value == 'cuda' else 'gloo (transport.weights nccl on a cpu run)'}")
        print(f"SpecActor: model {cfg.model.path} ({self.policy_dir}), data {cfg.data.source}\n"
              f"  rollout: {rollout.num_actors} actor(s), {rollout.prompts_per_step} prompts x {rollout.group_size} "
              f"samples per step, T={rollout.temperature} top_p={rollout.top_p} top_k={rollout.top_k}, speculation "
              f"{speculation.method}\n"
              f"  learner: {learner.num_ranks} rank(s), ZeRO-{learner.zero_stage}, {learner.dtype.value}, "
              f"lr {learner.lr}, steps {self.first_step}..{cfg.trainer.steps}\n"
              f"  transport: trajectories {self.learners.trajectory_endpoint}, {weights}, auth "
              f"{cfg.transport.auth.value}\n"
              f"  placement: {placed(self.placement)}\n"
              f"  logs: {self.dir} (engine log: {log_file})", flush=True)

    def _start(self, checkpoint: Path | None, state: dict) -> None:
        """Ray, the learner ranks and the rollout actors, at `checkpoint`'s step and data cursor (None: the run's
        first step, `state`)."""
        # (these import Ray, which reads its environment, set by __init__, when it is first imported)
        from driver.learners import LearnerGroup
        from driver.placement import check_reachable, gpus_per_device, nodes_of
        from driver.rollouts import RolloutPool

        cfg, ray = self.cfg, self.ray
        self.policy_dir = self.reference_dir if checkpoint is None else str(checkpoint / "hf")
        self.step = state["version"]  # the next step to take
        plan = CursorPlan(state["data_cursor"], cfg.rollout.num_actors, cfg.rollout.prompts_per_step)
        processes = cfg.learner.num_ranks + cfg.rollout.num_actors
        embedded = cfg.cluster.address is None  # this machine is the cluster: it offers every role's resource
        ray.init(address=cfg.cluster.address, include_dashboard=False, log_to_driver=True, configure_logging=False,
                 num_cpus=max(cfg.cluster.num_cpus or os.cpu_count(), processes) if embedded else None,
                 resources={name: 1 << 16 for name in (cfg.cluster.learner_resource, cfg.cluster.rollout_resource)
                            if name} if embedded else None,
                 runtime_env={"env_vars": {k: os.environ[k] for k in self.env}, "working_dir": None,
                              "worker_process_setup_hook": "driver.logs.route_worker_logs"})
        signal.signal(signal.SIGTERM, interrupt)  # a scheduler's stop, as Ctrl-C (over Ray's handler, which exits 15)
        try:
            check_reachable(cfg)
            gpus = gpus_per_device(cfg)
            curve = cfg.transport.auth.value == "curve"  # keys made here, per run; actors get theirs as they start
            self.learners = LearnerGroup(cfg, self.policy_dir, self.reference_dir, plan, num_gpus=gpus,
                                         keys=keypair() if curve else None, distiller=self.distiller)
            with self.learners_alive():  # (ranks, or rank 0's distiller, that die or hang while starting: LearnerLost)
                self.learners.start(None if checkpoint is None else str(checkpoint))
            self.rollouts = RolloutPool(cfg, self.policy_dir, self.learners, state["version"], plan,
                                        num_gpus=gpus * cfg.rollout.tensor_parallel_size,
                                        earlier_restarts=self.earlier_actor_restarts, drafters_off=self.drafters_off)
        except BaseException:
            ray.shutdown()
            raise
        self.placement = {**nodes_of(self.learners.group, [f"learner-{r}" for r in range(cfg.learner.num_ranks)]),
                          **nodes_of(self.rollouts.group, [f"rollout-{i}" for i in range(cfg.rollout.num_actors)])}
        self.evaluations: dict[int, list] = {}  # step asked at -> one ref per actor, until logged

    @contextlib.contextmanager
    def learners_alive(self):
        """Turns the death of a learner rank's process, or its making no progress for `trainer.step_timeout_s`, into
        `LearnerLost` (an error raised in training stands)."""
        try:
            yield
        except TimeoutError as e:  # alive to Ray, but making no progress: lost all the same
            raise LearnerLost(f"the learner ranks made no progress ({e}; trainer.step_timeout_s = "
                              f"{self.cfg.trainer.step_timeout_s:g})") from e
        except self.ray.exceptions.RayActorError as e:
            ranks = [r._actor_id.hex() for r in self.learners.ranks]
            if e.actor_id is not None and e.actor_id not in ranks or e.actor_init_failed:  # (its constructor raised)
                raise
            who = f"learner rank {ranks.index(e.actor_id)}" if e.actor_id in ranks else "a learner rank"
            raise LearnerLost(f"{who} is gone ({type(e).__name__})") from e

    def restart(self, error: LearnerLost) -> None:
        """After a learner rank's process died or hung: every process of the run stops and starts again from the
        run's newest checkpoint (its start, if it wrote none), while `trainer.max_learner_restarts` allows (a start
        that is lost again counts again); else `error` stands. What the dead processes had not checkpointed is
        generated and trained again."""
        limit = self.cfg.trainer.max_learner_restarts
        while True:
            if self.learner_restarts >= limit:
                raise error
            self.learner_restarts += 1
            try:
                checkpoint, state = checkpoint_state(str(self.dir))
            except (FileNotFoundError, KeyError, ValueError):
                checkpoint, state = self.origin
            print(f"{error} at step {self.step}; restart {self.learner_restarts} of {limit} (trainer.max_learner_"
                  f"restarts): every process starts again from {checkpoint or 'the start of the run'} (step "
                  f"{state['version']})", file=sys.stderr, flush=True)
            if self.rollouts is not None:
                self.earlier_actor_restarts += self.rollouts.restarts
                self.drafters_off = self.rollouts.drafters_off
                with contextlib.suppress(Exception):  # the actors stop their engines; the rest is shut down below
                    self.rollouts.stop(timeout_s=30)
            self.learners = self.rollouts = None  # (handles of the cluster shut down here: `close` must not call them)
            self.ray.shutdown()
            try:
                return self._start(checkpoint, state)
            except LearnerLost as again:  # ranks that hung while starting again
                error = again

    def evaluate_if_due(self, step: int) -> None:
        """Every `trainer.eval_every` steps (and after the last), the actors answer the held-out set beside
        training; the result is logged at this step once every actor's share is done."""
        every = self.cfg.trainer.eval_every
        if every and (step % every == 0 or step == self.cfg.trainer.steps):
            self.evaluations[step] = [a.evaluate.remote(step) for a in self.rollouts.actors]

    def log_evaluations(self, wait_s: float = 0.0) -> None:
        """Writes every evaluation whose shares are all in (waiting up to `wait_s` for them)."""
        deadline = time.time() + wait_s
        for step, refs in sorted(self.evaluations.items()):
            ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.time()))
            if len(ready) < len(refs):
                continue
            del self.evaluations[step]
            try:
                shares = self.ray.get(refs)
            except self.ray.exceptions.RayError as e:  # an actor died meanwhile: its replacement evaluates next time
                print(f"warning: the evaluation asked at step {step} was lost ({type(e).__name__})", file=sys.stderr)
                continue
            for tag, key, count in [("eval/reward_mean", "reward", "answered"),
                                    ("eval/reward_greedy", "greedy", "answered_greedy"),
                                    ("eval/response_length", "length", "answered")]:
                answered = sum(s[count] for s in shares)
                if answered:
                    self.writer.add_scalar(tag, sum(s[key] for s in shares) / answered, step)
                    if tag == "eval/reward_mean":
                        self.rewards.held_out(step, sum(s[key] for s in shares) / answered)

    def collect(self) -> dict[str, float]:
        """Rank 0 pulls the step's whole, fresh-enough groups (a rollout actor that dies meanwhile is replaced)."""
        self.step_started = time.time()
        with self.learners_alive():
            return self.rollouts.wait([self.learners.rank0.collect.remote()])[0]

    def train(self) -> dict[str, float]:
        """Every rank trains on its share; DeepSpeed all-reduces the gradients."""
        with self.learners_alive():
            return self.rollouts.wait(self.learners.all("train"), self.cfg.trainer.step_timeout_s)[0]

    def publish(self) -> dict[str, float]:
        """The new weights go out in buckets; actors apply them between engine steps."""
        with self.learners_alive():
            return self.rollouts.wait(self.learners.all("publish"), self.cfg.trainer.step_timeout_s)[0]

    def log(self, step: int, metrics: dict[str, float]) -> dict[str, str]:
        """Writes the step's scalars; returns the progress line's fields."""
        metrics["rollout/tokens_per_s"] = metrics["rollout/tokens"] / (time.time() - self.step_started)
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)
        self.rewards.train(metrics["rl/reward_mean"])
        self.distiller = (max(self.distiller[0], int(metrics.get("draft/restarts", 0))),
                          self.distiller[1] or "draft/off" in metrics)
        self.log_evaluations()
        fields = {"reward": f"{metrics['rl/reward_mean']:.3f}", "loss": f"{metrics['rl/loss']:.4f}",
                  "tok/s": f"{metrics['rollout/tokens_per_s']:.0f}", "stale": f"{metrics['rl/staleness_max']:.0f}"}
        if self.cfg.speculation.method != "none":
            fields["accept"] = f"{metrics['spec/acceptance_length']:.2f}"
        return fields

    def checkpoint_if_due(self, step: int) -> None:
        every = self.cfg.trainer.checkpoint_every
        if (every and (step + 1) % every == 0) or step + 1 == self.cfg.trainer.steps:
            root = str(self.dir / "checkpoints")
            with self.learners_alive():  # (a rank stopped while it saves is lost like one stopped in training)
                timeout = self.cfg.trainer.step_timeout_s
                seen_by_rank = self.rollouts.wait(self.learners.all("save_checkpoint", root), timeout)
                self.rollouts.wait([self.learners.rank0.seal_checkpoint.remote(root, self.run_id, seen_by_rank)],
                                   timeout)

    def save_final(self) -> None:
        with self.learners_alive():  # (the learners alone: no actor is replaced once training is over)
            self.ray.get(self.learners.all("save_pretrained", str(self.dir / "final")),
                         timeout=self.cfg.trainer.step_timeout_s or None)
        self.log_evaluations(wait_s=600)  # the held-out numbers of the final weights belong to the run
        for step in self.evaluations:  # (said, not silently left out)
            print(f"warning: the evaluation asked at step {step} took over 600 s and is not logged", file=sys.stderr)

    def close(self) -> dict:
        """Stops every actor and rank, writes `summary.json`, shuts Ray down; returns the summary."""
        ending = sys.exc_info()[1]  # the error that ends the run, if one does (the launcher calls this in `finally`)
        summary: dict = {"interrupted": self.interrupted, "placement": self.placement,
                         "actor_restarts": self.earlier_actor_restarts + (self.rollouts.restarts if self.rollouts
                                                                          else 0),
                         "learner_restarts": self.learner_restarts}
        try:
            self._collect_summaries(summary)
        finally:  # (a second Ctrl-C while Ray shuts down finds summary.json written)
            self.writer.close()
            self._write_summary(summary)
            self.ray.shutdown()
            unroute(self.log_handlers)
        learner = summary.get("learner")
        if learner is not None:
            dropped = {k.removeprefix("dropped_"): v for k, v in learner.items()
                       if k.startswith("dropped_") and isinstance(v, int) and v}
            draft = learner.get("draft")
            draft = "" if draft is None else (f", draft v{draft['version']}, distiller restarts "
                                              f"{draft['distiller_restarts']}"
                                              + (" (distillation off)" if draft["distillation_off"] else ""))
            print(f"done: step {learner['version']}{self.rewards}; trained {learner['trained']} trajectories, "
                  f"dropped {dropped or 'none'}, lost {learner['lost']}, skipped steps {learner['skipped_steps']}, "
                  f"actor restarts {summary['actor_restarts']}{draft}")
        print(f"summary: {self.dir / 'summary.json'}, engine log: {self.dir / 'run.log'}\n"
              f"TensorBoard: tensorboard --logdir {self.dir}")
        if self.interrupted:
            print(f"interrupted at step {learner['version'] if learner else '?'}; every process is shut down",
                  file=sys.stderr)
        elif learner is None or ending is not None:  # the error follows; say where the run can go on from
            cause = getattr(ending, "cause", None) or ending  # (a Ray task's error: what the task raised)
            reason = (f"learner rank 0 is gone ({summary['learner_error']})" if learner is None else
                      f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0]}")
            try:
                newest, state = checkpoint_state(str(self.dir))
                resume = (f"the newest checkpoint is {newest} (step {state['version']}): go on with "
                          f"trainer.resume_from={self.dir}")
            except (FileNotFoundError, KeyError, ValueError):
                resume = "no checkpoint was written (trainer.checkpoint_every)"
            print(f"stopped: {reason}; every process is shut down; {resume}", file=sys.stderr)
        return summary

    def _collect_summaries(self, summary: dict) -> None:
        """Into `summary`: the actors' and rank 0's summaries as they stop, or why rank 0's cannot be had (it died;
        a restart was interrupted before the run's processes were up again). An error stopping the actors stands."""
        up = self.ray.is_initialized()
        try:
            if self.rollouts is not None and up:
                summary["actors"] = self.rollouts.stop(timeout_s=120)
        finally:
            if self.learners is None or not up:
                summary["learner_error"] = "not running: a restart did not finish"
            else:
                try:
                    summary["learner"] = self.ray.get(self.learners.rank0.summary.remote(), timeout=60)
                except Exception as e:  # (the error that ended the loop follows)
                    summary["learner_error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"

    def _write_summary(self, summary: dict) -> None:
        """summary.json whole or not at all (a full disk leaves the previous one, not an empty file)."""
        path = self.dir / "summary.json"
        partial = path.with_suffix(".partial")
        try:
            partial.write_text(json.dumps(summary, indent=2))
            partial.replace(path)
        except OSError as e:
            partial.unlink(missing_ok=True)
            print(f"could not write {path}: {e}", file=sys.stderr)


class RewardWindows:
    """The console's last word on learning: the mean training reward of the run's first and last `window` steps
    (one step's batch is too noisy to compare two of), and the held-out reward at the first and last evaluation."""

    def __init__(self, window: int = 10):
        self.first: list[float] = []
        self.recent: deque[float] = deque(maxlen=window)
        self.window = window
        self.evaluations: list[tuple[int, float]] = []  # the first and the latest (step, held-out reward)

    def train(self, reward: float) -> None:
        if len(self.first) < self.window:
            self.first.append(reward)
        self.recent.append(reward)

    def held_out(self, step: int, reward: float) -> None:
        self.evaluations = [*self.evaluations[:1], (step, reward)]

    def __str__(self) -> str:
        if not self.first:
            return ""
        n = len(self.first)
        text = (f", reward {sum(self.first) / n:.3f} -> {sum(self.recent) / len(self.recent):.3f} (means over the "
                f"first and the last {n} steps)" if len(self.recent) == self.window else
                f", reward {sum(self.first) / n:.3f} (mean of {n} steps)")
        if self.evaluations:
            (a, first), (b, last) = self.evaluations[0], self.evaluations[-1]
            text += (f", held-out {first:.3f} (step {a}) -> {last:.3f} (step {b})" if b != a else
                     f", held-out {first:.3f} (step {a})")
        return text


def placed(placement: dict[str, dict[str, str]]) -> str:
    """The console's placement line: each node (short id and address) and the processes it holds."""
    nodes: dict[str, list[str]] = {}
    for name, where in placement.items():
        nodes.setdefault(f"node {where['node_id'][:8]} ({where['address']})", []).append(name)
    return "; ".join(f"{node}: {', '.join(names)}" for node, names in nodes.items())

