"""The draft planner (actor/draft_planner.py): it learns the engine's step cost curve and the drafter's cost from
observations, tracks acceptance per request, and drafts where verifying pays and nowhere else."""

import numpy as np
import pytest

from actor.draft_planner import (EXPLORE_EVERY, EXPLORE_SHARE, MAX_REST, MEASURED_DRAFTS, MEASURED_REJECTIONS,
                                 REST_STEPS, Acceptance, DraftCost, Explore, Rest, StepCost, Survival, geometric,
                                 plan)


def rated(rates: list[float], k: int) -> np.ndarray:
    return geometric(rates, k)


def learned(curve, tokens=range(1, 400)) -> StepCost:
    cost = StepCost()
    for _ in range(3):
        for n in tokens:
            cost.observe(n, curve(n))
    return cost


def weight_bound(n):  # a step costs about the same up to ~64 tokens (small batches, a big model)
    return 0.050 + 0.0001 * n


def compute_bound(n):  # every token costs a full share of the step
    return 0.002 + 0.004 * n


def test_step_cost_learns_the_curve_and_extrapolates_upwards():
    cost = learned(lambda n: 0.02 + 0.001 * max(0, n - 16))
    for n in (1, 10, 16, 40, 100, 300):
        assert cost.predict(n) == pytest.approx(0.02 + 0.001 * max(0, n - 16), rel=0.15)
    assert np.all(np.diff(cost.predict(np.arange(1, 2000))) >= 0)  # more tokens never predicted cheaper
    assert cost.predict(1000) > cost.predict(399) + 0.3  # beyond what it saw: along the trend


def test_step_cost_follows_a_changed_machine():
    cost = learned(weight_bound)
    slower = learned(lambda n: 10 * weight_bound(n))  # the same engine, ten times slower at every size it runs
    for _ in range(10):
        for n in range(1, 400):
            cost.observe(n, 10 * weight_bound(n))
    for n in (8, 64, 300):
        assert cost.predict(n) == pytest.approx(slower.predict(n), rel=0.05)


def test_draft_cost_learns_passes_tokens_and_catch_up():
    cost = DraftCost()
    rng = np.random.default_rng(0)
    for _ in range(200):
        passes, tokens, unseen = int(rng.integers(1, 5)), int(rng.integers(1, 64)), int(rng.integers(0, 400))
        cost.observe(passes, tokens, unseen, 0.001 + 0.002 * passes + 0.0001 * tokens + 0.00005 * unseen)
    assert cost.predict(np.array([4]), np.array([40]), np.array([100]))[0] == pytest.approx(0.018, rel=0.02)
    assert cost.predict(np.array([0]), np.array([0]))[0] == 0.0  # no drafts, no drafting cost


def test_draft_cost_fit_is_the_best_nonnegative_one():
    """The active-set fit (warm-started from the last fit's terms) against the best of the least-squares fits on
    every subset of the terms, after every observation of random, often collinear drafting steps."""
    rng = np.random.default_rng(3)
    for _ in range(40):
        cost, truth = DraftCost(), rng.normal(size=DraftCost.TERMS) * 0.002
        for _ in range(int(rng.integers(1, 30))):
            passes, drafted, unseen = int(rng.integers(0, 5)), int(rng.integers(0, 64)), int(rng.integers(0, 500))
            cost.observe(passes, drafted, unseen, max(0.0, truth @ [1, passes, drafted, unseen] + rng.normal() * 1e-3))
            gram = cost.gram + cost.ridge * np.eye(DraftCost.TERMS)

            def loss(coef):
                return coef @ gram @ coef - 2 * coef @ cost.moment

            best = 0.0
            for mask in range(1, 2 ** DraftCost.TERMS):
                terms = [t for t in range(DraftCost.TERMS) if mask >> t & 1]
                fit = np.zeros(DraftCost.TERMS)
                fit[terms] = np.linalg.solve(gram[np.ix_(terms, terms)], cost.moment[terms])
                if fit.min() >= 0:
                    best = min(best, loss(fit))
            assert cost.coef.min() >= 0 and loss(cost.coef) <= best + 1e-9 * abs(best) + 1e-18


