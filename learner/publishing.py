"""Rank 0's side of the weight channel: each new version of the policy (and of the distilled draft LM) in
size-bounded buckets, sent once to every actor and again when a replacement joins. With `transport.weights: nccl`
the policy's bytes go over each engine's own process group (transport/collective.py) and the channel carries only
their names, shapes and dtypes."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import torch
from omegaconf import DictConfig

from models.zoo import tensor_count
from transport.auth import Gate
from transport.collective import GroupTicket, WeightGroups
from transport.messages import Trajectory
from transport.zmq import WeightPublisher, pack_buckets

Named = Iterator[tuple[str, torch.Tensor]]


class WeightOutlet:
    def __init__(self, cfg: DictConfig, policy_dir: str, gate: Gate | None, draft_tensors: int, bucket_bytes: int):
        """`draft_tensors`: the tensors of a draft LM version (0: none is distilled); `bucket_bytes`: the most a
        bucket holds (`transport.weight_bucket_mib`)."""
        self.bucket_bytes = bucket_bytes
        # a subscriber that stops reading holds up two versions here at most (>= 1 tensor a bucket, a History)
        self.publisher = WeightPublisher(cfg.transport.host, gate=gate,
                                         queued_buckets=2 * (tensor_count(policy_dir) + 2 + draft_tensors))
        self.groups = WeightGroups(cfg.transport.host, cfg.cluster.device.value) \
            if cfg.transport.weights.value == "nccl" else None
        self.policy: tuple[int, list, int] | None = None  # the newest policy version sent: version, buckets, lead
        self.draft: tuple[int, list] | None = None  # the newest draft LM version sent: version, buckets
        self.lock = threading.Lock()  # one sender at a time: a step's versions, a replacement's resend

    @property
    def endpoint(self) -> str:
        return self.publisher.endpoint

    def open_group(self, actor: int, incarnation: int, workers: int) -> GroupTicket:
        """`transport.weights: nccl`: the weight-sync group of `actor`'s engine, formed anew for each incarnation."""
        return self.groups.open(actor, incarnation, workers)

    def send_policy(self, version: int, named: Named, lead: int) -> int:
        """Policy `version` with the learner's cursor `lead` (tasks/schedule.py); returns the bytes of its tensors."""
        buckets = pack_buckets(named, self.bucket_bytes)
        with self.lock:
            self.policy = version, buckets, lead
            if self.groups is not None:  # before its headers: an engine that has them pulls this version
                self.groups.offer(version, buckets)
            return self.publisher.publish(version, buckets, lead=lead, inline=self.groups is None)

    def send_draft(self, version: int, named: Named) -> int:
        buckets = pack_buckets(named, self.bucket_bytes)
        with self.lock:
            self.draft = version, buckets
            return self.publisher.publish(version, buckets, model="draft")

    def send_history(self, version: int, trajectories: list[Trajectory]) -> None:
        """The outputs trained at `version`, for every actor's history drafter."""
        with self.lock:
            self.publisher.publish_history(version, trajectories)

    def resend(self) -> None:
        """The newest versions again (a replacement actor joined). Before the first step there is nothing to send:
        the actors' starting weights are that version."""
        with self.lock:
            if self.policy is not None:
                version, buckets, lead = self.policy
                self.publisher.publish(version, buckets, lead=lead, inline=self.groups is None)
            if self.draft is not None:
                self.publisher.publish(*self.draft, model="draft")

    def pull_seconds(self) -> list[float]:
        """`transport.weights: nccl`: how long each engine's pull of the versions since the last call took."""
        return self.groups.take_seconds() if self.groups is not None else []
