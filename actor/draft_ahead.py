"""Decoupled speculation (`speculation.decoupled`): drafts for the next engine step prepared while this one verifies.

When the bridge hands the engine a request's drafts, it also asks the drafter, on a thread of its own, to propose
from the history those drafts make if all are accepted: the proposal's first token is its guess of the target's next
token (under the coupled sampler's noise, the target's likeliest token there), the rest the drafts that would follow
it. A drafter that `prepares_rejections` (the draft LM) is also asked for the likeliest outcomes where a draft is
rejected, from the history of the drafts before it, guessing the target's token past the rejected one: as many as
the thread's learned cost fits in the verify step the engine is predicted to take. When the verify step ends, a
request whose committed tokens are exactly one outcome's drafts and guess takes the rest as its drafts. One that
missed is drafted at once only where the cost model says it pays (else it decodes plainly this step): only the
waiting for the thread and that drafting are on the engine's critical path. Drafts only: every token is still the
target's coupled sample.

On a CPU the thread needs a core of its own beside the engine's one-thread forward (torch releases the GIL in its
kernels); on a GPU engine the draft LM's kernels run on the engine's GPU (no second CUDA stream is built), or a
drafter is given a GPU of its own through its `device` option."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, NamedTuple

import numpy as np

from actor.draft_planner import DraftCost
from drafters.base import DraftRequest


class Prepared(NamedTuple):
    length: int  # the length of the history it was proposed from
    tail: tuple[int, ...]  # the unverified tokens that history ended with (the drafts it assumed accepted)
    proposal: list[int]  # the guess of the target's next token, then the drafts after it
    confidences: list[float] | None
    source: str  # a composite drafter's member that proposed it ("": not a composite)
    rejection: bool  # prepared for an outcome where a draft is rejected


class DraftsAhead:
    """The preparation in flight and what the last one prepared, per request and outcome; what preparing costs the
    drafter's thread (`cost`, fitted on its calls), and counts for a benchmark's profile."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-ahead")
        self.future: Future | None = None
        self.prepared: dict[str, list[Prepared]] = {}
        self.cost = DraftCost()
        self.seconds = 0.0  # time the thread spent preparing (off the critical path)
        self.outcomes = 0  # outcomes prepared
        # per kind (all drafts accepted, a draft rejected): prepared outcomes that came about, and of those the ones
        # whose guess was the target's token (their drafts taken)
        self.reached, self.hits = {False: 0, True: 0}, {False: 0, True: 0}

    def settle(self) -> float:
        """Waits for the preparation in flight (its error is raised here); returns the seconds waited."""
        if self.future is None:
            return 0.0
        start = time.perf_counter()
        future, self.future = self.future, None
        self.prepared = future.result()
        return time.perf_counter() - start

    def take(self, request_id: str, history) -> tuple[list[int], list[float] | None, str] | None:
        """The drafts (with their confidences and source) prepared for `request_id` for the outcome `history` is:
        its drafts accepted up to the one the outcome assumed rejected, if any, then the guessed token."""
        for prepared in self.prepared.pop(request_id, ()):
            if not prepared.proposal or len(history) != prepared.length + 1:
                continue
            start = prepared.length - len(prepared.tail)
            if any(int(a) != b for a, b in zip(history[start : prepared.length], prepared.tail)):
                continue  # another outcome came about
            self.reached[prepared.rejection] += 1
            if int(history[prepared.length]) != prepared.proposal[0]:
                return None  # the outcome it was prepared for, but the target sampled another token than the guess
            self.hits[prepared.rejection] += 1
            return (prepared.proposal[1:], None if prepared.confidences is None else prepared.confidences[1:],
                    prepared.source)
        return None

    def launch(self, requests: list[DraftRequest], propose: Callable[[], tuple[list, list | None, list | None]]
               ) -> None:
        """Runs `propose()` on the thread: the drafter's proposals for `requests` (`ahead`: several per request where
        several outcomes are prepared), their confidences and (a composite's) sources."""
        self.prepared = {}
        self.outcomes += len(requests)

        def work() -> dict[str, list[Prepared]]:
            start = time.perf_counter()
            prepared: dict[str, list[Prepared]] = {}
            try:
                proposals, confidences, sources = propose()
                if proposals is None:  # the drafter prepared nothing this time (`Drafter.propose_ahead`)
                    return prepared
                for r, p, c, s in zip(requests, proposals, confidences or [None] * len(requests),
                                      sources or [""] * len(requests)):
                    tail = tuple(int(t) for t in r.token_ids[len(r.token_ids) - r.unverified:])
                    prepared.setdefault(r.request_id, []).append(Prepared(
                        len(r.token_ids), tail, [int(t) for t in p], c, str(s), r.rejected is not None))
                lengths = [len(p) for ps in prepared.values() for p in ps]
                self.cost.observe(max(lengths, default=0), sum(lengths), 0, time.perf_counter() - start)
                return prepared
            finally:
                self.seconds += time.perf_counter() - start

        self.future = self.pool.submit(work)


def ahead(outcomes: list[tuple[DraftRequest, list[int], int]], k: int) -> list[DraftRequest]:
    """Each (request, its drafts, how many of them an outcome accepts) as the request stands in that outcome, asking
    for `k` tokens: its guess of the target's next token (past the rejected draft, where one is), then the drafts
    after it (its history copied: the engine's buffer changes while the thread reads it)."""
    return [replace(r, position=r.position + j, max_tokens=k, unverified=j,
                    rejected=int(drafts[j]) if j < len(drafts) else None,
                    token_ids=np.concatenate([np.asarray(r.token_ids, dtype=np.int64),
                                              np.asarray(drafts[:j], dtype=np.int64)]))
            for r, drafts, j in outcomes]


def outcomes(chains: list[tuple[DraftRequest, list[int], int]], rates: np.ndarray | None, cost: DraftCost,
             step_s: float, tokens: int) -> list[tuple[DraftRequest, list[int], int]]:
    """The outcomes of a verify step to prepare drafts for, as (request, its drafts, drafts accepted): every request's
    all-accepted one (`chains`; no drafts: the plain step's) and, given the requests' acceptance `rates` (None: the
    drafter does not prepare rejections), the likeliest outcomes where a draft is rejected (at rate `a`, the first `j`
    accepted and the next rejected: `a**j * (1 - a)`), as many as the thread's fitted `cost` of asking `tokens` for
    each keeps within `step_s`, the engine's predicted step (all before either is measured)."""
    if rates is None or not chains:
        return chains
    likely = sorted(((a**j * (1 - a), n, j) for n, ((_, d, _), a) in enumerate(zip(chains, rates))
                     for j in range(len(d))), reverse=True)
    rows = np.arange(len(chains), len(chains) + len(likely) + 1)
    thread = cost.predict(np.full(len(rows), tokens), rows * tokens)
    fits = int(np.searchsorted(thread > step_s, True)) if step_s > 0 else len(rows)
    return chains + [(chains[n][0], chains[n][1], j) for _, n, j in likely[: max(fits - 1, 0)]]
