"""Fastest-of-N: several drafters, and per request the one whose proposal is expected to commit the most tokens.

Every step each member drafter proposes for every request (members are batched or cheap, and the choice needs
their proposals), and each request gets the proposal of the member with the best score. Scores come from full
information, not a bandit's guess: the coupled sampler commits exactly the target's tokens whoever drafted, so
after a verify step every member's last proposal is scored on the committed tokens (the length of its agreement
with them; a proposal that agreed with all of them is scored by that many, a lower bound). A request's score per
member is an exponential average of those counts, starting from the member's average over every request; the
proposal chosen is the one with the most expected accepted tokens. Every member's drafting cost is paid whichever
is chosen, so cost does not enter the choice (the draft planner charges the step's whole drafting cost when it
decides how many tokens to draft). No choice can change a trajectory; a bad one only costs speed.
"""

from __future__ import annotations

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
        self.scores: dict[str, list[float]] = {}
        self.last: dict[str, list[list[int]]] = {}  # per request: each member's last proposal
        self.choices: list[str] = []  # the member that drafted each request of the last proposal

    def propose(self, requests: list[DraftRequest], k: int) -> list[list[int]]:
        proposals = [member.propose(requests, k) if requests else [] for member in self.members]
        out, self.choices = [], []
        for i, request in enumerate(requests):
            mine = [list(p[i]) for p in proposals]
            self.last[request.request_id] = mine
            best = max(range(len(self.members)), key=lambda m: self._value(request.request_id, m, mine[m]))
            self.choices.append(self.names[best])
            out.append(mine[best])
        return out

    def sources(self) -> list[str]:
        return self.choices

    def _value(self, request_id: str, m: int, proposal: list[int]) -> float:
        """Expected accepted tokens of member `m`'s proposal for this request."""
        return min(self.scores.get(request_id, self.average)[m], len(proposal))

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

    def swap_weights(self, weights) -> bool:
        """To every member with weights of its own (the draft LM): true if one took them."""
        return any([member.swap_weights(weights) for member in self.members])

    def remove(self, request_id: str) -> None:
        for member in self.members:
            member.remove(request_id)
        self.scores.pop(request_id, None)
        self.last.pop(request_id, None)