def test_one_unlike_drafting_step_is_not_read_as_a_fixed_cost():
    """Measured (the draft LM in the long-tail benchmark's second epoch): four steps of two requests drafting four
    tokens, then a new batch of 101 requests drafting one token each and feeding the draft LM their 1286 prompt
    tokens, 10.7 ms. Clipping the unconstrained fit at 0 read that as a fixed cost of 60 ms per drafting step, and
    the planner drafted on 6 of the next 210 steps (exploring only)."""
    draft = DraftCost()
    for passes, drafted, unseen, seconds in [(4, 4, 2, 0.0041), (4, 8, 22, 0.0027), (4, 8, 12, 0.0027),
                                             (4, 8, 10, 0.0027), (1, 101, 1286, 0.0107)]:
        draft.observe(passes, drafted, unseen, seconds)
    assert draft.coef.min() >= 0
    assert draft.predict(np.array([4]), np.array([8]), np.array([10]))[0] < 0.006  # what such steps cost: ~3 ms
    assert plan(rated([0.8] * 8, 4), 8, learned(weight_bound), draft, unseen=[3] * 8)[0] == [4] * 8


def test_a_long_idle_request_pays_its_catch_up_with_its_first_draft():
    draft = DraftCost()
    rng = np.random.default_rng(1)
    for _ in range(100):
        passes, drafted, unseen = int(rng.integers(1, 5)), int(rng.integers(1, 64)), int(rng.integers(0, 2000))
        draft.observe(passes, drafted, unseen, 0.001 * passes + 0.00001 * unseen)
    # the same acceptance, but the second request's history would cost the drafter ~10 engine steps to catch up
    assert plan(rated([0.7, 0.7], 4), 2, learned(weight_bound), draft, unseen=[1, 50_000])[0] == [4, 0]


def test_acceptance_per_request_shrinks_towards_the_drafter_average():
    acc = Acceptance()
    for _ in range(50):
        acc.observe("good", 4, 4)
        acc.observe("bad", 4, 0)
    assert acc.rates(["good"])[0] > 0.9 and acc.rates(["bad"])[0] < 0.1
    assert 0.1 < acc.rates(["new"])[0] < 0.9  # never seen: the average over every request
    acc.remove("good")
    assert acc.rates(["good"])[0] == acc.rates(["new"])[0]


def test_survival_is_the_chance_that_a_draft_lands_inside_the_request():
    survival = Survival(max_len=100)
    for _ in range(50):  # every request so far ended with 10 tokens
        survival.ended(10)
    near, beyond = survival.factors([8, 60], 4)
    # 8 tokens out: the 9th is certain; a first accepted draft adds the 10th, a second the 11th, which no request had
    assert near[0] == pytest.approx(1.0) and near[1] < 0.05 and near[3] <= near[2] <= near[1]
    assert beyond == pytest.approx([1.0] * 4)  # longer than every request that ended: no end known


def test_a_second_plan_of_no_drafts_rests_the_planner_until_the_batch_halves_or_drafts_pay():
    rest = Rest()
    rest.planned(64, drafted=False)  # one plan of no drafts (the planner measuring a smaller step): no rest
    assert not rest.keeps(64)
    rest.planned(64, drafted=False)
    assert [rest.keeps(60) for _ in range(REST_STEPS + 1)] == [True] * REST_STEPS + [False]
    rest.planned(64, drafted=False)  # still idle: rests again, twice as long
    assert [rest.keeps(33) for _ in range(2 * REST_STEPS + 1)] == [True] * 2 * REST_STEPS + [False]
    for _ in range(8):  # idle on: each rest twice the last, up to MAX_REST
        rest.planned(64, drafted=False)
    assert sum(rest.keeps(64) for _ in range(4 * MAX_REST)) == MAX_REST
    rest.planned(64, drafted=False)
    assert rest.keeps(33) and not rest.keeps(32)  # half the batch: a smaller batch is where drafting starts to pay
    rest.planned(32, drafted=True)
    rest.planned(32, drafted=False)  # the first idle plan after drafting
    assert not rest.keeps(32)


def measured_acceptance() -> Acceptance:
    acceptance = Acceptance()
    while not acceptance.measured:
        acceptance.observe("r", drafted=4, accepted=4)
    return acceptance


