"""Fastest-of-N (drafters/fastest_of_n.py): per request, the member whose proposals the verifier's committed tokens
agree with, scored counterfactually for every member asked on every step; a costly member is asked only where it
may beat what the cheaper ones proposed."""

import itertools
import time

import pytest

from drafters.base import Drafter, DraftRequest
from drafters.fastest_of_n import FastestOfN, agreement


class Ones(Drafter):
    def propose(self, requests, k):
        return [[1] * k for _ in requests]

    def commit(self, request_id, committed):
        pass

    def remove(self, request_id):
        pass


class Twos(Ones):
    def propose(self, requests, k):
        return [[2] * k for _ in requests]


MEMBERS = ["test_fastest_of_n.Ones", "test_fastest_of_n.Twos"]


def request(rid: str) -> DraftRequest:
    return DraftRequest(rid, seed=0, position=0, token_ids=[5, 6])


def test_agreement_counts_the_common_prefix():
    assert agreement([1, 2, 3], [1, 2, 4, 5]) == 2 and agreement([], [1]) == 0 and agreement([1, 2], [1, 2, 3]) == 2


def test_each_request_gets_the_member_its_committed_tokens_agree_with():
    fon = FastestOfN(MEMBERS)
    for _ in range(4):  # the verifier commits 1s for "a" and 2s for "b", whichever member drafted
        fon.propose([request("a"), request("b")], 4)
        fon.commit("a", [1, 1, 1])
        fon.commit("b", [2, 2, 2])
    assert fon.propose([request("a"), request("b")], 4) == [[1, 1, 1, 1], [2, 2, 2, 2]]
    assert set(fon.sources()) == {"test_fastest_of_n.Ones", "test_fastest_of_n.Twos"}
    fon.remove("a")
    assert "a" not in fon.labels


def test_a_new_request_starts_from_the_members_average():
    fon = FastestOfN(MEMBERS)
    for i in range(20):
        fon.propose([request(f"r{i}")], 4)
        fon.commit(f"r{i}", [2, 2, 2, 2, 9])
        fon.remove(f"r{i}")
    assert fon.propose([request("new")], 4) == [[2, 2, 2, 2]]


def test_an_empty_proposal_never_wins_over_one_expected_to_be_accepted():
    fon = FastestOfN(MEMBERS)
    for _ in range(4):
        fon.propose([request("a")], 4)
        fon.commit("a", [2, 2, 9])  # Twos agrees with 2 tokens, Ones with none
    assert fon.propose([request("a")], 4) == [[2, 2, 2, 2]]
    assert fon.propose([request("a")], 0) == [[]]  # nothing to choose from: no draft


def test_configuration_errors_name_the_problem():
    with pytest.raises(ValueError, match="two or more distinct"):
        FastestOfN(["ngram"])
    with pytest.raises(ValueError, match="not among drafters"):
        FastestOfN(["ngram", "suffix"], options={"draft_lm": {}})


class SureOnes(Ones):  # sure of every token
    def confidences(self):
        return [[0.999] * 4]


class UnsureTwos(Twos):  # unsure of every token
    def confidences(self):
        return [[0.3] * 4]


def test_members_confidences_are_calibrated_on_every_members_labels_and_carry_over_to_new_requests():
    fon = FastestOfN(["test_fastest_of_n.SureOnes", "test_fastest_of_n.UnsureTwos"])
    assert fon.propose([request("a")], 4) == [[1, 1, 1, 1]]  # no labels yet: the confident member
    for _ in range(20):  # the verifier samples 2s: the sure member is always wrong, the unsure one always right
        fon.propose([request("a")], 4)
        fon.commit("a", [2, 2, 2, 2, 2])
    assert fon.propose([request("new")], 4) == [[2, 2, 2, 2]]  # a request with no labels of its own
    assert fon.sources() == ["test_fastest_of_n.UnsureTwos"]
    assert min(fon.confidences()[0]) > 0.8  # what the planner gets: the calibrated rates, not the member's 0.3


class SlowTwos(Twos):  # a draft model's cost: noted per call
    asked: list[list[str]] = []

    def propose(self, requests, k):
        time.sleep(0.005)
        SlowTwos.asked.append([r.request_id for r in requests])
        return super().propose(requests, k)


class SureOfA(Ones):  # a history drafter: sure of 1s for requests "a...", nothing for others
    def propose(self, requests, k):
        self.proposals = [[1] * k if r.request_id.startswith("a") else [] for r in requests]
        return self.proposals

    def confidences(self):
        return [[0.999] * len(p) for p in self.proposals]


