"""Malformed, truncated, wrong-version and oversized messages are counted and dropped; good ones keep flowing."""

import os
import time

import msgspec
import pytest
import torch
import zmq

import factories
from transport.messages import SCHEMA_VERSION, Trajectory, WeightAck
from transport.zmq import MAX_PENDING_VERSIONS, Inbox, Outbox, WeightPublisher, WeightSubscriber, pack_buckets


def trajectory(seq, schema=SCHEMA_VERSION, n=3):
    return factories.trajectory(schema=schema, seq=seq, group_id=seq, response_ids=range(n))


@pytest.fixture
def inbox():
    box = Inbox("127.0.0.1", max_bytes=4096)
    yield box
    box.close()


def test_bad_messages_are_counted_and_dropped_while_good_ones_flow(inbox, caplog):
    good = Outbox(inbox.endpoint, hwm=16)
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.connect(inbox.endpoint)
    valid = msgspec.msgpack.encode(trajectory(99))
    bad = [
        [os.urandom(64)],  # random bytes
        [valid[: len(valid) // 2]],  # truncated
        [msgspec.msgpack.encode(trajectory(5, schema=SCHEMA_VERSION + 1))],  # wrong version
        [msgspec.msgpack.encode(trajectory(6, n=2000))],  # oversized
        [b"two", valid],  # a message is one frame
        [msgspec.msgpack.encode({"type": "trajectory", "schema": 1})],  # missing fields
    ]
    for i, frames in enumerate(bad):
        good.send(trajectory(i))
        raw.send_multipart(frames)
        raw.send_multipart(frames)  # twice: logged once, counted twice
    good.send(WeightAck(SCHEMA_VERSION, actor_id=0, version=3, apply_seconds=0.01))
    received = [inbox.recv(2000) for _ in range(len(bad) + 1)]
    assert [m.seq for m in received[:-1]] == list(range(len(bad)))
    assert received[-1] == WeightAck(SCHEMA_VERSION, 0, 3, 0.01)
    assert inbox.recv(200) is None
    assert inbox.dropped == {"malformed": 6, "schema_version": 2, "oversized": 2, "frames": 2}
    warnings = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(warnings) == 4 and all("from a peer" in w for w in warnings)  # once per reason
    raw.close(0)
    good.close()


def test_outbox_applies_back_pressure():
    inbox = Inbox("127.0.0.1", max_bytes=1 << 20, hwm=2)
    out = Outbox(inbox.endpoint, hwm=2)
    sent = 0
    while sent < 2000 and out.send(trajectory(sent, n=8000), timeout_ms=300):  # ~70 kB each
        sent += 1
    assert 4 <= sent < 2000  # the sender stopped: only the bounded queues and socket buffers hold messages
    assert [inbox.recv(1000).seq for _ in range(4)] == [0, 1, 2, 3]  # in order, none lost
    # space again once the receiver reads (a few messages: ZeroMQ resumes a paused TCP reader at a low watermark)
    assert out.send(trajectory(sent, n=8000), timeout_ms=5000)
    out.close()
    inbox.close()


def test_weight_buckets_arrive_whole_and_bounded():
    pub = WeightPublisher("127.0.0.1")
    sub = WeightSubscriber(pub.endpoint)
    weights = [(f"layer{i}.weight", torch.randn(64, 32)) for i in range(5)] + [("big", torch.randn(1000, 10))]
    buckets = pack_buckets(iter(weights), bucket_bytes=3 * 64 * 32 * 4)
    assert [len(b) for b in buckets] == [3, 2, 1]  # size-bounded; a larger tensor alone

    deadline = time.time() + 5
    result = None
    while result is None and time.time() < deadline:  # PUB/SUB: resend until the subscription is live
        pub.publish(7, buckets, lead=3)
        result = sub.poll(200)
    version, received = result
    assert version == 7 and sub.lead == 3  # the learner's cursor lead comes with the version (tasks/schedule.py)
    assert sub.received >= len(buckets)  # each message taken counts (the actor's sign of life while they stream in)
    assert [n for n, _ in received] == [n for n, _ in weights]
    for (_, a), (_, b) in zip(received, weights):
        assert torch.equal(a, b)
    pub.close()
    sub.close()


def test_a_steps_history_reaches_subscribers_beside_its_weights_and_forged_ones_are_dropped():
    from transport.messages import History, Output

    pub = WeightPublisher("127.0.0.1")
    sub = WeightSubscriber(pub.endpoint)
    buckets = pack_buckets(iter([("w", torch.ones(3))]), bucket_bytes=1 << 20)
    deadline, result = time.time() + 5, None
    while result is None and time.time() < deadline:  # PUB/SUB: resend until the subscription is live
        pub.publish_history(4, [trajectory(1), trajectory(2, n=5)])
        pub.publish(4, buckets)
        result = sub.poll(200)
    histories = sub.take_history()
    assert result[0] == 4 and histories and sub.take_history() == []  # taken once
    assert histories[-1].version == 4 and [o.response_ids for o in histories[-1].outputs] == [[0, 1, 2], list(range(5))]
    assert histories[-1].outputs[0] == Output(actor_id=0, seq=1, prompt_ids=[1, 2], response_ids=[0, 1, 2], version=0)
    raw = zmq.Context.instance().socket(zmq.PUB)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    forged_sub = WeightSubscriber(f"tcp://127.0.0.1:{port}")
    good = msgspec.msgpack.encode(History(SCHEMA_VERSION, 1, [Output(1, 0, [3], [4, 5], 0)]))
    forged = [[msgspec.msgpack.encode(History(SCHEMA_VERSION + 1, 1, []))], [good, b"extra frame"],
              [msgspec.msgpack.encode(History(SCHEMA_VERSION, -1, []))], [good.replace(b"history", b"historx")]]
    deadline = time.time() + 5
    while not forged_sub._histories and time.time() < deadline:
        for frames in [*forged, [good]]:
            raw.send_multipart(frames)
        forged_sub.poll(200)
    histories = forged_sub.take_history()
    assert histories and all(h.outputs == [Output(1, 0, [3], [4, 5], 0)] for h in histories) and forged_sub.dropped >= 4
    for closing in (pub, sub, forged_sub):
        closing.close()
    raw.close(0)


def test_a_subscriber_that_never_reads_costs_the_publisher_a_bounded_queue():
    """Past `queued_buckets`, a stuck subscriber's buckets are dropped (it would take the next whole version);
    a subscriber that reads as versions come still gets every one whole."""
    context = zmq.Context()  # its own I/O thread: sockets other tests left in the shared context do not slow it
    # room for three versions of 4 buckets: ZeroMQ learns of a reader's progress lazily (an acknowledgement every
    # HWM/2 messages, taken in by the publisher on a later send), so right after the live subscriber has read a
    # version the publisher may still count up to 7 of its messages as queued; with room for two versions a fresh
    # version then lost its last bucket on a loaded host (CI: "version 3: newest None, partial [3]")
    pub = WeightPublisher("127.0.0.1", context=context, queued_buckets=12)
    stuck = context.socket(zmq.SUB)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 1 << 16)
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    stuck.connect(pub.endpoint)
    live = WeightSubscriber(pub.endpoint, context=context)
    buckets = pack_buckets(iter([(f"w{i}", torch.randn(1 << 18)) for i in range(4)]), bucket_bytes=1 << 20)
    deadline = time.time() + 5
    while live.poll(100) is None and time.time() < deadline:  # both subscriptions live
        pub.publish(0, buckets)
    while live.socket.poll(1000):  # the warm-up's copies drained (a bucket at a time: poll() returns None on a
        live.poll(0)  # partial version): the live subscriber's queue is empty
    for version in range(1, 31):  # a version per step, as the learner publishes
        pub.publish(version, buckets)
        deadline, newest = time.time() + 20, None  # generous: a loaded CI host
        while newest != version and time.time() < deadline:
            newest = (live.poll(100) or (None,))[0]
        assert newest == version, f"version {version}: newest {newest}, partial {live._pending['policy'].keys()}"
    held = 0
    while stuck.poll(500):
        stuck.recv_multipart()
        held += 1
    assert held < 40  # of the 120 buckets published after it stopped reading (unbounded: all 120)
    stuck.close(0)
    live.close()
    pub.close()
    context.term()


def test_a_wildcard_bind_advertises_an_address_peers_can_dial():
    box = Inbox("0.0.0.0", max_bytes=4096)  # what a multi-node config sets (transport.host)
    assert "0.0.0.0" not in box.endpoint
    out = Outbox(box.endpoint, hwm=4)
    out.send(trajectory(1))
    got = box.recv(5000)
    assert got is not None and got.seq == 1
    out.close()
    box.close()


def test_an_inbox_logs_a_kind_of_dropped_message_once_however_many_arrive(inbox, caplog):
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.connect(inbox.endpoint)
    for i in range(1000):
        raw.send(f"not msgpack {i}".encode())
    raw.send(msgspec.msgpack.encode(trajectory(1)))
    assert inbox.recv(5000).seq == 1 and inbox.dropped == {"malformed": 1000}
    assert sum("dropped" in r.getMessage() for r in caplog.records) == 1
    raw.close(0)


def test_an_inbox_takes_only_the_messages_meant_for_it():
    from transport.messages import TensorSpec, WeightBucket

    inbox = Inbox("127.0.0.1", max_bytes=4096, accepts=Trajectory | WeightAck)  # the learner's
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.connect(inbox.endpoint)
    bucket = WeightBucket(SCHEMA_VERSION, 1, 0, 1, [TensorSpec("w", "float32", [1])])
    raw.send(msgspec.msgpack.encode(bucket))  # well-typed, but not for this socket
    raw.send(msgspec.msgpack.encode(trajectory(1)))
    assert inbox.recv(2000).seq == 1 and inbox.dropped == {"malformed": 1}
    raw.close(0)
    inbox.close()


def test_a_weight_subscriber_survives_forged_buckets():
    from transport.messages import TensorSpec, WeightBucket

    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PUB)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    sub = WeightSubscriber(f"tcp://127.0.0.1:{port}")
    real = torch.arange(4, dtype=torch.float32)

    def bucket(version, index=0, count=1, dtype="float32", shape=(4,), payload=real.numpy().tobytes(), lead=0):
        header = WeightBucket(SCHEMA_VERSION, version, index, count, [TensorSpec("w", dtype, list(shape))], lead=lead)
        return [msgspec.msgpack.encode(header), payload]

    forged = [bucket(3, dtype="Tensor"), bucket(3, dtype="__class__"), bucket(3, index=5, count=2),
              bucket(3, count=-1), bucket(3, shape=(5,)), bucket(3, shape=(-4,)), bucket(-2), bucket(4, lead=-9)]
    forged += [bucket(100 + v, count=2) for v in range(10)]  # endless partial versions: bounded
    # empty tensors whose other dimensions no tensor can have; a header nested past Python's recursion limit
    forged += [bucket(3, shape=(0, 2**63), payload=b""), bucket(3, shape=(2**40, 2**40, 0), payload=b"")]
    nested = msgspec.msgpack.encode(WeightBucket(SCHEMA_VERSION, 3, 0, 1, []))
    forged.append([b"\xde\x00" + bytes([nested[0] - 0x80 + 1]) + nested[1:] + b"\xa4junk" + b"\x91" * 5000 + b"\xc0"])
    deadline, result = time.time() + 5, None
    while result is None and time.time() < deadline:  # PUB/SUB: resend until the subscription is live
        for frames in forged + [bucket(2)]:
            raw.send_multipart(frames)
        result = sub.poll(200)
    assert result is not None and result[0] == 2 and torch.equal(result[1][0][1], real) and sub.lead == 0
    assert sub.dropped >= 11 and all(len(versions) <= MAX_PENDING_VERSIONS for versions in sub._pending.values())
    raw.close(0)
    sub.close()


