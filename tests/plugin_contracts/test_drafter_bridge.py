"""What the engine side promises every drafter plugin (actor/draft_bridge.DrafterBridge), checked against a stand-in
for vLLM's model runner: commits always arrive, even on steps where the bridge does not draft, proposals with
ids outside the vocabulary never reach the engine (dropped and counted, the run goes on), and the draft planner
learns each request's acceptance from what the verifier committed and withholds drafts where they cannot pay, and a
drafter that raises or breaks its contract is switched off, the engine decoding on without it."""

import asyncio
import logging
import re
import threading
import time
from types import SimpleNamespace

import numpy as np
import torch
import pytest

from actor.draft_bridge import DrafterBridge
from actor.draft_planner import EXPLORE_EVERY, EXPLORE_SHARE, MEASURED_DRAFTS
from actor.drafter_checks import confidences_for, guarded, token_ids_within
from actor.vllm_hooks import (CoupledSampling, RequestRecord, caller_id, new_policy_version, remember_outputs,
                              stuck_drafter, swap_draft_weights)
from drafters.base import CompositeDrafter, Drafter
from drafters.calibration import EDGES

VOCAB = 100


class Recording(Drafter):
    def __init__(self, proposals: list[list]):
        self.proposals, self.commits, self.removed = proposals, [], []

    def propose(self, requests, k):
        return [list(p) for p in self.proposals[: len(requests)]]

    def commit(self, request_id, committed):
        self.commits.append((request_id, committed))

    def remove(self, request_id):
        self.removed.append(request_id)


def bridge(drafter: Drafter, req_ids: list[str], max_batch: int = 0, planning: bool = True, decoupled: bool = False,
           measured: bool = True) -> tuple[DrafterBridge, SimpleNamespace]:
    """A bridge over a stand-in runner; `measured`: its planner starts as if the drafter's acceptance were measured
    (a new planner explores every step until it is: `actor/draft_planner.Explore`)."""
    params = SimpleNamespace(seed=1, temperature=1.0, top_k=0, top_p=1.0, max_tokens=None)
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=req_ids, num_reqs=len(req_ids),
                                    num_prompt_tokens=np.full(len(req_ids), 3)),
        requests={r: SimpleNamespace(sampling_params=params) for r in req_ids},
        model_config=SimpleNamespace(get_vocab_size=lambda: VOCAB, max_model_len=1024))
    runner._sample = CoupledSampling(runner)  # where the bridge keeps per-request counts
    b = DrafterBridge(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4)))
    b.bind(runner, drafter, max_batch, planning, decoupled)
    b.acceptance.verified = MEASURED_DRAFTS if measured else 0
    return b, runner


def propose(b: DrafterBridge, committed: list[list[int]]) -> list[list[int]]:
    history = np.arange(40).reshape(len(committed), -1) % VOCAB
    return b.propose(committed, np.full(len(committed), 8), history)


def test_commits_reach_the_drafter_on_steps_without_drafting():
    drafter = Recording([[1, 2], [3]])
    b, runner = bridge(drafter, ["a-x", "b-y"], max_batch=1)  # two requests > max_batch: no drafts this step
    assert propose(b, [[5], [6, 7]]) == [[], []]
    assert drafter.commits == [("a-x", [5]), ("b-y", [6, 7])]
    assert not runner._sample.planning  # nothing planned above the bound: no planned steps counted


def test_invalid_proposals_are_dropped_and_counted_per_request():
    drafter = Recording([[1, 2], [-1], [VOCAB + 5], ["7"], [99, 3.5]])
    b, runner = bridge(drafter, ["a-1", "b-1", "c-1", "d-1", "e-1"])
    assert propose(b, [[5]] * 5) == [[1, 2], [], [], [], []]
    records: dict[str, RequestRecord] = runner._sample.records
    assert {r: c.stats.invalid_drafts for r, c in records.items()} == {"a": 0, "b": 1, "c": 1, "d": 1, "e": 1}
    assert token_ids_within([True, 1], 4, VOCAB) is None and token_ids_within([np.int64(1), 2, 3], 2, VOCAB) == [1, 2]
    assert all(c.stats.draft_seconds > 0 for c in records.values())  # each request's share of the drafter's time


def test_planner_learns_acceptance_from_commits_and_withholds_drafts_that_cannot_pay():
    drafter = Recording([[1, 2, 3], [4, 5, 6]])
    b, runner = bridge(drafter, ["a-1", "b-1"])
    assert propose(b, [[5], [6]]) == [[1, 2, 3], [4, 5, 6]]  # nothing measured yet: drafting looks free
    propose(b, [[1, 2, 3, 9], [4, 8]])  # a: all 3 drafts accepted (+ the bonus token); b: 1 of 3, then a rejection
    rate_a, rate_b = b.acceptance.rates(["a-1", "b-1"])
    assert rate_a > rate_b
    for tokens in range(1, 64):  # the engine turns out compute-bound: every token costs its share of the step
        b.step_cost.observe(tokens, 0.01 * tokens)
    assert propose(b, [[7], [7]]) == [[], []]
    stats = runner._sample.records["a"].stats
    assert stats.planned_tokens == 3 + 3  # 3 drafts handed over twice, then 0
    assert runner._sample.planning  # the sampler counts the planned steps (tests/test_vllm_hooks.py)
    assert drafter.commits[-2:] == [("a-1", [7]), ("b-1", [7])]  # commits still reach the drafter


def test_the_step_cost_learns_each_step_that_continued_the_last_batch_and_no_other():
    """A step that ran any request of the last batch on is an engine step of the batch the planner planned (after
    requests left, with vLLM's work on them: actors batch continuously, and requests leave at nearly every step); a
    step that ran none of them (a new batch, its prefill) is not."""
    b, runner = bridge(Recording([[], []]), ["a-1", "b-1"])
    runner._sample.step_tokens = 2
    propose(b, [[5], [6]])  # the first step: nothing before it to time
    propose(b, [[5], [6]])  # the batch ran on: learned (1 token a request: the 2-token bucket)
    assert b.step_cost.seen.tolist().index(True) == 2 and b.step_cost.seen.sum() == 1
    runner.input_batch.req_ids, runner.input_batch.num_reqs, runner._sample.step_tokens = ["a-1"], 1, 1
    propose(b, [[7]])  # b-1 left after the last step, a-1 ran on: learned (the 1-token bucket)
    assert b.step_cost.seen[0] and b.step_cost.seen.sum() == 2
    runner.requests["c-1"] = runner.requests["a-1"]
    runner.input_batch.req_ids, runner._sample.step_tokens = ["c-1"], 3
    propose(b, [[8]])  # none of the last batch ran on: not learned
    assert b.step_cost.seen.sum() == 2


