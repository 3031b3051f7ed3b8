"""ZeroMQ channels for the message types in `transport/messages.py`.

- `Inbox`: a PULL socket the receiver binds on a random port (its endpoint is advertised through Ray);
  senders `Outbox.send` to it, one frame per message (msgpack). A message that is not one frame, not decodable
  as a `Message`, of another schema version or over `max_bytes` is counted under its reason, logged once per
  (sender, reason), and dropped; the socket keeps serving good messages.
- `Outbox`: a PUSH socket with a bounded send queue (`hwm`): when the receiver falls behind, `send` blocks,
  which is the back-pressure on rollout actors.
- `WeightPublisher` / `WeightSubscriber`: PUB/SUB for weight updates, the policy's and the distilled draft LM's
  (each versioned on its own). Each bucket is one multipart message: a `WeightBucket` header, then one zero-copy
  frame per tensor.

Servers (`Inbox`, `WeightPublisher`) given a `transport.auth.Gate` and clients given `ClientKeys` speak CURVE:
authenticated and encrypted, and a gated inbox takes a message's sender from its key.

What a peer can make an inbox hold: libzmq reads every connection eagerly and hands a message over only once all
its frames are in, so the bound is per frame (MAXMSGSIZE, `max_bytes` + MAXMSGSIZE_SLACK; a larger frame closes the
peer's connection as it arrives), times the frames of one message, times the receive queue of each connection
(`hwm` messages). libzmq has no bound on the frames of one message: a gated inbox revokes the key of a peer whose
message has more than one frame, so from then on everything that key sends is dropped as it is read, and its actor,
silent, is replaced with a key of its own (driver/rollouts.py).
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections import Counter, deque
from collections.abc import Iterator

import msgspec
import torch
import zmq

from transport.auth import ClientKeys, Gate, dial
from transport.messages import SCHEMA_VERSION, History, Message, Output, TensorSpec, Trajectory, WeightBucket


def dialable(host: str) -> str:
    """The address peers dial for a socket bound to `host`: for a wildcard bind (every interface, what a multi-node
    run needs), this machine's outward address rather than the wildcard itself."""
    if host not in ("0.0.0.0", "*"):
        return host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # picks the outward interface; UDP connect sends nothing
            return probe.getsockname()[0]
        except OSError:  # no route at all: only this machine can dial it
            return "127.0.0.1"

log = logging.getLogger(__name__)
_encoder = msgspec.msgpack.Encoder()


# what decoding a peer's bytes may raise: msgspec's errors, and RecursionError for a value nested past Python's
# recursion limit (msgspec skips an unknown field's value, however deep, by recursing)
DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)
MAXMSGSIZE_SLACK = 64 << 10  # a frame this far over `max_bytes` closes its peer's connection before it is buffered


