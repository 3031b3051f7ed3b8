"""Contract of `learner/`: what the learner consumes and its bounded-asynchrony rule.

The learner trains on `transport.messages.Trajectory` groups. A trajectory sampled (in part) under policy
version `v` may be trained on at learner version `V` only while `V - v <= max_staleness`, where `v` is the
oldest version among its tokens; older ones are dropped and counted, never trained on and never lost silently.

The learner is `learner.num_ranks` DeepSpeed ranks (`learner.Learner`, placed by `driver/`): rank 0 owns the
trajectory inbox, its bookkeeping (`intake.Intake`) and the weight publisher, collects each step's groups and
broadcasts them; every rank trains on its share and DeepSpeed all-reduces the gradients, so a step over R ranks is
the step one rank would take. With `algorithm.kl_coef > 0` every rank also holds a frozen reference policy (the
run's starting weights, sharded like the policy under ZeRO-3) and the loss adds a k3 KL penalty to it. Without one,
a row whose advantage is exactly 0 (its group's rewards all equal) has no gradient, so it gets no backward pass (and
a forward, once the step's weights went out, only when the distiller learns from the step); the step's loss and
gradient stay those of the whole step, whose normalisers count it (`rl/zero_advantage_fraction` says how many rows
that was).

Checkpoints (their layout, sealing and which one a resume or restart takes) are `learner/checkpoint.py`'s.
"""

from __future__ import annotations


def longer_deadline(cfg) -> float | None:
    """How long a learner rank's start (a multi-GB checkpoint to load, rank 0's distiller to build) or a distiller's
    step (at idle priority) may take before it is taken for hung: the longer of trainer.step_timeout_s and
    rollout.start_timeout_s (None: trainer.step_timeout_s is 0, never)."""
    return max(cfg.trainer.step_timeout_s, cfg.rollout.start_timeout_s) if cfg.trainer.step_timeout_s else None


def staleness(policy_versions: list[int], learner_version: int) -> int:
    """How many versions behind the learner the oldest token of a trajectory is."""
    return learner_version - min(policy_versions, default=learner_version)


def admissible(policy_versions: list[int], learner_version: int, max_staleness: int) -> bool:
    return staleness(policy_versions, learner_version) <= max_staleness