def test_the_planner_drafts_nothing_past_where_requests_end():
    """A draft past a request's end commits nothing: once requests have ended after 6 tokens, a request with 5 out
    gets no drafts (its next token is its last), where a bridge that has seen no request end drafts."""
    ended, fresh = (bridge(Recording([[1, 2, 3, 4]]), ["a-1"])[0] for _ in range(2))
    for b in (ended, fresh):  # a step costs the same whatever it verifies; a draft pass a tenth of a step
        for tokens in range(1, 64):
            b.step_cost.observe(tokens, 0.01)
        for passes in (1, 2, 3, 4, 1, 2, 3, 4):
            b.draft_cost.observe(passes, passes, 0, 0.001 * passes)
    for _ in range(30):
        ended.survival.ended(6)
    assert propose(fresh, [[5]])[0]  # 8 tokens in the engine, 3 of them the prompt: 5 out
    assert propose(ended, [[5]]) == [[]]
    b, runner = bridge(Recording([[1]] * 2), ["a-1", "b-1"])
    propose(b, [[5], [6]])
    runner.input_batch.req_ids, runner.input_batch.num_reqs = ["a-1"], 1
    del runner.requests["b-1"]  # b-1 ended after that step: 5 tokens out then, at least one more since
    propose(b, [[7]])
    assert b.survival.ended_at[6] == 1.0 and b.survival.ended_at[:-1].sum() == 1.0


def test_without_the_planner_every_request_gets_k():
    b, _ = bridge(Recording([[1, 2, 3, 4, 5, 6]] * 2), ["a-1", "b-1"], planning=False)
    for tokens in range(1, 64):
        b.step_cost.observe(tokens, 0.01 * tokens)
    assert propose(b, [[5], [6]]) == [[1, 2, 3, 4], [1, 2, 3, 4]]


class Rated(Recording):
    def __init__(self, proposals: list[list], confidences: list[list]):
        super().__init__(proposals)
        self.rated = confidences

    def propose(self, requests, k):
        self.asked = len(requests)
        return super().propose(requests, k)

    def confidences(self):
        return [list(c) for c in self.rated[: self.asked]]


def test_a_rated_proposal_is_verified_as_far_as_its_calibrated_gains_pay_and_labelled_beyond():
    drafter = Rated([[1, 2, 3, 4]], [[0.999, 0.999, 0.1, 0.1]])
    b, runner = bridge(drafter, ["a-1"])
    assert propose(b, [[5]]) == [[1, 2, 3, 4]]  # nothing measured yet: drafting and verifying look free
    propose(b, [[1, 2, 3, 4, 9]])  # every draft accepted so far: this request is worth drafting for
    for _ in range(300):  # labels so far: sure tokens are accepted, unsure ones rejected
        b.calibration.observe([0.999, 0.1], [1, 2], [1, 7])
    for tokens in range(1, 64):  # verifying a token costs a tenth of a decode step
        b.step_cost.observe(tokens, 0.01 + 0.001 * tokens)
    assert propose(b, [[1, 2, 3, 4, 9]]) == [[1, 2]]  # 4 drafted (at its acceptance), the sure 2 verified
    assert b.verifying["a-1"] == (2, [1, 2, 3, 4], [0.999, 0.999, 0.1, 0.1])
    assert runner._sample.records["a"].stats.planned_tokens == 4 + 4 + 2
    unsure = int(np.searchsorted(EDGES, 0.1, side="right"))
    agreed = b.calibration.agreed[unsure]
    propose(b, [[1, 2, 3]])  # both accepted, and the bonus token 3 is the third draft: a label it had not earned
    assert b.calibration.agreed[unsure] > agreed
    drafter.rated = [[0.1] * 4]  # every token unsure: drafted, none verified, and that plan drafted nothing (`Rest`)
    idle = b.rest.idle
    assert propose(b, [[1, 2, 3]]) == [[]] and b.rest.idle == idle + 1
    b.planning = False
    assert propose(b, [[1, 2, 3]]) == [[1, 2, 3, 4]]  # without the planner: every drafted token


def test_a_proposal_without_ratings_in_a_rated_step_is_verified_at_its_requests_acceptance():
    """A drafter may rate some proposals and not others (`confidences`: None for a request): the unrated one is
    verified as far as its request's acceptance pays, as it was planned, not dropped for want of ratings."""
    class PartlyRated(Rated):
        def confidences(self):
            return [[0.999, 0.999], None][: self.asked]

    b, _ = bridge(PartlyRated([[1, 2], [3, 4]], None), ["a-1", "b-1"])
    for tokens in range(1, 64):  # verifying a token costs a hundredth of a decode step
        b.step_cost.observe(tokens, 0.01 + 0.0001 * tokens)
    for req_id in ("a-1", "b-1"):
        b.acceptance.observe(req_id, 4, 4)
    assert propose(b, [[5], [6]]) == [[1, 2], [3, 4]]
    assert b.verifying["b-1"] == (2, [3, 4], None)


def test_a_rated_drafter_is_not_asked_for_drafts_its_requests_keep_refusing():
    """Drafting is paid before the confidences are known: the first plan prices a request's drafts at what it has
    accepted so far, however sure the drafter claims to be (the second plan only trims what was drafted)."""
    drafter = Rated([[1, 2, 3, 4]] * 2, [[0.999] * 4] * 2)
    b, _ = bridge(drafter, ["a-1", "b-1"])
    propose(b, [[5], [5]])
    for _ in range(5):  # a: every draft accepted; b: its first draft rejected every time
        propose(b, [[1, 2, 3, 4, 9], [7]])
    for tokens in range(1, 64):
        b.step_cost.observe(tokens, 0.01 + 0.001 * tokens)
    b.draft_cost.observe(4, 8, 0, 0.004)  # a drafting pass costs what verifying 4 tokens does
    drafts = propose(b, [[1, 2, 3, 4, 9], [7]])
    assert drafts[0] and drafts[1] == []
    assert b.verifying.keys() == {"a-1"}  # b was not drafted for at all


def test_confidences_that_do_not_rate_every_draft_token_switch_the_drafter_off_with_its_name(caplog):
    b, runner = bridge(Rated([[1, 2]], [[0.5]]), ["a-1"])
    with caplog.at_level(logging.ERROR, logger="actor.draft_bridge"):
        assert propose(b, [[5]]) == [[]]
    assert "Rated: 1 confidences for a proposal of 2 tokens" in b.failure
    assert runner._sample.records["a"].stats.drafter_failure == b.failure and b.failure in caplog.text
    assert not runner._sample.planning  # switched off: no step is planned from now on


class Raises(Recording, CompositeDrafter):
    """Proposes like Recording until its `fail_at`-th call of `method`, which raises (a composite without members
    switched off, so that `member_labels` is called too)."""

    def member_labels(self):
        return {}

    def failures(self):
        return []

    def sources(self):
        return [""] * 2

    def __init__(self, method: str, fail_at: int):
        super().__init__([[1, 2], [3, 4]])
        self.calls, self.method, self.fail_at = 0, method, fail_at

    def __getattribute__(self, name):
        if name == object.__getattribute__(self, "method"):
            self.calls += 1
            if self.calls == self.fail_at:
                raise IndexError(f"{name} broke")
        return object.__getattribute__(self, name)


