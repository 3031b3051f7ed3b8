"""Decoupled speculation's bookkeeping (actor/draft_ahead.py): a prepared proposal is taken only by the outcome it
was prepared for (every draft accepted, then the guessed token), once; the drafter's error surfaces when the engine
waits for it. That no token changes is the exactness tests' (tests/test_speculative_rollout.py)."""

import numpy as np
import pytest

from actor.draft_ahead import DraftsAhead, ahead
from drafters.base import DraftRequest


def prepared() -> DraftsAhead:
    """Drafts [7, 8] being verified after [1, 2, 3]: prepared for both accepted (guess 9), the second rejected (guess
    4 past 8) and the first rejected (guess 5 past 7)."""
    history = np.array([1, 2, 3])
    request = DraftRequest("a", seed=1, position=5, token_ids=history, temperature=1.0)
    asked = ahead([(request, [7, 8], 2), (request, [7, 8], 1), (request, [7, 8], 0)], k=5)
    assert [list(r.token_ids) for r in asked] == [[1, 2, 3, 7, 8], [1, 2, 3, 7], [1, 2, 3]]
    assert [(r.unverified, r.rejected, r.position, r.max_tokens) for r in asked] == [
        (2, None, 7, 5), (1, 8, 6, 5), (0, 7, 5, 5)]
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
    assert drafts.rejection_hits == (taken is not None and len(history) < 6)


def test_a_drafter_that_prepares_nothing_this_time_leaves_no_prepared_drafts():
    drafts = DraftsAhead()
    asked = [DraftRequest("a", seed=1, position=5, token_ids=[1, 2, 3], unverified=1)]
    drafts.launch(asked, lambda: (None, None, None))
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