def test_an_actor_blocked_on_a_learner_that_stopped_reading_still_stops():
    import threading
    from types import SimpleNamespace

    from actor.rollout import RolloutActor

    inbox = Inbox("127.0.0.1", max_bytes=1 << 20, hwm=1)  # never read: its queue fills
    actor = SimpleNamespace(outbox=Outbox(inbox.endpoint, hwm=1), stopping=threading.Event(), turns_taken=0)
    results = []

    def send_until_refused():  # as the actor's group loop does: it gives up on the first refusal
        while not results or results[-1]:
            results.append(RolloutActor._send(actor, trajectory(len(results), n=8000)))

    sender = threading.Thread(target=send_until_refused)
    sender.start()
    time.sleep(1.0)
    assert sender.is_alive()  # back-pressure: it waits while the learner's queue is full
    waited = actor.turns_taken
    time.sleep(1.0)
    assert actor.turns_taken > waited  # and the driver, asking its turns, sees it waiting, not hung
    actor.stopping.set()  # stop() during the wait
    sender.join(timeout=5)
    assert not sender.is_alive() and results[-1] is False and all(results[:-1])
    actor.outbox.socket.close(0)
    inbox.close()


def test_with_curve_only_admitted_keys_get_in_and_a_key_speaks_only_for_itself():
    """Through a gated inbox and publisher, clients without a key, with an unknown key, with a key replaced since
    (a dead actor's) or with the key of another actor get nothing in and nothing out; the admitted client does."""
    from msgspec.structs import replace

    from transport.auth import ClientKeys, Gate, dial, keypair

    ctx = zmq.Context()  # a gate is the ZAP handler of its context
    gate = Gate(keypair(), ctx)
    inbox = Inbox("127.0.0.1", max_bytes=4096, context=ctx, gate=gate)
    publisher = WeightPublisher("127.0.0.1", context=ctx, gate=gate)
    old, actor0, actor1, stranger = keypair(), keypair(), keypair(), keypair()
    gate.admit("actor-0", old.public)
    gate.admit("actor-0", actor0.public)  # the replacement's key: the old one is revoked
    gate.admit("actor-1", actor1.public)
    raw = ctx.socket(zmq.PUSH)  # no CURVE at all
    raw.connect(inbox.endpoint)
    clients = {name: Outbox(inbox.endpoint, hwm=16, context=ctx, keys=ClientKeys(pair, gate.keys.public))
               for name, pair in [("old", old), ("stranger", stranger), ("actor1", actor1), ("actor0", actor0)]}
    forged_server = Outbox(inbox.endpoint, hwm=16, context=ctx,
                           keys=ClientKeys(actor0, keypair().public))  # dials a server key that is not the run's
    for seq in range(20):
        try:  # its handshake never completes, so it has no peer to queue for
            raw.send(msgspec.msgpack.encode(trajectory(1000 + seq)), zmq.NOBLOCK)
        except zmq.Again:
            pass
        for name, out in clients.items():  # every one claims actor 0 (trajectory()'s actor_id)
            out.send(trajectory({"old": 2000, "stranger": 3000, "actor1": 4000, "actor0": 0}[name] + seq),
                     timeout_ms=100)
        forged_server.send(trajectory(5000 + seq), timeout_ms=100)
    received = []
    while (message := inbox.recv(1500)) is not None:
        received.append(message.seq)
    assert received == list(range(20))  # only actor 0's own key, in order
    assert inbox.dropped == {"sender": 20}  # actor 1's key claiming actor 0's messages

    weights = [("w", torch.arange(4, dtype=torch.float32))]
    subscribers = {name: WeightSubscriber(publisher.endpoint, context=ctx, keys=keys) for name, keys in
                   [("plain", None), ("stranger", ClientKeys(stranger, gate.keys.public)),
                    ("actor0", ClientKeys(actor0, gate.keys.public))]}
    got: dict[str, object] = {}
    deadline = time.time() + 5
    while "actor0" not in got and time.time() < deadline:  # PUB/SUB: resend until the subscription is live
        publisher.publish(1, pack_buckets(iter(weights), 1 << 20))
        for name, sub in subscribers.items():
            if (result := sub.poll(100)) is not None:
                got[name] = result
    time.sleep(0.3)
    got |= {name: r for name, sub in subscribers.items() if (r := sub.poll(100)) is not None}
    assert list(got) == ["actor0"] and torch.equal(got["actor0"][1][0][1], weights[0][1])
    gate.admit("actor-0", keypair().public)  # actor 0 replaced while its connection stays open: it speaks no more
    clients["actor0"].send(trajectory(20), timeout_ms=100)
    assert inbox.recv(1500) is None and inbox.dropped == {"sender": 20, "revoked": 1}
    # a key that sends a message of more than one frame (libzmq held all of it before the inbox saw the first) is
    # revoked there and then: what it sends next is dropped on arrival
    rogue = ctx.socket(zmq.PUSH)
    dial(rogue, ClientKeys(actor1, gate.keys.public))
    rogue.connect(inbox.endpoint)
    rogue.send_multipart([msgspec.msgpack.encode(replace(trajectory(21), actor_id=1))] * 3)
    rogue.send(msgspec.msgpack.encode(replace(trajectory(22), actor_id=1)))
    assert inbox.recv(1500) is None and inbox.dropped == {"sender": 20, "revoked": 2, "frames": 1}
    assert gate.name_of(actor1.public) is None
    rogue.close(0)
    for out in [raw, *(c.socket for c in clients.values()), forged_server.socket]:
        out.close(0)  # unsent messages of the refused ones: nothing to wait for (a queued one held ctx.term() forever)
    for socket in [*subscribers.values(), inbox, publisher]:
        socket.close()
    gate.close()
    ctx.term()