def test_a_costly_member_is_asked_only_where_it_may_beat_the_cheaper_ones():
    SlowTwos.asked.clear()
    fon = FastestOfN(["test_fastest_of_n.SlowTwos", "test_fastest_of_n.SureOfA"])  # the costly one listed first
    for _ in range(10):  # the verifier commits 1s for "a", 2s for "b"
        fon.propose([request("a"), request("b")], 4)
        fon.commit("a", [1, 1, 1, 1, 1])
        fon.commit("b", [2, 2, 2, 2, 2])
    assert SlowTwos.asked[0] == ["a", "b"]  # nothing measured yet: every member, in the order given
    assert fon.propose([request("a"), request("b"), request("a2")], 4) == [[1] * 4, [2] * 4, [1] * 4]
    assert SlowTwos.asked[-1] == ["b"]  # measured slower, so asked last, and only where the sure member had nothing
    assert fon.sources() == ["test_fastest_of_n.SureOfA", "test_fastest_of_n.SlowTwos", "test_fastest_of_n.SureOfA"]
    before = [list(labels) for labels in fon.labels["a"]]
    fon.commit("a", [1, 1, 1, 1, 1])  # labels only the proposals that were made
    assert fon.labels["a"][0] == before[0] and fon.labels["a"][1][0] == before[1][0] + 4


class Silent(Ones):
    def propose(self, requests, k):
        return [[] for _ in requests]


def test_member_labels_score_every_proposal_made_once_and_forget_removed_requests():
    fon = FastestOfN(MEMBERS)  # first call: Ones (no cost measured yet: the first) is expected to do well enough
    fon.propose([request("a"), request("b")], 4)
    fon.commit("a", [1, 1, 7])  # two accepted, the third rejected
    fon.commit("b", [2])  # rejected at once
    ones, twos = MEMBERS
    assert fon.member_labels() == {"a": {ones: (2, 1)}, "b": {ones: (0, 1)}}  # Twos was not asked: no labels
    assert fon.member_labels() == {}  # each label reported once
    # a member with nothing to propose leaves every request to the next, which is then scored on each
    fon = FastestOfN(["test_fastest_of_n.Silent", twos])
    for _ in range(2):  # labels add up until they are asked for
        fon.propose([request("a"), request("b")], 4)
        fon.commit("a", [1, 1, 7])
        fon.commit("b", [2])  # one accepted, the rest past the committed tokens: unlabelled, not rejected
    assert fon.member_labels() == {"a": {"test_fastest_of_n.Silent": (0, 0), twos: (0, 2)},
                                   "b": {"test_fastest_of_n.Silent": (0, 0), twos: (2, 0)}}
    fon.propose([request("a")], 4)
    fon.commit("a", [2, 2, 2, 2, 2])
    fon.remove("a")
    assert fon.member_labels() == {}


class OnesAhead(Ones):
    """Prepares ahead (decoupled speculation): guesses 3 after any history, then 1s."""

    def propose_ahead(self, requests, k):
        return [[3] + [1] * (k - 1) for _ in requests]


def test_proposals_ahead_race_the_members_that_prepare_and_are_labelled_when_their_history_is_committed():
    """`propose_ahead`: members without it sit out; each proposal is labelled once the drafts it assumed are
    committed: its guess on the target's token, and the rest, if the guess was the target's, on the next commit."""
    ahead, twos = "test_fastest_of_n.OnesAhead", "test_fastest_of_n.Twos"
    fon = FastestOfN([twos, ahead])

    def unverified(rid: str) -> DraftRequest:  # two drafts being verified (8, 9) past the committed [5, 6]
        return DraftRequest(rid, seed=0, position=2, token_ids=[5, 6, 8, 9], unverified=2)

    assert fon.propose_ahead([unverified("a"), unverified("b"), unverified("c")], 4) == [[3, 1, 1, 1]] * 3
    assert fon.sources() == [ahead] * 3 and len(fon.confidences()) == 3  # Twos prepares nothing: it sat out
    fon.commit("a", [8, 9, 3])  # both drafts accepted and the target sampled the guess
    fon.commit("b", [8, 9, 4])  # both accepted, another token sampled: the guess was wrong
    fon.commit("c", [8, 7])  # a draft rejected: the history it was prepared for never happened, nothing labelled
    assert fon.member_labels() == {"a": {ahead: (1, 0)}, "b": {ahead: (0, 1)}}
    fon.commit("a", [1, 1, 7])  # the prepared rest, [1, 1, 1], on the next commit (taken or not): 2, then a rejection
    fon.commit("b", [1, 1, 1])  # b's rest was never current: no labels
    assert fon.member_labels() == {"a": {ahead: (2, 1)}}
    fon.propose_ahead([unverified("a")], 4)
    fon.remove("a")  # forgets what it held for a
    fon.commit("a", [8, 9, 3])
    assert fon.member_labels() == {}
    # a proposal of the step that reached past the drafts verified (only 2 of its 4 tokens were) labels that
    # position itself: the guess for it is not labelled a second time
    fon = FastestOfN([ahead, twos])  # nothing measured: OnesAhead is asked first
    fon.propose([DraftRequest("d", seed=0, position=2, token_ids=[5, 6])], 4)
    fon.propose_ahead([unverified("d")], 4)
    fon.commit("d", [8, 9, 3])
    assert fon.member_labels()["d"][ahead] == (0, 1)  # its [1, 1, 1, 1] rejected at once; its guess, 3, unlabelled