def test_exploring_is_due_after_enough_steps_and_a_share_of_their_time():
    explore = Explore(measured_acceptance())
    for _ in range(EXPLORE_EVERY - 1):
        explore.stepped(drafted=False)
        explore.took(0.001)
    assert not explore.due()
    explore.stepped(drafted=False)
    assert explore.due()  # nothing explored yet: the step count alone
    explore.explored(requests=1, cost=0.002)  # an exploring step that cost two plain steps
    explore.explored(requests=5, cost=1.0)  # a plan that drafted anyway: no measure of exploring
    explore.stepped(drafted=True)
    for _ in range(EXPLORE_EVERY):
        explore.stepped(drafted=False)
        explore.took(0.001)
    assert not explore.due()  # 32 ms of steps: exploring again now would spend 6% of them
    steps = 0
    while not explore.due():
        explore.stepped(drafted=False)
        explore.took(0.001)
        steps += 1
    assert abs(EXPLORE_EVERY + steps - 0.002 / EXPLORE_SHARE / 0.001) <= 1  # 0.2 s of steps: 1% of them is 2 ms
    explore.stepped(drafted=True)  # a plan that drafts starts the count again
    assert explore.steps == 0 and explore.seconds == 0.0


def test_a_new_planner_explores_until_the_drafters_acceptance_is_measured_for_a_while_at_most():
    """Judged on its starting guesses a good drafter can look not worth a try (the cold smoke preset's first plans at
    24 requests drafted nothing for 30 steps): a new planner explores every step until the drafter's acceptance
    rests on MEASURED_DRAFTS verified draft tokens (or MEASURED_REJECTIONS rejections: a bad drafter shows itself
    sooner), and a drafter that never proposes anything (nothing verified) stops being explored after EXPLORE_EVERY
    steps."""
    acceptance = Acceptance()
    explore = Explore(acceptance)
    assert explore.due()
    for step in range(100):  # one request drafts 4 a step, 3 accepted: 4 tokens verified a step
        if not explore.due():
            break
        acceptance.observe("r", drafted=4, accepted=3)
        explore.stepped(drafted=True)
    assert step == MEASURED_DRAFTS // 4 and acceptance.measured
    rejected = Acceptance()
    for _ in range(MEASURED_REJECTIONS):
        assert not rejected.measured
        rejected.observe("r", drafted=4, accepted=0)
    assert rejected.measured
    silent = Explore(Acceptance())  # proposals always empty: nothing is ever verified
    silent.explored(requests=1, cost=1.0)  # at a cost that the usual rule waits 100 s of steps for
    due = []
    for _ in range(2 * EXPLORE_EVERY):
        due.append(silent.due())
        silent.stepped(drafted=False)
        silent.took(0.001)
    assert due == [True] * EXPLORE_EVERY + [False] * EXPLORE_EVERY


def test_plan_drafts_fully_where_verifying_is_nearly_free():
    drafts, predicted = plan(rated([0.8] * 4, 4), 4, learned(weight_bound), DraftCost())
    assert drafts == [4, 4, 4, 4]
    assert predicted == pytest.approx(weight_bound(20), rel=0.15)


def test_plan_does_not_draft_where_every_token_costs_a_step_share():
    drafts, _ = plan(rated([0.6] * 32, 4), 32, learned(compute_bound), DraftCost())
    assert drafts == [0] * 32


def test_an_exploring_plan_drafts_for_the_likeliest_request_only_where_nothing_pays():
    """Without exploration a planner that stopped drafting never observes acceptance again, so it never starts
    again however the policy or batch changes; an exploring step drafts fully for one request, the likeliest."""
    cost = learned(compute_bound)
    assert plan(rated([0.5, 0.7, 0.4], 4), 3, cost, DraftCost())[0] == [0, 0, 0]
    drafts, predicted = plan(rated([0.5, 0.7, 0.4], 4), 3, cost, DraftCost(), explore=True)
    assert drafts == [0, 4, 0] and predicted == pytest.approx(compute_bound(7), rel=0.15)
    weight = learned(weight_bound)  # where drafting pays, exploring changes nothing
    gains = rated([0.8] * 4, 4)
    assert plan(gains, 4, weight, DraftCost(), explore=True) == plan(gains, 4, weight, DraftCost())
    assert plan(rated([0.5, 0.7, 0.4], 4).tolist(), 3, cost, DraftCost(), explore=True)[0] == [0, 4, 0]  # as lists


def test_plan_gives_drafts_to_requests_that_accept_them():
    # a mid curve: some drafting pays, so it goes to the requests with the best acceptance
    drafts, _ = plan(rated([0.95, 0.2, 0.9, 0.05], 4), 4, learned(lambda n: 0.01 + 0.001 * n), DraftCost())
    assert drafts[0] > 0 and drafts[2] > 0 and drafts[1] <= min(drafts[0], drafts[2]) and drafts[3] == 0


