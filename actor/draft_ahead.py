"""Decoupled speculation (`speculation.decoupled`): drafts for the next engine step prepared while this one verifies.

When the bridge hands the engine a request's drafts, it also asks the drafter, on a thread of its own, to propose
from the history those drafts make if all are accepted: the proposal's first token is its guess of the target's next
token (under the coupled sampler's noise, the target's likeliest token there), the rest the drafts that would follow
it. A drafter that `prepares_rejections` (the draft LM) is also asked for the likeliest outcomes where a draft is
rejected, from the history of the drafts before it, guessing the target's token past the rejected one: as many as
the thread's learned cost fits in the verify step the engine is predicted to take; one that `prepares_guesses` also
prepares the likeliest outcomes under its second guess of the target's token, ranked with the rest by how often
each guess has been right. When the verify step ends, a request whose committed tokens are exactly one outcome's
drafts and one of its guesses takes the rest as its drafts. One that
missed is drafted at once only where the cost model says it pays (else it decodes plainly this step): only the
waiting for the thread and that drafting are on the engine's critical path. Drafts only: every token is still the
target's coupled sample.

On a CPU the drafting needs a core of its own beside the engine's one-thread forward, and a drafter in the engine's
process takes the interpreter's lock between its torch calls, which slows the engine's step by about a third of its
busy time (bench/draft_contention.py): beside a CPU engine the drafter runs in a process of its own
(actor/drafter_process.py), and this thread only sends the call and waits. On a GPU engine the draft LM drafts on
the engine's GPU on a CUDA stream of its own, or a drafter is given a GPU of its own through its `device` option."""

from __future__ import annotations

import queue
import threading
import time
import weakref
from concurrent.futures import Future, wait
from dataclasses import replace
from typing import Callable, NamedTuple

import numpy as np

from actor.draft_planner import DraftCost, StepCost, plan
from actor.drafter_checks import guarded, plain_answers, sources_within
from drafters.base import CompositeDrafter, DraftRequest, described

# a preparation still running this long after it was launched is a hung drafter: the bridge switches it off (its
# thread is left to itself; a drafter's process is ended) and the engine decodes on, instead of stalling until the
# actor is taken for dead
SETTLE_DEADLINE_S = 60.0
# the share of the engine's predicted step it waits for a preparation still running: past it, a stall (a cache that
# grew, a busy host) most often runs on for longer than a step, and the step goes on without drafts
PATIENCE_SHARE = 0.5
# the most outcomes past each request's likeliest one a preparation holds: each is a scratch slot in the draft LM's
# cache while it is drafted, and the cache keeps its largest size (a cold thread asked for all 10 outcomes of 128
# requests grew it to 2,048 slots, whose every later doubling in length then stalled the engine for over a second)
MAX_FURTHER = 256


class Prepared(NamedTuple):
    length: int  # the length of the history it was proposed from
    tail: tuple[int, ...]  # the unverified tokens that history ended with (the drafts it assumed accepted)
    proposal: list[int] | None  # the guess of the target's next token, then the drafts after it (None: not ids)
    confidences: list[float] | None
    source: str  # a composite drafter's member that proposed it ("": not a composite)
    rejection: bool  # prepared for an outcome where a draft is rejected
    guess: int  # the drafter's guess (0: its best) of the target's token it starts from


