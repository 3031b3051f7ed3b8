"""Decoupled speculation's bookkeeping (actor/draft_ahead.py): a prepared proposal is taken only by the outcome it
was prepared for (every draft accepted, then the guessed token), once; the drafter's error surfaces when the engine
waits for it. That no token changes is the exactness tests' (tests/test_speculative_rollout.py)."""

import sys
import threading
import time

import numpy as np
import pytest

from actor import draft_ahead
from actor.draft_ahead import MAX_FURTHER, DraftsAhead, ahead, outcomes
from actor.draft_planner import DraftCost
from drafters.base import DraftRequest


def prepared() -> DraftsAhead:
    """Drafts [7, 8] being verified after [1, 2, 3]: prepared for both accepted (guess 9), the second rejected (guess
    4 past 8) and the first rejected (guess 5 past 7)."""
    history = np.array([1, 2, 3])
    request = DraftRequest("a", seed=1, position=5, token_ids=history, temperature=1.0)
    asked = ahead([(request, [7, 8], 2, 0), (request, [7, 8], 1, 0), (request, [7, 8], 0, 0)], k=5)
    assert [list(r.token_ids) for r in asked] == [[1, 2, 3, 7, 8], [1, 2, 3, 7], [1, 2, 3]]
    assert [(r.unverified, r.rejected, r.position, r.max_tokens, r.guess) for r in asked] == [
        (2, None, 7, 5, 0), (1, 8, 6, 5, 0), (0, 7, 5, 5, 0)]
    history[0] = 99  # the engine's buffer moves on: the request holds a copy
    assert asked[0].token_ids[0] == 1
    drafts = DraftsAhead()
    drafts.launch(asked, lambda: ([[9, 10, 11], [4, 12, 13], [5, 14]], [[0.9, 0.8, 0.7], [0.5, 0.4, 0.3], [0.2, 0.1]],
                                  ["suffix", "draft_lm", "draft_lm"]))  # (a composite's member that proposed each)
    assert drafts.settle() >= 0.0 and drafts.outcomes == 3
    return drafts


@pytest.mark.parametrize("history,taken", [
    ([1, 2, 3, 7, 8, 9], ([10, 11], [0.8, 0.7], "suffix")),  # both drafts accepted, the target sampled the guess
    ([1, 2, 3, 7, 8, 6], None),  # both accepted, another token sampled
    ([1, 2, 3, 7, 4], ([12, 13], [0.4, 0.3], "draft_lm")),  # the second draft rejected, the target sampled the guess
    ([1, 2, 3, 7, 6], None),  # the second rejected, another token sampled
    ([1, 2, 3, 5], ([14], [0.1], "draft_lm")),  # the first rejected, the guess sampled
    ([1, 2, 3, 7, 8, 9, 10], None),  # not a history it was prepared for
])
def test_prepared_drafts_are_taken_only_by_the_outcome_they_were_prepared_for(history, taken):
    drafts = prepared()
    assert drafts.take("a", np.array(history)) == taken
    assert drafts.take("a", np.array(history)) is None  # once
    rejection = len(history) < 6
    assert drafts.hits[rejection] == (taken is not None) and drafts.hits[not rejection] == 0
    assert drafts.reached[rejection] == (len(history) < 7) and drafts.reached[not rejection] == 0


def test_a_drafter_that_prepares_nothing_this_time_leaves_no_prepared_drafts():
    drafts = DraftsAhead()
    asked = [DraftRequest("a", seed=1, position=5, token_ids=[1, 2, 3], unverified=1)]
    drafts.launch(asked, lambda: (None, None, None))
    drafts.settle()
    assert drafts.prepared == {}  # `propose_ahead` returned None: every request drafts as it would serially


def test_which_outcomes_a_drafter_prepares_is_read_once_and_must_be_true_or_false():
    """`prepares_rejections` and `prepares_guesses` are read when decoupled drafting is set up, in the drafter's
    checked call (the engine's thread would otherwise judge them at every step): anything but True or False is the
    drafter's error there, which switches it off (actor/vllm_hooks.install)."""
    class Odd:
        prepares_rejections, prepares_guesses = np.array([True, False]), False

    class Exits:
        prepares_guesses = False

        @property
        def prepares_rejections(self):
            sys.exit(4)

    with pytest.raises(TypeError, match="prepares_rejections and prepares_guesses must be True or False"):
        DraftsAhead(Odd())
    with pytest.raises(RuntimeError, match="raised SystemExit: 4"):
        DraftsAhead(Exits())
    assert DraftsAhead().kinds == (False, False)


