"""Fastest-of-N: several drafters, and per request the proposal expected to commit the most tokens.

Every step each member drafter proposes for every request (members are batched or cheap, and the choice needs
their proposals), and each request gets the proposal with the most expected accepted tokens. Expectations come from
full information, not a bandit's guess: the coupled sampler commits exactly the target's tokens whoever drafted, so
after a verify step every member's last proposal is labelled token by token on the committed tokens
(drafters/calibration.py), chosen or not. Per member, a calibration table maps a draft token's confidence to its
acceptance rate; a member that reports no confidences is given, per request, its own running acceptance rate on
that request's labels. A proposal's expected accepted tokens is the sum of its tokens' probabilities of being
reached and accepted; the chosen proposal's calibrated rates are this drafter's confidences, so the draft planner
verifies it as far as that pays. Every member's drafting cost is paid whichever is chosen, so cost does not enter
the choice (the draft planner charges the step's whole drafting cost when it decides how many tokens to draft). No
choice can change a trajectory; a bad one only costs speed.
"""

from __future__ import annotations

from drafters.base import Drafter, DraftRequest, load_drafter
from drafters.calibration import Calibration


class FastestOfN(Drafter):
    def __init__(self, drafters: list[str], options: dict | None = None, prior: float = 2.0):
        """`drafters`: member names (built-in, dotted path or entry point); `options`: per member name, the keyword
        arguments of its constructor; `prior`: pseudo-labels of a member's overall rate in a new request's own."""
        self.check_options(dict(drafters=drafters, options=options, prior=prior))
        if len(drafters) < 2 or len(set(drafters)) != len(drafters):
            raise ValueError(f"FastestOfN: needs two or more distinct drafters, got {drafters!r}")
        options = options or {}
        unknown = set(options) - set(drafters)
        if unknown:
            raise ValueError(f"FastestOfN: options for {sorted(unknown)}, which are not among drafters {drafters}")
        self.names = list(drafters)
        self.members = [load_drafter(name, dict(options.get(name, {}))) for name in self.names]
        self.prior = prior
        self.tables = [Calibration() for _ in self.members]
        self.labels: dict[str, list[list[float]]] = {}  # per request and member: [accepted, rejected] labels
        self.overall = [[0.5, 0.5] for _ in self.members]  # per member: the same over every request, forgetting
        self.last: dict[str, list[tuple[list[int], list[float]]]] = {}  # per request: each member's last proposal
        self.choices: list[str] = []  # the member that drafted each request of the last proposal
        self.chosen: list[list[float]] = []  # the chosen proposals' calibrated rates

    def propose(self, requests: list[DraftRequest], k: int) -> list[list[int]]:
        proposals = [(member.propose(requests, k), member.confidences()) if requests else ([], None)
                     for member in self.members]
        out, self.choices, self.chosen = [], [], []
        for i, request in enumerate(requests):
            mine = []
            for m, (drafts, sureness) in enumerate(proposals):
                proposal = list(drafts[i])
                own = sureness[i][: len(proposal)] if sureness is not None else \
                    [self._own_rate(request.request_id, m)] * len(proposal)
                mine.append((proposal, list(own)))
            self.last[request.request_id] = mine
            best = max(range(len(self.members)), key=lambda m: sum(self.tables[m].gains(mine[m][1])))
            self.choices.append(self.names[best])
            self.chosen.append(self.tables[best].rates(mine[best][1]))
            out.append(mine[best][0])
        return out

    def confidences(self) -> list[list[float]]:
        return self.chosen

    def sources(self) -> list[str]:
        return self.choices

    def _own_rate(self, request_id: str, m: int) -> float:
        """Member `m`'s acceptance rate on this request's labels, shrunk towards its rate over every request."""
        accepted, rejected = self.labels[request_id][m] if request_id in self.labels else (0.0, 0.0)
        overall = self.overall[m][0] / max(self.overall[m][0] + self.overall[m][1], 1e-9)
        return (accepted + self.prior * overall) / (accepted + rejected + self.prior)

    def commit(self, request_id: str, committed: list[int]) -> None:
        for member in self.members:
            member.commit(request_id, committed)
        last = self.last.pop(request_id, None)
        if last is None:
            return
        labels = self.labels.setdefault(request_id, [[0.0, 0.0] for _ in self.members])
        for m, (proposal, own) in enumerate(last):
            self.tables[m].observe(own, proposal, committed)
            agreed = agreement(proposal, committed)
            rejected = 1.0 if agreed < min(len(proposal), len(committed)) else 0.0
            labels[m][0], labels[m][1] = labels[m][0] + agreed, labels[m][1] + rejected
            self.overall[m] = [0.99 * self.overall[m][0] + agreed, 0.99 * self.overall[m][1] + rejected]

    def swap_weights(self, weights) -> bool:
        """To every member with weights of its own (the draft LM): true if one took them."""
        return any([member.swap_weights(weights) for member in self.members])

    def remove(self, request_id: str) -> None:
        for member in self.members:
            member.remove(request_id)
        self.labels.pop(request_id, None)
        self.last.pop(request_id, None)


def agreement(proposal: list[int], committed: list[int]) -> int:
    n = 0
    for a, b in zip(proposal, committed):
        if a != b:
            break
        n += 1
    return n
