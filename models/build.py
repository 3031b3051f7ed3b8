"""Builds the built-in models (`python -m models` runs it through `models.zoo.build`, cached by recipe key).

Tokenizer first (trained on task text), then each model SFT-trained on worked solutions from the
arithmetic task under the recipe's data seed, saved as safetensors with the tokenizer beside it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import transformers

from models.recipe import ArchSpec, Recipe, SftSpec
from models.sft import train
from models.tokenizer import train_tokenizer
from tasks.arithmetic import ArithmeticTask
from tasks.base import format_completion


def make_model(arch: ArchSpec, vocab_size: int, eos_id: int, max_position: int) -> transformers.PreTrainedModel:
    common = dict(
        vocab_size=vocab_size, hidden_size=arch.hidden, num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads, num_key_value_heads=arch.kv_heads, head_dim=arch.head_dim,
        intermediate_size=arch.intermediate, max_position_embeddings=max_position, tie_word_embeddings=True,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, torch_dtype="float32",
    )
    if arch.experts:
        config = transformers.Qwen3MoeConfig(
            **common, num_experts=arch.experts, num_experts_per_tok=arch.experts_per_token,
            moe_intermediate_size=arch.expert_intermediate, decoder_sparse_step=1, mlp_only_layers=[],
            norm_topk_prob=True, output_router_logits=False,
        )
        return transformers.Qwen3MoeForCausalLM(config)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))


def build_all(recipe: Recipe, out: Path, log=print) -> dict:
    torch.set_num_threads(os.cpu_count() or 1)
    task = ArithmeticTask(seed=recipe.data_seed, max_ops=recipe.max_ops, max_operand=recipe.max_operand,
                          wording=recipe.wording)
    corpus = [p.prompt + format_completion(p.solution) for p in (task[i] for i in range(4000))]
    tokenizer = train_tokenizer(corpus, recipe.vocab_size)
    report: dict = {"recipe": json.loads(json.dumps(recipe.__dict__, default=lambda o: o.__dict__)),
                    "key": recipe.key(), "models": {}}
    plan: list[tuple[str, ArchSpec | None, SftSpec]] = [
        ("dense", recipe.dense, recipe.policy_sft),
        ("moe", recipe.moe, recipe.policy_sft),
        ("draft", recipe.draft, recipe.draft_sft),
    ]
    for name, arch, sft in plan:
        if arch is None:  # not in this recipe
            continue
        torch.manual_seed(sft.seed)
        model = make_model(arch, len(tokenizer), tokenizer.eos_token_id, recipe.max_position)
        params = sum(p.numel() for p in model.parameters())
        log(f"SFT {name}: {type(model).__name__}, {params:,} parameters, {sft.steps} steps")
        start = time.time()
        losses = train(model, tokenizer, task, sft, log)
        model.save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
        report["models"][name] = {
            "architecture": type(model).__name__, "parameters": params,
            "sft_seconds": round(time.time() - start, 1),
            "loss_first": round(losses[0], 4), "loss_last": round(sum(losses[-20:]) / len(losses[-20:]), 4),
        }
    return report
