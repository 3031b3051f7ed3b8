"""What the drafter bridge (actor/draft_bridge.py) checks of each call into a drafter plugin: that it left torch's
process-wide settings as it found them (`guarded`), that its proposals are integer ids within the vocabulary
(`token_ids_within`) and its confidences numbers, one per draft token (`confidences_for`). A call that fails a check
switches the drafter off; drafts only ever save time, so the engine decodes on without it."""

from __future__ import annotations

import operator
from contextlib import contextmanager

import torch

from drafters.base import Drafter


def _flag(module, name: str):
    return (lambda: getattr(module, name)), (lambda value: setattr(module, name, value))


# The process-wide torch settings a drafter shares with the target it runs beside, each able to change the target's
# logits or kernels: (what it is, how to read it, how to set it back).
SHARED_STATE = [
    ("torch.get_num_threads()", torch.get_num_threads, torch.set_num_threads),
    ("torch.get_default_dtype()", torch.get_default_dtype, torch.set_default_dtype),
    ("torch.are_deterministic_algorithms_enabled()", torch.are_deterministic_algorithms_enabled,
     torch.use_deterministic_algorithms),
    ("torch.get_float32_matmul_precision()", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    ("torch.is_grad_enabled()", torch.is_grad_enabled, torch.set_grad_enabled),
    ("torch.backends.cuda.matmul.allow_tf32", *_flag(torch.backends.cuda.matmul, "allow_tf32")),
    ("torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
     *_flag(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction")),
    ("torch.backends.cudnn.allow_tf32", *_flag(torch.backends.cudnn, "allow_tf32")),
]


@contextmanager
def guarded(drafter: Drafter):
    """Runs a drafter's call and checks that it left torch's process-wide settings (SHARED_STATE) as it found them:
    one it changed is set back at once, and the call raises (the bridge then switches the drafter off)."""
    before = [get() for _, get, _ in SHARED_STATE]
    try:
        yield
    finally:
        changed = []
        for (name, get, put), value in zip(SHARED_STATE, before):
            if get() != value:
                put(value)
                changed.append(name)
    if changed:
        raise RuntimeError(f"drafter {type(drafter).__name__} changed {', '.join(changed)}, which the target shares "
                           "(set back; drafters/base.py: a drafter leaves process-wide state as it found it)")


def confidences_for(values, tokens: int, drafter: str) -> list[float]:
    """A plugin's confidences for a proposal of `tokens` tokens as floats in [0, 1] (NaN counts as 0)."""
    try:
        floats = list(map(float, values[:tokens]))
    except (TypeError, ValueError) as e:
        raise RuntimeError(f"drafter {drafter}: confidences must be numbers, got {values!r}") from e
    if len(floats) < tokens:
        raise RuntimeError(f"drafter {drafter}: {len(floats)} confidences for a proposal of {tokens} tokens "
                           "(drafters/base.py: one per draft token)")
    return [v if 0.0 <= v <= 1.0 else (1.0 if v > 1.0 else 0.0) for v in floats]  # NaN fails every comparison: 0


def token_ids_within(proposal, vocab_size: int) -> list[int] | None:
    """`proposal` as plain ints when every one is an integer id in [0, vocab_size); None otherwise."""
    try:
        ids = list(map(operator.index, proposal))
    except TypeError:
        return None
    return ids if not ids or (min(ids) >= 0 and max(ids) < vocab_size) else None
