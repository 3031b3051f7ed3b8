"""A live, gated inbox feeding rank 0's intake under a storm of hostile messages from admitted peers: every valid
group still arrives once and intact, nothing crashes, rank 0 grows by a bounded amount, and every bad message is
accounted for under its reason."""

import random
import threading
import time

import msgspec
import zmq
from msgspec.structs import replace

from learner.intake import Intake
from tasks.schedule import CursorPlan
from transport.auth import ClientKeys, Gate, dial, keypair
import factories
from transport.messages import (MAX_DRAFTERS, SCHEMA_VERSION, Heartbeat, SpecStats, TensorSpec, Trajectory, WeightAck,
                                WeightBucket)
from transport.zmq import MAXMSGSIZE_SLACK, Inbox, Outbox

FUZZED = 12_000
GROUPS, GROUP_SIZE, VOCAB, MAX_LEN, MAX_BYTES = 40, 4, 64, 24, 4096
VERSION = 1  # the learner's weights while the messages arrive


def trajectory(actor: int, group: int, index: int, seq: int, rng: random.Random) -> Trajectory:
    n = rng.randint(1, 8)
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
    response = [rng.randrange(VOCAB) for _ in range(n)]
    return factories.trajectory(actor_id=actor, seq=seq, group_id=group, group_size=GROUP_SIZE, sample_index=index,
                                prompt_ids=prompt, response_ids=response,
                                behaviour_logprobs=[-rng.random() * 5 for _ in range(n)],
                                policy_versions=[rng.randint(0, VERSION) for _ in range(n)],
                                reward=rng.choice([0.0, 1.0]))


def semantic_violations(t: Trajectory) -> dict[str, list[Trajectory]]:
    """Well-formed trajectories of actor 1 that the intake refuses, by reason (actor 1 owns the odd group ids): each
    would crash the learner, poison its float32 loss or its metrics, or sit in memory for good."""
    n = len(t.response_ids)
    return {"group": [replace(t, group_size=GROUP_SIZE + 1)], "owner": [replace(t, group_id=t.group_id + 1)],
            "behind": [replace(t, group_id=-t.group_id)],  # before the plan's first cursor
            "lengths": [replace(t, behaviour_logprobs=t.behaviour_logprobs + [-1.0])],
            "too_long": [replace(t, prompt_ids=[1] * MAX_LEN)], "token_ids": [replace(t, response_ids=[VOCAB] * n)],
            "reward": [replace(t, reward=float("nan")), replace(t, reward=1e39), replace(t, reward=3e38)],
            "logprobs": [replace(t, behaviour_logprobs=[float("-inf")] * n),
                         replace(t, reward=0.0, behaviour_logprobs=[-1e3] * n)],  # a negative advantage's ratio
            "spec": [replace(t, spec=SpecStats(drafter_labels={"ngram": [1]})),
                     replace(t, spec=SpecStats(drafter_choices={"x": -1})),
                     replace(t, spec=SpecStats(drafter_labels={"ngram": [1, -1]})),
                     replace(t, spec=SpecStats(draft_seconds=float("nan"))), replace(t, spec=SpecStats(verify_steps=-1)),
                     replace(t, spec=SpecStats(cost_error=1e308))],  # (finite, but two of them sum to inf)
            "generate_seconds": [replace(t, generate_seconds=float("inf")), replace(t, generate_seconds=-1.0)],
            "incarnation": [replace(t, seq=t.seq + (1 << 32))],  # a replacement the driver never started
            "versions": [replace(t, policy_versions=[VERSION + 1] * n)],
            "ahead": [replace(t, group_id=t.group_id + 6 * GROUPS)]}  # a step no actor admits yet


