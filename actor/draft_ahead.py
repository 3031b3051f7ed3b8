"""Decoupled speculation (`speculation.decoupled`): drafts for the next engine step prepared while this one verifies.

When the bridge hands the engine a request's drafts, it also asks the drafter, on a thread of its own, to propose
from the history those drafts make if all are accepted: the proposal's first token is its guess of the target's next
token (under the coupled sampler's noise, the target's likeliest token there), the rest the drafts that would follow
it. When the verify step ends, a request whose committed tokens are exactly the drafts and that guess takes the rest
as its drafts. One that missed is drafted at once only where the cost model says it pays (else it decodes plainly
this step): only the waiting for the thread and that drafting are on the engine's critical path. Drafts only:
every token is still the target's coupled sample.

On a CPU the thread needs a core of its own beside the engine's one-thread forward (torch releases the GIL in its
kernels); on a GPU engine the draft LM's kernels run on the engine's GPU (no second CUDA stream is built), or a
drafter is given a GPU of its own through its `device` option."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, NamedTuple

import numpy as np

from drafters.base import DraftRequest


class Prepared(NamedTuple):
    length: int  # the length of the history it was proposed from
    tail: tuple[int, ...]  # the unverified tokens that history ended with (the drafts being verified)
    proposal: list[int]  # the guess of the target's next token, then the drafts after it
    confidences: list[float] | None
    source: str  # a composite drafter's member that proposed it ("": not a composite)


class DraftsAhead:
    """The preparation in flight and what the last one prepared, per request."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-ahead")
        self.future: Future | None = None
        self.prepared: dict[str, Prepared] = {}
        self.seconds = 0.0  # time the thread spent preparing (off the critical path)

    def settle(self) -> float:
        """Waits for the preparation in flight (its error is raised here); returns the seconds waited."""
        if self.future is None:
            return 0.0
        start = time.perf_counter()
        future, self.future = self.future, None
        self.prepared = future.result()
        return time.perf_counter() - start

    def take(self, request_id: str, history) -> tuple[list[int], list[float] | None, str] | None:
        """The drafts (with their confidences and source) prepared for `request_id` if `history` is the outcome they
        were prepared for: every draft accepted, then the guessed token."""
        prepared = self.prepared.pop(request_id, None)
        if prepared is None or not prepared.proposal or len(history) != prepared.length + 1:
            return None
        expected = (*prepared.tail, prepared.proposal[0])
        if any(int(a) != b for a, b in zip(history[prepared.length - len(prepared.tail):], expected)):
            return None
        return (prepared.proposal[1:], None if prepared.confidences is None else prepared.confidences[1:],
                prepared.source)

    def launch(self, requests: list[DraftRequest], propose: Callable[[], tuple[list, list | None, list | None]]
               ) -> None:
        """Runs `propose()` on the thread: the drafter's proposals for `requests` (`ahead`), their confidences and
        (a composite's) sources."""
        self.prepared = {}

        def work() -> dict[str, Prepared]:
            start = time.perf_counter()
            try:
                proposals, confidences, sources = propose()
                if proposals is None:  # the drafter prepared nothing this time (`Drafter.propose_ahead`)
                    return {}
                return {r.request_id: Prepared(len(r.token_ids), tuple(int(t) for t in r.token_ids[
                    len(r.token_ids) - r.unverified:]), [int(t) for t in p], c, str(s))
                        for r, p, c, s in zip(requests, proposals, confidences or [None] * len(requests),
                                              sources or [""] * len(requests))}
            finally:
                self.seconds += time.perf_counter() - start

        self.future = self.pool.submit(work)


def ahead(requests: list[tuple[int, DraftRequest]], drafts: list[list[int]], k: int) -> list[DraftRequest]:
    """Each request (with its row) as it stands if its drafts in `drafts[row]` are all accepted, asking for `k`
    tokens: its guess of the target's next token, then the drafts after it (its history copied: the engine's
    buffer changes while the thread reads it)."""
    return [replace(r, position=r.position + len(drafts[row]), max_tokens=k, unverified=len(drafts[row]),
                    token_ids=np.concatenate([np.asarray(r.token_ids, dtype=np.int64),
                                              np.asarray(drafts[row], dtype=np.int64)]))
            for row, r in requests]