class Inbox:
    def __init__(self, host: str, max_bytes: int, hwm: int = 1000, context: zmq.Context | None = None,
                 accepts=Message, gate: Gate | None = None):
        """`accepts`: the message types (a union) this inbox is for; any other is dropped as malformed. `gate`:
        only clients it admits connect, and a message naming an `actor_id` must come from key `actor-<id>`."""
        self.socket = (context or zmq.Context.instance()).socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, hwm)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_bytes + MAXMSGSIZE_SLACK)
        if gate is not None:
            gate.serve(self.socket)
        self.gate = gate
        port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{dialable(host)}:{port}"
        self.max_bytes = max_bytes
        self.dropped: Counter[str] = Counter()
        self._decoder = msgspec.msgpack.Decoder(accepts)
        self._logged: set[tuple[str, str]] = set()

    def recv(self, timeout_ms: int) -> Message | None:
        """The next good message, or None once `timeout_ms` passes without one (bad ones are dropped meanwhile)."""
        deadline = time.monotonic() + timeout_ms / 1000
        while self.socket.poll(timeout_ms):
            frame, count = self._frames()
            if frame is not None:
                message = self._decode(frame, count)
                if message is not None:
                    return message
            timeout_ms = max(0, round((deadline - time.monotonic()) * 1000))
        return None

    def _frames(self) -> tuple[zmq.Frame | None, int]:
        """One message: its first frame and how many it had (the rest are read and let go). (None, 0) when the
        message announced never comes (ZeroMQ drops it with its peer's connection if a frame exceeds MAXMSGSIZE)."""
        first, count = None, 0
        try:
            while True:
                frame = self.socket.recv(zmq.NOBLOCK, copy=False)  # the rest of a message is there with its start
                count += 1
                if first is None:
                    first = frame
                if not frame.more:
                    return first, count
        except zmq.Again:
            return None, 0

    def _decode(self, frame: zmq.Frame, count: int) -> Message | None:
        key, sender = None, "a peer"
        if self.gate is not None:  # it names the sender from its key, per message (None: revoked since it connected)
            key = frame.get("User-Id").encode()
            sender = self.gate.name_of(key)
            if sender is None:
                return self._drop("a revoked key", "revoked", "its key was revoked after it connected")
        if count != 1:  # libzmq held every frame before this one: a key that does it once does it no more
            if key is not None:
                self.gate.revoke(key)
            revoked = "; its key is revoked" if key is not None else ""
            return self._drop(sender, "frames", f"{count} frames, expected 1{revoked}")
        if len(frame) > self.max_bytes:
            return self._drop(sender, "oversized", f"{len(frame)} bytes > limit {self.max_bytes}")
        try:
            message = self._decoder.decode(frame.buffer)
        except (*DECODE_ERRORS, UnicodeDecodeError) as e:  # (a string not UTF-8)
            return self._drop(sender, "malformed", str(e))
        if message.schema != SCHEMA_VERSION:
            return self._drop(sender, "schema_version", f"schema {message.schema}, expected {SCHEMA_VERSION}")
        claimed = getattr(message, "actor_id", None)
        if self.gate is not None and claimed is not None and sender != f"actor-{claimed}":  # a key speaks only for itself
            return self._drop(sender, "sender", f"claims to be actor {claimed}")
        return message

    def _drop(self, sender: str, reason: str, detail: str) -> None:
        self.dropped[reason] += 1
        if (sender, reason) not in self._logged:  # (senders: the gate's names, or "a peer")
            self._logged.add((sender, reason))
            log.warning("dropped a %s message from %s: %s (further ones are only counted)", reason, sender, detail)
        return None

    def close(self) -> None:
        self.socket.close(0)


class Outbox:
    def __init__(self, endpoint: str, hwm: int, context: zmq.Context | None = None, keys: ClientKeys | None = None):
        self.socket = (context or zmq.Context.instance()).socket(zmq.PUSH)
        self.socket.setsockopt(zmq.SNDHWM, hwm)
        self.socket.setsockopt(zmq.LINGER, 5000)
        if keys is not None:
            dial(self.socket, keys)
        self.socket.connect(endpoint)

    def send(self, message: Message, timeout_ms: int | None = None) -> bool:
        """Blocks while the receiver's queue is full; False if `timeout_ms` passed first."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms, zmq.POLLOUT):
            return False
        self.socket.send(_encoder.encode(message))
        return True

    def close(self) -> None:
        self.socket.close()


def pack_buckets(named: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Groups tensors into buckets of at most `bucket_bytes` (a larger tensor gets a bucket of its own)."""
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor.detach().contiguous().cpu()))
        size += nbytes
    return buckets


