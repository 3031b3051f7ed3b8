"""The speculation scalars a step's trajectories carry to TensorBoard (learner/metrics.py): acceptance, each member
of a composite drafter's token acceptance on every proposal it made, and the alarm for a drafter (or a member) whose
drafts are nearly all rejected, the zeroed-draft-weights failure."""

import logging

import msgspec
import pytest

import factories
import learner.metrics
from learner.metrics import ALARM_DRAFTED, MAX_WARNED, rollout_metrics
from transport.messages import SpecStats, Trajectory


def trajectory(verify_steps: int, drafted: int, accepted: int, labels: dict | None = None) -> Trajectory:
    return factories.trajectory(response_ids=[3] * 10, behaviour_logprobs=[-1.0] * 10, generate_seconds=0.5,
                                spec=SpecStats(verify_steps=verify_steps, draft_tokens=drafted,
                                               accepted_tokens=accepted, drafter_labels=labels or {}))


@pytest.mark.parametrize(("accepted", "alarm"), [(0, 1.0), (4, 1.0), (5, 0.0), (60, 0.0)])
def test_a_drafter_accepted_about_never_raises_the_alarm(accepted, alarm, caplog):
    """100 verify steps of 200 drafts: acceptance length under 1.05 (fewer than 5 accepted) is a broken drafter."""
    with caplog.at_level(logging.WARNING, logger="learner.metrics"):
        metrics = rollout_metrics([trajectory(50, 100, accepted // 2), trajectory(50, 100, accepted - accepted // 2)],
                                  "draft_lm")
    assert metrics["spec/acceptance_length"] == pytest.approx(1 + accepted / 100)
    assert metrics["spec/alarm"] == alarm
    assert ("drafter draft_lm" in caplog.text) == bool(alarm)


def test_too_few_drafts_raise_no_alarm():
    assert rollout_metrics([trajectory(10, ALARM_DRAFTED - 1, 0)], "ngram")["spec/alarm"] == 0.0


def test_each_member_gets_its_token_acceptance_and_a_broken_one_the_alarm(caplog):
    """Fastest-of-N's draft LM gone bad while the suffix drafter is chosen: the composite's acceptance looks fine,
    the member's labels do not."""
    good = {"suffix": [300, 60], "drafters.draft_lm.DraftLM": [2, 120]}
    with caplog.at_level(logging.WARNING, logger="learner.metrics"):
        metrics = rollout_metrics([trajectory(100, 400, 300, good), trajectory(1, 4, 4, {"suffix": [4, 0]})],
                                  "fastest_of_n")
    assert metrics["spec/member/suffix/token_acceptance"] == pytest.approx(304 / 364)
    assert metrics["spec/member/DraftLM/token_acceptance"] == pytest.approx(2 / 122)
    assert metrics["spec/acceptance_length"] > 3 and metrics["spec/alarm"] == 1.0
    assert "member DraftLM of drafter fastest_of_n" in caplog.text and "of this step's" not in caplog.text
    healthy = rollout_metrics([trajectory(100, 400, 300, {"suffix": [300, 60], "draft_lm": [200, 90]})],
                              "fastest_of_n")
    assert healthy["spec/alarm"] == 0.0 and healthy["spec/member/draft_lm/token_acceptance"] == pytest.approx(200 / 290)
    few = rollout_metrics([trajectory(100, 400, 300, {"suffix": [300, 60], "draft_lm": [0, ALARM_DRAFTED - 1]})],
                          "fastest_of_n")
    assert few["spec/alarm"] == 0.0  # too few labels to call it broken


def test_trajectories_decoded_without_a_switched_off_drafter_raise_the_alarm(caplog, monkeypatch):
    """A drafter that raised was switched off in its engine (actor/draft_bridge.py): the run goes on, so TensorBoard
    and the log must say that its rollouts no longer draft."""
    monkeypatch.setattr(learner.metrics, "WARNED", set())  # (this process's own: the test fills it)
    failure = "drafter Raises switched off: IndexError: broke (test_rollout_metrics)"
    with caplog.at_level(logging.WARNING, logger="learner.metrics"):
        off = msgspec.structs.replace(trajectory(0, 0, 0), spec=SpecStats(drafter_failure=failure))
        metrics = rollout_metrics([trajectory(50, 100, 60), off], "draft_lm")
    assert metrics["spec/drafter_failed"] == 0.5 and metrics["spec/alarm"] == 1.0
    assert f"{failure}: 1 of this step's 2 trajectories were decoded without drafts" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="learner.metrics"):
        again = rollout_metrics([off, off], "draft_lm")
    assert again["spec/drafter_failed"] == 1.0 and again["spec/alarm"] == 1.0 and not caplog.text  # said once
    assert rollout_metrics([trajectory(50, 100, 60)], "draft_lm")["spec/drafter_failed"] == 0.0
    # a peer's made-up failures, a new one in every trajectory: warned of up to MAX_WARNED, then TensorBoard only
    made_up = [msgspec.structs.replace(off, spec=SpecStats(drafter_failure=f"made up {i}"))
               for i in range(2 * MAX_WARNED)]
    with caplog.at_level(logging.WARNING, logger="learner.metrics"):
        assert rollout_metrics(made_up, "draft_lm")["spec/drafter_failed"] == 1.0
    assert len(learner.metrics.WARNED) == MAX_WARNED and caplog.text.count("decoded without drafts") == MAX_WARNED - 1


def test_without_speculation_there_are_no_spec_scalars_per_drafter():
    metrics = rollout_metrics([trajectory(0, 0, 0)], "none")
    assert "spec/alarm" not in metrics and not [k for k in metrics if k.startswith("spec/member/")]


def test_decoupled_drafting_reports_its_hit_rate_and_the_drafting_waited_for():
    plain = trajectory(40, 100, 60)
    assert "spec/prepared_hit_rate" not in rollout_metrics([plain], "draft_lm")  # not decoupled: no such scalar
    ahead = [msgspec.structs.replace(plain, spec=msgspec.structs.replace(plain.spec, prepared_steps=n, draft_seconds=s))
             for n, s in ((10, 0.25), (30, 0.5))]
    metrics = rollout_metrics(ahead, "draft_lm")
    assert metrics["spec/prepared_hit_rate"] == pytest.approx(40 / 80)
    assert metrics["spec/critical_draft_seconds"] == pytest.approx(0.75)