class DraftsAhead:
    """The preparation in flight and what the last one prepared, per request and outcome; what preparing costs the
    drafter's thread (`cost`, fitted on its calls), and counts for a benchmark's profile."""

    def __init__(self, drafter=None):
        """`drafter`: whose `prepares_rejections` and `prepares_guesses` decide which outcomes are prepared (read once
        here, in its checked call: each is True or False, else the drafter's error; None: neither)."""
        self.kinds = (False, False)
        if drafter is not None:
            with guarded(drafter):
                self.kinds = (drafter.prepares_rejections, drafter.prepares_guesses)
        if not all(type(kind) is bool for kind in self.kinds):
            raise TypeError(f"drafter {type(drafter).__name__}: prepares_rejections and prepares_guesses must be True "
                            f"or False, got {self.kinds!r:.100}")
        # the drafter's thread: a daemon, so that a drafter stuck in a call never holds up the engine process's exit
        # (a pool's worker is joined at exit); its jobs are (future, work)
        self.jobs: queue.SimpleQueue[tuple[Future, Callable[[], dict]]] = queue.SimpleQueue()
        threading.Thread(target=run_jobs, args=(self.jobs,), name="draft-ahead", daemon=True).start()
        weakref.finalize(self, self.jobs.put, None)  # (the thread ends with this object)
        self.future: Future | None = None
        self.launched = 0.0  # when the preparation in flight was launched
        self.prepared: dict[str, list[Prepared]] = {}
        self.cost = DraftCost()
        self.seconds = 0.0  # time the thread spent preparing (off the critical path)
        self.outcomes = 0  # outcomes prepared
        self.busy_steps = 0  # engine steps that went on without drafts: the preparation had outlasted its patience
        self.overdue_since = 0  # busy_steps when the preparation in flight was launched
        # per kind (all drafts accepted, a draft rejected): prepared outcomes that came about, and of those the ones
        # where a guess was the target's token (their drafts taken); per kind and guess, the outcomes it was right in
        self.reached, self.hits = {False: 0, True: 0}, {False: 0, True: 0}
        self.right = {(kind, guess): 0 for kind in (False, True) for guess in (0, 1)}

    def settle(self, patience: float | None = None) -> float:
        """Waits for the preparation in flight, `patience` seconds at most (None: as long as it takes; once it has
        outlasted a patience, no more), and returns the seconds waited; the preparation is still in flight (`busy`)
        where it outlasted them. Its error is raised here, and TimeoutError once it has run SETTLE_DEADLINE_S."""
        if self.future is None:
            return 0.0
        start = time.perf_counter()
        left = self.launched + SETTLE_DEADLINE_S - start
        if patience is not None and self.busy_steps > self.overdue_since:  # (a stall: waited for once)
            patience = 0.0
        done, _ = wait([self.future], timeout=max(0.0, left if patience is None else min(patience, left)))
        if not done:
            if time.perf_counter() >= self.launched + SETTLE_DEADLINE_S:
                raise TimeoutError(f"propose_ahead had not returned {SETTLE_DEADLINE_S:g} s after it was called")
            return time.perf_counter() - start
        future, self.future = self.future, None
        self.prepared = future.result()
        return time.perf_counter() - start

    @property
    def busy(self) -> bool:
        """Whether a preparation is still in flight (it outlasted `settle`'s patience)."""
        return self.future is not None

    def take(self, request_id: str, history) -> tuple[list[int], list[float] | None, str] | None:
        """The drafts (with their confidences and source) prepared for `request_id` for the outcome `history` is:
        its drafts accepted up to the one the outcome assumed rejected, if any, then the guessed token."""
        reached = None  # the kind of the outcome that came about, once one of its guesses is found
        for prepared in self.prepared.pop(request_id, ()):
            if not prepared.proposal or len(history) != prepared.length + 1:
                continue
            start = prepared.length - len(prepared.tail)
            if any(int(a) != b for a, b in zip(history[start : prepared.length], prepared.tail)):
                continue  # another outcome came about
            if reached is None:
                reached = prepared.rejection
                self.reached[reached] += 1
            if int(history[prepared.length]) == prepared.proposal[0]:  # the target's token was this guess
                self.hits[reached] += 1
                self.right[reached, min(prepared.guess, 1)] += 1
                return (prepared.proposal[1:], None if prepared.confidences is None else prepared.confidences[1:],
                        prepared.source)
        return None

    def guess_rates(self) -> dict[tuple[bool, int], float]:
        """Per kind of outcome (a draft rejected or not) and guess (0: the drafter's best, 1: its second), how often
        it was the target's token where that outcome came about (a prior of 2 outcomes at 0.6 / 0.15 before then)."""
        return {(kind, guess): (self.right[kind, guess] + 2 * (0.6, 0.15)[guess]) / (self.reached[kind] + 2)
                for kind, guess in self.right}

    def prepare(self, drafter, chains: list[tuple[DraftRequest, list[int], int]],
                rates: Callable[[list[str]], np.ndarray], predicted: float, k: int, members: set[str],
                vocab_size: int, unseen: int = 0) -> None:
        """The drafter, on the thread, proposes from the histories of the outcomes `outcomes` picks for each chain
        (a request, the drafts handed over for it, their count): k + 1 tokens each, the guess of the target's next
        token, then k drafts (read as ids of a `vocab_size` vocabulary in its guarded call). `rates`: the requests'
        acceptance rates; `predicted`: the verify step's seconds; `members`: a composite's member names so far;
        `unseen`: the history tokens the chains had not shown the drafter before (a draft model's catch-up)."""
        rejections, guesses = self.kinds
        asked = ahead(outcomes(chains, rates([r.request_id for r, _, _ in chains]) if rejections or guesses else None,
                               self.cost, predicted, k + 1, rejections, self.guess_rates() if guesses else None,
                               unseen), k + 1)
        name = type(drafter).__name__

        def propose():
            with guarded(drafter):
                proposals = drafter.propose_ahead(list(asked), k + 1)  # (a copy: the outcomes are filed in this order)
                if proposals is None:
                    return None, None, None
                proposals, confidences = plain_answers(proposals, drafter.confidences(), [k + 1] * len(asked),
                                                       vocab_size, name)
                return proposals, confidences, sources_within(drafter.sources(), len(asked), members, name) \
                    if isinstance(drafter, CompositeDrafter) else None

        self.launch(asked, propose, unseen)

    def launch(self, requests: list[DraftRequest], propose: Callable[[], tuple[list, list | None, list | None]],
               unseen: int = 0) -> None:
        """Runs `propose()` on the thread: the drafter's proposals for `requests` (`ahead`: several per request where
        several outcomes are prepared; as `plain_answers` reads them, one per request), their confidences and (a
        composite's) sources; its cost is learnt with the `unseen` history tokens it catches up on."""
        self.prepared = {}
        self.outcomes += len(requests)

        def work() -> dict[str, list[Prepared]]:
            start = time.perf_counter()
            prepared: dict[str, list[Prepared]] = {}
            try:
                proposals, confidences, sources = propose()
                if proposals is None:  # the drafter prepared nothing this time (`Drafter.propose_ahead`)
                    return prepared
                for r, p, c, s in zip(requests, proposals, [None] * len(requests) if confidences is None else
                                      confidences, [""] * len(requests) if sources is None else sources):
                    tail = tuple(int(t) for t in r.token_ids[len(r.token_ids) - r.unverified:])
                    prepared.setdefault(r.request_id, []).append(Prepared(
                        len(r.token_ids), tail, None if p is None else list(p), c, str(s), r.rejected is not None,
                        r.guess))
                lengths = [len(p.proposal or ()) for ps in prepared.values() for p in ps]
                self.cost.observe(max(lengths, default=0), sum(lengths), unseen, time.perf_counter() - start)
                return prepared
            finally:
                self.seconds += time.perf_counter() - start

        self.future, self.launched, self.overdue_since = Future(), time.perf_counter(), self.busy_steps
        self.jobs.put((self.future, work))


