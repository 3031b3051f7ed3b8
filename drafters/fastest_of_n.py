"""Fastest-of-N: several drafters, and per request the one expected to commit the most tokens per second.

Every step each member drafter proposes for every request (members are batched or cheap, and the choice needs
their proposals), and each request gets the proposal of the member with the best score. Scores come from full
information, not a bandit's guess: the coupled sampler commits exactly the target's tokens whoever drafted, so
after a verify step every member's last proposal is scored on the committed tokens (the length of its agreement
with them; a proposal that agreed with all of them is scored by that many, a lower bound). A request's score per
member is an exponential average of those counts, starting from the member's average over every request; a
member's cost per request-step (measured) is charged against the engine step time (the interval between
proposals), so an expensive member must accept more to win. No choice can change a trajectory; a bad one only
costs speed.
"""

from __future__ import annotations

import time

from drafters.base import Drafter, DraftRequest, load_drafter


def agreement(proposal: list[int], committed: list[int]) -> int:
    n = 0
    for a, b in zip(proposal, committed):
        if a != b:
            break
        n += 1
    return n


class FastestOfN(Drafter):
    def __init__(self, drafters: list[str], options: dict | None = None, decay: float = 0.5):
        """`drafters`: member names (built-in, dotted path or entry point); `options`: per member name, the keyword
        arguments of its constructor."""
        if len(drafters) < 2 or len(set(drafters)) != len(drafters):
            raise ValueError(f"FastestOfN: needs two or more distinct drafters, got {drafters!r}")
        options = options or {}
        unknown = set(options) - set(drafters)
        if unknown:
            raise ValueError(f"FastestOfN: options for {sorted(unknown)}, which are not among drafters {drafters}")
        self.names = list(drafters)
        self.members = [load_drafter(name, dict(options.get(name, {}))) for name in self.names]
        self.decay = decay
        self.average = [1.0] * len(self.members)  # per member: average agreement over every request (prior)
        self.cost = [0.0] * len(self.members)  # per member: seconds per request-step
        self.step_seconds = 0.0  # the engine's seconds between two proposals
        self.last_end: float | None = None
        self.scores: dict[str, list[float]] = {}
        self.last: dict[str, list[list[int]]] = {}  # per request: each member's last proposal
        self.choices: list[str] = []  # the member that drafted each request of the last proposal

    def propose(self, requests: list[DraftRequest], k: int) -> list[list[int]]:
        if self.last_end is not None:
            self.step_seconds = 0.8 * self.step_seconds + 0.2 * (time.perf_counter() - self.last_end)
        proposals = []
        for m, member in enumerate(self.members):
            start = time.perf_counter()
            proposals.append(member.propose(requests, k) if requests else [])
            if requests:
                spent = (time.perf_counter() - start) / len(requests)
                self.cost[m] = spent if self.cost[m] == 0 else 0.8 * self.cost[m] + 0.2 * spent
        out, self.choices = [], []
        for i, request in enumerate(requests):
            mine = [list(p[i]) for p in proposals]
            self.last[request.request_id] = mine
            best = max(range(len(self.members)), key=lambda m: self._value(request.request_id, m, mine[m]))
            self.choices.append(self.names[best])
            out.append(mine[best])
        self.last_end = time.perf_counter()
        return out

    def sources(self) -> list[str]:
        return self.choices

    def _value(self, request_id: str, m: int, proposal: list[int]) -> float:
        """Expected committed tokens per second of member `m`'s proposal for this request."""
        score = self.scores.get(request_id, self.average)[m]
        expected = 1.0 + min(score, len(proposal))
        return expected / (self.step_seconds + self.cost[m] + 1e-9)

    def commit(self, request_id: str, committed: list[int]) -> None:
        for member in self.members:
            member.commit(request_id, committed)
        last = self.last.pop(request_id, None)
        if last is None:
            return
        scores = self.scores.setdefault(request_id, list(self.average))
        for m, proposal in enumerate(last):
            agreed = agreement(proposal, committed)
            scores[m] = self.decay * scores[m] + (1 - self.decay) * agreed
            self.average[m] = 0.98 * self.average[m] + 0.02 * agreed

    def remove(self, request_id: str) -> None:
        for member in self.members:
            member.remove(request_id)
        self.scores.pop(request_id, None)
        self.last.pop(request_id, None)
