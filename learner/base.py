"""Contract of `learner/`: what the learner consumes and its bounded-asynchrony rule.

The learner trains on `transport.messages.Trajectory` groups. A trajectory sampled (in part) under policy
version `v` may be trained on at learner version `V` only while `V - v <= max_staleness`, where `v` is the
oldest version among its tokens; older ones are dropped and counted, never trained on and never lost silently.
"""

from __future__ import annotations


def staleness(policy_versions: list[int], learner_version: int) -> int:
    """How many versions behind the learner the oldest token of a trajectory is."""
    return learner_version - min(policy_versions, default=learner_version)


def admissible(policy_versions: list[int], learner_version: int, max_staleness: int) -> bool:
    return staleness(policy_versions, learner_version) <= max_staleness
