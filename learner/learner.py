"""One learner rank: a DeepSpeed engine that trains on the step's trajectory groups and publishes the new weights
in size-bounded buckets. Rank 0 also owns the trajectory inbox, its bookkeeping (`intake.Intake`) and the
weight publisher. A step is three calls, in order, that the driver makes: `collect` (rank 0), `train` and
`publish` (every rank)."""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from configs.schema import LossAggregation, StepOrder
from learner.checkpoint import RankCheckpoints
from learner.distill import RemoteDistiller
from learner.exchange import broadcast_groups, gather_full_state
from learner.grpo import SUMMED, Packed, StepRows, micro_batch_loss, plan_step, response_logprobs
from learner.intake import Intake
from learner.metrics import intake_metrics, step_metrics
from learner.optim import build_engines
from learner.publishing import WeightOutlet
from learner.rollout_log import RolloutLog
from tasks.schedule import CursorPlan
from transport.auth import Gate, KeyPair
from transport.collective import GroupTicket
from transport.messages import Heartbeat, Trajectory, WeightAck, trajectory_bytes
from transport.zmq import Inbox

# how long a step with its groups in hand waits at least for a straggler among their cursors (twice what gathering
# them took, if longer; algorithm.step_order cursor): one that does not come in time (a dead actor's, until its
# replacement has started and regenerated it) is left to later steps, and is dropped if too stale by then
STRAGGLER_WAIT_S = 10.0


