"""Weight-sync benchmark: how close the weight channel comes to raw ZeroMQ on this machine, and what CURVE costs.

    python -m bench.weight_sync [--mib 256] [--repeats 5] [--out runs/bench/weight_sync.json]

The stored result, read by `launch.py --plan` for a weight sync's time, is bench/results/weight_sync_cpu2.json
(docs/benchmarks.md); copy a new measurement there to replace it.

A subscriber process (as a rollout actor is) receives one weight version of `--mib` MiB (fp32 tensors of a
transformer layer's sizes, in `transport.weight_bucket_mib` buckets) and acknowledges it; the time is from the
first byte sent to the acknowledgement. Systems, every one in every repeat (rotating order), paired with `raw`:
- `raw`: the same frames (an 8-byte header, then the tensors' bytes) over plain PUB/SUB, received and counted,
  nothing decoded: the machine's ZeroMQ bandwidth;
- `raw_curve`: the same over CURVE (authenticated, encrypted);
- `weights`: `transport.zmq.WeightPublisher` -> `WeightSubscriber` (headers decoded and checked, tensors built);
- `weights_curve`: the same behind the run's gate (`transport.auth`), what a run does by default;
- `collective`: `transport.weights: nccl` on this CPU: the headers over `WeightPublisher` (CURVE), the bytes pulled
  over the weight-sync process group (`transport.collective`, gloo here) and viewed as tensors.
The JSON has per-system GB/s medians and each system's bandwidth as a fraction of `raw` (median and 95% interval
of the paired ratio).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import struct
import time
from pathlib import Path

import torch
import zmq

from bench.stats import paired
from transport.auth import ClientKeys, Gate, keypair
from transport.collective import GroupTicket, WeightGroups, WeightReceiver
from transport.zmq import WeightPublisher, WeightSubscriber, pack_buckets

SYSTEMS = ["raw", "raw_curve", "weights", "weights_curve", "collective"]
HEADER = struct.Struct("<iii")  # version, bucket, number of buckets


def model(mib: int) -> list[tuple[str, torch.Tensor]]:
    """fp32 tensors shaped like one 1024-wide layer's (attention 1024x1024, MLP 1024x2816), `mib` MiB in all."""
    shapes = [(1024, 1024)] * 4 + [(2816, 1024)] * 3
    tensors, size, i = [], 0, 0
    while size < mib << 20:
        shape = shapes[i % len(shapes)]
        tensors.append((f"t{i}", torch.randn(shape)))
        size += shape[0] * shape[1] * 4
        i += 1
    return tensors


def subscribe(system: str, endpoint: str, ack_endpoint: str, keys: ClientKeys | None, last: int,
              ticket: GroupTicket | None) -> None:
    """The subscriber process: acknowledges each complete version (0 is the warm-up, sent until acknowledged)
    until it has version `last`."""
    ctx = zmq.Context()
    ack = ctx.socket(zmq.PUSH)
    ack.connect(ack_endpoint)
    if ticket is not None:
        sub, receiver, version = WeightSubscriber(endpoint, ctx, keys), WeightReceiver(ticket, 1), -1
        while version < last:
            if (result := sub.poll(1000)) is not None and result[0] > version:
                pulled, tensors = receiver.pull(sub.layouts)
                if tensors is None:
                    continue
                for _ in tensors:  # every bucket received and viewed as its tensors
                    pass
                version = pulled
                ack.send(HEADER.pack(version, 0, 0))
        sub.close()
    elif system.startswith("weights"):
        sub = WeightSubscriber(endpoint, ctx, keys)
        version = -1
        while version < last:
            if (result := sub.poll(1000)) is not None:
                version = result[0]
                ack.send(HEADER.pack(version, 0, 0))
        sub.close()
    else:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        if keys is not None:
            from transport.auth import dial

            dial(sub, keys)
        sub.connect(endpoint)
        buckets: dict[int, set[int]] = {}
        complete = -1
        while complete < last:
            frames = sub.recv_multipart(copy=False)
            version, bucket, count = HEADER.unpack(frames[0].bytes)
            received = buckets.setdefault(version, set())
            received.add(bucket)
            if len(received) == count:
                ack.send(HEADER.pack(version, 0, 0))
                del buckets[version]
                complete = version
        sub.close()
    ack.close()
    ctx.term()


