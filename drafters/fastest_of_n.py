"""Fastest-of-N: several drafters, and per request the proposal expected to commit the most tokens.

Members are asked in order of their measured drafting seconds per request, cheapest first, and a member is asked
for a request only while the best proposal so far is expected to commit fewer tokens than that member is expected
to: a history drafter sure of a long path spares the request a draft model's sequential forwards, and a request the
cheap members have nothing for gets every member. Expectations come from full information, not a bandit's guess:
the coupled sampler commits exactly the target's tokens whoever drafted, so after a verify step every proposal
that was made is labelled token by token on the committed tokens (drafters/calibration.py), chosen or not. Per
member, a calibration table maps a draft token's confidence to its acceptance rate; a member that reports no
confidences is given, per request, its own running acceptance rate on that request's labels (shrunk towards its rate
on the prompt's other requests, the group's siblings and earlier epochs' samples). A proposal's expected
accepted tokens is the sum of its tokens' probabilities of being reached and accepted; a member not yet asked is
expected to give that of its running rate on the request (shrunk towards the prompt's, then every request's) for each
token it may draft. The chosen proposal's calibrated rates are this drafter's confidences, so the draft planner
verifies it as far as that pays. No choice can change a trajectory; a bad one only costs speed. The same labels,
summed per member (`member_labels`), are each member's token acceptance in TensorBoard, so a member that has gone
bad (a draft LM's zeroed weights) shows, and raises `spec/alarm`, even while the others are chosen instead. A
member that raises or answers out of contract is switched off and the others race on (`failures()` says so, for the
same alarm); once every member is off, the composite raises and the engine switches it off (actor/draft_bridge.py).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from itertools import islice
from typing import Any

from drafters.base import CompositeDrafter, Drafter, DraftRequest, described, load_drafter, prepares_ahead
from drafters.calibration import Calibration

MAX_PROMPTS = 4096  # prompts whose members' labels are kept (the least recently labelled forgotten first)
log = logging.getLogger(__name__)


class FastestOfN(CompositeDrafter):
    def __init__(self, drafters: list[str], options: dict | None = None, prior: float = 2.0, device: str = "cpu"):
        """`drafters`: member names (built-in, dotted path or entry point); `options`: per member name, the keyword
        arguments of its constructor; `prior`: pseudo-labels of a member's overall rate in a new request's own;
        `device`: where members that take one put their tensors (the engine's, when the engine builds it)."""
        self.check_options(dict(drafters=drafters, options=options, prior=prior, device=device))
        if len(drafters) < 2 or len(set(drafters)) != len(drafters):
            raise ValueError(f"FastestOfN: needs two or more distinct drafters, got {drafters!r}")
        options = options or {}
        unknown = set(options) - set(drafters)
        if unknown:
            raise ValueError(f"FastestOfN: options for {sorted(unknown)}, which are not among drafters {drafters}")
        self.names = list(drafters)
        self.members = [load_drafter(name, dict(options.get(name, {})), device) for name in self.names]
        self.prior = prior
        self.tables = [Calibration() for _ in self.members]
        self.labels: dict[str, list[list[float]]] = {}  # per request and member: [accepted, rejected] labels
        self.prompt_of: dict[str, tuple[int, ...]] = {}  # per request: its prompt
        # per prompt and member: the same over all of its requests, the group's siblings and earlier epochs' samples
        self.by_prompt: OrderedDict[tuple[int, ...], list[list[float]]] = OrderedDict()
        self.overall = [[0.5, 0.5] for _ in self.members]  # per member: the same over every request, forgetting
        self.last: dict[str, dict[int, tuple[list[int], list[float]]]] = {}  # per request: members' last proposals
        # per request: the drafts its last `propose_ahead` assumed accepted, and members' proposals made after them
        self.ahead: dict[str, tuple[tuple[int, ...], dict[int, tuple[list[int], list[float]]]]] = {}
        self.choices: list[str] = []  # the member that drafted each request of the last proposal
        self.chosen: list[list[float]] = []  # the chosen proposals' calibrated rates
        self.seconds = [0.0 for _ in self.members]  # per member: drafting seconds per request asked, averaged
        self.unreported: dict[str, dict[str, tuple[int, int]]] = {}  # labels since the last `member_labels()` call
        self.off: dict[int, str] = {}  # members switched off for raising: why

    def propose(self, requests: list[DraftRequest], k: int) -> list[list[int]]:
        mine, best = self._race(requests, k, lambda member, asked: member.propose(asked, k), self.members)
        for request, proposals in zip(requests, mine):
            self.last[request.request_id] = proposals
        return self._chosen(mine, best)

    def propose_ahead(self, requests: list[DraftRequest], k: int) -> list[list[int]]:
        """The same race among the members that prepare ahead (the others sit it out: a request only they would
        draft gets no prepared drafts). Every member's proposal is held until the verifier commits: if the drafts
        being verified are all accepted, its first token (its guess) is labelled on the target's token, and if that
        is the target's, the rest is labelled on the next commit as a proposal of that step, taken or not."""
        ready = [member if prepares_ahead(member) else None for member in self.members]
        mine, best = self._race(requests, k, lambda member, asked: member.propose_ahead(asked, k), ready)
        for request, proposals in zip(requests, mine):
            tail = tuple(int(t) for t in request.token_ids[len(request.token_ids) - request.unverified:])
            self.ahead[request.request_id] = (tail, proposals)
        return self._chosen(mine, best)

    def _chosen(self, mine: list[dict[int, tuple[list[int], list[float]]]], best: list[int]) -> list[list[int]]:
        """Per request, the proposal of the member `_race` chose ([] where none answered), that member's name
        (`sources`) and its calibrated rates (`confidences`)."""
        self.choices = [self.names[m] if m >= 0 else "" for m in best]
        self.chosen = [self.tables[m].rates(proposals[m][1]) if m >= 0 else [] for proposals, m in zip(mine, best)]
        return [proposals[m][0] if m >= 0 else [] for proposals, m in zip(mine, best)]

    def _race(self, requests: list[DraftRequest], k: int, ask: Callable[[Drafter, list[DraftRequest]], Any],
              members: list[Drafter | None]) -> tuple[list[dict[int, tuple[list[int], list[float]]]], list[int]]:
        """Asks the `members` (None: sits out) cheapest first, each for the requests it may still win: per request,
        every answering member's proposal with its confidences, and the member expected to commit the most tokens
        (-1: none answered)."""
        mine: list[dict[int, tuple[list[int], list[float]]]] = [{} for _ in requests]  # per request: member -> proposal
        best = [(0.0, -1) for _ in requests]  # per request: the best expected accepted tokens so far, and its member
        budgets = [r.budget(k) for r in requests]
        for r in requests:
            if r.request_id not in self.prompt_of:
                self.prompt_of[r.request_id] = tuple(r.token_ids[: len(r.token_ids) - r.position])
        for m in sorted(range(len(self.members)), key=self.seconds.__getitem__):
            asked = [i for i, r in enumerate(requests) if members[m] is not None and m not in self.off
                     and (best[i][1] < 0 or best[i][0] < self._expected(m, r, budgets[i]))]
            if not asked:
                continue
            start = time.perf_counter()
            answer = self._call(m, lambda member: ask(member, [requests[i] for i in asked]))
            confidences = self._call(m, lambda member: member.confidences()) if answer is not None else None
            if answer is None or m in self.off:
                continue
            per_request = (time.perf_counter() - start) / len(asked)
            self.seconds[m] = per_request if self.seconds[m] == 0 else 0.9 * self.seconds[m] + 0.1 * per_request
            try:
                proposals = self._answers(requests, asked, budgets, answer, confidences, m)
            except (TypeError, ValueError) as e:  # out of contract: as if it had raised
                self._switch_off(m, e)
                continue
            for i, proposal, own in proposals:
                mine[i][m] = (proposal, own)
                gain = sum(self.tables[m].gains(own))
                if best[i][1] < 0 or gain > best[i][0]:
                    best[i] = (gain, m)
        return mine, [m for _, m in best]

    def _answers(self, requests: list[DraftRequest], asked: list[int], budgets: list[int], drafts, confidences,
                 m: int) -> list[tuple[int, list[int], list[float]]]:
        """Member `m`'s proposals for the requests `asked` (indices into `requests`), each read as far as its request's
        budget, with its confidence in each token (or its running rate on the request); ValueError or TypeError where
        they break the drafter contract."""
        if len(drafts) != len(asked) or (confidences is not None and len(confidences) != len(asked)):
            raise ValueError(f"{len(drafts)} proposals and {'no' if confidences is None else len(confidences)} "
                             f"confidence lists for {len(asked)} requests")
        out = []
        for j, i in enumerate(asked):
            proposal = list(islice(drafts[j], budgets[i]))
            own = list(map(float, islice(confidences[j], len(proposal)))) if confidences is not None else \
                [self._own_rate(requests[i].request_id, m)] * len(proposal)
            if len(own) < len(proposal):
                raise ValueError(f"{len(own)} confidences for a proposal of {len(proposal)} tokens")
            out.append((i, proposal, own))
        return out

    def _call(self, m: int, ask: Callable[[Drafter], Any]):
        """`ask(member m)`; None once it raised (which switches it off)."""
        try:
            return ask(self.members[m])
        except Exception as e:
            self._switch_off(m, e)
            return None

    def _switch_off(self, m: int, error: Exception) -> None:
        self.off[m] = f"member {self.names[m]} switched off: {described(error)}"
        log.error("fastest-of-N: %s; the others race on", self.off[m], exc_info=error)
        if len(self.off) == len(self.members):
            raise RuntimeError(f"every member is switched off ({'; '.join(self.off.values())})") from error

    def failures(self) -> list[str]:
        return list(self.off.values())

    def confidences(self) -> list[list[float]]:
        return self.chosen

    def sources(self) -> list[str]:
        return self.choices

    def _own_rate(self, request_id: str, m: int) -> float:
        """Member `m`'s acceptance rate on this request's labels, shrunk towards its rate on the other requests of the
        prompt (siblings, earlier epochs), itself shrunk towards its rate over every request."""
        accepted, rejected = self.labels[request_id][m] if request_id in self.labels else (0.0, 0.0)
        rate = self.overall[m][0] / max(self.overall[m][0] + self.overall[m][1], 1e-9)
        prompt = self.by_prompt.get(self.prompt_of.get(request_id))
        if prompt is not None:
            others = prompt[m][0] - accepted, prompt[m][1] - rejected
            rate = (others[0] + self.prior * rate) / (others[0] + others[1] + self.prior)
        return (accepted + self.prior * rate) / (accepted + rejected + self.prior)

    def _expected(self, m: int, request: DraftRequest, budget: int) -> float:
        """Member `m`'s expected accepted tokens on `request` before it is asked: its running rate there, per token."""
        rate = min(self._own_rate(request.request_id, m), 0.99)
        return rate * (1 - rate**budget) / (1 - rate)  # the sum of rate**j over j = 1..budget

    def _ask_all(self, ask: Callable[[Drafter], Any]) -> list:
        """`ask` of every member still on, in order: their answers (None from one that raised and is now off)."""
        return [self._call(m, ask) for m in range(len(self.members)) if m not in self.off]

    def commit(self, request_id: str, committed: list[int]) -> None:
        self._ask_all(lambda member: member.commit(request_id, committed))
        last = self.last.pop(request_id, None)
        if last is not None:
            self._label(request_id, last, committed)
        tail, prepared = self.ahead.pop(request_id, ((), None))
        if prepared is None or len(committed) <= len(tail) or tuple(committed[: len(tail)]) != tail:
            return  # a draft was rejected: the history the members prepared for never happened
        target = committed[len(tail)]
        # a member whose proposal of this step reached past the drafts verified has had that position labelled there
        covered = {m for m, (p, _) in (last or {}).items() if len(p) > len(tail)}
        guesses = {m: (p[:1], own[:1]) for m, (p, own) in prepared.items() if p and m not in covered}
        if guesses:
            self._label(request_id, guesses, [target])
        rest = {m: (p[1:], own[1:]) for m, (p, own) in prepared.items() if p and p[0] == target}
        if rest:  # the proposals current for the next commit (unless a proposal of the next step replaces them)
            self.last[request_id] = rest

    def _label(self, request_id: str, proposals: dict[int, tuple[list[int], list[float]]], committed: list[int]
               ) -> None:
        """Each member's proposal labelled on the committed tokens: its calibration, its running rates on the
        request, the prompt and overall, and the labels not yet reported."""
        labels = self.labels.setdefault(request_id, [[0.0, 0.0] for _ in self.members])
        key = self.prompt_of.get(request_id)
        prompt = self.by_prompt.setdefault(key, [[0.0, 0.0] for _ in self.members])
        self.by_prompt.move_to_end(key)
        if len(self.by_prompt) > MAX_PROMPTS:
            self.by_prompt.popitem(last=False)
        unreported = self.unreported.setdefault(request_id, {})
        for m, (proposal, own) in proposals.items():
            self.tables[m].observe(own, proposal, committed)
            agreed = agreement(proposal, committed)
            rejected = 1 if agreed < min(len(proposal), len(committed)) else 0
            labels[m][0], labels[m][1] = labels[m][0] + agreed, labels[m][1] + rejected
            prompt[m][0], prompt[m][1] = prompt[m][0] + agreed, prompt[m][1] + rejected
            self.overall[m] = [0.99 * self.overall[m][0] + agreed, 0.99 * self.overall[m][1] + rejected]
            before = unreported.get(self.names[m], (0, 0))
            unreported[self.names[m]] = (before[0] + agreed, before[1] + rejected)

    def member_labels(self) -> dict[str, dict[str, tuple[int, int]]]:
        unreported, self.unreported = self.unreported, {}
        return unreported

    def remember(self, prompt_ids: list[int], response_ids: list[int], version: int) -> None:
        self._ask_all(lambda member: member.remember(prompt_ids, response_ids, version))

    def new_policy(self, version: int) -> None:
        self._ask_all(lambda member: member.new_policy(version))

    def swap_weights(self, weights) -> bool:
        """To every member with weights of its own (the draft LM): true if one took them, or if a member is switched
        off (it may have been the one: the weights are dropped, as the engine drops them for a drafter it switched
        off)."""
        return any(self._ask_all(lambda member: member.swap_weights(weights))) or bool(self.off)

    def remove(self, request_id: str) -> None:
        self._ask_all(lambda member: member.remove(request_id))
        self.labels.pop(request_id, None)
        self.last.pop(request_id, None)
        self.ahead.pop(request_id, None)
        self.unreported.pop(request_id, None)
        self.prompt_of.pop(request_id, None)


def agreement(proposal: list[int], committed: list[int]) -> int:
    n = 0
    for a, b in zip(proposal, committed):
        if a != b:
            break
        n += 1
    return n
