"""The drafter's side of the engine: vLLM's `custom_class` proposer, called once per engine step (written against
vllm 0.32.0's V1 model runner, like actor/vllm_hooks.py, which binds it).

Each step it tells the `Drafter` plugin what each verify step committed, drops requests that left the batch, and asks
the draft planner (actor/draft_planner.py) how many tokens each request may draft, learning the step and drafting
costs and each request's acceptance as it goes. A drafter that rates its tokens (`Drafter.confidences`) is asked for
the tokens that pay at the request's acceptance so far (decoupled, with drafts prepared off the critical path: k for
every request), and its proposals are verified only as far as each token's calibrated gain pays. Every verify step
labels the proposals it checked (drafters/calibration.py). The drafter sees ids, seeds, positions and read-only views
of copies of the requests' histories (actor/drafter_checks.Histories), never the engine's buffer. A drafter that
raises or breaks its contract is switched off for the engine's life (`switch_off`): the engine decodes on without
drafts, tokens unchanged."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from itertools import islice
from typing import Any

import numpy as np

from actor.draft_ahead import PATIENCE_SHARE, DraftsAhead, worth_drafting_now
from actor.draft_commits import Commits
from actor.drafter_checks import CallWatch, Histories, guarded, labels_within, plain_answers, sources_within
from actor.drafter_process import ProcessDrafter
from actor.draft_planner import Acceptance, DraftCost, Explore, Rest, StepCost, Survival, geometric, plan
from drafters.base import CompositeDrafter, Drafter, DraftRequest, described, prepares_ahead, printable
from drafters.calibration import Calibration
from transport.messages import MAX_DRAFTERS, MAX_FAILURE, add_labels

log = logging.getLogger(__name__)
# decoupled: how long the drafter's thread may hold the GIL while the engine's waits for it (Python's default 5 ms is
# most of a small verify step)
SWITCH_S = 0.0005


class DrafterBridge:
    def __init__(self, vllm_config):
        self.k = vllm_config.speculative_config.num_speculative_tokens
        # the drafter (a str names one that could not be built), and its name as logs and trajectories call it
        self.runner, self.drafter, self.name = None, None, ""
        self.max_batch, self.planning = 0, True
        self.live: set[str] = set()  # the requests of the last step's batch
        self.known: set[str] = set()  # every request the drafter has state for
        self.commits = Commits()  # what the drafter has heard of each request's commits
        self.step_cost, self.draft_cost, self.acceptance, self.rest = StepCost(), DraftCost(), Acceptance(), Rest()
        self.calibration, self.rated = Calibration(), False  # rated: the drafter gives confidences (last we saw)
        self.histories, self.members = Histories(), set()  # what drafters see; a composite's member names so far
        # per request drafted last step: the tokens handed to the engine, its whole proposal and its confidences
        self.verifying: dict[str, tuple[int, list[int], list[float] | None]] = {}
        self.shown: dict[str, int] = {}  # per request, the history length in its last proposal (the drafter's view)
        self.positions: dict[str, int] = {}  # per request, its output tokens as of its last step (for `survival`)
        self.predicted, self.explore = 0.0, Explore(self.acceptance)  # the step planned last's engine seconds
        self.step_end: float | None = None  # when the last propose() returned: the next step's engine time starts
        self.seconds = self.drafter_seconds = 0.0  # in propose(), and of that in the drafter's calls (a profile)
        self.failure = ""  # why the drafter was switched off ("": it was not)
        self.watch = CallWatch()  # the drafter's call the engine's thread is in (a hung one: driver/rollouts.py)
        self.ahead: DraftsAhead | None = None  # speculation.decoupled: the next step's drafts, prepared meanwhile
        self.waited = self.waited_total = 0.0  # the engine's wait for the thread: this step, and over its life
        self.unseen_total = 0  # history tokens shown to the drafter for the first time, over the engine's life

    def load_model(self, *args, **kwargs) -> None:  # vLLM hands over the target model; drafters bring their own
        pass

    def bind(self, runner, drafter: Drafter | str, max_batch: int, planning: bool, decoupled: bool = False) -> None:
        """`drafter`: the plugin, or (a str) the name of one that could not be built, switched off by the caller."""
        self.runner, self.drafter, self.max_batch, self.planning = runner, drafter, max_batch, planning
        built = not isinstance(drafter, str)
        self.name = type(drafter).__name__ if built else drafter
        if decoupled and built and prepares_ahead(drafter):
            self.ahead = DraftsAhead(drafter)
            sys.setswitchinterval(SWITCH_S)  # the engine's thread takes the GIL back from the drafter's sooner
        elif decoupled and built:
            log.warning("speculation.decoupled: drafter %s cannot prepare drafts ahead (no propose_ahead); it drafts "
                        "on the engine's critical path", self.name)
        self.vocab_size, self.max_model_len = runner.model_config.get_vocab_size(), runner.model_config.max_model_len
        self.survival = Survival(self.max_model_len)
        runner._sample.planning = built
        dropped = getattr(runner, "_on_request_state_removed", None)  # vLLM's hook as it drops a request's state
        if dropped is not None:
            runner._on_request_state_removed = lambda r, state: (self.commits.left(r, state), dropped(r, state))

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        start = time.perf_counter()
        try:
            return self._propose(start, sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        finally:
            self.step_end = time.perf_counter()
            self.seconds += self.step_end - start

    def _propose(self, start, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> list[list[int]]:
        """One engine step's drafts: a step of rest drafts nothing and does nothing per request; else forget the
        requests that left -> hear what was committed -> plan each request's budget -> draft -> record the plan."""
        if self.drafter is None:
            raise RuntimeError("DrafterBridge.propose before install(): no drafter bound")
        batch = self.runner.input_batch
        req_ids = batch.req_ids[: batch.num_reqs]
        self._observe_step(start, req_ids)
        # no drafter call while its thread still runs: waited for half a step at most (counted in drafter_seconds)
        self.waited = self.settle(PATIENCE_SHARE * self.predicted or None)
        if self._rests(req_ids, sampled_token_ids):
            return [[] for _ in req_ids]
        gone = self._forget(req_ids)
        lengths = num_tokens_no_spec[: len(req_ids)].tolist()  # plain ints: a numpy scalar per request costs more
        prompt_lengths = batch.num_prompt_tokens[: len(req_ids)].tolist()
        commits = self.commits.since_last_plan(req_ids, sampled_token_ids, lengths, prompt_lengths, token_ids_cpu)
        self._hear([(req_ids[row], tokens) for row, tokens in commits], gone)
        drafting = not self.failure and not (self.max_batch and len(req_ids) > self.max_batch)  # none above the bound
        self.runner._sample.planning = drafting
        rows = [row for row, _ in commits] if drafting else []
        self.positions.update(zip(req_ids, (n - p for n, p in zip(lengths, prompt_lengths))))
        budgets, explore = self._plan(req_ids, rows, lengths)
        requests = self._requests(req_ids, rows, budgets, lengths, token_ids_cpu)
        drafts: list[list[int]] = [[] for _ in req_ids]
        started, unseen = time.perf_counter(), 0
        if requests:
            try:
                unseen = self._draft(requests, drafts, len(req_ids), verify_all=explore or not self.planning)
            except Exception as e:
                self.switch_off(e)
                drafts = [[] for _ in req_ids]
        self._record(req_ids, rows, drafts)
        if explore:  # what exploring cost: drafting, and the verify tokens it added
            self.explore.explored(sum(map(bool, drafts)), time.perf_counter() - started + self.predicted
                                  - float(self.step_cost.predict(len(req_ids))))
        if self.ahead is not None and requests and not self.failure:  # the last drafter call of this step
            self.ahead.prepare(self.drafter, [(r, drafts[row], len(drafts[row])) for row, r in requests],
                               self.acceptance.rates, self.predicted, self.k, self.members, self.vocab_size, unseen)
        return drafts

    def _rests(self, req_ids: list[str], sampled_token_ids) -> bool:
        """Whether this step drafts nothing and does no work per request: a step of the planner's rest (`Rest`), or,
        decoupled, one where the drafter's thread still prepares after half a step (a stall: a cache that grew, a
        busy host), which costs more to wait for than a step without drafts (the drafts just verified are observed).
        The drafter hears the commits at the next plan (actor/draft_commits.py)."""
        rows, busy = len(req_ids), self.ahead is not None and self.ahead.busy and not self.failure
        rests = busy or (self.planning and not self.failure and not self.verifying and not self.explore.due()
                         and not (self.max_batch and rows > self.max_batch) and self.rest.keeps(rows))
        if busy:  # (the wait is the engine's drafting time on each request: spec/critical_draft_seconds)
            self._observe_verified([(r, list(t)) for r, t in zip(req_ids, sampled_token_ids) if r in self.verifying])
            for req_id in req_ids:
                self.runner._sample.stats_for(req_id).draft_seconds += self.waited / rows
            self.verifying, self.ahead.busy_steps = {}, self.ahead.busy_steps + 1
        if rests:  # (`planning` again: a plan above `max_batch` set it off; none is counted above it)
            self.commits.rested, self.runner._sample.planning = True, not (self.max_batch and rows > self.max_batch)
            self.explore.stepped(drafted=False)
        return rests

    def _forget(self, req_ids: list[str]) -> list[tuple[str, list[int]]]:
        """The requests vLLM no longer holds (finished or aborted), their state dropped, each with its outputs the
        drafter has not heard of. A request out of this step's batch may only be waiting (unscheduled, preempted by a
        weight update): it is kept."""
        self.known.update(req_ids)
        gone = [r for r in self.known - set(req_ids) if r not in self.runner.requests]
        gone += [r for r in self.commits.tails if r not in self.known]  # it came and went during a rest
        left = []
        for req_id in gone:
            self.acceptance.remove(req_id)
            self.histories.drop(req_id)
            self.shown.pop(req_id, None)
            seen, (unheard, length) = self.positions.pop(req_id, -1), self.commits.forget(req_id)
            position = seen if length is None else length  # (vLLM's own count where it saw the request leave)
            if position >= 0:  # it ended (or was aborted) after its last step: at least a token on
                self.survival.ended(position + 1)
            self.known.discard(req_id)
            left.append((req_id, unheard))
        return left

    def _hear(self, commits: list[tuple[str, list[int]]], gone: list[tuple[str, list[int]]]) -> None:
        """What the verifier committed: each drafted request's acceptance and labels, then the drafter told."""
        self._observe_verified(commits)
        if not self.failure:
            try:
                self._tell(gone, commits)
            except Exception as e:
                self.switch_off(e)
        self.verifying = {}

    def _observe_verified(self, commits: list[tuple[str, list[int]]]) -> None:
        """Each drafted request's acceptance, and its tokens' labels, from what the verifier committed."""
        for req_id, committed in commits:
            sent, proposal, confidences = self.verifying.get(req_id, (0, None, None))
            if sent:
                self.acceptance.observe(req_id, sent, min(len(committed) - 1, sent))
            if confidences is not None:
                self.calibration.observe(confidences, proposal, committed)

    def _plan(self, req_ids: list[str], rows: list[int], lengths: list[int]) -> tuple[list[int], bool]:
        """Each drafting row's budget (k without the planner) and whether this step explores."""
        explore = self.explore.due()
        if not self.planning:
            return [self.k] * len(rows), explore
        # decoupled, a drafter that rates its tokens drafts k for every request (verified as far as their ratings
        # pay: `_draft`) while its drafts are verified; after two steps of none, as planned below (it may rest)
        if self.ahead is not None and self.rated and not explore and self.rest.idle < 2:
            return [self.k] * len(rows), explore
        unseen = [lengths[row] - self.shown.get(req_ids[row], 0) for row in rows]
        # decoupled: as if drafting were free (prepared drafts cost the engine nothing; a miss: `worth_drafting_now`),
        # but an exploring step, which measures, as serial (free, it drafted a whole batch at its hardest tokens)
        budgets, _ = plan(self._gains([req_ids[row] for row in rows]), len(req_ids), self.step_cost,
                          self.draft_cost if self.ahead is None or explore else None, explore=explore, unseen=unseen)
        return budgets, explore

    def _requests(self, req_ids: list[str], rows: list[int], budgets: list[int], lengths: list[int],
                  token_ids_cpu) -> list[tuple[int, DraftRequest]]:
        """What the drafter is asked, per row with a budget: ids, seed, position, sampling settings and a read-only
        view of the history."""
        runner, sampler, requests = self.runner, self.runner._sample, []
        for row, budget in ((row, budget) for row, budget in zip(rows, budgets) if budget > 0):
            length, req_id = lengths[row], req_ids[row]
            params = runner.requests[req_id].sampling_params
            position = self.positions[req_id]
            # a verify step emits up to drafts + 1 tokens: drafts past the request's last token are never verified
            last = self.max_model_len - length if params.max_tokens is None else \
                min(self.max_model_len - length, params.max_tokens - position)
            budget = min(budget, last - 1)
            if budget <= 0:  # rows without a committed token (partial prefill) have nothing to draft from either
                continue
            history = self.histories.view(req_id, token_ids_cpu[row, :length])  # never the engine's buffer
            requests.append((row, DraftRequest(
                request_id=req_id, seed=sampler.seed_of(req_id), position=position, token_ids=history,
                temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, max_tokens=budget)))
        return requests

    def _record(self, req_ids: list[str], rows: list[int], drafts: list[list[int]]) -> None:
        """The step's plan in its requests' stats (and a switched-off drafter or member on every request from now
        on), and the step the planner expects."""
        sampler = self.runner._sample
        members_off = self.call("failures", lambda d: "; ".join(map(str, islice(d.failures() or (), MAX_DRAFTERS))),
                                off="") if isinstance(self.drafter, CompositeDrafter) else ""  # (read in the call)
        if self.failure or members_off:  # every request from now on says it was decoded without them
            reason = printable(self.failure or f"drafter {self.name}: {members_off}")
            for req_id in req_ids:
                sampler.stats_for(req_id).drafter_failure = reason[:MAX_FAILURE]  # what a trajectory may carry
        for row in rows:  # (the steps are counted where every request is, in the sampler: `CoupledSampling.planning`)
            if drafts[row]:
                sampler.stats_for(req_ids[row]).planned_tokens += len(drafts[row])
        self.explore.stepped(any(drafts))
        if rows:  # (a plan whose drafts were all cut, or refused, drafted nothing: `Rest`)
            self.rest.planned(len(req_ids), any(drafts))
        self.predicted = float(self.step_cost.predict(len(req_ids) + sum(len(d) for d in drafts)))

    def _tell(self, gone: list[tuple[str, list[int]]], commits: list[tuple[str, list[int]]]) -> None:
        """The drafter hears which requests left and what was committed (drafting or not), and a composite's
        members' labels go to their requests' stats; its own time, not the bridge's."""
        start, sampler = time.perf_counter(), self.runner._sample
        with self.watch.running("commit"), guarded(self.drafter):
            for req_id, unheard in gone:
                if unheard:
                    self.drafter.commit(req_id, unheard)
                self.drafter.remove(req_id)
            for req_id, committed in commits:
                self.drafter.commit(req_id, committed)
            labels = labels_within(self.drafter.member_labels(), self.known, self.members, self.name) \
                if isinstance(self.drafter, CompositeDrafter) else {}
        for req_id, members in labels.items():
            add_labels(sampler.stats_for(req_id).drafter_labels, members)
        self.drafter_seconds += time.perf_counter() - start

    def switch_off(self, error: Exception) -> None:
        """The drafter raised or broke its contract: no more calls to it in this engine, whose steps go on without
        drafts (the same tokens, at plain decoding's speed). Said once in the log, with the traceback, and on every
        request's stats from then on (`SpecStats.drafter_failure`: TensorBoard's spec/drafter_failed and
        spec/alarm)."""
        self.failure = f"drafter {self.name} switched off: {described(error)}"
        self.verifying, self.runner._sample.planning = {}, False
        if isinstance(self.drafter, ProcessDrafter):  # its process goes (it may be stuck in a call)
            self.drafter.end()
        log.error("%s; this engine decodes on without drafts", self.failure, exc_info=error)

    def settle(self, patience: float | None = None) -> float:
        """Waits for the drafts being prepared on the drafter's thread (decoupled), since no other call of the drafter
        may run meanwhile: `patience` seconds at most (None: until they are ready); returns the seconds waited. An
        error it raised there switches the drafter off."""
        waited = 0.0
        if self.ahead is not None and not self.failure:
            try:
                with self.watch.running("propose_ahead"):
                    waited = self.ahead.settle(patience)
            except Exception as e:
                self.switch_off(e)
        self.drafter_seconds, self.waited_total = self.drafter_seconds + waited, self.waited_total + waited
        return waited

    def call(self, hook: str, ask: Callable[[Drafter], Any], off=None):
        """`ask(drafter)`, a call of its `hook` outside proposing and committing (remember, new_policy, swap_weights,
        failures), once its thread has finished preparing drafts: `off` once the drafter is switched off, or when this
        call raises (which switches it off)."""
        self.settle()
        if not self.failure:
            try:
                with self.watch.running(hook), guarded(self.drafter):
                    return ask(self.drafter)
            except Exception as e:
                self.switch_off(e)
        return off

    def _observe_step(self, start: float, req_ids: list[str]) -> None:
        """Teaches the step cost the step that just ran if it continued the last batch; its error is charged to the
        requests of the next step (by the sampler)."""
        sampler, continuing = self.runner._sample, not self.live.isdisjoint(req_ids)
        self.live, sampler.step_error = set(req_ids), 0.0
        if self.step_end is None or not continuing or not sampler.step_tokens:
            return
        measured = start - self.step_end
        predicted = self.step_cost.observe(sampler.step_tokens, measured)
        sampler.step_error = abs(predicted - measured) / measured if predicted > 0 and measured > 0 else 0.0
        self.explore.took(min(measured, 2 * predicted) if predicted > 0 else measured)  # (a stall counts as 2 steps)

    def _draft(self, requests: list[tuple[int, DraftRequest]], drafts: list[list[int]], base_tokens: int,
               verify_all: bool) -> int:
        """Proposals for `requests` into `drafts`: all of each (`verify_all`) or, from a drafter that rates its
        tokens, the prefix whose calibrated gains pay for verifying it; returns the catch-up left to a preparation."""
        start = time.perf_counter()
        # what the bridge needs of each request, read before the drafter sees them (a plugin may write to them)
        asked = [(row, r.request_id, len(r.token_ids), r.position) for row, r in requests]
        unseen = sum(self._unseen(r) for _, r in requests)
        proposals, confidences, sources, prepared, caught_up = self._proposals([r for _, r in requests], base_tokens)
        elapsed, sampler = time.perf_counter() - start, self.runner._sample
        self.drafter_seconds, self.unseen_total = self.drafter_seconds + elapsed, self.unseen_total + unseen
        if any(proposals):  # (a step that skipped every miss says nothing of the drafter's confidences)
            self.rated = confidences is not None
        made = []
        for j, ((row, req_id, length, _), proposal) in enumerate(zip(asked, proposals)):
            self.shown[req_id] = length
            stats = sampler.stats_for(req_id)
            stats.draft_seconds += (elapsed + self.waited) / len(requests)  # what the engine waited for
            if proposal is None:  # a plugin's bad ids must not reach the engine: no draft this step, counted
                stats.invalid_drafts += 1
            rated = confidences[j] if confidences is not None else None
            made.append((row, req_id, proposal or [], rated))
        keep = [len(valid) for _, _, valid, _ in made]
        if confidences is not None and not verify_all:
            survive = self.survival.factors([position for *_, position in asked], self.k)
            keep, _ = plan([self.calibration.gains(rated) * survive[j, : len(rated)] if rated is not None else
                            self._gains([rid])[0][: len(valid)] for j, (_, rid, valid, rated) in enumerate(made)],
                           base_tokens, self.step_cost, None)  # (unrated: at its request's acceptance, as planned)
        for j, ((row, req_id, valid, rated), n) in enumerate(zip(made, keep)):
            drafts[row] = valid[:n]
            self.verifying[req_id] = (n, valid, rated)
            if n:  # a verify step: were its drafts prepared, and (a composite) whose are they
                stats = sampler.stats_for(req_id)
                stats.prepared_steps += j in prepared
                if sources and sources[j]:
                    stats.drafter_choices[sources[j]] = stats.drafter_choices.get(sources[j], 0) + 1
        # what drafting cost this step: the drafter's call and the bridge's work on its proposals
        if self.ahead is None:  # (decoupled: _proposals learns what drafting a miss costs)
            self.draft_cost.observe(max(len(valid) for _, _, valid, _ in made),
                                    sum(len(valid) for _, _, valid, _ in made), unseen, time.perf_counter() - start)
        return unseen - caught_up

    def _proposals(self, requests: list[DraftRequest], base_tokens: int
                   ) -> tuple[list, list | None, list[str] | None, set[int], int]:
        """Each request's proposal (its ids cut to its budget; None: not ids of the vocabulary) and confidences:
        prepared during the last step where its outcome was the one prepared for (decoupled), else asked of the
        drafter now in one call (decoupled: only where the cost model says drafting it now pays, else no drafts this
        step); a composite's member per request ("": none; None for a plain drafter); which were prepared; and what
        the misses drafted now caught up on (`_unseen`; 0 serial: `_draft` counts it)."""
        budgets = [r.max_tokens for r in requests]  # the bridge's (read before any call: a plugin may write to them)
        taken = ((j, self.ahead.take(r.request_id, r.token_ids)) for j, r in enumerate(requests)) if self.ahead else ()
        found = {j: got for j, got in taken if got is not None}  # j -> (proposal, confidences, source)
        prepared = set(found)
        asked = [(j, r) for j, r in enumerate(requests) if j not in found]
        if self.ahead is not None and asked:
            ready = [(requests[j].request_id, min(len(p), budgets[j])) for j, (p, _, _) in found.items()]
            asked = worth_drafting_now(asked, base_tokens, ready, self._gains, self.step_cost, self.draft_cost,
                                       self._unseen)
        start, unseen = time.perf_counter(), 0
        if asked:
            allowed = [r.max_tokens for _, r in asked]
            unseen = sum(self._unseen(r) for _, r in asked) if self.ahead is not None else 0
            with self.watch.running("propose"), guarded(self.drafter):
                fresh = self.drafter.propose([r for _, r in asked], max(allowed))
                fresh, rated = plain_answers(fresh, self.drafter.confidences(), allowed, self.vocab_size, self.name)
                sources = sources_within(self.drafter.sources(), len(asked), self.members, self.name) \
                    if isinstance(self.drafter, CompositeDrafter) else None
            if self.ahead is not None:  # what drafting the misses on the critical path costs
                lengths = [len(p or ()) for p in fresh]
                self.draft_cost.observe(max(lengths), sum(lengths), unseen, time.perf_counter() - start)
            found.update((j, (p, c, s)) for (j, _), p, c, s in zip(
                asked, fresh, [None] * len(asked) if rated is None else rated, sources or [""] * len(asked)))
        triples = [found.get(j, ([], None, "")) for j in range(len(requests))]  # skipped misses: no drafts
        proposals = [None if p is None else p[:budget] for (p, _, _), budget in zip(triples, budgets)]
        confidences = [None if c is None else c[:budget] for (_, c, _), budget in zip(triples, budgets)]
        any_rated = any(c is not None for c in confidences)
        sources = [str(s) for *_, s in triples] if isinstance(self.drafter, CompositeDrafter) else None
        return proposals, confidences if any_rated else None, sources, prepared, unseen

    def _gains(self, req_ids: list[str]) -> np.ndarray:
        """Per request (this step's), the expected committed tokens each of k draft tokens adds: reached and accepted
        at its acceptance rate, and inside the request (`Survival`)."""
        positions = [self.positions[r] for r in req_ids]
        return geometric(self.acceptance.rates(req_ids), self.k) * self.survival.factors(positions, self.k)

    def _unseen(self, request: DraftRequest) -> int:
        """History tokens the drafter would see for the first time (its catch-up) if `request` drafted now."""
        return len(request.token_ids) - self.shown.get(request.request_id, 0)
