"""A step's scalars for TensorBoard: the GRPO step's (rl/*), those its trajectories carry about the rollout that made
them (lengths, truncation, generation time, and speculation: acceptance, the draft planner's choices, a composite
drafter's member shares and each member's token acceptance, the broken-drafter alarm, drafters switched off for
raising), and what the intake and the inbox refused."""

from __future__ import annotations

import logging
from collections import Counter

import torch

from omegaconf import DictConfig

from learner.base import staleness
from learner.grpo import SUMMED, StepRows
from transport.messages import SpecStats, Trajectory, add_labels, total

log = logging.getLogger(__name__)
# a step's drafter (or a composite's member) with at least ALARM_DRAFTED draft tokens (labelled tokens) accepted
# under ALARM_RATE of the time raises spec/alarm: an acceptance length of ~1 (< 1.05 for a drafter), what a draft
# LM's zeroed weights give; a working drafter, drafting only where the planner expects it to pay, stays far above
ALARM_DRAFTED, ALARM_RATE = 100, 0.05
WARNED: set[str] = set()  # drafter failures this process has warned about (SpecStats.drafter_failure)
MAX_WARNED = 64  # past these, a peer's made-up failures are in TensorBoard only (neither the console nor memory)


def step_metrics(rows: StepRows, sums: torch.Tensor, extremes: torch.Tensor, cfg: DictConfig, version: int,
                 skipped_steps: int) -> dict[str, float]:
    """The GRPO step to `version` (rl/*: `sums` and `extremes` as `Learner._descend` all-reduced them) and the
    rollout scalars of its trajectories."""
    loss, *means, batches, grad_norm = sums.tolist()
    metrics = {
        "rl/reward_mean": rows.rewards.mean().item(),
        "rl/zero_advantage_fraction": (rows.advantages == 0).float().mean().item(),  # rows that teach nothing
        "rl/loss": loss,  # the step's objective
        "rl/grad_norm": grad_norm,
        "rl/skipped_steps": float(skipped_steps),  # steps whose gradient was not finite, so not taken
        "rl/staleness_max": max(staleness(t.policy_versions, version - 1) for t in rows.trajectories),
        **rollout_metrics(rows.trajectories, cfg.speculation.method),
    }
    if batches:  # over the rows trained on (none when every group is uniform)
        metrics.update({f"rl/{name}": value / batches for name, value in zip(SUMMED, means)
                        if name != "kl" or cfg.algorithm.kl_coef > 0})
        metrics.update({"rl/ratio_max": extremes[0].item(), "rl/ratio_min": -extremes[1].item()})
    return metrics


def rollout_metrics(trajectories: list[Trajectory], method: str) -> dict[str, float]:
    lengths = torch.tensor([len(t.response_ids) for t in trajectories], dtype=torch.float32)
    spec = total(t.spec for t in trajectories)
    metrics = {
        "rollout/trajectories": float(len(trajectories)),
        "rollout/tokens": lengths.sum().item(),
        "rollout/response_length": lengths.mean().item(),
        "rollout/response_length_max": lengths.max().item(),
        "rollout/response_length_p50": lengths.quantile(0.5).item(),
        "rollout/response_length_p90": lengths.quantile(0.9).item(),
        "rollout/truncated_fraction": sum(t.finish_reason == "length" for t in trajectories) / len(trajectories),
        "rollout/generate_seconds_max": max(t.generate_seconds for t in trajectories),
        # mean -log p of the sampled tokens under the weights that sampled them: a Monte-Carlo estimate of the
        # policy's entropy per token at the rollout's sampling settings, at every step (rl/entropy: trained rows only)
        "rollout/entropy_estimate":
            -sum(lp for t in trajectories for lp in t.behaviour_logprobs) / lengths.sum().item(),
        # tokens emitted per verify step that carried drafts (1 = nothing accepted, or no drafts at all)
        "spec/acceptance_length": spec.acceptance_length(),
        "spec/draft_tokens": float(spec.draft_tokens),
        "spec/accepted_tokens": float(spec.accepted_tokens),
        **planner_metrics(spec),
    }
    for source, n in spec.drafter_choices.items():  # which member of a composite drafter drafted, as shares
        metrics[f"spec/choice/{source.rsplit('.', 1)[-1]}"] = n / sum(spec.drafter_choices.values())
    if method != "none":  # per drafter, so drafters can be compared across runs
        metrics.update(drafter_metrics(method.rsplit(".", 1)[-1], spec, trajectories))
    return metrics