def run_jobs(jobs: queue.SimpleQueue) -> None:
    """The drafter's thread: each job's work, its answer or error into its future, until a None; it holds no job
    between two (a job's work holds the drafter). An exit it raised (`SystemExit`, a `BaseException` of its own) is
    the drafter's error like any other: the engine, which settles, is not to exit."""
    while (job := jobs.get()) is not None:
        future, work = job
        try:
            future.set_result(work())
        except Exception as e:  # the drafter's error is raised where the engine settles
            future.set_exception(e)
        except BaseException as e:  # noqa: BLE001
            future.set_exception(RuntimeError(f"preparing drafts ahead raised {described(e)}"))
        del job, future, work


def ahead(outcomes: list[tuple[DraftRequest, list[int], int, int]], k: int) -> list[DraftRequest]:
    """Each (request, its drafts, how many of them an outcome accepts, which guess) as the request stands in that
    outcome, asking for `k` tokens: its guess of the target's next token (past the rejected draft, where one is),
    then the drafts after it (its history copied: the engine's buffer changes while the thread reads it)."""
    return [replace(r, position=r.position + j, max_tokens=k, unverified=j, guess=g,
                    rejected=int(drafts[j]) if j < len(drafts) else None,
                    token_ids=read_only(np.concatenate([np.asarray(r.token_ids, dtype=np.int64),
                                                        np.asarray(drafts[:j], dtype=np.int64)])))
            for r, drafts, j, g in outcomes]