def test_a_gated_inbox_drops_a_connection_that_never_completes_its_handshake():
    """An unauthenticated peer holds a descriptor for HANDSHAKE_MS, not ZeroMQ's default 30 s: a raw TCP client
    that sends nothing is disconnected (its read ends) well before then."""
    import socket

    from transport.auth import HANDSHAKE_MS, Gate, keypair

    ctx = zmq.Context()
    gate = Gate(keypair(), ctx)
    inbox = Inbox("127.0.0.1", max_bytes=4096, context=ctx, gate=gate)
    host, port = inbox.endpoint.removeprefix("tcp://").rsplit(":", 1)
    peer = socket.create_connection((host, int(port)))
    peer.settimeout(HANDSHAKE_MS / 1000 + 10)  # ZeroMQ's own default (30 s) would run past this
    try:
        while peer.recv(4096):  # ZeroMQ's greeting, then the close
            pass
    finally:
        peer.close()
        inbox.close()
        gate.close()
        ctx.term()


def test_a_token_list_longer_than_any_trajectory_is_refused_before_it_is_built():
    """msgspec checks a list's declared length first: a message announcing 2^21 token ids costs its bytes, not the
    ~40x they would take as Python objects."""
    import tracemalloc

    from transport.messages import MAX_TOKENS

    encoded = msgspec.msgpack.encode({**msgspec.to_builtins(trajectory(1)), "prompt_ids": [7] * (2 * MAX_TOKENS)})
    tracemalloc.start()
    with pytest.raises(msgspec.ValidationError, match=r"length <= 1048576 - at `\$.prompt_ids`"):
        msgspec.msgpack.Decoder(Trajectory).decode(encoded)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < len(encoded) // 4