@pytest.mark.parametrize("method", ["propose", "commit", "remove", "member_labels", "new_policy"])
def test_a_drafter_that_raises_is_switched_off_and_the_engine_decodes_on_without_it(method, caplog):
    """A plugin's exception must not kill the rollout (a dead engine, a restarted actor, the same exception again):
    drafts only save time, so the engine goes on without them. The drafter is never called again, the log says why
    once with the traceback, and every request from then on carries the reason (TensorBoard's spec/alarm)."""
    drafter = Raises(method, fail_at=1 if method in ("remove", "new_policy") else 2)
    b, runner = bridge(drafter, ["a-1", "b-1"])
    with caplog.at_level(logging.ERROR, logger="actor.draft_bridge"):
        if method == "new_policy":
            new_policy_version(SimpleNamespace(model_runner=SimpleNamespace(drafter=b)), 3)
        assert propose(b, [[5], [6]]) in ([[1, 2], [3, 4]], [[], []])
        if method == "remove":  # a request leaves the engine: the drafter is told
            del runner.requests["b-1"]
            runner.input_batch.req_ids, runner.input_batch.num_reqs = ["a-1"], 1
            assert propose(b, [[5]]) == [[]]
        else:
            assert propose(b, [[1, 2, 9], [3, 7]]) == [[], []]
        calls, commits = drafter.calls, len(drafter.commits)
        for _ in range(3):
            assert propose(b, [[5]] * runner.input_batch.num_reqs) == [[]] * runner.input_batch.num_reqs
    assert b.failure.startswith("drafter Raises switched off: IndexError: ") and "broke" in b.failure
    assert drafter.calls == calls and len(drafter.commits) == commits  # never called again
    assert caplog.text.count("switched off") == 1 and "Traceback" in caplog.text
    live = [caller_id(r) for r in runner.input_batch.req_ids]  # (in the "remove" case b-1 left before the failure)
    assert [runner._sample.records[r].stats.drafter_failure for r in live] == [b.failure] * len(live)
    worker = SimpleNamespace(model_runner=SimpleNamespace(drafter=b))
    remember_outputs(worker, [([1], [2], 0)])
    assert swap_draft_weights(worker, [("w", 0)])  # taken and dropped: the engine no longer drafts


def test_confidences_are_read_as_probabilities_and_non_numbers_stop_the_engine_with_the_drafters_name():
    """Out of [0, 1] is clamped, NaN counts as 0 (never as sure), numpy and int values are read as floats; extra
    confidences past the proposal are ignored."""
    assert confidences_for([float("nan"), -0.5, 1.7, np.float32(0.25), 1, 0.9], 5, "D") == [0.0, 0.0, 1.0, 0.25, 1.0]
    for bad in (["sure"], [None], [[0.5]], ["0.9"], [b"0.9"], "11"):  # (float() parses text)
        with pytest.raises(RuntimeError, match="drafter D: confidences must be numbers"):
            confidences_for(bad, 1, "D")


def test_during_the_planners_rest_the_drafter_hears_every_commit_once_in_order_even_of_a_request_that_ends():
    """A step of rest does no work per request: the drafter hears its commits at the next plan (read from the
    engine's buffer), or, for a request vLLM drops meanwhile, from vLLM's hook as it drops it, before its removal;
    a request preempted at the plan after a rest hears that rest's tokens once it is back."""
    class HeardAtRemoval(Recording):
        def remove(self, request_id):  # what it had heard of the request when it was removed
            self.removed.append((request_id, self.heard(request_id)))

        def heard(self, request_id):
            return [t for r, ids in self.commits if r == request_id for t in ids]

    drafter = HeardAtRemoval([[], [], []])
    b, runner = bridge(drafter, ["a-1", "b-1", "p-1"])
    outputs: dict[str, list[int]] = {r: [] for r in runner.requests}  # 3 prompt tokens each
    dropped = []
    runner._on_request_state_removed = lambda req_id, state: dropped.append(req_id)  # vLLM's own hook (a no-op)
    b.bind(runner, drafter, 0, True)  # binds over it

    def step(batch: list[str], committed: list[list[int]]) -> list[list[int]]:  # the engine's rows, condensed
        runner.input_batch.req_ids, runner.input_batch.num_reqs = batch, len(batch)
        runner.input_batch.num_prompt_tokens = np.full(len(batch), 3)
        for req_id, ids in zip(batch, committed):
            outputs.setdefault(req_id, []).extend(ids)
        buffer = np.zeros((len(batch), 32), dtype=np.int64)
        for row, req_id in enumerate(batch):
            buffer[row, 3 : 3 + len(outputs[req_id])] = outputs[req_id]
        return b.propose(committed, np.array([3 + len(outputs[r]) for r in batch]), buffer)

    def leaves(req_id: str) -> None:  # vLLM drops it (it finished), its state with it
        runner._on_request_state_removed(req_id, SimpleNamespace(prompt_token_ids=[0, 0, 0],
                                                                 output_token_ids=list(outputs[req_id])))
        del runner.requests[req_id]

    for tokens in range(1, 64):  # a compute-bound engine: the planner plans no drafts
        b.step_cost.observe(tokens, 0.01 * tokens)
    assert step(["a-1", "b-1", "p-1"], [[10], [20], [40]]) == [[]] * 3  # a plan
    heard = len(drafter.commits)
    b.rest.rows, b.rest.left = 3, 3  # the planner rests for the next 3 steps
    assert step(["a-1", "b-1", "p-1"], [[11, 12], [21], [41]]) == [[]] * 3
    assert step(["a-1", "b-1", "p-1"], [[13], [22], [42]]) == [[]] * 3
    runner.requests["c-1"] = runner.requests["a-1"]
    assert step(["a-1", "b-1", "p-1", "c-1"], [[14], [23], [43], [30]]) == [[]] * 4  # c-1 came
    assert len(drafter.commits) == heard  # nothing heard during the rest
    leaves("b-1"), leaves("c-1")  # both ended at the last step; c-1 came and went during the rest
    step(["a-1"], [[15]])  # the batch shrank: a plan again; p-1 is preempted (still held, out of the batch)
    b.rest.left = 0  # (two plans of no drafts: the planner would rest again)
    step(["a-1", "p-1"], [[16], [44]])  # p-1 is back at a plan that follows none of the rest
    assert dropped == ["b-1", "c-1"]  # vLLM's own hook still runs
    for req_id in outputs:
        assert drafter.heard(req_id) == outputs[req_id]
    assert drafter.removed == [("b-1", outputs["b-1"]), ("c-1", outputs["c-1"])]  # each heard whole, then removed
    ended = b.survival.ended_at[:-1]  # where each ended (its output length + 1), the older discounted once
    assert ended[len(outputs["b-1"]) + 1] > 0.99 and ended[len(outputs["c-1"]) + 1] == 1.0 and ended.sum() < 2
    assert set(b.positions) == set(b.commits.told) == {"a-1", "p-1"} and not b.commits.tails  # nothing kept