def read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def outcomes(chains: list[tuple[DraftRequest, list[int], int]], rates: np.ndarray | None, cost: DraftCost,
             step_s: float, tokens: int, rejections: bool = True, guesses: dict[tuple[bool, int], float] | None = None,
             unseen: int = 0) -> list[tuple[DraftRequest, list[int], int, int]]:
    """The outcomes of a verify step to prepare drafts for, as (request, its drafts, drafts accepted, guess): every
    request's all-accepted one under its best guess (`chains`; no drafts: the plain step's) and, given the requests'
    acceptance `rates` (None: nothing more), the likeliest other ones: where a draft is rejected (`rejections`; at
    rate `a`, the first `j` accepted and the next rejected: `a**j * (1 - a)`) and, with `guesses` (how often each
    guess has been right, per kind of outcome), under the second guess too; ranked by the chance that they are taken
    (the outcome's times its guess's), as many as the thread's fitted `cost` of asking `tokens` for each, with the
    `unseen` history tokens the chains catch up on, keeps within `step_s`, the engine's predicted step, and
    `MAX_FURTHER` (before either is measured: the likeliest only)."""
    first = [(r, d, j, 0) for r, d, j in chains]
    if rates is None or not chains or step_s <= 0 or not cost.measured:  # (step or thread unmeasured: these only)
        return first
    right = guesses or {(kind, 0): 1.0 for kind in (False, True)}
    likely = sorted(((a**j * (1 - a if j < len(d) else 1) * right[j < len(d), g], n, j, g)
                     for n, ((_, d, _), a) in enumerate(zip(chains, rates))
                     for j in range(0 if rejections else len(d), len(d) + 1) for g in range(2 if guesses else 1)
                     if (j, g) != (len(d), 0)), reverse=True)
    rows = np.arange(len(chains), len(chains) + len(likely) + 1)
    thread = cost.predict(np.full(len(rows), tokens), rows * tokens, unseen)
    fits = min(int(np.searchsorted(thread > step_s, True)), MAX_FURTHER + 1)
    return first + [(chains[n][0], chains[n][1], j, g) for _, n, j, g in likely[: max(fits - 1, 0)]]


def worth_drafting_now(asked: list[tuple[int, DraftRequest]], base_tokens: int, ready: list[tuple[str, int]],
                       gains: Callable[[list[str]], np.ndarray], step_cost: StepCost, draft_cost: DraftCost,
                       unseen: Callable[[DraftRequest], int]) -> list[tuple[int, DraftRequest]]:
    """The requests (row, request) whose drafts were not prepared, with the budgets the cost model gives drafting them
    now, on the critical path (0: left out; they decode plainly this step, and get drafts prepared for the next),
    weighed against the whole step of `base_tokens`: drafting them delays the tokens of every request of the step,
    the `ready` ones' (their ids and prepared drafts) too. `gains`: the bridge's per-request gains of each draft
    token; `unseen`: the history tokens drafting a request now would catch up on."""
    missed = [list(g[: r.max_tokens]) for g, (_, r) in zip(gains([r.request_id for _, r in asked]), asked)]
    ready_gains = gains([rid for rid, _ in ready])
    elsewhere = base_tokens - len(asked) + sum(float(g[:n].sum()) for g, (_, n) in zip(ready_gains, ready))
    budgets, _ = plan(missed, base_tokens + sum(n for _, n in ready), step_cost, draft_cost,
                      unseen=[unseen(r) for _, r in asked], elsewhere=elsewhere)
    # (each with a view of its own: the bridge's `r.token_ids` is read again when preparing, whatever the drafter does
    # to the view it is given, say a reshape in place)
    return [(j, replace(r, max_tokens=b, token_ids=r.token_ids[:])) for (j, r), b in zip(asked, budgets) if b > 0]
