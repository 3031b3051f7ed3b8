"""Supervised fine-tuning of a causal LM on worked solutions (loss on the completion tokens only)."""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Iterator

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from models.recipe import SftSpec
from tasks.base import Dataset, format_completion

Example = tuple[list[int], int]  # (prompt + completion + eos token ids, prompt length)


def encode(tokenizer: PreTrainedTokenizerFast, prompts: list[str], completions: list[str]) -> list[Example]:
    """Prompt and completion are tokenized apart, exactly as a rollout sees them (prompt in, completion out)."""
    p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    return [(p + c + [tokenizer.eos_token_id], len(p)) for p, c in zip(p_ids, c_ids)]


def batches(dataset: Dataset, tokenizer: PreTrainedTokenizerFast, tokens_per_batch: int, seed: int,
            chunk: int = 1024) -> Iterator[list[Example]]:
    """Endless batches of examples with similar lengths, each at most `tokens_per_batch` tokens once padded."""
    rng = random.Random(seed)
    for c in itertools.count():
        problems = [dataset[c * chunk + i] for i in range(chunk)]
        examples = sorted(encode(tokenizer, [p.prompt for p in problems],
                                 [format_completion(p.solution) for p in problems]), key=lambda e: len(e[0]))
        group: list[Example] = []
        out = []
        for ex in examples:
            if group and len(ex[0]) * (len(group) + 1) > tokens_per_batch:
                out.append(group)
                group = []
            group.append(ex)
        out.append(group)
        rng.shuffle(out)
        yield from out


def collate(batch: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, prompt_len) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
        mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def train(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, dataset: Dataset, spec: SftSpec,
          log: Callable[[str], None] = print) -> list[float]:
    """Trains `model` in place; returns the loss of every step."""
    torch.manual_seed(spec.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01, betas=(0.9, 0.98))

    def lr_scale(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_scale)
    losses, start = [], time.time()
    for step, batch in zip(range(spec.steps), batches(dataset, tokenizer, spec.tokens_per_batch, spec.seed)):
        loss = model(**collate(batch, tokenizer.pad_token_id)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == spec.steps - 1:
            log(f"  step {step:4d}/{spec.steps}  loss {loss.item():.4f}  {time.time() - start:.0f}s")
    model.eval()
    return losses