class WeightPublisher:
    def __init__(self, host: str, context: zmq.Context | None = None, gate: Gate | None = None,
                 queued_buckets: int = 0):
        """`queued_buckets`: how many buckets the socket holds for a subscriber that does not read (0: all). Past
        that, that subscriber's buckets are dropped, so its versions arrive incomplete and it takes the next whole
        one; the publisher's memory stays bounded."""
        self.socket = (context or zmq.Context.instance()).socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, queued_buckets)
        self.socket.setsockopt(zmq.LINGER, 0)
        if gate is not None:
            gate.serve(self.socket)
        port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{dialable(host)}:{port}"

    def publish(self, version: int, buckets: list[list[tuple[str, torch.Tensor]]], model: str = "policy",
                lead: int = 0, inline: bool = True) -> int:
        """Sends each bucket of `model`'s weights once to every subscriber, with the learner's cursor `lead`;
        returns the bytes of its tensors. `inline` false: the headers only (the bytes go over
        transport/collective.py)."""
        sent = 0
        for index, bucket in enumerate(buckets):
            specs = [TensorSpec(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in bucket]
            header = WeightBucket(SCHEMA_VERSION, version, index, len(buckets), specs, model, lead, inline)
            frames = [_encoder.encode(header)]
            if inline:
                frames += [t.view(torch.uint8).reshape(-1).numpy() for _, t in bucket]
            self.socket.send_multipart(frames, copy=False)
            sent += sum(t.numel() * t.element_size() for _, t in bucket)
        return sent

    def publish_history(self, version: int, trajectories: list[Trajectory]) -> int:
        """Sends the outputs the learner trained at `version` to every subscriber (`History`); returns the bytes."""
        outputs = [Output(t.actor_id, t.seq, t.prompt_ids, t.response_ids, min(t.policy_versions, default=version))
                   for t in trajectories]
        frame = _encoder.encode(History(SCHEMA_VERSION, version, outputs))
        self.socket.send(frame, copy=False)
        return len(frame)

    def close(self) -> None:
        self.socket.close(0)


MAX_BUCKETS = 1 << 20  # a version of more buckets than this is not one a learner sent
MAX_PENDING_VERSIONS = 4  # partial versions a subscriber assembles at once, per model
MAX_ELEMENTS = 1 << 40  # the most elements a weight tensor's shape may name (its dimensions past 0 too: an empty one)
MAX_HISTORIES = 8  # `History` messages a subscriber keeps until taken (the newest)
MODELS = ("policy", "draft")  # the weights a publisher sends: the policy, and the draft LM it distils
DTYPES = {name: getattr(torch, name) for name in ("float32", "bfloat16", "float16", "float64", "int64", "int32",
                                                  "int8", "uint8", "bool")}  # what a weight bucket may carry


def checked_size(spec: TensorSpec) -> tuple[torch.dtype, int]:
    """The dtype and byte size a bucket header claims for a tensor, after checking them."""
    dtype = DTYPES.get(spec.dtype)
    if dtype is None:
        raise ValueError(f"{spec.name}: dtype {spec.dtype!r} is not a weight dtype")
    if any(d < 0 for d in spec.shape) or math.prod(max(d, 1) for d in spec.shape) > MAX_ELEMENTS:
        raise ValueError(f"{spec.name}: shape {spec.shape}")
    return dtype, math.prod(spec.shape) * dtype.itemsize


def _tensor(spec: TensorSpec, buffer) -> torch.Tensor:
    """A bucket's tensor from its frame, after checking what the header claims (dtype, shape, byte size)."""
    dtype, expected = checked_size(spec)
    if len(buffer) != expected:
        raise ValueError(f"{spec.name}: {len(buffer)} bytes for shape {spec.shape} {spec.dtype} ({expected})")
    return torch.frombuffer(bytearray(buffer), dtype=dtype).reshape(spec.shape) if expected else \
        torch.empty(spec.shape, dtype=dtype)


class WeightSubscriber:
    def __init__(self, endpoint: str, context: zmq.Context | None = None, keys: ClientKeys | None = None):
        self.socket = (context or zmq.Context.instance()).socket(zmq.SUB)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            dial(self.socket, keys)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self._decoder = msgspec.msgpack.Decoder(WeightBucket | History)
        self._histories: deque[History] = deque(maxlen=MAX_HISTORIES)
        # per model: partial versions being assembled (per bucket: its tensors, or inline=False its specs), and the
        # newest complete one not yet taken
        self._pending: dict[str, dict[int, dict[int, list]]] = {m: {} for m in MODELS}
        self._complete: dict[str, tuple[int, list]] = {}
        # policy versions sent inline=False: per bucket the specs of its tensors, for the engine's pull (the newest)
        self.layouts: dict[int, list[list[TensorSpec]]] = {}
        self.lead = 0  # sent with the newest complete policy version
        self.dropped = 0
        self.received = 0  # messages taken so far, good or not (its owner's sign of life while a version streams in)

    def poll(self, timeout_ms: int = 0) -> tuple[int, list[tuple[str, torch.Tensor]] | None] | None:
        """The newest complete policy version received so far, or None: (version, its tensors), or (version, None)
        when it was sent without them (its layout is in `layouts`). Older partial versions are discarded; draft LM
        versions received meanwhile wait for `take_draft`."""
        self._receive(timeout_ms)
        return self._complete.pop("policy", None)

    def take_draft(self) -> tuple[int, list[tuple[str, torch.Tensor]]] | None:
        """The newest complete draft LM version received by the last `poll`, or None."""
        return self._complete.pop("draft", None)

    def take_history(self) -> list[History]:
        """The `History` messages received by the last `poll` (the newest `MAX_HISTORIES`), oldest first."""
        histories = list(self._histories)
        self._histories.clear()
        return histories

    def _receive(self, timeout_ms: int) -> None:
        while self.socket.poll(timeout_ms):
            timeout_ms = 0
            frames = self.socket.recv_multipart(copy=False)
            self.received += 1
            try:
                header = self._decoder.decode(frames[0].buffer)
                if isinstance(header, History):
                    if header.schema != SCHEMA_VERSION or len(frames) != 1 or header.version < 0:
                        raise ValueError(f"history of schema {header.schema}, version {header.version}, "
                                         f"{len(frames) - 1} extra frames")
                    self._histories.append(header)
                    continue
                if header.schema != SCHEMA_VERSION or len(frames) != (len(header.tensors) if header.inline else 0) + 1:
                    raise ValueError(f"schema {header.schema}, {len(frames) - 1} tensor frames")
                if not 0 <= header.bucket < header.num_buckets <= MAX_BUCKETS or header.version < 0 \
                        or header.model not in MODELS or header.lead < 0 or not (header.inline or
                                                                             header.model == "policy"):
                    raise ValueError(f"bucket {header.bucket} of {header.num_buckets}, version {header.version} of "
                                     f"{header.model!r}, lead {header.lead}, inline {header.inline}")
                if header.inline:
                    content = [(spec.name, _tensor(spec, frame.buffer)) for spec, frame in
                               zip(header.tensors, frames[1:])]
                else:
                    for spec in header.tensors:
                        checked_size(spec)
                    content = header.tensors
            except (*DECODE_ERRORS, ValueError) as e:
                self.dropped += 1
                log.warning("dropped a malformed message on the weight channel: %s", e)
                continue
            pending = self._pending[header.model]
            buckets = pending.setdefault(header.version, {})
            buckets[header.bucket] = content
            while len(pending) > MAX_PENDING_VERSIONS:  # bounded: a peer could start endless versions
                del pending[min(pending)]
            if len(buckets) == header.num_buckets:
                ordered = [buckets[i] for i in sorted(buckets)]
                if header.inline:
                    self._complete[header.model] = (header.version, [t for bucket in ordered for t in bucket])
                else:
                    self._complete[header.model] = (header.version, None)
                    self.layouts = {v: b for v, b in self.layouts.items() if v > header.version - MAX_PENDING_VERSIONS}
                    self.layouts[header.version] = ordered
                if header.model == "policy":
                    self.lead = header.lead
                self._pending[header.model] = {v: b for v, b in pending.items() if v > header.version}

    def close(self) -> None:
        self.socket.close(0)