def test_a_planner_that_drafts_nothing_explores_one_request_at_about_a_hundredth_of_the_engines_time(monkeypatch):
    """Where no drafting pays, the bridge rests, and every so often drafts for one request anyway (`Explore`): first
    after EXPLORE_EVERY steps, then only once the engine's steps since took 1 / EXPLORE_SHARE times what that
    exploring step cost (its drafting and the verify tokens it added)."""
    clock = [0.0]  # the bridge's clock: 10 ms of engine between steps, 5 ms in each drafter call

    class Slow(Recording):
        def propose(self, requests, k):
            clock[0] += 0.005
            return super().propose(requests, k)

    monkeypatch.setattr("actor.draft_bridge.time.perf_counter", lambda: clock[0])
    b, runner = bridge(Slow([[1, 2, 3, 4]] * 2), ["a-1", "b-1"])
    for tokens in range(1, 64):  # a compute-bound engine: verifying a token costs a request's share of a step
        b.step_cost.observe(tokens, 0.005 * tokens)
    runner._sample.step_tokens = 2

    def steps_until_drafts() -> int:
        for n in range(1, 2000):
            clock[0] += 0.01
            drafts = propose(b, [[5], [6]])
            if any(drafts):
                assert sorted(map(len, drafts)) == [0, 4]  # one request, all its drafts
                return n
        raise AssertionError("never explored")

    assert steps_until_drafts() == EXPLORE_EVERY + 1  # nothing explored before: the step count alone
    assert b.explore.cost == pytest.approx(0.005 + 4 * 0.005, rel=0.3)  # its drafting and its 4 verify tokens
    propose(b, [[5, 1], [6]])  # the verify step
    assert 0.8 < steps_until_drafts() * 0.01 * EXPLORE_SHARE / b.explore.cost < 1.2


def test_a_drafters_commits_count_as_its_own_time_not_the_bridges(monkeypatch):
    """The per-step profile (bench.rollout, bench.exactness) splits the bridge's work from the plugin's: a drafter
    whose commit() is slow shows up as drafter time."""

    clock = [0.0]  # the bridge's clock, which only the drafter's commits move

    class SlowCommits(Recording):
        def commit(self, request_id, committed):
            clock[0] += 1.0

    monkeypatch.setattr("actor.draft_bridge.time.perf_counter", lambda: clock[0])
    b, _ = bridge(SlowCommits([[1], [2]]), ["a-1", "b-1"], max_batch=1)  # no drafting: only the commits
    propose(b, [[5], [6]])
    assert b.drafter_seconds == 2.0 and b.seconds == 2.0  # all of the step's time is the drafter's


class Reports(Recording, CompositeDrafter):
    """A composite whose reports are `sources`, `labels` and `failed` as given."""

    def __init__(self, sources=("m", "m"), labels=None, failed=()):
        super().__init__([[1, 2], [3, 4]])
        self.names, self.labels, self.failed = sources, labels or {}, failed

    def sources(self):
        return list(self.names)

    def member_labels(self):
        return self.labels

    def failures(self):
        return list(self.failed)


def test_a_composites_member_switched_off_is_reported_while_the_composite_drafts_on():
    b, runner = bridge(Reports(failed=["member m switched off: KeyError: 'x'"]), ["a-1", "b-1"])
    assert propose(b, [[5], [6]]) == [[1, 2], [3, 4]] and not b.failure
    assert [c.stats.drafter_failure for c in runner._sample.records.values()] == [
        "drafter Reports: member m switched off: KeyError: 'x'"] * 2


class Writes(Recording):
    """Writes into the history it is handed (the engine's own input buffer: its last element is the token the
    target just sampled, which the next step feeds the model)."""

    def propose(self, requests, k):
        requests[0].token_ids[-1] = 0
        return super().propose(requests, k)


class Retunes(Recording):
    """Changes torch's process-wide settings, which the target shares."""

    def propose(self, requests, k):
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(True)
        return super().propose(requests, k)


class RetunesBackends(Recording):
    """Changes a backend's fp32 precision (after which torch.get_float32_matmul_precision raises) and where tensors
    are made by default."""

    def propose(self, requests, k):
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        torch.set_default_device("meta")
        return super().propose(requests, k)


@pytest.mark.parametrize("drafter, reason", [
    (Writes, "ValueError: assignment destination is read-only"),
    (Retunes, "changed torch.get_default_dtype(), torch.is_grad_enabled()"),
    (RetunesBackends, "changed torch.get_default_device(), torch.backends.mkldnn.matmul.fp32_precision")])
def test_a_drafter_cannot_change_what_the_target_is_fed_or_how_it_computes(drafter, reason):
    """The boundary: a drafter's history is a read-only view of the engine's buffer (a write raises inside the
    drafter), and torch's process-wide settings a drafter changed are set back after its call; either way it is
    switched off and the engine's inputs and settings are what they were."""
    b, runner = bridge(drafter([[1, 2], [3, 4]]), ["a-1", "b-1"])
    history = np.arange(40).reshape(2, -1) % VOCAB
    kept = history.copy()
    with torch.no_grad():
        dtype, precision = torch.get_default_dtype(), torch.get_float32_matmul_precision()
        assert b.propose([[5], [6]], np.full(2, 8), history) == [[], []]
        assert torch.get_default_dtype() == dtype and not torch.is_grad_enabled()
        assert torch.empty(1).device.type == "cpu" and torch.get_float32_matmul_precision() == precision
    assert np.array_equal(history, kept) and history.flags.writeable  # the buffer itself stays the engine's
    assert reason in b.failure


def test_drafts_stop_at_the_requests_last_token():
    """A verify step emits up to drafts + 1 tokens: a request 2 tokens short of `max_tokens` is asked for 1 draft,
    one at its last token for none (drafting past the end is work thrown away)."""
    class Budgets(Recording):
        def propose(self, requests, k):
            self.asked = {r.request_id: r.max_tokens for r in requests}
            return [[1, 2, 3, 4][: r.max_tokens] for r in requests]

    drafter = Budgets([])
    b, runner = bridge(drafter, ["a-1", "b-1", "c-1", "d-1"], planning=False)
    for req_id, max_tokens in (("a-1", 7), ("b-1", 6), ("c-1", 100), ("d-1", 8)):  # 8 tokens, 3 prompt: position 5
        runner.requests[req_id] = SimpleNamespace(sampling_params=SimpleNamespace(
            seed=1, temperature=1.0, top_k=0, top_p=1.0, max_tokens=max_tokens))
    assert propose(b, [[5], [6], [7], [8]]) == [[1], [], [1, 2, 3, 4], [1, 2]]
    assert drafter.asked == {"a-1": 1, "c-1": 4, "d-1": 2}


class Ahead(Recording):
    """Prepares drafts ahead slowly, and notes any call that overlaps that preparation."""

    def __init__(self, proposals):
        super().__init__(proposals)
        self.busy, self.overlaps, self.ahead_calls = False, [], 0

    def propose_ahead(self, requests, k):
        import time

        self.busy = True
        time.sleep(0.2)
        self.busy, self.ahead_calls = False, self.ahead_calls + 1
        return [[7, 8, 9] for _ in requests]

    def new_policy(self, version):
        self.overlaps.append(("new_policy", self.busy))

    def commit(self, request_id, committed):
        self.overlaps.append(("commit", self.busy))
        super().commit(request_id, committed)