def drafter_metrics(name: str, spec: SpecStats, trajectories: list[Trajectory]) -> dict[str, float]:
    """Drafter `name`'s figures under its own name, each composite member's token acceptance, and the alarm: a
    drafter or member whose drafts are (nearly) all rejected, or one that was switched off for raising."""
    metrics = {f"spec/{name}/acceptance_length": spec.acceptance_length(),
               f"spec/{name}/draft_tokens": float(spec.draft_tokens),
               f"spec/{name}/accepted_tokens": float(spec.accepted_tokens),
               f"spec/{name}/draft_seconds": spec.draft_seconds}
    # a drafter whose drafts are (nearly) all rejected (zeroed weights, another tokenizer) costs time for nothing
    broken = [f"drafter {name}: {spec.accepted_tokens} of this step's {spec.draft_tokens} draft tokens accepted "
              f"(acceptance length {spec.acceptance_length():.3f})"] \
        if spec.draft_tokens >= ALARM_DRAFTED and spec.accepted_tokens < ALARM_RATE * spec.verify_steps else []
    labels: dict[str, list[int]] = {}  # a composite's members, each scored on every proposal it made
    add_labels(labels, {member.rsplit(".", 1)[-1]: pair for member, pair in spec.drafter_labels.items()})
    for member, (yes, no) in sorted(labels.items()):
        if yes + no:  # the chance that one of its draft tokens is accepted, given the ones before it were
            metrics[f"spec/member/{member}/token_acceptance"] = yes / (yes + no)
        if yes + no >= ALARM_DRAFTED and yes < ALARM_RATE * (yes + no):
            broken.append(f"member {member} of drafter {name}: {yes} of {yes + no} labelled draft tokens "
                          "would have been accepted")
    for line in broken:
        log.warning("%s: drafting costs time for nothing (zeroed draft weights? another tokenizer?)", line)
    # an engine whose drafter raised decodes on without it (actor/draft_bridge.py switch_off): same tokens, slower
    failed = Counter(t.spec.drafter_failure for t in trajectories if t.spec.drafter_failure)
    metrics["spec/drafter_failed"] = sum(failed.values()) / len(trajectories)
    for failure, n in sorted(failed.items()):
        if failure not in WARNED and len(WARNED) < MAX_WARNED:  # it lasts the engine's life: said once, then in
            WARNED.add(failure)  # TensorBoard only
            log.warning("%s: %d of this step's %d trajectories were decoded without drafts (from now on "
                        "spec/drafter_failed in TensorBoard)", failure, n, len(trajectories))
    metrics["spec/alarm"] = float(bool(broken or failed))
    return metrics


def planner_metrics(spec: SpecStats) -> dict[str, float]:
    """The draft planner's choices (tokens allowed per request and step, its step-cost error) and, decoupled, how
    often drafts were ready when verification ended and the drafting the engines waited for."""
    metrics = {}
    if spec.planned_steps:
        metrics["spec/planned_tokens"] = spec.planned_tokens / spec.planned_steps
        metrics["spec/planner_cost_error"] = spec.cost_error / spec.planned_steps
    if spec.prepared_steps:
        metrics["spec/prepared_hit_rate"] = spec.prepared_steps / max(spec.verify_steps, 1)
        metrics["spec/critical_draft_seconds"] = spec.draft_seconds
    return metrics


def intake_metrics(summary: dict, inbox_dropped: dict[str, int]) -> dict[str, float]:
    """What the intake (`Intake.summary()`) and the inbox refused or lost so far, cumulative, by reason."""
    metrics = {"rollout/dropped_stale": float(summary["dropped_stale"]),
               "transport/lost_trajectories": float(summary["lost"])}
    if summary["dropped_stale"]:  # against rollout/response_length: what dropping them leaves out of training
        metrics["rollout/dropped_stale_response_length"] = summary["stale_response_tokens"] / summary["dropped_stale"]
    dropped = {**summary["dropped_invalid_by_reason"], **inbox_dropped}
    metrics.update({f"transport/dropped/{reason}": float(n) for reason, n in dropped.items()})
    return metrics