def test_plan_counts_the_drafting_cost():
    expensive = DraftCost()
    for passes in range(1, 5):
        for tokens in (1, 8, 32):
            expensive.observe(passes, tokens, tokens, 0.2 * passes)  # each draft pass costs four engine steps
    drafts, _ = plan(rated([0.8] * 4, 4), 4, learned(weight_bound), expensive)
    assert drafts == [0, 0, 0, 0]


def test_drafting_a_few_requests_is_weighed_against_everything_the_step_commits():
    """Decoupled: drafting the requests whose drafts were not prepared delays every request of the step. A pass that
    pays for one request alone (its tokens against a small step) does not when 60 prepared requests' tokens wait."""
    cost = DraftCost()
    for passes in range(1, 5):
        for tokens in (1, 2, 4):
            cost.observe(passes, tokens, 0, 0.01 * passes)  # a draft pass: a fifth of a step
    step = learned(weight_bound)
    assert plan(rated([0.9], 4), 1, step, cost)[0] == [4]  # alone in the step: worth it
    assert plan(rated([0.9], 4), 61 + 4 * 60, step, cost, elsewhere=60 * 3.0)[0] == [0]


def test_plan_before_any_measurement_drafts_everything_it_may():
    assert plan(rated([0.5, 0.01], 3), 2, StepCost(), DraftCost())[0] == [3, 3]
    assert plan(rated([], 4), 0, StepCost(), DraftCost())[0] == []


def test_a_planner_that_has_only_seen_drafted_steps_tries_fewer_drafts():
    cost = StepCost()
    cost.observe(20, compute_bound(20))  # four requests, four drafts each: all it has seen
    drafts, _ = plan(rated([0.6] * 4, 4), 4, cost, DraftCost())
    assert sum(drafts) < 16  # a step with fewer drafts looks cheaper until measured
    for n in range(1, 64):
        cost.observe(n, compute_bound(n))
    assert plan(rated([0.6] * 4, 4), 4, cost, DraftCost())[0] == [0, 0, 0, 0]  # measured: drafting cannot pay here


def test_one_stalled_step_does_not_turn_drafting_off():
    cost = learned(weight_bound)
    cost.observe(20, 5.0)  # a step that waited on something else: a hundred times the usual
    assert cost.predict(20) < 2 * weight_bound(20) + 1e-9
    assert plan(rated([0.9] * 4, 4), 4, cost, DraftCost())[0] == [4, 4, 4, 4]


def test_a_stalled_small_step_never_seen_again_does_not_lift_the_curve():
    """A slow first step of a size that never recurs (an engine's warm-up, the end of a batch) caps nothing and is
    capped: the curve above it stays what was measured there, so drafting is not taken for free."""
    cost = learned(compute_bound, tokens=range(8, 400))
    cost.observe(3, 5.0)  # the first and only step of 3 tokens, stalled
    for n in (16, 40, 190):
        assert cost.predict(n) == pytest.approx(compute_bound(n), rel=0.15)
    assert cost.predict(3) <= cost.predict(8)
    assert plan(rated([0.6] * 8, 4), 8, cost, DraftCost())[0] == [0] * 8  # compute-bound: still no drafting


def test_a_step_larger_than_any_seen_is_taken_as_measured_and_a_stall_where_the_curve_is_known_is_not():
    """Beyond the largest step it has seen the curve only extrapolates: the first step there teaches its real cost
    (a guard against stalls there kept a 1.8 s step of 909 tokens at 0.43 s, and the planner drafted on)."""
    cost = learned(weight_bound)
    known, far = 8, 900
    before = float(cost.predict(known))
    cost.observe(known, 100 * before)  # a stalled step: moves the curve by at most 2x
    assert float(cost.predict(known)) <= 2 * before
    cost.observe(far, 50 * float(cost.predict(far)))
    assert float(cost.predict(far)) == pytest.approx(50 * float(learned(weight_bound).predict(far)), rel=0.01)


def test_observe_predicts_from_a_curve_at_most_a_few_observations_old():
    cost = StepCost()
    for n in (8, 64):
        cost.observe(n, 0.01)
    made = cost.predict(np.array([8, 64]))  # a plan makes the curve
    for _ in range(StepCost.STALE):  # steps of rest: observed, and predicted from the curve as made
        assert cost.observe(64, 0.04) == pytest.approx(0.01)
    assert cost.observe(64, 0.04) > 0.011  # then made again from what it saw
    assert cost.predict(64) > made[1]  # a plan always predicts from every observation