def test_decoupled_drafts_are_prepared_on_a_thread_and_no_other_call_overlaps_it():
    drafter = Ahead([[1, 2], [3]])
    b, _ = bridge(drafter, ["a-x", "b-y"], planning=False, decoupled=True)
    assert propose(b, [[5], [6]]) == [[1, 2], [3]]  # the drafts for the next step; the thread prepares the one after
    new_policy_version(SimpleNamespace(model_runner=SimpleNamespace(drafter=b)), 1)  # between steps: it waits
    propose(b, [[5], [6]])  # the next step: it waits for the thread before telling the drafter anything
    b.settle()  # (the step after that would wait for the third preparation too)
    assert drafter.ahead_calls == 2 and drafter.overlaps and not any(busy for _, busy in drafter.overlaps)


class ReshapesItsHistories(Ahead):
    """Gives each history it is handed a batch dimension, in place (an old idiom), and notes what it prepares from."""

    def propose(self, requests, k):
        for r in requests:
            r.token_ids.shape = (1, -1)
        return super().propose(requests, k)

    def propose_ahead(self, requests, k):
        self.histories = [np.asarray(r.token_ids).tolist() for r in requests]
        return super().propose_ahead(requests, k)


def test_what_a_drafter_does_to_the_view_it_is_handed_never_reaches_the_drafts_prepared_after_it():
    drafter = ReshapesItsHistories([[1, 2], [3]])
    b, _ = bridge(drafter, ["a-x", "b-y"], planning=False, decoupled=True)
    assert propose(b, [[5], [6]]) == [[1, 2], [3]]
    b.settle()
    assert not b.failure and drafter.ahead_calls == 1
    history = (np.arange(40).reshape(2, -1) % VOCAB)[:, :8].tolist()
    assert drafter.histories == [history[0] + [1, 2], history[1] + [3]]  # each history and its drafts, flat


def test_a_preparation_that_outlasts_a_step_is_not_waited_for_and_no_call_overlaps_it():
    """Decoupled, the engine waits for the drafter's thread half a step at most (the step cost's prediction), once:
    past it the step drafts nothing and calls the drafter nowhere, and so does the next without waiting again; the
    drafts it verified are still observed, and the next plan tells the drafter every token committed meanwhile, once
    and in order."""
    drafter = Ahead([[1, 2], [3]])  # (it prepares for 0.2 s)
    b, runner = bridge(drafter, ["a-x", "b-y"], planning=False, decoupled=True)
    b.step_cost.observe(2, 0.01)  # a step measured: 10 ms
    history = np.arange(40).reshape(2, -1) % VOCAB
    assert b.propose([[5], [6]], np.array([8, 8]), history) == [[1, 2], [3]]
    verified = b.acceptance.verified
    charged = sum(r.stats.draft_seconds for r in runner._sample.records.values())
    assert b.propose([[8, 9], [28]], np.array([10, 9]), history) == [[], []]  # its preparation still runs
    assert 0.004 < b.waited < 0.1 and b.ahead.busy and b.ahead.busy_steps == 1
    assert sum(r.stats.draft_seconds for r in runner._sample.records.values()) == pytest.approx(charged + b.waited)
    assert b.acceptance.verified == verified + 3  # a-x's 2 drafts (1 accepted) and b-y's 1 (rejected) observed
    assert b.propose([[10], [29]], np.array([11, 10]), history) == [[], []]  # still preparing: not waited for again
    assert b.waited < 0.004 and b.ahead.busy_steps == 2
    new_policy_version(SimpleNamespace(model_runner=SimpleNamespace(drafter=b)), 1)  # between steps: it waits
    time.sleep(0.3)
    assert b.propose([[11], [30]], np.array([12, 11]), history) == [[1, 2], [3]]
    assert drafter.commits == [("a-x", [5]), ("b-y", [6]), ("a-x", [8, 9, 10, 11]), ("b-y", [28, 29, 30])]
    b.settle()
    assert drafter.ahead_calls == 2 and ("new_policy", False) in drafter.overlaps  # (none launched while busy)
    assert not any(busy for _, busy in drafter.overlaps)


def test_a_drafter_that_prepares_rejections_is_asked_for_the_outcomes_with_a_rejected_draft():
    class Outcomes(Ahead):
        prepares_rejections = True

        def propose_ahead(self, requests, k):
            self.asked = [(r.request_id, r.unverified, r.rejected) for r in requests]
            return [[9] for _ in requests]

    drafter = Outcomes([[1, 2], [3]])
    b, _ = bridge(drafter, ["a-x", "b-y"], planning=False, decoupled=True)
    chains = [("a-x", 2, None), ("b-y", 1, None)]  # every draft accepted: always asked for
    propose(b, [[5], [6]])
    b.settle()
    assert drafter.asked == chains  # the thread's cost and the step not measured yet: the likeliest outcomes only
    assert b.ahead.cost.coef.any()  # the thread's cost, learned from its calls
    b.step_cost.observe(2, 1.0)  # a step measured (this harness runs none): a second for the step verifying
    propose(b, [[5, 9, 9], [6, 9]])
    b.settle()
    assert drafter.asked[:2] == chains and sorted(drafter.asked[2:]) == [("a-x", 0, 1), ("a-x", 1, 2), ("b-y", 0, 3)]


def test_the_threads_cost_counts_what_a_preparation_catches_up_on_not_what_drafting_a_miss_now_did():
    """Decoupled: the history a preparation reads for the first time goes into the thread's cost (it fits further
    outcomes into the step with it); a miss drafted at once caught up on the engine's thread, where that cost is the
    critical path's, and is not counted again."""
    class Quick(Ahead):
        def propose_ahead(self, requests, k):
            return [[7, 8, 9] for _ in requests]

    b, _ = bridge(Quick([[1, 2], [3]]), ["a-x", "b-y"], planning=False, decoupled=True)
    assert propose(b, [[5], [6]]) == [[1, 2], [3]]  # nothing prepared yet, drafting now looks free: drafted at once
    b.settle()
    assert b.ahead.cost.measured and b.ahead.cost.gram[3, 3] == 0
    skips, _ = bridge(Quick([[1, 2], [3]]), ["a-x", "b-y"], planning=False, decoupled=True)
    skips.step_cost.observe(2, 0.001)
    for unseen in (8, 16):  # drafting now costs a second against a 1 ms step: it never pays
        skips.draft_cost.observe(4, 8, unseen, 1.0)
    assert propose(skips, [[5], [6]]) == [[], []]
    skips.settle()
    assert skips.ahead.cost.gram[3, 3] == 16**2  # the two requests' 8 history tokens each, read by the preparation


