"""A rollout actor's held-out evaluation, without an engine: request ids, scoring, and what a cut-short one reports."""

from actor.evaluation import EVAL_SEED_BASE, Evaluation
from tasks.base import Problem

PROBLEMS = {0: Problem("a", "1+1=?", "2", ""), 5: Problem("b", "2+2=?", "4", "")}


def test_every_problem_is_asked_greedily_and_sampled_and_done_only_when_all_answered():
    evaluation = Evaluation(tag=3, problems=PROBLEMS)
    ids = evaluation.request_ids()
    assert sorted((j, greedy) for _, j, greedy in ids) == [(0, False), (0, True), (5, False), (5, True)]
    evaluation.pending.update(rid for rid, _, _ in ids)
    answers = {0: (" 1+1=2\n#### 2", "#### 3"), 5: (" 2+2=4\n#### 4", "#### 4")}
    for rid, j, greedy in ids:
        assert not evaluation.done.is_set()
        evaluation.record(rid, answers[j][greedy], length=4 + j, version=7)
    assert evaluation.done.is_set()
    result = evaluation.result()
    assert (result["reward"], result["greedy"], result["answered"], result["answered_greedy"]) == (2.0, 1.0, 2, 2)
    assert result["length"] == 4 + 9 and result["versions"] == [7]
    assert EVAL_SEED_BASE > 1 << 32  # sampled answers never share a seed with a training request of a real run


def test_a_cut_short_evaluation_reports_only_what_was_answered():
    evaluation = Evaluation(tag=0, problems=PROBLEMS)
    evaluation.pending.update(rid for rid, _, _ in evaluation.request_ids())
    evaluation.record("eval0-5-t", "#### 4", length=2, version=0)
    result = evaluation.result()
    assert (result["answered"], result["answered_greedy"], result["reward"]) == (1, 0, 1.0)