class Learner(RankCheckpoints):
    """Built in two phases, since every rank must know where rank 0 meets them before any joins the process group:
    `__init__` on every rank, then `start(master)` on every rank with rank 0's `master_address()`."""

    def __init__(self, cfg: DictConfig, policy_dir: str, reference_dir: str, plan: CursorPlan, rank: int = 0,
                 keys: KeyPair | None = None, distiller: tuple[int, bool] = (0, False)):
        """`keys` (rank 0): the servers' CURVE pair; then only clients `admit`ted may connect to the inbox or
        the weight publisher (transport/auth.py). `distiller` (rank 0): the run's distiller restarts so far, and
        whether distillation is off."""
        self.cfg, self.policy_dir, self.reference_dir = cfg, policy_dir, reference_dir
        self.rank, self.world, self.micro = rank, cfg.learner.num_ranks, cfg.learner.micro_batch_size
        self.bucket_bytes = cfg.transport.weight_bucket_mib << 20  # weights are gathered and sent this much at a time
        self.distiller: RemoteDistiller | None = None  # rank 0, when the draft LM is distilled
        if rank == 0:
            self.gate = None if keys is None else Gate(keys)
            self.inbox = Inbox(cfg.transport.host, trajectory_bytes(cfg.model.max_model_len),
                               cfg.transport.trajectory_queue,
                               accepts=Trajectory | WeightAck | Heartbeat, gate=self.gate)  # a weight bucket: dropped
            # the draft LM distilled beside the policy, published on the same channel (learner/distill.py)
            distilled = cfg.speculation.distill.every_versions > 0
            self.distiller = RemoteDistiller(cfg, *distiller) if distilled else None
            draft_tensors = self.distiller.tensors + 1 if self.distiller else 0
            self.outlet = WeightOutlet(cfg, policy_dir, self.gate, draft_tensors, self.bucket_bytes)
            vocab = json.loads((Path(policy_dir) / "config.json").read_text())["vocab_size"]
            self.intake = Intake(cfg.rollout.group_size, cfg.algorithm.max_staleness, plan, vocab,
                                 cfg.model.max_model_len, cfg.trainer.deterministic, cfg.rollout.max_tokens)
            self.rollout_log = RolloutLog(cfg.logging.dir, cfg.seed) if cfg.logging.rollouts else None
        self.version, self.skipped_steps = 0, 0  # skipped: optimizer steps not taken, their gradient not finite
        self.groups: list[list[Trajectory]] = []  # rank 0: what `collect` gathered for the next `train`
        self.reference = None  # the frozen reference policy when algorithm.kl_coef > 0
        self.lock = threading.Lock()  # collect() and a replacement actor's reissue()/republish() run concurrently
        self.listener: socket.socket | None = None  # rank 0: the rendezvous socket, from master_address() to start()

    def endpoints(self) -> tuple[str, str]:
        """Rank 0: (trajectory inbox, weight publisher) endpoints the actors dial."""
        return self.inbox.endpoint, self.outlet.endpoint

    def admit(self, name: str, public: bytes) -> None:
        """Rank 0: the CURVE key `name` (actor-<i>) connects with from now on; its earlier key is revoked."""
        self.gate.admit(name, public)

    def open_weight_group(self, actor: int, incarnation: int) -> GroupTicket:
        """Rank 0 (`transport.weights: nccl`): the weight-sync group of `actor`'s engine, formed anew for each of
        its incarnations (an earlier one's is closed)."""
        workers = self.cfg.rollout.tensor_parallel_size if self.cfg.cluster.device.value == "cuda" else 1
        return self.outlet.open_group(actor, incarnation, workers)

    def master_address(self) -> str:
        """Rank 0: where the other ranks meet it: the torch.distributed store's socket, bound now on this node's
        address only (not every interface) and held until `start` serves it (no other process can take the port)."""
        import ray

        if self.listener is None:
            host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
            self.listener = socket.create_server((host, 0))
        host, port = self.listener.getsockname()[:2]
        return f"{host}:{port}"

    def start(self, master: str | None = None, resume: str | None = None) -> None:
        """Joins the process group and builds the DeepSpeed engine (every rank at once); loads `resume` if given."""
        import deepspeed

        cfg, world = self.cfg, self.world
        host, port = (master or self.master_address()).rsplit(":", 1)
        os.environ.update(RANK=str(self.rank), LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR=host,
                          MASTER_PORT=port)
        # ranks > 0 wait in a broadcast while rank 0 collects a step's groups, which may take long (a first step, a
        # replaced actor's start); a rank that dies is reported to the driver, which then stops the run
        backend, timeout = "gloo" if cfg.cluster.device.value == "cpu" else "nccl", datetime.timedelta(hours=24)
        if not torch.distributed.is_initialized():  # (a process that built a learner before keeps its group)
            store = torch.distributed.TCPStore(host, int(port), world, is_master=self.rank == 0, timeout=timeout,
                                               wait_for_workers=False, use_libuv=True,
                                               master_listen_fd=self.listener.detach() if self.rank == 0 else None)
            torch.distributed.init_process_group(backend, store=store, rank=self.rank, world_size=world,
                                                 timeout=timeout)
        # DeepSpeed's shared-memory all-reduce serves CPU inference, not training; loading it JIT-builds it under a
        # lock file that a process killed meanwhile leaves behind, and every later start on the host waits on it
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)  # DeepSpeed takes the group as it is
        torch.manual_seed(cfg.seed)
        self.engine, self.reference = build_engines(cfg, self.policy_dir, self.reference_dir)
        if resume is not None:
            self.load_checkpoint(resume)
        if self.rank == 0:  # the actors start with these weights and this lead (tasks/schedule.py)
            self.intake.published(self.version)

    def collect(self) -> dict[str, float]:
        """Rank 0: pulls the next `prompts_per_step` whole, fresh-enough groups for `train`."""
        wanted, start, until = self.cfg.rollout.prompts_per_step, time.time(), None
        with self.lock:  # the inbox is read only here: actors' silence is measured from now on (`silences`)
            groups = self.intake.take_held(self.version)  # kept back from the last step for this one
            self.intake.listen(True)
        while True:  # a step's worth; then the stragglers among their cursors, a while at most (intake.py)
            if len(groups) >= wanted:
                until = until or time.time() + max(2 * (time.time() - start), STRAGGLER_WAIT_S)
                with self.lock:
                    if self.cfg.algorithm.step_order is StepOrder.arrival or time.time() > until \
                            or not self.intake.waits_for_stragglers(groups):
                        break
            message = self.inbox.recv(1000 if until is None else 50)
            if message is not None:
                with self.lock:
                    group = self.intake.receive(message, self.version)
                if group is not None:
                    groups.append(group)
        with self.lock:
            self.intake.listen(False)
            groups = self.intake.keep_back(groups, self.version)
            held = len(self.intake.held)
        self.groups = sorted(groups, key=lambda g: g[0].group_id)  # in cursor order, however they arrived
        if self.rollout_log is not None:
            self.rollout_log.write(self.version, self.groups)
        return {"rl/wait_seconds": time.time() - start, "rollout/held_groups": float(held)}

    def train(self) -> dict[str, float]:
        """Every rank: one GRPO step on its share of the collected groups: plan the rows -> forward the distiller's
        -> descend -> metrics (rank 0's; {} on the others)."""
        groups = self.groups if self.world == 1 else broadcast_groups(self.groups, self.rank, self.engine.device)
        # the distiller (rank 0) learns from the step when it is free to take it (a busy one skips it), and from
        # the rows without a gradient only if asked (`zero_advantage_rows`); under ZeRO-3 a forward gathers the
        # weights from every rank, so there every rank forwards its share of those, every step
        learning, zero3 = self.distiller is not None and self.distiller.ready(), self.cfg.learner.zero_stage == 3
        distill = self.cfg.speculation.distill
        teach = distill.zero_advantage_rows and (learning or (distill.every_versions > 0 and zero3))
        rows = plan_step(groups, self.cfg.algorithm, self.rank, self.world, self.micro, teach)
        self.engine.train()
        lr = self.engine.get_lr()[0]  # this step's (the scheduler moves on with the optimizer step)
        start = time.time()
        self._forward_taught(rows, learning, zero3)
        sums, extremes = self._descend(rows, learning)
        self.version += 1
        if self.rank != 0:
            return {}
        with self.lock:
            summary = self.intake.summary()
        return {**step_metrics(rows, sums, extremes, self.cfg, self.version, self.skipped_steps),
                "rl/lr": lr, "rl/train_seconds": time.time() - start, **intake_metrics(summary, self.inbox.dropped)}

    def _forward_taught(self, rows: StepRows, learning: bool, zero3: bool) -> None:
        """The rows without a gradient that the distiller learns from: deferred until the new weights are out
        (`publish`), or under ZeRO-3 forwarded now by every rank in step (a gathering forward)."""
        for indices in rows.taught:
            batch = [rows.trajectories[i] for i in indices]
            if not zero3:
                self.distiller.defer(batch)
                continue
            with torch.no_grad():
                full = response_logprobs(self.engine, Packed(batch or rows.shortest), self.cfg.rollout)
            if learning and batch:
                self.distiller.observe(batch, full)

    def _descend(self, rows: StepRows, learning: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batches' forward and backward passes and one optimizer step; returns the summed statistics
        (loss, SUMMED..., micro-batches, grad norm) and the ratio extremes, all-reduced over the ranks."""
        algo, trajectories = self.cfg.algorithm, rows.trajectories
        step_tokens = sum(len(t.response_ids) for t in trajectories)
        # DeepSpeed divides each micro-batch's loss by its configured accumulation steps (gas) and the all-reduce
        # averages the ranks: weights that make the sum the loss over the whole step, however it was cut
        gas = self.engine.gradient_accumulation_steps()
        sums, extremes = torch.zeros(len(SUMMED) + 3), torch.tensor([float("-inf"), float("-inf")])
        for j, indices in enumerate(rows.micro_batches):
            self.engine.set_gradient_accumulation_boundary(j == len(rows.micro_batches) - 1)  # one optimizer step
            batch = [trajectories[i] for i in indices]
            if batch:
                loss, stats, full = micro_batch_loss(self.engine, self.reference, Packed(batch),
                                                     rows.advantages[indices], self.cfg)
                if learning:
                    self.distiller.observe(batch, full)
                share = (sum(len(t.response_ids) for t in batch) / step_tokens
                         if algo.loss_aggregation == LossAggregation.token_mean else len(batch) / len(trajectories))
                loss = loss * (share * gas * self.world)
            else:  # this rank has no rows left: a zero loss keeps its passes in step with the other ranks'
                row = Packed(rows.shortest)
                loss = self.engine(input_ids=row.ids, attention_mask=row.attention).logits.sum() * 0.0
            self.engine.backward(loss)
            boundary = self.engine.is_gradient_accumulation_boundary()  # once per step: the optimizer steps
            plain_fp32 = not (self.engine.zero_optimization() or self.engine.bfloat16_enabled())
            if boundary and plain_fp32:  # DeepSpeed clips these (all-reduced) gradients in place and keeps no norm
                grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.engine.module.parameters()
                                                           if p.grad is not None]).item()
            self.engine.step()
            if boundary and not plain_fp32:  # ZeRO and bf16 optimizers record the norm they clipped by
                grad_norm = float(self.engine.get_global_grad_norm())
            if batch:
                sums += torch.tensor([loss.item() / (gas * self.world), *(stats[name] for name in SUMMED), 1.0, 0.0])
                extremes = torch.maximum(extremes, torch.tensor([stats["ratio_max"], -stats["ratio_min"]]))
        sums[-1] = grad_norm / self.world  # every rank computed the same all-reduced norm
        if not self.engine.was_step_applied():  # a non-finite gradient (all-reduced: the same on every rank)
            self.skipped_steps += 1  # the weights stay as they were; the next publish sends them unchanged
        if self.world > 1:
            sums, extremes = sums.to(self.engine.device), extremes.to(self.engine.device)
            torch.distributed.all_reduce(sums)
            torch.distributed.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX)
            sums, extremes = sums.cpu(), extremes.cpu()
        return sums, extremes

    def publish(self) -> dict[str, float]:
        """Every rank: sends the new weights (rank 0), each bucket once to all actors; rank 0's sync metrics."""
        from transformers.core_model_loading import revert_weight_conversion

        start = time.time()
        state = gather_full_state(self.engine, self.rank, self.cfg.learner.zero_stage, self.bucket_bytes)
        if state is None:
            return {}
        # named and shaped as the checkpoint has them: transformers fuses MoE experts in memory, vLLM reloads
        # per-expert checkpoint tensors
        named = revert_weight_conversion(self.engine.module, state).items()
        with self.lock:
            lead = self.intake.published(self.version)  # between steps: exact (tasks/schedule.py)
        sent = self.outlet.send_policy(self.version, iter(named), lead)
        if self.cfg.speculation.method != "none":  # the step's outputs, for every actor's history drafter
            self.outlet.send_history(self.version, [t for g in self.groups for t in g])
        draft = self.distiller.take_outgoing() if self.distiller is not None else None
        if draft is not None:
            sent += self.outlet.send_draft(draft[0], iter(draft[1]))
        with self.lock:  # the actors' acknowledgements of earlier versions
            applied, swapped = self.intake.take_apply_seconds(), self.intake.take_apply_seconds("draft")
        pulled = self.outlet.pull_seconds()
        metrics = {"sync/weight_seconds": time.time() - start, "sync/weight_bytes": float(sent),
                   **({"sync/broadcast_seconds_max": max(pulled)} if pulled else {}),
                   "rollout/cursor_lead": float(lead),
                   **({"sync/apply_seconds_max": max(applied)} if applied else {}),
                   **({"draft/swap_seconds": max(swapped)} if swapped else {})}
        if self.distiller is not None:  # the step to the distiller, its deferred rows forwarded with these weights
            metrics.update(self.distiller.start(self.version, lambda rows: response_logprobs(
                self.engine, Packed(rows), self.cfg.rollout)))
        return metrics

    def republish(self) -> int:
        """Rank 0: sends the newest weights again (a replacement actor joined); returns the policy's version."""
        self.outlet.resend()
        return self.version

    def reissue(self, actor: int, incarnation: int) -> int:
        """Rank 0: a rollout actor died; the group ordinal its replacement (`incarnation`) starts from
        (`Intake.replaced`)."""
        with self.lock:
            return self.intake.replaced(actor, incarnation)

    def silences(self) -> dict[int, float]:
        """Rank 0: seconds each actor has been silent while `collect` waits (`Intake.silences`)."""
        with self.lock:
            return self.intake.silences()

    def unstarted(self) -> dict[int, float]:
        """Rank 0: seconds each actor that never spoke has been awaited while `collect` waits (`Intake.unstarted`)."""
        with self.lock:
            return self.intake.unstarted()

    def claims(self) -> dict[int, int]:
        """Rank 0: heartbeats' standing claims of lost trajectories, for the driver to check (`Intake.claims`)."""
        with self.lock:
            return self.intake.claims()

    def take_gaps(self, sent: dict[int, int]) -> dict[int, int]:
        """Rank 0: actors that lost messages, each with the group ordinal to regenerate from; `sent`: the claimed
        actors' own counts of messages sent (`Intake.take_gaps`)."""
        with self.lock:
            return self.intake.take_gaps(sent)

    def summary(self) -> dict:
        with self.lock:  # collect() may still be taking messages (Ctrl-C, an error elsewhere)
            summary = {**self.intake.summary(), "version": self.version, "skipped_steps": self.skipped_steps,
                       "dropped_messages": dict(self.inbox.dropped)}
        if self.distiller is not None:  # the draft version the actors were last sent, and the distiller's state
            sent = self.outlet.draft[0] if self.outlet.draft else 0
            summary["draft"] = {"version": sent, **self.distiller.summary()}
        return summary