def test_a_decoupled_plan_counts_prepared_drafts_as_free_except_when_it_explores():
    """Prepared drafts cost the engine nothing, so a decoupled plan weighs only verifying them; an exploring step
    (the acceptance not measured yet) is to measure, and plans as serial drafting does: counted free, it drafted for
    a whole batch of 128 at the answers' first tokens, whose rejections then kept later drafts few."""
    req_ids = [f"r{i}-x" for i in range(8)]
    b, _ = bridge(Ahead([]), req_ids, decoupled=True, measured=False)
    for tokens in (8, 16, 40):  # a step's cost by its tokens: verifying drafts costs little (as on a GPU)
        b.step_cost.observe(tokens, 0.01 + 0.00002 * tokens)
    for passes, drafted in ((4, 4), (4, 32)):  # drafting now: 50 ms whatever is drafted
        b.draft_cost.observe(passes, drafted, 8, 0.05)
    rows, lengths = list(range(8)), [8] * 8
    b.positions.update(dict.fromkeys(req_ids, 5))  # (output positions, as a step records them)
    budgets, explore = b._plan(req_ids, rows, lengths)
    assert explore and sum(map(bool, budgets)) == 1  # as serial: drafting does not pay, one request explores
    b.acceptance.verified = MEASURED_DRAFTS  # measured (and at 0.9), no longer exploring: prepared drafts are free
    for req_id in req_ids:
        b.acceptance.observe(req_id, 4, 4)
    b.explore.life = EXPLORE_EVERY
    budgets, explore = b._plan(req_ids, rows, lengths)
    assert not explore and all(budgets)


def test_a_decoupled_drafter_that_rates_its_tokens_drafts_k_for_every_request_serial_plans_by_acceptance():
    """A request's acceptance cannot tell its sure tokens from its unsure ones: at half its drafts accepted and a step
    that costs as many tokens as it computes, the plan gives it none. Decoupled, drafts are prepared off the engine's
    critical path and a rated drafter's are verified only as far as their calibrated gains pay (`_draft`), so every
    request drafts k while its drafts are verified (after two steps of none it plans by acceptance, and may rest);
    serial drafting pays for every token it drafts and still plans by acceptance; an exploring step plans as
    serial."""
    req_ids, rows, lengths = [f"r{i}-x" for i in range(8)], list(range(8)), [8] * 8
    for decoupled, expected in ((True, [4] * 8), (False, [0] * 8)):
        b, _ = bridge(Ahead([]), req_ids, decoupled=decoupled)
        for tokens in (8, 16, 40):  # compute-bound: a verified token costs what a decoded one does
            b.step_cost.observe(tokens, 0.001 * tokens)
        for req_id in req_ids:
            b.acceptance.observe(req_id, 4, 1)
        b.positions.update(dict.fromkeys(req_ids, 5))
        assert b._plan(req_ids, rows, lengths) == ([0] * 8, False)  # no ratings seen yet: by acceptance
        b.rated = True
        assert b._plan(req_ids, rows, lengths) == (expected, False)
        for _ in range(2):  # two plans whose drafts were all cut
            b.rest.planned(len(req_ids), False)
        assert b._plan(req_ids, rows, lengths) == ([0] * 8, False)
        b.rest.planned(len(req_ids), True)  # a step verified drafts again
        assert b._plan(req_ids, rows, lengths) == (expected, False)
        b.explore.steps, b.explore.seconds = EXPLORE_EVERY, 1.0  # an exploring step: one request, as serial
        budgets, explore = b._plan(req_ids, rows, lengths)
        assert explore and sum(map(bool, budgets)) == 1


class Reorders(Ahead):
    """Sorts the outcomes it is asked about in place (for its own batching), and answers in the order given:
    b's guess and drafts (7, 8, 9), then a's (3, 4, 5)."""

    def propose_ahead(self, requests, k):
        given = [r.request_id for r in requests]
        requests.sort(key=lambda r: r.request_id, reverse=True)
        return [[7, 8, 9] if rid == "b-y" else [3, 4, 5] for rid in given]


class WritesAhead(Ahead):
    def propose_ahead(self, requests, k):
        requests[0].token_ids[0] = 5
        return [[7] for _ in requests]


def test_what_propose_ahead_is_handed_is_its_own_to_reorder_and_cannot_be_written():
    b, _ = bridge(Reorders([[1, 2], [3]]), ["a-x", "b-y"], planning=False, decoupled=True)
    history = np.zeros((2, 16), dtype=np.int64)
    assert b.propose([[5], [6]], np.array([8, 8]), history) == [[1, 2], [3]]
    history[0, 8:11] = [1, 2, 3]  # a: both drafts and its guess committed; b: its draft and its guess
    history[1, 8:10] = [3, 7]
    assert b.propose([[1, 2, 3], [3, 7]], np.array([11, 10]), history) == [[4, 5], [8, 9]]  # each its own
    b, _ = bridge(WritesAhead([[1, 2], [3]]), ["a-x", "b-y"], planning=False, decoupled=True)
    propose(b, [[5], [6]])
    assert propose(b, [[5], [6]]) == [[], []] and "read-only" in b.failure


def test_a_composites_prepared_drafts_count_for_the_member_that_prepared_them():
    class Composite(Ahead, CompositeDrafter):
        def propose(self, requests, k):
            self.named = ["serial"] * len(requests)
            return super().propose(requests, k)

        def propose_ahead(self, requests, k):
            self.named = ["ahead"] * len(requests)
            return [[7, 8, 9] for _ in requests]

        def sources(self):
            return self.named

        def member_labels(self):
            return {}

        def failures(self):
            return []

    b, runner = bridge(Composite([[1, 2], [3]]), ["a-x", "b-y"], planning=False, decoupled=True)
    history = np.zeros((2, 16), dtype=np.int64)
    assert b.propose([[5], [6]], np.array([8, 8]), history) == [[1, 2], [3]]
    history[0, 8:11] = [1, 2, 7]  # a: both drafts and the guess committed; b: its draft rejected
    history[1, 8] = 4
    drafts = b.propose([[1, 2, 7], [4]], np.array([11, 9]), history)
    assert drafts[0] == [8, 9]  # prepared
    stats = runner._sample.records
    assert stats["a"].stats.prepared_steps == 1 and stats["a"].stats.drafter_choices == {"serial": 1, "ahead": 1}
    assert stats["b"].stats.prepared_steps == 0 and stats["b"].stats.drafter_choices.get("ahead", 0) == 0


def test_a_drafters_failure_is_cut_to_what_a_trajectory_may_carry():
    """A plugin's exception message of any length switches it off; what every request then carries is at most
    MAX_FAILURE characters, so its trajectories still decode at the learner."""
    import msgspec

    import factories
    from transport.messages import MAX_FAILURE, Trajectory

    class Verbose(Recording):
        def propose(self, requests, k):
            raise ValueError("x" * 10 * MAX_FAILURE)

    b, runner = bridge(Verbose([[1], [2]]), ["a-1", "b-1"])
    propose(b, [[5], [6]])
    propose(b, [[7], [8]])
    stats = runner._sample.records["a"].stats
    assert b.failure and len(stats.drafter_failure) == MAX_FAILURE
    encoded = msgspec.msgpack.encode(factories.trajectory(spec=stats))
    assert msgspec.msgpack.Decoder(Trajectory).decode(encoded).spec.drafter_failure == stats.drafter_failure


class ForcesWrites(Recording):
    """Forces writes into its histories past the read-only flag: through torch, through the flag itself and through
    the array the view is of."""

    def propose(self, requests, k):
        history = requests[0].token_ids
        torch.from_numpy(history)[-1] = 0  # (torch warns that the array is read-only, and writes)
        history.base[:] = 0
        history.flags.writeable = True
        history[0] = 0
        return super().propose(requests, k)