def test_a_drafter_that_raises_on_its_thread_raises_when_the_engine_waits():
    drafts = DraftsAhead()

    def broken():
        raise RuntimeError("drafter broke")

    drafts.launch([], broken)
    with pytest.raises(RuntimeError, match="drafter broke"):
        drafts.settle()
    assert drafts.settle() == 0.0  # nothing in flight any more
    drafts.launch([], lambda: sys.exit(3))  # an exit is the drafter's error too: the engine does not exit
    with pytest.raises(RuntimeError, match="preparing drafts ahead raised SystemExit: 3"):
        drafts.settle()


def a_second_per_drafted_token() -> DraftCost:
    """The thread's cost as learnt from its calls: a second per drafted token."""
    cost = DraftCost()
    for drafted in (5, 10, 15, 20):
        cost.observe(5, drafted, 0, float(drafted))
    return cost


def test_the_likeliest_rejection_outcomes_are_prepared_as_far_as_the_threads_cost_fits_the_step():
    a, b = (DraftRequest(rid, seed=1, position=5, token_ids=np.arange(8)) for rid in ("a-x", "b-y"))
    chains = [(a, [1, 2], 2), (b, [3], 1)]  # drafts being verified, all accepted
    cost = a_second_per_drafted_token()  # (k + 1 = 5 tokens a request)
    picked = outcomes(chains, np.array([0.5, 0.5]), cost, 15.5, 5)  # the step verifying: time for 3 requests' worth
    assert [(r.request_id, j, g) for r, _, j, g in picked] == [("a-x", 2, 0), ("b-y", 1, 0), ("b-y", 0, 0)]  # the
    # likeliest: the first draft rejected (at acceptance 0.5: 0.5 against 0.25 for the second), b's before a's on a tie
    best = [(r, d, j, 0) for r, d, j in chains]
    assert outcomes(chains, np.array([0.5, 0.5]), cost, 5.0, 5) == best  # not even these fit: nothing more
    assert len(outcomes(chains, np.array([0.5, 0.5]), cost, 1e9, 5)) == 5  # a long step: every outcome
    # the step or the thread not measured yet: the likeliest only (a cold thread asked for every outcome of a large
    # batch grew the draft LM's cache for good)
    assert outcomes(chains, np.array([0.5, 0.5]), cost, 0.0, 5) == best
    assert outcomes(chains, np.array([0.5, 0.5]), DraftCost(), 1e9, 5) == best
    assert outcomes(chains, None, cost, 1e9, 5) == best  # a drafter that prepares only the all-accepted outcome


def test_the_history_a_preparation_catches_up_on_leaves_less_of_the_step_for_further_outcomes():
    """A draft model preparing drafts for new requests first reads their prompts: the thread's cost learns that from
    its calls (`launch(unseen=...)`), and a preparation with a large catch-up holds fewer further outcomes."""
    a, b = (DraftRequest(rid, seed=1, position=5, token_ids=np.arange(8)) for rid in ("a-x", "b-y"))
    chains = [(a, [1, 2], 2), (b, [3], 1)]
    cost = DraftCost()  # a second per drafted token, a tenth of one per history token caught up on
    for drafted, unseen in ((5, 0), (10, 40), (15, 10), (20, 80), (10, 0)):
        cost.observe(5, drafted, unseen, drafted + 0.1 * unseen)
    assert len(outcomes(chains, np.array([0.5, 0.5]), cost, 15.5, 5)) == 3
    assert outcomes(chains, np.array([0.5, 0.5]), cost, 15.5, 5, unseen=50) == [(r, d, j, 0) for r, d, j in chains]


def test_a_preparation_holds_at_most_max_further_outcomes_past_the_likeliest_ones():
    chains = [(DraftRequest(f"r{i}", seed=1, position=5, token_ids=np.arange(8)), [1, 2, 3, 4], 4) for i in range(128)]
    picked = outcomes(chains, np.full(128, 0.5), a_second_per_drafted_token(), 1e9, 5,
                      guesses={(kind, g): 0.5 for kind in (False, True) for g in (0, 1)})
    assert len(picked) == 128 + MAX_FURTHER  # (of 128 x 10 outcomes)


