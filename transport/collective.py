"""Policy weights over a collective (`transport.weights: nccl`): NCCL between GPUs, gloo between CPU processes.

Learner rank 0 and each rollout engine form a process group of their own (rank 0 the learner, ranks 1..n the
engine's workers, the stateless-group pattern: not torch.distributed's default group, which is DeepSpeed's on the
learner and vLLM's on the engine). A group meets through a TCPStore that rank 0 binds on the run's address (never on
every interface) under a per-run secret prefix handed out by the driver, and is formed again for an actor's
replacement (its own prefix), so a dead engine only ever breaks its own group. The names, shapes and dtypes of a
version still travel as `WeightBucket` headers over the authenticated ZeroMQ channel; only the bytes go here.

The engine pulls: when it is ready to apply a version it signals rank 0 through the store, and rank 0's sender for
that group broadcasts its newest version, a header (version, bucket count, bucket sizes) and then each bucket as
one flat byte buffer, which the engine's workers read straight into their parameters bucket by bucket
(`actor/vllm_hooks.pull_weights`). Rank 0 never waits on an engine: each group has its own sender thread."""

from __future__ import annotations

import datetime
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from transport.messages import TensorSpec
from transport.zmq import checked_size, dialable

log = logging.getLogger(__name__)

TIMEOUT = datetime.timedelta(seconds=600)  # forming a group, or one transfer, past which its peer is taken for gone
POLL_S = 0.02  # how often a sender looks for a pull


@dataclass(frozen=True)
class GroupTicket:
    """What one engine's workers need to join their group with learner rank 0."""

    host: str
    port: int
    prefix: str  # the run's secret, the actor and its incarnation: no other group's keys
    size: int  # 1 + the engine's workers
    backend: str  # "nccl" or "gloo"


def form_group(store: dist.Store, host: str, rank: int, ticket: GroupTicket):
    """This process's member of the group (blocks until every member has joined, within `TIMEOUT`)."""
    if ticket.backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, ticket.size)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = TIMEOUT
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]  # its sockets on the run's address
    return dist.ProcessGroupGloo(store, rank, ticket.size, options)


def broadcast(group, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def flatten(bucket: list[tuple[str, torch.Tensor]], device: str) -> torch.Tensor:
    """A bucket's tensors as one contiguous byte buffer on `device`, in order."""
    parts = [t.detach().contiguous().view(torch.uint8).reshape(-1) for _, t in bucket]
    return (torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)).to(device)


