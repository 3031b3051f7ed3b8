"""The learner: a DeepSpeed engine that pulls trajectory groups, enforces staleness, takes a GRPO step and
publishes the new weights in size-bounded buckets."""

from __future__ import annotations

import json
import os
import shutil
import socket
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
    def __init__(self, cfg: DictConfig, model_dir: str, rank: int = 0, master: str | None = None,
                 resume: str | None = None):
        import deepspeed
        from transformers import AutoModelForCausalLM

        world = cfg.learner.num_ranks
        os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=master or str(free_port()))
        deepspeed.init_distributed(dist_backend="gloo" if cfg.cluster.device.value == "cpu" else "nccl")
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        micro = cfg.learner.micro_batch_size
        ds_config = {
            "train_batch_size": batch,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": batch // (micro * world),
            "gradient_clipping": cfg.learner.grad_clip,
            "zero_optimization": {"stage": cfg.learner.zero_stage},
            "bf16": {"enabled": cfg.learner.dtype == Dtype.bfloat16},
            "steps_per_print": 1 << 30,
        }
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learner.lr, weight_decay=cfg.learner.weight_decay)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        self.micro = micro
        self.model_dir = model_dir
        self.inbox = Inbox(cfg.transport.host, cfg.transport.max_message_mib << 20, cfg.transport.trajectory_queue)
        self.publisher = WeightPublisher(cfg.transport.host)
        self.version = 0
        self.pending: dict[int, list[Trajectory]] = defaultdict(list)
        self.counts = {"received": 0, "trained": 0, "dropped_stale": 0}
        self.acks: list[WeightAck] = []
        self.data_cursor = 0  # one past the newest prompt (group id) trained on: where a resumed run starts
        self.trained_groups = [1 << 62, -1]  # lowest and highest group id trained on by this process
        if resume is not None:
            self.load_checkpoint(resume)

    def endpoints(self) -> tuple[str, str]:
        return self.inbox.endpoint, self.publisher.endpoint

    def collect(self) -> tuple[list[list[Trajectory]], float]:
        """The next `prompts_per_step` complete groups that are fresh enough; stale ones are counted and dropped."""
        want, n = self.cfg.rollout.prompts_per_step, self.cfg.rollout.group_size
        groups: list[list[Trajectory]] = []
        start = time.time()
        while len(groups) < want:
            message = self.inbox.recv(1000)
            if message is None:
                continue
            if isinstance(message, WeightAck):
                self.acks.append(message)
                continue
            self.counts["received"] += 1
            group = self.pending[message.group_id]
            group.append(message)
            if len(group) == n:
                del self.pending[message.group_id]
                if all(admissible(t.policy_versions, self.version, self.cfg.algorithm.max_staleness) for t in group):
                    groups.append(sorted(group, key=lambda t: t.sample_index))
                    self.data_cursor = max(self.data_cursor, message.group_id + 1)
                    low, high = self.trained_groups
                    self.trained_groups = [min(low, message.group_id), max(high, message.group_id)]
                else:
                    self.counts["dropped_stale"] += n
        return groups, time.time() - start

    def step(self) -> dict[str, float]:
        groups, wait_seconds = self.collect()
        cfg, algo = self.cfg, self.cfg.algorithm
        trajectories = [t for g in groups for t in g]
        rewards = torch.tensor([[t.reward for t in g] for g in groups])
        advantages = group_advantages(rewards, algo.normalize_advantage_std).flatten()
        self.engine.train()
        start, losses, clip = time.time(), [], []
        for i in range(0, len(trajectories), self.micro):
            batch = trajectories[i : i + self.micro]
            loss, stats = self.micro_batch_loss(batch, advantages[i : i + self.micro])
            self.engine.backward(loss)
            self.engine.step()
            losses.append(loss.item())
            clip.append(stats["clip_fraction"])
        self.version += 1
        self.counts["trained"] += len(trajectories)
        sync_start = time.time()
        sent = self.publish()
        verify_steps = sum(t.verify_steps for t in trajectories)
        drafted = sum(t.draft_tokens for t in trajectories)
        accepted = sum(t.accepted_tokens for t in trajectories)
        return {
            "rl/reward_mean": rewards.mean().item(),
            "rl/loss": sum(losses) / len(losses),
            "rl/clip_fraction": sum(clip) / len(clip),
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

    def full_state(self) -> dict[str, torch.Tensor]:
        """Full parameters (gathered under ZeRO-3) as the in-memory model names them."""
        import deepspeed

        params = list(self.engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=self.cfg.learner.zero_stage == 3):
            return {name: p.detach().float().clone() for name, p in params}

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Named and shaped as the checkpoint has them (transformers fuses MoE experts in memory; vLLM
        reloads per-expert checkpoint tensors)."""
        from transformers.core_model_loading import revert_weight_conversion

        return list(revert_weight_conversion(self.engine.module, self.full_state()).items())

    def publish(self) -> int:
        buckets = pack_buckets(iter(self.named_weights()), self.cfg.transport.weight_bucket_mib << 20)
        return self.publisher.publish(self.version, buckets)

    def save_pretrained(self, path: str) -> None:
        self.engine.module.save_pretrained(path, state_dict=self.full_state())
        for name in TOKENIZER_FILES:  # a checkpoint vLLM can serve as it is
            if (Path(self.model_dir) / name).is_file():
                shutil.copy(Path(self.model_dir) / name, Path(path) / name)

    def save_checkpoint(self, root: str) -> str:
        """`root/step_<version>/`: DeepSpeed state (weights, optimizer), the weights as a Hugging Face checkpoint
        (what resumed actors load) and state.json (version, data cursor, counters)."""
        path = Path(root) / f"step_{self.version}"
        self.engine.save_checkpoint(str(path / "deepspeed"), tag="state")
        self.save_pretrained(str(path / "hf"))
        state = {"version": self.version, "data_cursor": self.data_cursor, "counts": self.counts}
        (path / "state.json").write_text(json.dumps(state, indent=2))  # written last: marks the checkpoint complete
        return str(path)

    def load_checkpoint(self, path: str) -> None:
        path = find_checkpoint(path)
        self.engine.load_checkpoint(str(path / "deepspeed"), tag="state")
        state = json.loads((path / "state.json").read_text())
        self.version, self.data_cursor, self.counts = state["version"], state["data_cursor"], state["counts"]

    def summary(self) -> dict:
        return {**self.counts, "version": self.version, "data_cursor": self.data_cursor,
                "trained_groups": self.trained_groups,
                "pending": sum(len(g) for g in self.pending.values()),
                "dropped_messages": dict(self.inbox.dropped), "acks": len(self.acks)}
