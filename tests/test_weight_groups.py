"""`transport.weights: nccl` (gloo on this CPU): a policy version's headers over ZeroMQ, its bytes pulled over the
weight-sync process group of learner rank 0 and one engine, arrive bit for bit; the rendezvous listens on the run's
address only; a version whose headers have not arrived is drained, not applied."""

import time

import torch

from transport.collective import WeightGroups, WeightReceiver
from transport.messages import TensorSpec
from transport.zmq import WeightPublisher, WeightSubscriber, pack_buckets


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("embed", torch.randn(37, 16, generator=g).to(torch.bfloat16)),  # an odd byte count before fp32 ones
            ("norm", torch.randn(16, generator=g)),
            ("layer.weight", torch.randn(64, 64, generator=g)),
            ("empty", torch.empty(0, 4)),
            ("steps", torch.arange(5, dtype=torch.int64) + seed)]


def headers(pub: WeightPublisher, sub: WeightSubscriber, version: int, buckets) -> None:
    deadline = time.time() + 5
    while time.time() < deadline:  # PUB/SUB: resend until the subscription is live
        pub.publish(version, buckets, inline=False)
        if sub.poll(200) == (version, None):
            return
    raise AssertionError(f"headers of v{version} never arrived")


def listening_addresses(port: int) -> set[str]:
    addresses = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, local_port = local.split(":")
        if int(local_port, 16) == port and state == "0A":  # LISTEN
            addresses.add(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return addresses


def test_a_version_pulled_over_the_group_is_the_published_one_bit_for_bit():
    groups = WeightGroups("127.0.0.1", "cpu")
    assert listening_addresses(groups.port) == {"127.0.0.1"}  # not every interface
    ticket = groups.open(actor=0, incarnation=0, workers=1)
    assert ticket.backend == "gloo" and ticket.size == 2 and groups.secret in ticket.prefix
    receiver = WeightReceiver(ticket, rank=1)
    pub = WeightPublisher("127.0.0.1")
    sub = WeightSubscriber(pub.endpoint)
    try:
        for version in (1, 2):
            sent = weights(version)
            buckets = pack_buckets(iter(sent), bucket_bytes=4096)
            assert len(buckets) > 1
            groups.offer(version, buckets)
            headers(pub, sub, version, buckets)
            pulled, tensors = receiver.pull(sub.layouts)
            received = list(tensors)
            assert pulled == version and [n for n, _ in received] == [n for n, _ in sent]
            for (_, a), (_, b) in zip(received, sent):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        timed, deadline = [], time.monotonic() + 30  # the sender records a transfer once its last broadcast returns,
        while len(timed) < 2 and time.monotonic() < deadline:  # which can be after the receiver's has
            timed += groups.take_seconds()
            time.sleep(0.01)
        assert len(timed) == 2

        groups.offer(3, pack_buckets(iter(weights(3)), bucket_bytes=4096))  # its headers not sent yet
        assert receiver.pull(sub.layouts) == (3, None)  # drained: nothing to apply
        assert receiver.pull(sub.layouts)[1] is None  # and again, until the headers come
    finally:
        groups.close()
        pub.close()
        sub.close()


def test_a_replacement_engine_gets_a_group_of_its_own():
    groups = WeightGroups("127.0.0.1", "cpu")
    first = groups.open(actor=0, incarnation=0, workers=1)
    WeightReceiver(first, rank=1)
    second = groups.open(actor=0, incarnation=1, workers=1)  # the first engine died: its group is closed
    assert second.prefix != first.prefix
    receiver = WeightReceiver(second, rank=1)
    sent = weights(7)
    buckets = pack_buckets(iter(sent), bucket_bytes=1 << 20)
    groups.offer(7, buckets)
    layout = {7: [[TensorSpec(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in b]
                  for b in buckets]}
    version, tensors = receiver.pull(layout)
    assert version == 7 and all(torch.equal(a, b) for (_, a), (_, b) in zip(tensors, sent))
    groups.close()


def test_headers_without_bytes_are_only_for_the_policy():
    pub = WeightPublisher("127.0.0.1")
    sub = WeightSubscriber(pub.endpoint)
    buckets = pack_buckets(iter(weights(1)), bucket_bytes=1 << 20)
    deadline = time.time() + 5
    while sub.dropped == 0 and time.time() < deadline:
        pub.publish(1, buckets, model="draft", inline=False)  # a draft LM's bytes only ever come inline
        sub.poll(200)
    assert sub.dropped >= 1 and sub.take_draft() is None
    pub.close()
    sub.close()
