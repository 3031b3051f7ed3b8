"""The learner: a DeepSpeed engine that pulls trajectory groups, enforces staleness, takes a GRPO step and
publishes the new weights in size-bounded buckets."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch
from omegaconf import DictConfig

from configs.schema import Dtype
from learner.base import admissible, find_checkpoint, staleness
from learner.grpo import group_advantages, policy_loss, token_logprobs
from transport.messages import Trajectory, WeightAck
from transport.zmq import Inbox, WeightPublisher, pack_buckets


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


class Learner:
    """One DeepSpeed rank. Rank 0 also owns the trajectory inbox and the weight publisher: it collects the step's
    groups and hands them to every rank, each of which trains on its share (DeepSpeed all-reduces gradients).
    Built in two phases, since every rank must know where rank 0 meets them before any joins the process group:
    `__init__` on every rank, then `start(master)` on every rank with rank 0's `master_address()`."""

    def __init__(self, cfg: DictConfig, model_dir: str, rank: int = 0):
        self.cfg, self.model_dir, self.rank, self.world = cfg, model_dir, rank, cfg.learner.num_ranks
        self.micro = cfg.learner.micro_batch_size
        if rank == 0:
            self.inbox = Inbox(cfg.transport.host, cfg.transport.max_message_mib << 20, cfg.transport.trajectory_queue)
            self.publisher = WeightPublisher(cfg.transport.host)
        self.published: list | None = None  # rank 0: the newest weight buckets sent, for a replacement actor
        self.version = 0
        self.pending: dict[int, list[Trajectory]] = defaultdict(list)
        self.counts = {"received": 0, "trained": 0, "dropped_stale": 0, "dropped_duplicate": 0, "dropped_reissued": 0}
        self.acks: list[WeightAck] = []
        self.data_cursor = 0  # one past the newest prompt (group id) trained on: where a resumed run starts
        self.start_cursor = 0  # where this process's actors started
        self.trained_groups = [1 << 62, -1]  # lowest and highest group id trained on by this process
        self.completed: set[int] = set()  # group ids delivered whole (trained or dropped stale) by this process
        self.lock = threading.Lock()  # step() and a replacement actor's reissue()/republish() may run concurrently

    def endpoints(self) -> tuple[str, str]:
        return self.inbox.endpoint, self.publisher.endpoint

    def master_address(self) -> str:
        """Rank 0: where the other ranks meet it (torch.distributed rendezvous)."""
        import ray

        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        return f"{host}:{free_port()}"

    def start(self, master: str | None = None, resume: str | None = None) -> None:
        """Joins the process group and builds the DeepSpeed engine (every rank at once); loads `resume` if given."""
        import deepspeed
        from transformers import AutoModelForCausalLM

        cfg, world = self.cfg, self.world
        host, port = (master or self.master_address()).rsplit(":", 1)
        os.environ.update(RANK=str(self.rank), LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR=host,
                          MASTER_PORT=port)
        # ranks > 0 wait in a broadcast while rank 0 collects a step's groups, which may take long (a first step, a
        # replaced actor's start); a rank that dies is reported to the driver, which then stops the run
        deepspeed.init_distributed(dist_backend="gloo" if cfg.cluster.device.value == "cpu" else "nccl",
                                   timeout=datetime.timedelta(hours=24))
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        ds_config = {
            "train_batch_size": batch,
            "train_micro_batch_size_per_gpu": self.micro,
            "gradient_accumulation_steps": batch // (self.micro * world),
            "gradient_clipping": cfg.learner.grad_clip,
            "zero_optimization": {"stage": cfg.learner.zero_stage},
            "bf16": {"enabled": cfg.learner.dtype == Dtype.bfloat16},
            "steps_per_print": 1 << 30,
        }
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learner.lr, weight_decay=cfg.learner.weight_decay)
        warmup = cfg.learner.warmup_steps
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule,
                                               config=ds_config)
        if resume is not None:
            self.load_checkpoint(resume)

    def collect(self) -> tuple[list[list[Trajectory]], float]:
        """The next `prompts_per_step` complete groups that are fresh enough; stale ones are counted and dropped."""
        groups: list[list[Trajectory]] = []
        start = time.time()
        while len(groups) < self.cfg.rollout.prompts_per_step:
            message = self.inbox.recv(1000)
            if message is not None:
                with self.lock:
                    self.take(message, groups)
        return groups, time.time() - start

    def take(self, message, groups: list[list[Trajectory]]) -> None:
        if isinstance(message, WeightAck):
            self.acks.append(message)
            return
        self.counts["received"] += 1
        group = self.pending[message.group_id]
        if any(t.sample_index == message.sample_index for t in group):  # a dead actor's, still in flight
            self.counts["dropped_duplicate"] += 1
            return
        group.append(message)
        n = self.cfg.rollout.group_size
        if len(group) < n:
            return
        del self.pending[message.group_id]
        if message.group_id in self.completed:  # regenerated by a replacement actor, already delivered
            self.counts["dropped_duplicate"] += n
            return
        self.completed.add(message.group_id)
        if all(admissible(t.policy_versions, self.version, self.cfg.algorithm.max_staleness) for t in group):
            groups.append(sorted(group, key=lambda t: t.sample_index))
            self.data_cursor = max(self.data_cursor, message.group_id + 1)
            low, high = self.trained_groups
            self.trained_groups = [min(low, message.group_id), max(high, message.group_id)]
        else:
            self.counts["dropped_stale"] += n

    def step(self) -> dict[str, float]:
        """One GRPO step on every rank (rank 0 collects); rank 0's metrics, {} on the others."""
        groups, wait_seconds = self.collect() if self.rank == 0 else (None, 0.0)
        if self.world > 1:  # every rank gets the step's groups and trains on its share
            box = [groups, wait_seconds]
            torch.distributed.broadcast_object_list(box, src=0)
            groups, wait_seconds = box
        with self.lock:
            return self.train(groups, wait_seconds)

    def train(self, groups: list[list[Trajectory]], wait_seconds: float) -> dict[str, float]:
        algo = self.cfg.algorithm
        trajectories = [t for g in groups for t in g]
        rewards = torch.tensor([[t.reward for t in g] for g in groups])
        advantages = group_advantages(rewards, algo.normalize_advantage_std).flatten()
        share = len(trajectories) // self.world
        mine = range(self.rank * share, (self.rank + 1) * share)
        self.engine.train()
        lr = self.engine.get_lr()[0]  # this step's (the scheduler moves on with the optimizer step)
        start, totals = time.time(), torch.zeros(3)  # loss, clip fraction, micro-batches
        for i in range(mine.start, mine.stop, self.micro):
            loss, stats = self.micro_batch_loss(trajectories[i : i + self.micro], advantages[i : i + self.micro])
            self.engine.backward(loss)
            self.engine.step()
            totals += torch.tensor([loss.item(), stats["clip_fraction"], 1.0])
        if self.world > 1:
            totals = totals.to(self.engine.device)
            torch.distributed.all_reduce(totals)
            totals = totals.cpu()
        self.version += 1
        self.counts["trained"] += len(trajectories)
        sync_start = time.time()
        sent = self.publish()
        if self.rank != 0:
            return {}
        verify_steps = sum(t.verify_steps for t in trajectories)
        drafted = sum(t.draft_tokens for t in trajectories)
        accepted = sum(t.accepted_tokens for t in trajectories)
        return {
            "rl/reward_mean": rewards.mean().item(),
            "rl/loss": (totals[0] / totals[2]).item(),
            "rl/clip_fraction": (totals[1] / totals[2]).item(),
            "rl/lr": lr,
            "rl/staleness_max": max(staleness(t.policy_versions, self.version - 1) for t in trajectories),
            "rl/response_length": sum(len(t.response_ids) for t in trajectories) / len(trajectories),
            "rl/wait_seconds": wait_seconds,
            "rl/train_seconds": sync_start - start,
            "sync/weight_seconds": time.time() - sync_start,
            "sync/weight_bytes": float(sent),
            "rollout/trajectories": float(len(trajectories)),
            "rollout/tokens": float(sum(len(t.response_ids) for t in trajectories)),
            "rollout/dropped_stale": float(self.counts["dropped_stale"]),
            "rollout/generate_seconds_max": max(t.generate_seconds for t in trajectories),
            # tokens emitted per verify step that carried drafts (1 = nothing accepted); 0 when not speculating
            "spec/acceptance_length": (accepted + verify_steps) / verify_steps if verify_steps else 0.0,
            "spec/draft_tokens": float(drafted),
            "spec/accepted_tokens": float(accepted),
        }

    def micro_batch_loss(self, batch: list[Trajectory], advantages: torch.Tensor):
        width = max(len(t.prompt_ids) + len(t.response_ids) for t in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        attention = torch.zeros(len(batch), width, dtype=torch.long)
        resp_width = max(len(t.response_ids) for t in batch)
        targets = torch.zeros(len(batch), resp_width, dtype=torch.long)
        behaviour = torch.zeros(len(batch), resp_width)
        mask = torch.zeros(len(batch), resp_width)
        for row, t in enumerate(batch):
            seq = t.prompt_ids + t.response_ids
            ids[row, : len(seq)] = torch.tensor(seq)
            attention[row, : len(seq)] = 1
            targets[row, : len(t.response_ids)] = torch.tensor(t.response_ids)
            behaviour[row, : len(t.response_ids)] = torch.tensor(t.behaviour_logprobs)
            mask[row, : len(t.response_ids)] = 1
        logits = self.engine(input_ids=ids, attention_mask=attention).logits
        # the logit row predicting response token j of row r sits at prompt_len + j - 1
        index = torch.stack([torch.arange(resp_width) + len(t.prompt_ids) - 1 for t in batch]).clamp(max=width - 1)
        rows = logits.gather(1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        logprobs = token_logprobs(rows, targets, self.cfg.rollout.temperature)
        algo = self.cfg.algorithm
        return policy_loss(logprobs, behaviour, advantages, mask, algo.clip_low, algo.clip_high,
                           algo.loss_aggregation, self.cfg.rollout.max_tokens)

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """Every rank: rank 0 gets the full parameters on the CPU in the training dtype, as the in-memory model
        names them; other ranks get None (under ZeRO-3 they take part in gathering them, about a weight bucket's
        worth at a time, so a device holds little more than its own shard)."""
        import deepspeed

        if self.rank != 0 and self.cfg.learner.zero_stage != 3:
            return None

        limit = self.cfg.transport.weight_bucket_mib << 20
        chunks: list[list] = [[]]
        size = 0
        for name, p in self.engine.module.named_parameters():
            if chunks[-1] and size >= limit:
                chunks.append([])
                size = 0
            chunks[-1].append((name, p))
            size += getattr(p, "ds_numel", p.numel()) * p.element_size()  # ds_numel: the full size of a shard
        state = {}
        for chunk in chunks:
            with deepspeed.zero.GatheredParameters([p for _, p in chunk], enabled=self.cfg.learner.zero_stage == 3):
                if self.rank == 0:
                    state.update((name, p.detach().to("cpu", copy=True)) for name, p in chunk)
        return state if self.rank == 0 else None

    def publish(self) -> int:
        """Every rank: sends the new weights (rank 0), each bucket once to all actors; returns the bytes sent."""
        from transformers.core_model_loading import revert_weight_conversion

        state = self.full_state()
        if state is None:
            return 0
        # named and shaped as the checkpoint has them: transformers fuses MoE experts in memory, vLLM reloads
        # per-expert checkpoint tensors
        named = revert_weight_conversion(self.engine.module, state).items()
        self.published = pack_buckets(iter(named), self.cfg.transport.weight_bucket_mib << 20)
        return self.publisher.publish(self.version, self.published)

    def republish(self) -> int:
        """Rank 0: sends the newest weights again (a replacement actor joined); returns their version. Before the
        first step there is nothing to send: the actors' starting weights are that version."""
        with self.lock:
            if self.published is not None:
                self.publisher.publish(self.version, self.published)
            return self.version

    def save_pretrained(self, path: str) -> None:
        """Every rank: the weights as a Hugging Face checkpoint that vLLM can serve (written by rank 0)."""
        state = self.full_state()
        if state is None:
            return
        self.engine.module.save_pretrained(path, state_dict=state)
        for name in TOKENIZER_FILES:
            if (Path(self.model_dir) / name).is_file():
                shutil.copy(Path(self.model_dir) / name, Path(path) / name)

    def save_checkpoint(self, root: str) -> str:
        """Every rank: `root/step_<version>/` with the DeepSpeed state (weights, optimizer), the weights as a Hugging
        Face checkpoint (what resumed actors load) and state.json (version, data cursor, counters)."""
        path = Path(root) / f"step_{self.version}"
        self.engine.save_checkpoint(str(path / "deepspeed"), tag="state")
        self.save_pretrained(str(path / "hf"))
        if self.rank == 0:
            state = {"version": self.version, "data_cursor": self.data_cursor, "counts": self.counts}
            (path / "state.json").write_text(json.dumps(state, indent=2))  # written last: marks it complete
        return str(path)

    def load_checkpoint(self, path: str) -> None:
        path = find_checkpoint(path)
        # the schedule follows this config (a changed learner.lr applies), fast-forwarded to the checkpoint's step
        self.engine.load_checkpoint(str(path / "deepspeed"), tag="state", load_lr_scheduler_states=False)
        state = json.loads((path / "state.json").read_text())
        self.version, self.data_cursor = state["version"], state["data_cursor"]
        self.engine.lr_scheduler.last_epoch = self.version - 1
        self.engine.lr_scheduler.step()
        self.counts.update(state["counts"])
        self.start_cursor = self.data_cursor

    def reissue(self, actor_id: int) -> int:
        """A rollout actor died: forget its partial groups and return the data cursor a replacement starts from,
        its first group not delivered whole (groups it delivered after that are regenerated and dropped as
        duplicates). Actor `a` of `R` owns cursors start + k * R + a."""
        stride = self.cfg.rollout.num_actors
        with self.lock:
            for group_id in [g for g in self.pending if (g - self.start_cursor) % stride == actor_id]:
                self.counts["dropped_reissued"] += len(self.pending.pop(group_id))
            cursor = self.start_cursor + actor_id
            while cursor in self.completed:
                cursor += stride
            return cursor - actor_id

    def summary(self) -> dict:
        with self.lock:  # step() may still be taking messages (Ctrl-C, an error elsewhere)
            return {**self.counts, "version": self.version, "data_cursor": self.data_cursor,
                    "trained_groups": self.trained_groups, "pending": sum(len(g) for g in self.pending.values()),
                    "dropped_messages": dict(self.inbox.dropped), "acks": len(self.acks)}