def measure(system: str, tensors, bucket_mib: int, repeats_here: int) -> list[float]:
    """Seconds per version for `repeats_here` versions sent to a fresh subscriber process."""
    ctx = zmq.Context()
    gate = Gate(keypair(), ctx) if system.endswith("curve") or system == "collective" else None
    keys = None
    if gate is not None:
        keys = ClientKeys(keypair(), gate.keys.public)
        gate.admit("bench", keys.own.public)
    acks = ctx.socket(zmq.PULL)
    ack_endpoint = f"tcp://127.0.0.1:{acks.bind_to_random_port('tcp://127.0.0.1')}"
    buckets = pack_buckets(iter(tensors), bucket_mib << 20)
    groups = ticket = None
    if system == "collective":
        groups = WeightGroups("127.0.0.1", "cpu")
        ticket = groups.open(0, 0, workers=1)
        publisher = WeightPublisher("127.0.0.1", ctx, gate)
        endpoint, socket = publisher.endpoint, publisher.socket

        def send(version, buckets):
            groups.offer(version, buckets)
            publisher.publish(version, buckets, inline=False)
    elif system.startswith("weights"):
        publisher = WeightPublisher("127.0.0.1", ctx, gate)
        send = publisher.publish
        endpoint, socket = publisher.endpoint, publisher.socket
    else:
        socket = ctx.socket(zmq.PUB)
        socket.setsockopt(zmq.SNDHWM, 0)
        if gate is not None:
            gate.serve(socket)
        endpoint = f"tcp://127.0.0.1:{socket.bind_to_random_port('tcp://127.0.0.1')}"
        frames = [[t.view(torch.uint8).reshape(-1).numpy() for _, t in bucket] for bucket in buckets]

        def send(version, _):
            for index, bucket in enumerate(frames):
                socket.send_multipart([HEADER.pack(version, index, len(frames)), *bucket], copy=False)
    process = mp.get_context("spawn").Process(target=subscribe, args=(system, endpoint, ack_endpoint, keys,
                                                                      repeats_here, ticket))
    process.start()
    while not acks.poll(200):  # warm-up: PUB/SUB drops what is sent before the subscription is live
        if system.startswith("weights") or groups is not None:
            send(0, [buckets[0][:1]])
        else:
            socket.send_multipart([HEADER.pack(0, 0, 1), b"x"])
    seconds = []
    for version in range(1, repeats_here + 1):
        start = time.perf_counter()
        send(version, buckets)
        while HEADER.unpack(acks.recv())[0] != version:  # acknowledgements of repeated warm-ups come first
            pass
        seconds.append(time.perf_counter() - start)
    process.join(30)
    socket.close(0)
    acks.close(0)
    if gate is not None:
        gate.close()
    if groups is not None:
        groups.close()
    ctx.term()
    return seconds


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="weight bytes per version, MiB (>= 100 MB is asked)")
    parser.add_argument("--bucket-mib", type=int, default=32, help="as transport.weight_bucket_mib")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/weight_sync.json"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    tensors = model(args.mib)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    seconds: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    for repeat in range(args.repeats):
        order = SYSTEMS[repeat % len(SYSTEMS):] + SYSTEMS[: repeat % len(SYSTEMS)]
        for system in order:
            seconds[system] += measure(system, tensors, args.bucket_mib, 1)
        print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(f"{s} {nbytes / seconds[s][-1] / 1e9:.2f} GB/s"
                                                                  for s in SYSTEMS), flush=True)
    result = {
        "config": {"bytes": nbytes, "tensors": len(tensors), "bucket_mib": args.bucket_mib, "repeats": args.repeats,
                   "torch_threads": torch.get_num_threads()},
        "systems": {s: {"seconds": [round(x, 4) for x in seconds[s]],
                        "gb_per_s": round(nbytes / statistics.median(seconds[s]) / 1e9, 3),
                        # bandwidth relative to raw: raw's seconds over the system's, paired per repeat
                        "of_raw": paired(seconds["raw"], seconds[s])} for s in SYSTEMS},
    }
    result["curve_cost"] = paired(seconds["weights"], seconds["weights_curve"])  # < 1: CURVE's slowdown
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for s in SYSTEMS:
        print(f"{s:14s} {result['systems'][s]['gb_per_s']:6.2f} GB/s  of raw {result['systems'][s]['of_raw']}")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