def bucket_bytes(bucket: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def unflatten(specs: list[TensorSpec], flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors `specs` describe, as views of `flat` (checked against it as a ZeroMQ bucket's frames are)."""
    sizes = [checked_size(spec) for spec in specs]
    if sum(nbytes for _, nbytes in sizes) != flat.numel():
        raise ValueError(f"a bucket of {flat.numel()} bytes does not hold the tensors its header names")
    offset = 0
    for spec, (dtype, nbytes) in zip(specs, sizes):
        part = flat[offset:offset + nbytes]
        if offset % dtype.itemsize:  # after a tensor of a narrower dtype: a view would be misaligned
            part = part.clone()
        offset += nbytes
        yield spec.name, part.view(dtype).reshape(spec.shape)


class Sender(threading.Thread):
    """Rank 0's side of one engine's group: forms it, then answers each pull with the newest version."""

    def __init__(self, groups: WeightGroups, ticket: GroupTicket, name: str):
        super().__init__(name=f"weights-{name}", daemon=True)
        self.groups, self.ticket, self.closed = groups, ticket, threading.Event()

    def run(self) -> None:
        store = dist.PrefixStore(self.ticket.prefix, self.groups.store)
        try:
            group = form_group(store, self.groups.host, 0, self.ticket)
            served = 0
            while not self.closed.wait(POLL_S):
                if store.check([f"pull/{served + 1}"]):
                    served += 1
                    self.send(group)
        except Exception as e:  # noqa: BLE001 -- a peer that went away ends this group only
            if not self.closed.is_set():
                log.warning("weight group %s closed: %s", self.name, e)

    def send(self, group) -> None:
        start = time.perf_counter()
        version, buckets = self.groups.newest
        device = self.groups.device
        broadcast(group, torch.tensor([version, len(buckets)], dtype=torch.int64, device=device))
        broadcast(group, torch.tensor([bucket_bytes(b) for b in buckets], dtype=torch.int64, device=device))
        for bucket in buckets:  # one bucket at a time on the device
            broadcast(group, flatten(bucket, device))
        self.groups.record(time.perf_counter() - start)


class WeightGroups:
    """Learner rank 0: the rendezvous, the newest policy version (its buckets, in host memory), and a sender per
    engine."""

    def __init__(self, host: str, device: str):
        listener = socket.create_server((dialable(host) if host != "0.0.0.0" else "", 0))
        self.host, self.port = dialable(host), listener.getsockname()[1]
        self.store = dist.TCPStore(self.host, self.port, is_master=True, wait_for_workers=False, timeout=TIMEOUT,
                                   master_listen_fd=listener.detach(), use_libuv=True)
        self.secret = secrets.token_hex(16)
        self.device, self.backend = device, "nccl" if device == "cuda" else "gloo"
        self.newest: tuple[int, list[list[tuple[str, torch.Tensor]]]] = (-1, [])
        self.senders: dict[int, Sender] = {}
        self.lock = threading.Lock()
        self.seconds: list[float] = []  # each transfer's, until taken

    def open(self, actor: int, incarnation: int, workers: int) -> GroupTicket:
        """A group for `actor`'s engine (its `workers` join as ranks 1..workers); an earlier one of it is closed."""
        ticket = GroupTicket(self.host, self.port, f"{self.secret}/actor{actor}/incarnation{incarnation}",
                             1 + workers, self.backend)
        with self.lock:
            if actor in self.senders:
                self.senders[actor].closed.set()
            self.senders[actor] = sender = Sender(self, ticket, f"actor-{actor}")
        sender.start()
        return ticket

    def offer(self, version: int, buckets: list[list[tuple[str, torch.Tensor]]]) -> None:
        """Makes `version` the one the next pulls get (call before its headers go out)."""
        self.newest = (version, buckets)

    def record(self, seconds: float) -> None:
        with self.lock:
            self.seconds.append(seconds)

    def take_seconds(self) -> list[float]:
        with self.lock:
            seconds, self.seconds = self.seconds, []
        return seconds

    def close(self) -> None:
        for sender in self.senders.values():
            sender.closed.set()
        for sender in self.senders.values():
            sender.join(timeout=1.0)


class WeightReceiver:
    """One engine worker's member of its group (rank 1 + the worker's rank)."""

    def __init__(self, ticket: GroupTicket, rank: int):
        client = dist.TCPStore(ticket.host, ticket.port, is_master=False, timeout=TIMEOUT)
        self.store, self.rank = dist.PrefixStore(ticket.prefix, client), rank
        self.device = "cuda" if ticket.backend == "nccl" else "cpu"
        self.group = form_group(self.store, ticket.host, rank, ticket)

    def pull(self, layouts: dict[int, list[list[TensorSpec]]]) -> tuple[int, Iterator | None]:
        """Asks for the newest version (the first worker asks for the engine) and receives its header: (version,
        its tensors bucket by bucket as they arrive) when `layouts` describes it, else (version, None) after
        draining it (its headers have not reached this engine yet: pull again once they have)."""
        if self.rank == 1:
            self.store.set(f"pull/{self.store.add('pulls', 1)}", b"")
        header = torch.empty(2, dtype=torch.int64, device=self.device)
        broadcast(self.group, header)
        version, count = (int(x) for x in header.tolist())
        sizes = torch.empty(count, dtype=torch.int64, device=self.device)
        broadcast(self.group, sizes)
        layout = layouts.get(version)
        if layout is not None and len(layout) != count:
            raise ValueError(f"weights v{version}: {count} buckets sent, {len(layout)} announced")
        buffers = (self._receive(int(n)) for n in sizes.tolist())
        if layout is None:
            for _ in buffers:
                pass
            return version, None
        return version, (t for specs, flat in zip(layout, buffers) for t in unflatten(specs, flat))

    def _receive(self, nbytes: int) -> torch.Tensor:
        flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        broadcast(self.group, flat)
        return flat