def hostile_messages(rng: random.Random) -> tuple[list[bytes], dict[str, int], dict[str, int]]:
    """FUZZED one-frame messages, with how many of them the inbox and the intake must drop under each reason.
    Randomly mutated encodings may land under any reason (or be well-formed): they are only counted in total."""
    inbox_reasons: dict[str, int] = {}
    intake_reasons: dict[str, int] = {}
    messages = []
    for i in range(FUZZED):
        base = trajectory(1, 2 * rng.randrange(GROUPS) + 1, 0, i, rng)
        encoded = msgspec.msgpack.encode(base)
        kind = rng.randrange(10)
        if kind == 9:  # an unknown field nested past Python's recursion limit (msgspec recurses to skip it)
            depth = rng.randint(1100, MAX_BYTES - len(encoded) - 16)  # (a 16-entry map: its 15 fields and "junk")
            frame, reason = b"\xde\x00\x10" + encoded[1:] + b"\xa4junk" + b"\x91" * depth + b"\xc0", "malformed"
        elif kind == 0:
            frame, reason = rng.randbytes(rng.randint(0, 300)), "malformed"
        elif kind == 1:
            frame, reason = encoded[: rng.randrange(len(encoded))], "malformed"
        elif kind == 2:
            frame, reason = msgspec.msgpack.encode(replace(base, schema=SCHEMA_VERSION + 1)), "schema_version"
        elif kind == 3:
            frame, reason = rng.randbytes(MAX_BYTES + 1 + rng.randrange(MAXMSGSIZE_SLACK // 2)), "oversized"
        elif kind == 4:  # more drafters than a composite drafter combines: refused as it is decoded
            labels = {f"d{j}": [0, 0] for j in range(MAX_DRAFTERS + 1)}
            frame, reason = msgspec.msgpack.encode(replace(base, spec=SpecStats(drafter_labels=labels))), "malformed"
        elif kind == 5:  # a message type that is not the inbox's
            header = WeightBucket(SCHEMA_VERSION, 3, 0, 1, [TensorSpec("w", "float32", [2])])
            frame, reason = msgspec.msgpack.encode(header), "malformed"
        elif kind == 6:  # actor 1's key speaking for actor 0
            frame, reason = msgspec.msgpack.encode(replace(base, actor_id=0, group_id=base.group_id - 1)), "sender"
        elif kind == 7:
            reason, variants = rng.choice(list(semantic_violations(base).items()))
            bad = rng.choice(variants)
            intake_reasons[reason] = intake_reasons.get(reason, 0) + 1
            messages.append(msgspec.msgpack.encode(bad))
            continue
        else:  # bytes flipped, inserted or cut anywhere: any outcome, as long as it is counted
            mutated = bytearray(encoded)
            for _ in range(rng.randint(1, 4)):
                at = rng.randrange(len(mutated))
                op = rng.randrange(3)
                if op == 0:
                    mutated[at] = rng.randrange(256)
                elif op == 1:
                    mutated.insert(at, rng.randrange(256))
                elif len(mutated) > 1:
                    del mutated[at]
            messages.append(bytes(mutated))
            continue
        inbox_reasons[reason] = inbox_reasons.get(reason, 0) + 1
        messages.append(frame)
    return messages, inbox_reasons, intake_reasons


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_fuzzed_messages_never_crash_the_inbox_nor_touch_a_valid_group():
    rng = random.Random(0)
    valid = [trajectory(0, 2 * g, i, g * GROUP_SIZE + i, rng) for g in range(GROUPS) for i in range(GROUP_SIZE)]
    hostile, inbox_reasons, intake_reasons = hostile_messages(rng)
    ctx = zmq.Context()
    gate = Gate(keypair(), ctx)
    inbox = Inbox("127.0.0.1", MAX_BYTES, hwm=64, context=ctx, accepts=Trajectory | WeightAck | Heartbeat, gate=gate)
    actor0, actor1, actor2 = keypair(), keypair(), keypair()
    for name, pair in [("actor-0", actor0), ("actor-1", actor1), ("actor-2", actor2)]:
        gate.admit(name, pair.public)
    good = Outbox(inbox.endpoint, hwm=16, context=ctx, keys=ClientKeys(actor0, gate.keys.public))
    evil = ctx.socket(zmq.PUSH)
    dial(evil, ClientKeys(actor1, gate.keys.public))
    evil.connect(inbox.endpoint)
    huge = ctx.socket(zmq.PUSH)  # frames over the socket's size limit: ZeroMQ drops the connection, not the inbox
    dial(huge, ClientKeys(actor1, gate.keys.public))
    huge.connect(inbox.endpoint)
    # actor 2's key: a message of 200 frames, each within the size limit, that libzmq holds whole before the inbox
    # sees it; then one-frame messages, which its revoked key no longer gets in
    multipart = ctx.socket(zmq.PUSH)
    dial(multipart, ClientKeys(actor2, gate.keys.public))
    multipart.connect(inbox.endpoint)
    after_revocation = 100

    def send() -> None:
        every = len(hostile) // len(valid)
        multipart.send_multipart([bytes(MAX_BYTES + MAXMSGSIZE_SLACK // 2)] * 200)
        for i, frame in enumerate(hostile):
            evil.send(frame)
            if i % every == 0 and i // every < len(valid):
                good.send(valid[i // every])
            if i % 3000 == 0:
                try:
                    huge.send(bytes(MAX_BYTES + 2 * MAXMSGSIZE_SLACK), zmq.NOBLOCK)
                except zmq.Again:  # its connection was dropped and is not back yet
                    pass
            if i % (len(hostile) // after_revocation) == 0 and i // (len(hostile) // after_revocation) < after_revocation:
                multipart.send(msgspec.msgpack.encode(trajectory(2, 0, 0, i, random.Random(i))))

    before = rss_mib()
    sender = threading.Thread(target=send)
    sender.start()
    plan = CursorPlan(0, 2, 2 * GROUPS)  # every valid group is step 0's
    intake = Intake(GROUP_SIZE, max_staleness=1, plan=plan, vocab_size=VOCAB, max_len=MAX_LEN)
    delivered, others = [], 0  # others: acknowledgements and heartbeats
    deadline = time.monotonic() + 120
    while sum(inbox.dropped.values()) + intake.counts.received + others < FUZZED + len(valid) + 1 + after_revocation:
        assert time.monotonic() < deadline, f"{dict(inbox.dropped)}, {intake.counts}"
        if (message := inbox.recv(1000)) is None:
            continue
        if isinstance(message, WeightAck | Heartbeat):
            others += 1
        elif (group := intake.receive(message, VERSION)) is not None:
            delivered.append(group)
    sender.join()
    assert inbox.recv(500) is None  # nothing more: none of the oversize-limit frames reached the application
    assert rss_mib() - before < 64, "the storm grew the receiving process"  # sockets' buffers, counters, groups

    ours = [g for g in delivered if g[0].actor_id == 0]
    assert sorted(t.group_id for g in ours for t in g[:1]) == [2 * g for g in range(GROUPS)]  # each once
    assert sorted((t for g in ours for t in g), key=lambda t: t.seq) == valid  # intact
    assert inbox.dropped["frames"] == 1 and inbox.dropped["revoked"] == after_revocation  # actor 2's
    for reason, n in inbox_reasons.items():  # exactly these, plus whatever the mutated bytes turned into
        assert inbox.dropped[reason] >= n, reason
    for reason, n in intake_reasons.items():
        assert intake.invalid[reason] >= n, reason
    mutated = FUZZED - sum(inbox_reasons.values()) - sum(intake_reasons.values())
    assert len(hostile) == FUZZED and mutated > 1000
    # every hostile message was accounted for once (the loop's condition): dropped by the inbox, or taken by the
    # intake (then dropped, pending, or trained as actor 1's own group)
    c = intake.counts
    assert c.received == c.trained + intake.pending_trajectories() + c.dropped_stale + c.dropped_duplicate + \
        c.dropped_invalid
    for socket in [good.socket, evil, huge, multipart]:
        socket.close(0)
    inbox.close()
    gate.close()
    ctx.term()