def test_second_guesses_are_ranked_with_the_rest_by_the_chance_that_they_are_taken():
    a, b = (DraftRequest(rid, seed=1, position=5, token_ids=np.arange(8)) for rid in ("a-x", "b-y"))
    chains = [(a, [1, 2], 2), (b, [], 0)]  # b drafted nothing: its plain step's outcome is certain
    cost = a_second_per_drafted_token()
    right = {(False, 0): 0.6, (False, 1): 0.3, (True, 0): 0.5, (True, 1): 0.1}  # per kind (a draft rejected), guess
    picked = outcomes(chains, np.array([0.5, 0.5]), cost, 25.5, 5, guesses=right)  # 3 outcomes past the chains
    # b's second guess 1 x 0.3; a's first draft rejected 0.5 x 0.5, its second 0.25 x 0.5; (a's second guess past
    # both accepted 0.25 x 0.3 next)
    assert [(r.request_id, j, g) for r, _, j, g in picked[2:]] == [("b-y", 0, 1), ("a-x", 0, 0), ("a-x", 1, 0)]
    only_guesses = outcomes(chains, np.array([0.5, 0.5]), cost, 1e9, 5, rejections=False, guesses=right)
    assert [(r.request_id, j, g) for r, _, j, g in only_guesses[2:]] == [("b-y", 0, 1), ("a-x", 2, 1)]


def test_a_second_guess_is_taken_where_the_first_was_not_the_targets_token():
    history = np.array([1, 2, 3])
    request = DraftRequest("a", seed=1, position=5, token_ids=history, temperature=1.0)
    drafts = DraftsAhead()
    drafts.launch(ahead([(request, [7], 1, 0), (request, [7], 1, 1)], k=3), lambda: ([[9, 10], [6, 11]], None, None))
    drafts.settle()
    assert drafts.take("a", np.array([1, 2, 3, 7, 6])) == ([11], None, "")
    assert drafts.reached[False] == drafts.hits[False] == 1 and drafts.right[False, 1] == 1  # the outcome counted once
    rates = drafts.guess_rates()
    assert rates[False, 1] > rates[True, 1] and rates[False, 0] < rates[True, 0]  # from the prior, moved by it


def test_a_preparation_is_waited_for_as_long_as_asked_and_one_that_never_ends_is_a_timeout(monkeypatch):
    """`settle(patience)` returns after `patience` with the preparation still in flight (`busy`), and takes its
    drafts once it has ended; past SETTLE_DEADLINE_S after its launch, waiting raises TimeoutError."""
    request = DraftRequest("a", seed=1, position=3, token_ids=np.array([1, 2, 3]), temperature=1.0)
    release = threading.Event()
    drafts = DraftsAhead()
    drafts.launch([request], lambda: (release.wait(), ([[4, 5]], None, None))[1])
    assert 0.05 <= drafts.settle(0.05) < 1.0 and drafts.busy
    release.set()
    drafts.settle(5.0)
    assert not drafts.busy and drafts.take("a", np.array([1, 2, 3, 4])) == ([5], None, "")
    monkeypatch.setattr(draft_ahead, "SETTLE_DEADLINE_S", 0.2)
    drafts.launch([request], lambda: (time.sleep(30), None)[1])
    assert drafts.settle(0.01) < 0.2 and drafts.busy
    with pytest.raises(TimeoutError, match="propose_ahead had not returned 0.2 s after it was called"):
        drafts.settle()


def test_the_drafters_thread_holds_nothing_between_preparations_and_ends_with_its_owner():
    """A preparation's work (which holds the drafter) is let go once it is done, and the thread ends when the
    DraftsAhead that owns it is collected (a thread per engine, for ever, held every engine's last drafter)."""
    import gc
    import weakref

    class Drafter:
        pass

    before = set(threading.enumerate())
    drafter, drafts = Drafter(), DraftsAhead()
    held, threads = weakref.ref(drafter), set(threading.enumerate()) - before  # (its thread)
    drafts.launch([], lambda d=drafter: (None, None, None) if d else None)
    drafts.settle()
    del drafter
    gc.collect()
    assert held() is None
    assert [t.name for t in threads] == ["draft-ahead"]
    del drafts
    gc.collect()
    time.sleep(0.2)
    assert not threads & set(threading.enumerate())
