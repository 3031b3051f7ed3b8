"""The optimizer of the learner's plain fp32 path (no ZeRO, no bf16), where DeepSpeed itself skips nothing."""

from __future__ import annotations

import torch


class FiniteAdamW(torch.optim.AdamW):
    """AdamW that leaves the weights and its state untouched when the gradient is not finite, and says so in
    `overflow`, which DeepSpeed's engine reads to count the step as skipped. DeepSpeed's ZeRO and bf16 optimizers
    skip such steps themselves; its plain fp32 path would write NaN into every weight."""

    overflow = False

    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.overflow = bool(grads) and not torch.isfinite(torch.nn.utils.get_total_norm(grads)).item()
        return None if self.overflow else super().step(closure)