class Remembering(Ones):
    def __init__(self):
        self.outputs = []

    def remember(self, prompt_ids, response_ids, version):
        self.outputs.append((prompt_ids, response_ids, version))

    def new_policy(self, version):
        self.outputs.append(version)


def test_other_actors_outputs_and_policy_versions_reach_every_member():
    fon = FastestOfN(["test_fastest_of_n.Remembering", "suffix"])
    fon.remember([5, 6], [1, 2, 3], 0)
    fon.new_policy(1)
    assert fon.members[0].outputs == [([5, 6], [1, 2, 3], 0), 1] and fon.members[1].version == 1
    assert fon.members[1].propose([DraftRequest("a", seed=0, position=1, token_ids=[5, 6, 1])], 4) == [[2, 3]]


def test_a_new_request_starts_from_what_its_prompts_other_requests_showed():
    """Siblings (and earlier epochs) of a prompt say which member suits it before the request has labels of its own."""
    fon = FastestOfN(MEMBERS)
    other = DraftRequest("x0", seed=0, position=0, token_ids=[7, 8])
    for i in range(6):  # prompt [5, 6] commits 2s, prompt [7, 8] 1s: every member is labelled on both
        fon.propose([request(f"a{i}"), DraftRequest(f"x{i}", seed=0, position=0, token_ids=[7, 8])], 4)
        fon.commit(f"a{i}", [2, 2, 2, 2, 9])
        fon.commit(f"x{i}", [1, 1, 1, 1, 9])
    ones, twos = range(2)
    fon.propose([request("new"), DraftRequest("new-x", seed=0, position=0, token_ids=[7, 8])], 4)
    assert fon._own_rate("new", twos) > fon._own_rate("new", ones)  # no labels of its own yet: its prompt's
    assert fon._own_rate("new-x", ones) > fon._own_rate("new-x", twos)
    assert fon.propose([request("new"), other], 4) == [[2, 2, 2, 2], [1, 1, 1, 1]]


class Broken(Ones):
    """Proposes 3s; its `method` raises (a plugin's bug), or for `confidences` answers out of contract."""

    method = "propose"

    def __init__(self):
        self.calls = 0

    def __getattribute__(self, name):
        if name == type(self).method:
            self.calls += 1
            if name == "confidences":
                return lambda: [[0.5]]  # one confidence list for two requests
            raise KeyError(f"{name} broke")
        return object.__getattribute__(self, name)

    def propose(self, requests, k):
        return [[3] * k for _ in requests]

    def confidences(self):
        return None


@pytest.mark.parametrize("method", ["propose", "commit", "remove", "remember", "confidences"])
def test_a_member_that_raises_is_switched_off_and_the_others_race_on(method, monkeypatch, caplog):
    """One broken plugin among the members costs its own proposals, not the composite's: it is never called again,
    the others keep drafting, and `failures()` names it for the engine's alarm. Once every member is off, the
    composite raises (and the engine switches it off)."""
    monkeypatch.setattr(Broken, "method", method)
    fon = FastestOfN(["test_fastest_of_n.Broken", "test_fastest_of_n.Twos"])
    broken = fon.members[0]
    for _ in range(3):
        drafts = fon.propose([request("a"), request("b")], 4)
        fon.commit("a", [2, 2, 2, 2, 9])
        fon.remember([5, 6], [2, 2], 0)
        fon.remove("b")
    why = "ValueError: 2 proposals and 1 confidence lists for 2 requests" if method == "confidences" else \
        f"KeyError: '{method} broke'"
    assert fon.failures() == [f"member test_fastest_of_n.Broken switched off: {why}"]
    calls = broken.calls
    assert fon.propose([request("a"), request("b")], 4) == [[2, 2, 2, 2]] * 2 and drafts == [[2, 2, 2, 2]] * 2
    fon.commit("a", [2, 9])
    fon.remove("a")
    assert broken.calls == calls  # never asked again
    assert "fastest-of-N: member test_fastest_of_n.Broken switched off" in caplog.text
    assert fon.swap_weights([("w", 0)])  # (Twos has no weights) taken for the member switched off, and dropped
    monkeypatch.setattr(Twos, "propose", lambda self, requests, k: 1 / 0)
    with pytest.raises(RuntimeError, match="every member is switched off"):
        fon.propose([request("c")], 4)


class Endless(Ones):
    """Proposes endless counts, each with an endless list of confidences."""

    def propose(self, requests, k):
        return [itertools.count(3) for _ in requests]

    def confidences(self):
        return [itertools.repeat(0.9) for _ in range(len(MEMBERS))]


def test_a_members_endless_proposal_is_read_as_far_as_its_requests_budget():
    fon = FastestOfN(["test_fastest_of_n.Endless", "test_fastest_of_n.Ones"])
    short = DraftRequest("b", seed=0, position=0, token_ids=[5, 6], max_tokens=2)
    assert fon.propose([request("a"), short], 4) == [[3, 4, 5, 6], [3, 4]] and not fon.failures()
