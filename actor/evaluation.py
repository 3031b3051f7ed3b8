"""Held-out evaluation inside a rollout actor's engine loop: the actor's share of the run's eval set, answered
greedily and at the rollout temperature (fixed seeds, so every evaluation of a run is comparable), under whatever
weights the actor holds while the requests run. Its requests share the engine with training rollouts and never
become trajectories."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from tasks.base import Problem
from tasks.reward import score

EVAL_SEED_BASE = 1 << 40  # the T > 0 answer to held-out problem j samples with seed EVAL_SEED_BASE + j


@dataclass(eq=False)  # identity: one object per evaluation, hashable
class Evaluation:
    tag: int  # the learner step it was asked at
    problems: dict[int, Problem]  # index in the run's eval set -> problem
    pending: set[str] = field(default_factory=set)
    sums: dict[str, float] = field(default_factory=lambda: {"reward": 0.0, "greedy": 0.0, "length": 0.0,
                                                            "answered": 0, "answered_greedy": 0})
    versions: set[int] = field(default_factory=set)
    done: threading.Event = field(default_factory=threading.Event)

    def request_ids(self) -> list[tuple[str, int, bool]]:
        """(request id, eval index, greedy) for every request this evaluation makes."""
        return [(f"eval{self.tag}-{j}-{'g' if greedy else 't'}", j, greedy)
                for j in self.problems for greedy in (False, True)]

    def record(self, request_id: str, text: str, length: int, version: int) -> None:
        _, j, kind = request_id.rsplit("-", 2)
        reward = score(text, self.problems[int(j)].answer).reward
        if kind == "g":
            self.sums["greedy"] += reward
            self.sums["answered_greedy"] += 1
        else:
            self.sums["reward"] += reward
            self.sums["length"] += length
            self.sums["answered"] += 1
        self.versions.add(version)
        self.pending.discard(request_id)
        if not self.pending:
            self.done.set()

    def result(self) -> dict:
        """Sums over the answers this actor gave (all of its share, unless stop() cut it short); the driver adds up
        every actor's and divides by the answered counts."""
        return {**self.sums, "versions": sorted(self.versions)}
