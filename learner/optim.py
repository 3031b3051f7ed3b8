"""A learner rank's DeepSpeed engine (the policy, its optimizer and learning-rate schedule) and the frozen reference
policy; the optimizer of the plain fp32 path (no ZeRO, no bf16), where DeepSpeed itself skips nothing."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from configs.schema import Dtype


class FiniteAdamW(torch.optim.AdamW):
    """AdamW that leaves the weights and its state untouched when the gradient is not finite, and says so in
    `overflow`, which DeepSpeed's engine reads to count the step as skipped. DeepSpeed's ZeRO and bf16 optimizers
    skip such steps themselves; its plain fp32 path would write NaN into every weight."""

    overflow = False

    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.overflow = bool(grads) and not torch.isfinite(torch.nn.utils.get_total_norm(grads)).item()
        return None if self.overflow else super().step(closure)


def build_engines(cfg: DictConfig, policy_dir: str, reference_dir: str):
    """In a joined process group: the policy's DeepSpeed engine (AdamW, linear warm-up, gradient clipping, ZeRO stage
    and dtype as `learner` says, a step of rollout.prompts_per_step x group_size rows cut into micro-batches) and,
    with algorithm.kl_coef > 0, the reference policy's engine (no optimizer; sharded and cast like the policy), else
    None."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    learner = cfg.learner
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    ds_config = {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": learner.micro_batch_size,
        "gradient_accumulation_steps": batch // (learner.micro_batch_size * learner.num_ranks),
        "gradient_clipping": learner.grad_clip,
        "zero_optimization": {"stage": learner.zero_stage},
        "bf16": {"enabled": learner.dtype == Dtype.bfloat16},
        "steps_per_print": 1 << 30,
    }
    # DeepSpeed's ZeRO and bf16 optimizers wrap this one and skip a non-finite gradient themselves
    plain_fp32 = learner.zero_stage == 0 and learner.dtype != Dtype.bfloat16
    optimizer = (FiniteAdamW if plain_fp32 else torch.optim.AdamW)(model.parameters(), lr=learner.lr,
                                                              weight_decay=learner.weight_decay)
    warmup = learner.warmup_steps
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule, config=ds_config)
    if cfg.algorithm.kl_coef <= 0:
        return engine, None
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    reference.requires_grad_(False)
    return engine, deepspeed.initialize(model=reference, config=ds_config)[0]