def test_a_drafter_that_forces_a_write_into_its_history_changes_only_its_own_copy():
    """The engine's token buffer never reaches a plugin: its histories are copies, so a forced write misleads its own
    drafts only. The engine's inputs stay what they were, and the drafter (which broke no check) drafts on."""
    b, _ = bridge(ForcesWrites([[1, 2], [3, 4]]), ["a-1", "b-1"])
    history = np.arange(40).reshape(2, -1) % VOCAB
    kept = history.copy()
    with pytest.warns(UserWarning, match="not writable"):
        assert b.propose([[5], [6]], np.full(2, 8), history) == [[1, 2], [3, 4]]
    assert np.array_equal(history, kept) and not b.failure
    seen = []
    b.drafter.propose = lambda requests, k: seen.extend(r.token_ids.tolist() for r in requests) or [[], []]
    history[0, 8:10] = [7, 8]  # the next step: a's history is its copy, mended where it no longer matches
    b.propose([[7, 8], [6]], np.array([10, 9]), history)
    assert seen == [history[0, :10].tolist(), history[1, :9].tolist()]


class Exits(Recording):
    def propose(self, requests, k):
        raise SystemExit(3)


class Autocasts(Recording):
    def propose(self, requests, k):
        torch.autocast("cpu", dtype=torch.bfloat16).__enter__()  # entered, never left: the target would compute in it
        return super().propose(requests, k)


class GivesUp(BaseException):
    """A plugin's own exception outside `Exception`."""


class RaisesThis(Recording):
    def __init__(self, error: BaseException):
        super().__init__([])
        self.error = error

    def propose(self, requests, k):
        raise self.error


class LazyDtype(Recording):
    """Answers with generators that, as they are read, make float64 the default dtype."""

    def propose(self, requests, k):
        def ids(p):
            torch.set_default_dtype(torch.float64)
            yield from p
        return [ids(p) for p in self.proposals[: len(requests)]]


class UnsayableError(Exception):
    def __str__(self):
        raise SystemExit(5)  # a plugin's own error whose message cannot be made (an exit, even)


class ExitingIds(Recording):
    """Answers ids whose `__index__` exits the process."""

    def propose(self, requests, k):
        class Id:
            def __index__(self):
                raise SystemExit(4)
        return [[Id()] for _ in requests]


@pytest.mark.parametrize("drafter, reason", [
    (Exits([[1, 2], [3, 4]]), "raised SystemExit: 3"),
    (Autocasts([[1, 2], [3, 4]]), "changed torch.is_autocast_enabled('cpu')"),
    (RaisesThis(GivesUp("no")), "raised GivesUp: no"),
    (RaisesThis(asyncio.CancelledError()), "raised CancelledError"),
    (LazyDtype([[1, 2], [3, 4]]), "changed torch.get_default_dtype()"),
    (ExitingIds([]), "raised SystemExit: 4"),
    (RaisesThis(UnsayableError()), "switched off: UnsayableError: <its message raised SystemExit>"),
], ids=["exit", "autocast", "own_base_exception", "cancelled", "lazy_dtype", "lazy_exit", "unsayable"])
def test_an_exit_or_a_leaked_setting_switches_the_drafter_off_and_leaves_the_engine_running(drafter, reason):
    """Whatever a plugin raises is its error, and reading its answer (a generator, an id's `__index__`) is part of
    its call: checked as the call is."""
    b, _ = bridge(drafter, ["a-1", "b-1"])
    assert propose(b, [[5], [6]]) == [[], []]
    assert reason in b.failure and not torch.is_autocast_enabled("cpu")
    assert torch.get_default_dtype() == torch.float32


def test_a_keyboard_interrupt_on_the_main_thread_is_a_real_ctrl_c_and_passes():
    with pytest.raises(KeyboardInterrupt):
        with guarded(Recording([])):
            raise KeyboardInterrupt
    failures = []

    def elsewhere():  # no Ctrl-C reaches another thread: a plugin raised it
        try:
            with guarded(Recording([])):
                raise KeyboardInterrupt
        except RuntimeError as e:
            failures.append(str(e))

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert failures and "raised KeyboardInterrupt" in failures[0]


class WidensItsBudget(Recording):
    def propose(self, requests, k):
        for r in requests:
            object.__setattr__(r, "max_tokens", 10_000)  # through the frozen dataclass
        return [list(range(1, 60)) for _ in requests]


def test_a_drafter_that_writes_its_requests_budget_gets_no_more_drafts_than_the_bridge_allowed():
    b, _ = bridge(WidensItsBudget([]), ["a-1", "b-1"], planning=False)
    assert propose(b, [[5], [6]]) == [[1, 2, 3, 4], [1, 2, 3, 4]] and not b.failure


class LyingName(str):
    def __len__(self):
        return 1


@pytest.mark.parametrize("drafter, reason", [
    (Reports(sources=("m" * 300, "m")), "sources() must name one member per request"),
    (Reports(sources=(3, "m")), "sources() must name one member per request"),
    (Reports(labels={"a-1": {"m": (1.5, 0)}}), "member_labels() must map request ids"),
    (Reports(labels={"a-1": {7: (1, 0)}}), "member_labels() must map request ids"),
    (Reports(labels={"a-1": {f"m{i}": (1, 0) for i in range(65)}}), "more than 64 member names"),
    (Reports(labels={"a-1": {"m": (2**64, 0)}}), "member_labels() must map request ids"),  # past msgpack's ints
    (Reports(labels={"a-1": {"": (1, 0)}}), "member_labels() must map request ids"),
    (Reports(sources=(LyingName("m" * 300), "m")), "sources() must name one member per request"),
    (Reports(sources=("\udce9" * 60, "m")), "sources() must name one member per request"),  # 360 once escaped
])
def test_a_composites_reports_a_trajectory_could_not_carry_switch_it_off(drafter, reason):
    """What a composite reports per request goes into every trajectory the learner decodes (transport/messages.py):
    a name too long, a count that is not one, too many members, and the learner would drop every trajectory of the
    actor as malformed, and the actor regenerate them, for ever. Such reports switch the composite off instead."""
    b, runner = bridge(drafter, ["a-1", "b-1"])
    propose(b, [[5], [6]])
    propose(b, [[1, 2, 9], [3, 4, 8]])
    assert reason in b.failure
    assert all(len(n) <= 256 for r in runner._sample.records.values() for n in r.stats.drafter_choices)


def test_a_composites_reports_are_read_as_a_trajectory_carries_them():
    """numpy counts are read as ints, labels for requests the engine does not hold are dropped (they would make
    records nobody takes), failures that are not strings are read as text, and a lone surrogate in a reason is
    escaped: every request's stats still encode and decode."""
    import msgspec

    import factories
    from transport.messages import Trajectory

    labels = {"a-1": {"m": (np.int64(2), np.int64(1))}, "gone-1": {"m": (1, 0)}}
    b, runner = bridge(Reports(labels=labels, failed=[ValueError("bad \udce9")]), ["a-1", "b-1"])
    propose(b, [[5], [6]])
    records = runner._sample.records
    assert set(records) == {"a", "b"} and records["a"].stats.drafter_labels == {"m": [2, 1]}
    assert not b.failure and "bad \\udce9" in records["a"].stats.drafter_failure
    for record in records.values():
        encoded = msgspec.msgpack.encode(factories.trajectory(spec=record.stats))
        assert msgspec.msgpack.Decoder(Trajectory).decode(encoded).spec == record.stats


