"""GRPO-family losses: group-normalised advantages and a clipped ratio against behaviour logprobs, over
trajectories packed as the model reads them (`Packed`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from configs.schema import LossAggregation
from sampling.coupled import processed_logprobs
from transport.messages import Trajectory


class Packed:
    """A micro-batch of trajectories as tensors: `ids`/`attention` [B, W] (prompt + response, right-padded);
    per response token [B, T]: `targets` (its id), `behaviour` (its rollout logprob), `mask` (1 on real tokens),
    and `index`, the position whose logits predict it (prompt length + j - 1)."""

    def __init__(self, batch: list[Trajectory]):
        width = max(len(t.prompt_ids) + len(t.response_ids) for t in batch)
        resp_width = max(len(t.response_ids) for t in batch)
        self.ids = torch.zeros(len(batch), width, dtype=torch.long)
        self.attention = torch.zeros(len(batch), width, dtype=torch.long)
        self.targets = torch.zeros(len(batch), resp_width, dtype=torch.long)
        self.behaviour = torch.zeros(len(batch), resp_width)
        self.mask = torch.zeros(len(batch), resp_width)
        for row, t in enumerate(batch):
            seq = t.prompt_ids + t.response_ids
            self.ids[row, : len(seq)] = torch.tensor(seq)
            self.attention[row, : len(seq)] = 1
            self.targets[row, : len(t.response_ids)] = torch.tensor(t.response_ids)
            self.behaviour[row, : len(t.response_ids)] = torch.tensor(t.behaviour_logprobs)
            self.mask[row, : len(t.response_ids)] = 1
        self.index = torch.stack([torch.arange(resp_width) + len(t.prompt_ids) - 1 for t in batch]).clamp(max=width - 1)


def group_advantages(rewards: torch.Tensor, normalize_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """`rewards` is [groups, group_size]; each reward minus its group's mean, over the group's std if asked. A group
    whose rewards are all equal gets exactly 0: its float mean can miss them by a rounding error, which a std near 0
    would blow up into an advantage of noise (length-penalised rewards of equal length did)."""
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    centered = torch.where((rewards == rewards[:, :1]).all(dim=1, keepdim=True), 0.0, centered)
    return centered / (rewards.std(dim=1, keepdim=True) + eps) if normalize_std else centered


def step_rows(lengths: list[int], live: list[int], rank: int, world: int, micro: int) -> list[list[int]]:
    """Rank `rank`'s micro-batches (row indices) of a step whose trajectories have `lengths`, over its `live` rows
    (those whose loss has a gradient): sorted by length and dealt round-robin to the `world` ranks, which balances
    their tokens, then cut into batches of up to `micro` similar lengths, which pad little. Every rank gets as many
    micro-batches as the busiest one, at least one, so their collectives stay in step; a rank with fewer rows gets
    empty ones at the end (a pass with a zero loss)."""
    ordered = sorted(live, key=lambda i: lengths[i])
    mine = ordered[rank::world]
    count = max(1, math.ceil(math.ceil(len(ordered) / world) / micro))
    return [mine[j * micro : (j + 1) * micro] for j in range(count)]


@dataclass
class StepRows:
    """A step's rows as one rank trains them (indices into `trajectories`): `micro_batches` have a gradient (one
    optimizer step over all of them), `taught` are forwarded only, for the draft LM's distiller, and `shortest` is
    what a rank with no rows left forwards to stay in step with the others."""

    trajectories: list[Trajectory]
    rewards: torch.Tensor  # [groups, group_size]
    advantages: torch.Tensor  # [rows]
    micro_batches: list[list[int]]
    taught: list[list[int]]
    shortest: list[Trajectory]


def plan_step(groups: list[list[Trajectory]], algo: DictConfig, rank: int, world: int, micro: int,
              teach: bool) -> StepRows:
    """Group-normalised advantages and rank `rank`'s rows of the step. A row whose advantage is exactly 0 (a group
    whose rewards are all equal) adds nothing to the gradient without a KL term: it gets no backward pass, and is
    forwarded (`taught`) only when the distiller learns from the step (`teach`)."""
    trajectories = [t for g in groups for t in g]
    rewards = torch.tensor([[t.reward for t in g] for g in groups])
    advantages = group_advantages(rewards, algo.normalize_advantage_std).flatten()
    live = [i for i, a in enumerate(advantages.tolist()) if algo.kl_coef > 0 or a != 0.0]
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
    rest = sorted(set(range(len(trajectories))) - set(live))
    return StepRows(trajectories, rewards, advantages, step_rows(lengths, live, rank, world, micro),
                    step_rows(lengths, rest, rank, world, micro) if rest and teach else [],
                    [trajectories[lengths.index(min(lengths))]])


LOG_RATIO_MAX = 20.0  # a ratio above e^20 is clipped for a positive advantage, and otherwise overflows no float32


def policy_loss(
    logprobs: torch.Tensor,  # [B, T] current policy, response tokens
    behaviour: torch.Tensor,  # [B, T] logprobs recorded at rollout
    advantages: torch.Tensor,  # [B]
    mask: torch.Tensor,  # [B, T] 1 on response tokens
    clip_low: float,
    clip_high: float,
    aggregation: LossAggregation,
    max_tokens: int,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    dual_clip: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    # a token outside the current top-k/top-p set has logprob -inf: a zero ratio with a zero gradient, never NaN.
    # With max_staleness > 0 that happens: the behaviour policy's top-p set held the token, the current one's not
    outside = torch.isneginf(logprobs.detach())
    logprobs = logprobs.clamp(min=-1e4)
    ratio = torch.exp((logprobs - behaviour).clamp(max=LOG_RATIO_MAX))  # finite in float32, whatever was sent
    adv = advantages.unsqueeze(1)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    # dual clip: with a negative advantage the clip above leaves the ratio whole, so one token whose behaviour
    # logprob is far below the policy's (stale, or sent so) would outweigh the batch; its loss stops at dual_clip x |A|
    capped = (adv < 0) & (per_token > -dual_clip * adv) if dual_clip > 0 else torch.zeros_like(per_token, dtype=bool)
    per_token = torch.where(capped, -dual_clip * adv, per_token)
    mask = mask.float()
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None and kl_coef > 0:
        log_r = ref_logprobs.clamp(min=-1e4) - logprobs
        kl = torch.exp(log_r) - log_r - 1  # k3 estimator of KL(pi || ref), >= 0
        per_token = per_token + kl_coef * kl
    if aggregation == LossAggregation.token_mean:
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
    elif aggregation == LossAggregation.seq_mean_token_mean:
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    else:  # Dr.GRPO: a constant normaliser, no length bias
        loss = ((per_token * mask).sum(1) / max_tokens).mean()
    with torch.no_grad():
        clipped = ((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).float()
        tokens = mask.sum().clamp(min=1)
        on = mask > 0
        stats = {"clip_fraction": ((clipped * mask).sum() / tokens).item(),
                 "dual_clip_fraction": ((capped.float() * mask).sum() / tokens).item(),
                 "ratio_max": ratio[on].max().item(), "ratio_min": ratio[on].min().item(),
                 "kl": ((kl * mask).sum() / tokens).item(),
                 "outside_mask_fraction": ((outside * mask).sum() / tokens).item()}
    return loss, stats


def response_logprobs(model, packed: Packed, rollout: DictConfig) -> torch.Tensor:
    """[B, T, vocab]: `model`'s distribution at each response token of `packed`, processed as the actor sampled it
    (`rollout`'s temperature, top-k and top-p)."""
    logits = model(input_ids=packed.ids, attention_mask=packed.attention).logits
    rows = logits.gather(1, packed.index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    return processed_logprobs(rows, rollout.temperature, rollout.top_k, rollout.top_p)


# the stats a step sums over micro-batches
SUMMED = ("clip_fraction", "dual_clip_fraction", "entropy", "kl", "outside_mask_fraction")


def micro_batch_loss(policy, reference, packed: Packed, advantages: torch.Tensor,
                     cfg: DictConfig) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """One micro-batch's loss under `cfg` (`reference`: the frozen policy of the KL term, or None), its statistics,
    and the policy's full distributions [B, T, vocab] (what the draft LM's distiller learns from)."""
    full = response_logprobs(policy, packed, cfg.rollout)
    logprobs = full.gather(-1, packed.targets.unsqueeze(-1)).squeeze(-1)
    ref = None
    if reference is not None:
        with torch.no_grad():
            ref = response_logprobs(reference, packed, cfg.rollout).gather(-1, packed.targets.unsqueeze(-1)).squeeze(-1)
    algo = cfg.algorithm
    # deterministic runs (max_staleness 0): the tokens were sampled under exactly these weights, so the policy's
    # own logprobs are the behaviour logprobs, and the engine's (whose last bits depend on its batch) are unused
    behaviour = logprobs.detach() if cfg.trainer.deterministic else packed.behaviour
    loss, stats = policy_loss(logprobs, behaviour, advantages, packed.mask, algo.clip_low, algo.clip_high,
                              algo.loss_aggregation, cfg.rollout.max_tokens, ref, algo.kl_coef, algo.dual_clip)
    with torch.no_grad():  # mean entropy of the sampled distribution over the trained tokens
        entropy = torch.special.entr(full.detach().exp()).sum(-1)
        stats["entropy"] = ((entropy * packed.mask).sum() / packed.mask.sum().clamp(min=1)).item()
    return loss, stats, full
