"""logging.rollouts (learner/rollout_log.py): a step's trajectories as JSON lines, with the step and the seed that
reproduces each sample."""

import json

import factories
from learner.rollout_log import FILE, RolloutLog
from sampling.coupled import group_seed
from transport.messages import Trajectory


def trajectory(group: int, index: int, response: list[int]) -> Trajectory:
    return factories.trajectory(seq=group * 2 + index, group_id=group, sample_index=index, prompt_ids=[5, 6],
                                response_ids=response, policy_versions=[3] * len(response), reward=float(index))


def test_each_step_appends_its_trajectories_with_step_and_seed(tmp_path):
    log = RolloutLog(tmp_path / "run", run_seed=7)
    log.write(3, [[trajectory(10, 0, [1, 2]), trajectory(10, 1, [4])]])
    lines = [json.loads(line) for line in (tmp_path / "run" / FILE).read_text().splitlines()]  # flushed per step
    assert [(r["step"], r["group_id"], r["sample_index"], r["response_ids"], r["reward"]) for r in lines] == \
        [(3, 10, 0, [1, 2], 0.0), (3, 10, 1, [4], 1.0)]
    assert [r["seed"] for r in lines] == [group_seed(7, 10, 2), group_seed(7, 10, 2) + 1]
    RolloutLog(tmp_path / "run", run_seed=7).write(4, [[trajectory(11, 0, [9])]])  # a resumed run appends
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / FILE).read_text().splitlines()]
    assert steps == [3, 3, 4]



def test_a_line_a_killed_rank_left_half_written_is_cut_before_the_restarted_rank_appends(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / FILE).write_bytes(b'{"step": 1}\n{"step": 2, "se')  # killed mid-line
    RolloutLog(tmp_path / "run", run_seed=7).write(2, [[trajectory(10, 0, [1])]])
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / FILE).read_text().splitlines()] == [1, 2]
    (tmp_path / "run" / FILE).write_bytes(b'{"st')  # no whole line at all
    RolloutLog(tmp_path / "run", run_seed=7)
    assert (tmp_path / "run" / FILE).read_bytes() == b""