def test_a_preparation_that_never_ends_switches_the_drafter_off_and_the_engine_decodes_on(monkeypatch):
    """Decoupled: a drafter whose thread hangs would stall the engine at its next step until the actor is taken for
    dead, and its replacement would hang the same way. Past the deadline it is switched off instead."""
    import threading

    release = threading.Event()

    class Hangs(Recording):
        def propose_ahead(self, requests, k):
            release.wait()
            return [[] for _ in requests]

    monkeypatch.setattr("actor.draft_ahead.SETTLE_DEADLINE_S", 0.2)
    threading.Timer(2.0, release.set).start()  # (without a deadline the engine would get drafts after 2 s)
    b, _ = bridge(Hangs([[1, 2], [3]]), ["a-x", "b-y"], planning=False, decoupled=True)
    try:
        assert propose(b, [[5], [6]]) == [[1, 2], [3]]
        assert propose(b, [[5], [6]]) == [[], []] and "TimeoutError" in b.failure
        assert propose(b, [[7], [8]]) == [[], []]
    finally:
        release.set()


@pytest.mark.parametrize("answer", [[], [[7, 8], [7, 8], [7, 8]], [[7, 8]]])
def test_a_preparation_of_other_than_one_proposal_per_outcome_switches_the_drafter_off(answer):
    """As `propose`: `propose_ahead` answers one proposal per request it is asked about, or None (nothing prepared);
    more, fewer or none at all is a broken contract, found when the engine next waits for the thread."""
    class Miscounts(Recording):
        def propose_ahead(self, requests, k):
            return answer

    b, _ = bridge(Miscounts([[1, 2], [3]]), ["a-x", "b-y"], planning=False, decoupled=True)
    assert propose(b, [[5], [6]]) == [[1, 2], [3]]
    assert propose(b, [[5], [6]]) == [[], []] and re.search(r"returned \d+ proposals", b.failure)


@pytest.mark.parametrize("hook", ["propose", "commit", "new_policy"])
def test_a_call_that_never_returns_is_named_from_another_thread_while_the_engine_waits_in_it(hook):
    """Nothing can interrupt a plugin's call on the engine's thread: the actor goes silent and is replaced. Before
    that, the driver asks which call it is stuck in (actor/vllm_hooks.stuck_drafter, from another thread), to start
    the replacement without the drafter; the answer names the hook, and nothing once it has returned."""
    import threading

    entered, release = threading.Event(), threading.Event()

    class Hangs(Recording):
        def __getattribute__(self, name):
            if name == hook:
                entered.set()
                release.wait(10)
            return super().__getattribute__(name)

    b, runner = bridge(Hangs([[1, 2], [3]]), ["a-x", "b-y"], planning=False)
    worker = SimpleNamespace(model_runner=SimpleNamespace(drafter=b))
    propose(b, [[5], [6]])  # drafts are verifying: the next step commits them
    assert stuck_drafter(worker, 0.0) == ""
    step = threading.Thread(target=lambda: new_policy_version(worker, 2) if hook == "new_policy"
                            else propose(b, [[1, 2], [3]]))
    step.start()
    try:
        assert entered.wait(10)
        time.sleep(0.3)
        assert stuck_drafter(worker, 0.2).startswith(f"its {hook} call had not returned after ")
        assert stuck_drafter(worker, 5.0) == ""  # not that long yet
    finally:
        release.set()
        step.join()
    assert stuck_drafter(worker, 0.0) == "" and not b.failure


class Odd(Reports):
    """A composite whose `failures()` and `swap_weights()` return `odd` as it is."""

    def __init__(self, odd):
        super().__init__()
        self.odd = odd

    def failures(self):
        return self.odd

    def swap_weights(self, weights):
        return self.odd


@pytest.mark.parametrize("odd", [3, np.array([[1, 2], [3, 4]]), torch.tensor([1, 2])], ids=["int", "array", "tensor"])
def test_answers_that_are_not_what_the_contract_says_switch_the_drafter_off_and_never_reach_the_engine(odd):
    """Reading a plugin's answer (a composite's failures as text, swap_weights as a truth value) is part of the
    call: an answer that cannot be read so switches the drafter off there, rather than raising out of the engine's
    step or the actor's weight swap and taking the actor down."""
    b, _ = bridge(Odd(odd), ["a-1", "b-1"])
    propose(b, [[5], [6]])  # read after this step's drafts were made
    assert "switched off" in b.failure and propose(b, [[1, 2], [3, 4]]) == [[], []]
    b, _ = bridge(Odd(odd), ["a-1", "b-1"])
    worker = SimpleNamespace(model_runner=SimpleNamespace(drafter=b))
    swap_draft_weights(worker, [("w", 0)])  # returns, whatever the answer (an int reads as a truth value)
    assert ("switched off" in b.failure) == (not isinstance(odd, int))


def test_a_constructor_is_waited_for_until_its_deadline_and_its_exit_is_an_error_like_any_other():
    import sys
    import threading

    from actor.drafter_checks import built_within

    drafter = Recording([])
    assert built_within(lambda: drafter, 5.0) is drafter and built_within(lambda: drafter, None) is drafter
    with pytest.raises(TimeoutError, match="its constructor had not returned after 0.2 s"):
        built_within(threading.Event().wait, 0.2)
    with pytest.raises(KeyError, match="model"):
        built_within(lambda: {}["model"], 5.0)
    with pytest.raises(RuntimeError, match="raised SystemExit: 2"):
        built_within(lambda: sys.exit(2), 5.0)
    with pytest.raises(RuntimeError, match="raised SystemExit: 3"):  # without a deadline too
        built_within(lambda: sys.exit(3), None)
    # a constructor that changed a setting the target shares (on its own thread): seen from the engine's, set back
    with pytest.raises(RuntimeError, match=r"drafter pkg.Retunes changed torch.get_default_dtype\(\)"):
        with guarded("pkg.Retunes"):
            built_within(lambda: torch.set_default_dtype(torch.float64), 5.0)
    assert torch.get_default_dtype() == torch.float32


def test_an_endless_answer_is_refused_once_it_runs_past_what_was_asked_for():
    """An answer is read inside the drafter's checked call: an endless generator is read one item too far, then
    refused (read whole, it would fill the engine's memory)."""
    import itertools

    from actor.drafter_checks import plain_answers, sources_within

    with pytest.raises(RuntimeError, match="returned 3 proposals"):
        plain_answers(itertools.repeat([1]), None, [4, 4], VOCAB, "Endless")
    with pytest.raises(RuntimeError, match="returned 2 proposals and 3 confidence lists"):
        plain_answers([[1], [2]], itertools.repeat([0.5]), [4, 4], VOCAB, "Endless")
    with pytest.raises(RuntimeError, match="one member per request"):
        sources_within(itertools.repeat("a"), 2, set(), "Endless")
