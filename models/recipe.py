"""The recipe of the built-in models: tokenizer, architectures and SFT settings.

A recipe's `key()` names its cache directory, so a changed recipe builds anew and an unchanged one is reused.
Bump `RECIPE_VERSION` when the build code changes what a recipe produces.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from tasks.arithmetic import ArithmeticTask

RECIPE_VERSION = 1


@dataclass(frozen=True)
class ArchSpec:
    """A Qwen3 (dense) or Qwen3-MoE causal LM. vLLM's CPU attention needs head_dim in {32, 64, 80, 96, 112, 128, ...}."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    head_dim: int = 32
    experts: int = 0  # 0: dense (Qwen3ForCausalLM); > 0: Qwen3MoeForCausalLM
    experts_per_token: int = 2
    expert_intermediate: int = 0


@dataclass(frozen=True)
class SftSpec:
    steps: int
    lr: float
    tokens_per_batch: int = 2048  # padded tokens per optimizer step (batches are bucketed by length)
    warmup_steps: int = 20
    seed: int = 0


@dataclass(frozen=True)
class Recipe:
    data_seed: int = 1_000_003  # SFT data comes from a seed the RL configs do not use
    max_ops: int = ArithmeticTask.max_ops
    max_operand: int = ArithmeticTask.max_operand
    vocab_size: int = 320
    max_position: int = 1024
    dense: ArchSpec = field(default_factory=lambda: ArchSpec(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384))
    moe: ArchSpec | None = field(  # None: no MoE policy in this recipe
        default_factory=lambda: ArchSpec(
            hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384, experts=4, experts_per_token=2,
            expert_intermediate=192,
        )
    )
    draft: ArchSpec = field(default_factory=lambda: ArchSpec(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128))
    # Short on purpose: the policies should solve about half of the easy problems and few hard ones,
    # so GRPO has both signal and room to improve.
    policy_sft: SftSpec = field(default_factory=lambda: SftSpec(steps=1200, lr=3e-3))
    draft_sft: SftSpec = field(default_factory=lambda: SftSpec(steps=1200, lr=3e-3))
    wording: float = 0.0  # the share of worked steps the SFT data writes out in words (ArithmeticTask.wording)

    def key(self) -> str:
        fields = asdict(self)
        if not fields["wording"]:  # added after models were built: at its default it leaves their key as it was
            del fields["wording"]
        text = json.dumps({"version": RECIPE_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


# The `wordy_` built-in models: policy and draft LM SFT-trained on solutions that write half of their steps in
# words, the same questions and architectures. What RL with a length penalty (`algorithm.length_penalty`) changes
# there is how the answers are written, the drift a draft LM frozen at the start cannot follow.
WORDY = Recipe(wording=0.5, moe=None)
