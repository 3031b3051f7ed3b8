"""The contract every drafter plugin must pass (drafters/base.py), run over each built-in drafter and the
documented example. Add yours to DRAFTERS."""

import inspect
import json
import operator
import random
import typing

import numpy as np
import pytest

from drafters.base import CompositeDrafter, Drafter, DrafterLoadError, DraftRequest, drafter_class, load_drafter
from models.zoo import resolve

DRAFTERS = ["ngram", "draft_lm", "suffix", "fastest_of_n", "examples.drafters.bigram.BigramDrafter"]
OPTIONS = {"fastest_of_n": {"drafters": ["suffix", "draft_lm"]}}  # constructor arguments where one is required
K = 4
VOCAB = json.loads((resolve("builtin:draft") / "config.json").read_text())["vocab_size"]  # the built-in models'


def request(rid: str, history: list[int], seed: int = 7, temperature: float = 1.0) -> DraftRequest:
    """As the engine hands it: the history a read-only int32 view of a wider buffer (a drafter that writes raises)."""
    buffer = np.zeros((1, len(history) + 8), dtype=np.int32)
    buffer[0, : len(history)] = history
    view = buffer[0, : len(history)]
    view.flags.writeable = False
    return DraftRequest(request_id=rid, seed=seed, position=max(len(history) - 5, 0), token_ids=view,
                        temperature=temperature)


def histories(n: int, length: int = 40) -> list[list[int]]:
    rng = random.Random(0)
    motif = [rng.randrange(VOCAB) for _ in range(6)]
    # repetitive histories, so that every drafter has something to propose
    return [[rng.randrange(VOCAB) for _ in range(3)] + motif * (length // 6) + motif[: i % 5] for i in range(n)]


@pytest.fixture(params=DRAFTERS, scope="module")
def make(request):
    return lambda: load_drafter(request.param, OPTIONS.get(request.param, {}))


def check_shape(proposals, requests, k=K):
    assert isinstance(proposals, list) and len(proposals) == len(requests)
    for p in proposals:
        assert len(p) <= k and all(0 <= operator.index(t) < VOCAB for t in p)


def test_is_a_drafter_and_proposes_at_most_k_valid_tokens(make):
    drafter = make()
    assert isinstance(drafter, Drafter)
    reqs = [request(f"r{i}", h) for i, h in enumerate(histories(5))]
    proposals = drafter.propose(reqs, K)
    check_shape(proposals, reqs)
    assert any(proposals), "no drafts at all on repetitive histories"
    check_shape(drafter.propose(reqs, 1), reqs, k=1)


def test_confidences_if_given_rate_each_draft_token_of_the_last_proposal(make):
    drafter = make()
    reqs = [request(f"r{i}", h) for i, h in enumerate(histories(4))]
    for k in (K, 1):
        proposals, confidences = drafter.propose(reqs, k), drafter.confidences()
        if confidences is None:  # optional: the planner then uses each request's acceptance so far
            return
        assert len(confidences) == len(reqs)
        for proposal, rated in zip(proposals, confidences):
            assert len(rated) == len(proposal) and all(0.0 <= float(c) <= 1.0 for c in rated)


def test_a_composites_member_labels_count_each_committed_requests_labels_once(make):
    drafter = make()
    if not isinstance(drafter, CompositeDrafter):  # a drafter without members has none
        return
    reqs = [request(f"r{i}", h) for i, h in enumerate(histories(3))]
    proposals = drafter.propose(reqs, K)
    assert len(drafter.sources()) == len(reqs) and drafter.failures() == []
    for r, proposal in zip(reqs, proposals):
        drafter.commit(r.request_id, [*proposal[:1], 0])
    labels = drafter.member_labels()
    assert set(labels) <= {r.request_id for r in reqs}
    for r, proposal in zip(reqs, proposals):
        for accepted, rejected in labels.get(r.request_id, {}).values():
            # a member's proposal is labelled on the committed tokens only: at most two here, at most one rejected
            assert 0 <= accepted <= 2 and rejected in (0, 1) and accepted + rejected <= 2
    assert drafter.member_labels() == {}


def test_other_actors_outputs_are_taken_without_breaking_drafting(make):
    drafter = make()
    hist = histories(3)
    drafter.new_policy(3)
    drafter.remember(hist[0][:10], hist[0][10:], 2)  # history for drafters that keep it; ignored by the rest
    drafter.remember([], [], 3)
    reqs = [request(f"r{i}", h) for i, h in enumerate(hist)]
    proposals = drafter.propose(reqs, K)
    check_shape(proposals, reqs)
    assert any(proposals)


def test_empty_batch_and_empty_proposals(make):
    drafter = make()
    assert drafter.propose([], K) == []
    reqs = [request("short", [5])]  # one token of context: a drafter may propose nothing, but must answer
    check_shape(drafter.propose(reqs, K), reqs)


def test_batch_order_does_not_change_a_requests_drafts(make):
    reqs = [request(f"r{i}", h, seed=i) for i, h in enumerate(histories(6))]
    forward = make().propose(reqs, K)
    order = [3, 0, 5, 1, 4, 2]
    shuffled = make().propose([reqs[i] for i in order], K)
    assert shuffled == [forward[i] for i in order]


def test_state_follows_the_history_after_commits_rollbacks_and_removal(make):
    history = histories(1, length=60)[0]
    drafter = make()
    first = drafter.propose([request("a", history[:30])], K)[0]
    drafter.commit("a", history[30:33])
    # the verifier kept 3 tokens which may differ from the drafts: answer as a fresh drafter would
    assert drafter.propose([request("a", history[:33])], K) == make().propose([request("a", history[:33])], K)
    drafter.remove("a")
    drafter.remove("never-seen")  # removing an unknown request is not an error
    # the id is reused for another request: nothing of the old one may leak
    other = list(reversed(history[:20]))
    assert drafter.propose([request("a", other)], K) == make().propose([request("a", other)], K)
    drafter.commit("unknown", [1, 2])  # a commit for a request never proposed for is not an error
    assert len(first) <= K


@pytest.mark.parametrize("name", DRAFTERS)
def test_options_are_judged_at_config_load_without_building_the_drafter(name):
    cls = drafter_class(name)
    args = cls.check_options(OPTIONS.get(name, {}))
    assert set(args) == set(inspect.signature(cls).parameters)  # every argument, defaults filled in
    with pytest.raises(TypeError, match="no_such_option"):
        cls.check_options({**OPTIONS.get(name, {}), "no_such_option": 1})
    hints = typing.get_type_hints(cls.__init__)
    for option in (p for p in args if hints.get(p) in (int, float, str, bool)):  # a value of another type, named
        with pytest.raises(TypeError, match=option):
            cls.check_options({**OPTIONS.get(name, {}), option: [1]})


def test_loading_by_name_and_clear_errors():
    assert drafter_class("ngram").__name__ == "NgramDrafter"
    with pytest.raises(DrafterLoadError, match="no_such_drafter"):
        drafter_class("no_such_drafter")
    with pytest.raises(DrafterLoadError, match="cannot import"):
        drafter_class("drafters.nowhere.Missing")
    with pytest.raises(DrafterLoadError, match="not a subclass"):
        drafter_class("collections.OrderedDict")
    with pytest.raises(DrafterLoadError, match="does not implement commit, propose, remove"):  # (abstract)
        drafter_class("drafters.base.Drafter")
