"""What the learner ranks exchange outside DeepSpeed's own gradient all-reduce: rank 0's groups for the step, and the
full weights gathered from every rank's shards (what is published and saved)."""

from __future__ import annotations

import msgspec
import torch

from transport.messages import Trajectory


def broadcast_groups(groups: list[list[Trajectory]], rank: int, device) -> list[list[Trajectory]]:
    """Every rank: rank 0's groups, sent as msgspec bytes in a tensor broadcast (no pickle between ranks: a rank
    unpickling what it is sent would run whatever code the bytes name)."""
    payload = torch.frombuffer(bytearray(msgspec.msgpack.encode(groups)), dtype=torch.uint8) if rank == 0 \
        else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([payload.numel()], device=device)
    torch.distributed.broadcast(size, src=0)
    payload = payload.to(device) if rank == 0 else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    torch.distributed.broadcast(payload, src=0)
    return msgspec.msgpack.decode(payload.cpu().numpy().tobytes(), type=list[list[Trajectory]])


def gather_full_state(engine, rank: int, zero_stage: int, bucket_bytes: int) -> dict[str, torch.Tensor] | None:
    """Every rank: rank 0 gets the full parameters on the CPU in the training dtype, as the in-memory model names
    them; other ranks get None (under ZeRO-3 they take part in gathering them, about `bucket_bytes` at a time, so a
    device holds little more than its own shard)."""
    import deepspeed

    if rank != 0 and zero_stage != 3:
        return None
    chunks: list[list] = [[]]
    size = 0
    for name, p in engine.module.named_parameters():
        if chunks[-1] and size >= bucket_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append((name, p))
        size += getattr(p, "ds_numel", p.numel()) * p.element_size()  # ds_numel: the full size of a shard
    state = {}
    for chunk in chunks:
        with deepspeed.zero.GatheredParameters([p for _, p in chunk], enabled=zero_stage == 3):
            if rank == 0:
                state.update((name, p.detach().to("cpu", copy=True)) for name, p in chunk)
    return state if rank == 0 else None
