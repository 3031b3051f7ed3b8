"""Decoupled speculation's bookkeeping (actor/draft_ahead.py): a prepared proposal is taken only by the outcome it
was prepared for (every draft accepted, then the guessed token), once; the drafter's error surfaces when the engine
waits for it. That no token changes is the exactness tests' (tests/test_speculative_rollout.py)."""

import numpy as np
import pytest

from actor.draft_ahead import DraftsAhead, ahead
from drafters.base import DraftRequest


def prepared(proposal, confidences=None, sources=None) -> DraftsAhead:
    history = np.array([1, 2, 3])
    asked = ahead([(0, DraftRequest("a", seed=1, position=5, token_ids=history, temperature=1.0))], [[7, 8]], k=5)
    assert list(asked[0].token_ids) == [1, 2, 3, 7, 8] and asked[0].unverified == 2
    assert asked[0].position == 7 and asked[0].max_tokens == 5
    history[0] = 99  # the engine's buffer moves on: the request holds a copy
    assert asked[0].token_ids[0] == 1
    drafts = DraftsAhead()
    drafts.launch(asked, lambda: ([proposal], confidences, sources))
    assert drafts.settle() >= 0.0
    return drafts


@pytest.mark.parametrize("history,taken", [
    ([1, 2, 3, 7, 8, 9], ([10, 11], [0.8, 0.7], "suffix")),  # both drafts accepted, the target sampled the guess
    ([1, 2, 3, 7, 8, 4], None),  # both accepted, another token sampled
    ([1, 2, 3, 7, 5], None),  # the second draft rejected
    ([1, 2, 3, 7, 8, 9, 10], None),  # not the history it was prepared for
])
def test_prepared_drafts_are_taken_only_by_the_outcome_they_were_prepared_for(history, taken):
    drafts = prepared([9, 10, 11], [[0.9, 0.8, 0.7]], ["suffix"])  # (a composite's member that proposed it)
    assert drafts.take("a", np.array(history)) == taken
    assert drafts.take("a", np.array(history)) is None  # once


def test_a_drafter_that_prepares_nothing_this_time_leaves_no_prepared_drafts():
    drafts = DraftsAhead()
    drafts.launch([DraftRequest("a", seed=1, position=5, token_ids=[1, 2, 3], unverified=1)], lambda: (None, None, None))
    drafts.settle()
    assert drafts.prepared == {}  # `propose_ahead` returned None: every request drafts as it would serially


def test_a_drafter_that_raises_on_its_thread_raises_when_the_engine_waits():
    drafts = DraftsAhead()

    def broken():
        raise RuntimeError("drafter broke")

    drafts.launch([], broken)
    with pytest.raises(RuntimeError, match="drafter broke"):
        drafts.settle()
    assert drafts.settle() == 0.0  # nothing in flight any more
