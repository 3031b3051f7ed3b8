import json
import statistics

import pytest

from tasks.arithmetic import ArithmeticTask
from tasks.base import ANSWER_MARK
from tasks.jsonl import DataFormatError, JsonlDataset, load_jsonl
from tasks.reward import length_penalized, score


def test_generator_is_deterministic_per_seed():
    a, b, other = ArithmeticTask(seed=3), ArithmeticTask(seed=3), ArithmeticTask(seed=4)
    assert [a[i] for i in range(50)] == [b[i] for i in range(50)]
    assert [a[i] for i in range(50)] != [other[i] for i in range(50)]
    # random access: a problem does not depend on which were generated before it
    assert ArithmeticTask(seed=3)[37] == a[37]


def test_solutions_are_correct_and_scored_correct():
    task = ArithmeticTask(seed=0)
    for i in range(200):
        p = task[i]
        assert p.solution.endswith(f"{ANSWER_MARK} {p.answer}")
        assert eval(p.question.removesuffix("=?")) == int(p.answer)  # the question's own arithmetic
        assert len(p.solution.splitlines()) == p.difficulty + 1
        assert score(" " + p.solution, p.answer).reward == 1.0


def test_solution_lengths_have_a_long_tail():
    task = ArithmeticTask(seed=0)
    lengths = sorted(len(task[i].solution) for i in range(4000))
    median = statistics.median(lengths)
    p99 = lengths[int(0.99 * len(lengths))]
    mean = statistics.mean(lengths)
    assert p99 >= 8 * median, (median, p99)  # a few answers many times longer than the typical one
    assert mean > 1.3 * median  # right-skewed
    assert sum(x <= 2 * median for x in lengths) >= 0.6 * len(lengths)  # most answers are short


def test_a_sized_task_repeats_its_problems_each_epoch_in_a_new_order():
    task = ArithmeticTask(seed=0, size=50)
    first, second = [task[i] for i in range(50)], [task[i] for i in range(50, 100)]
    assert len({p.id for p in first}) == 50  # an epoch is every problem once
    assert sorted(p.id for p in second) == sorted(p.id for p in first)
    assert [p.id for p in second] != [p.id for p in first]
    assert set(first) == {ArithmeticTask(seed=0)[i] for i in range(50)}  # the endless stream's first 50
    with pytest.raises(ValueError, match="size"):
        ArithmeticTask(size=-1)


def test_wording_writes_a_share_of_steps_in_words_and_leaves_the_questions_and_answers_as_they_were():
    plain, wordy = ArithmeticTask(seed=5), ArithmeticTask(seed=5, wording=0.5)
    worded = steps = 0
    for i in range(300):
        p, w = plain[i], wordy[i]
        assert (w.question, w.answer, w.difficulty) == (p.question, p.answer, p.difficulty)
        assert score(" " + w.solution, w.answer).correct
        lines = w.solution.splitlines()[:-1]
        for line, compact in zip(lines, p.solution.splitlines()):
            words = line.replace("plus", "+").replace("minus", "-").replace("makes", "=").replace(" ", "")
            assert words == compact
            worded += " makes " in line
        steps += len(lines)
    assert 0.4 < worded / steps < 0.6
    assert ArithmeticTask(seed=5, wording=1.0)[0].solution.count(" makes ") == plain[0].difficulty


def test_the_length_penalty_takes_from_correct_answers_only_by_their_share_of_the_budget():
    assert length_penalized(1.0, 100, 400, 0.4) == pytest.approx(0.9)
    assert length_penalized(1.0, 50, 400, 0.4) > length_penalized(1.0, 100, 400, 0.4)
    assert length_penalized(1.0, 900, 400, 0.4) == pytest.approx(0.6)  # never more than the penalty
    assert length_penalized(0.0, 10, 400, 0.4) == 0.0  # a short wrong answer gains nothing
    assert length_penalized(1.0, 100, 400, 0.0) == 1.0


def test_tail_exponent_zero_draws_every_difficulty_equally():
    task = ArithmeticTask(seed=0, max_ops=3, tail_exponent=0.0)
    counts = [sum(task[i].difficulty == k for i in range(3000)) for k in (1, 2, 3)]
    assert all(900 < c < 1100 for c in counts), counts


def test_with_ops_fixes_difficulty():
    task = ArithmeticTask(seed=0)
    assert {task.with_ops(5, i).difficulty for i in range(20)} == {5}


@pytest.mark.parametrize("response,answer,reward,well_formed", [
    (" 3+4=7\n#### 7", "7", 1.0, True),
    (" 3+4=7\n####7\n", "7", 1.0, True),
    ("#### 1,234", "1234", 1.0, True),
    ("#### 7.0", "7", 1.0, True),
    ("#### 3.50", "3.5", 1.0, True),
    ("#### " + "1" * 40, "1" * 39 + "2", 0.0, True),  # past 28 digits: still exact (normalize() rounded them equal)
    (" 3+4=8\n#### 8", "7", 0.0, True),
    (" 3+4=7", "7", 0.0, False),
    ("#### seven", "7", 0.0, False),
    ("#### 7\n#### 7", "7", 0.0, False),
    ("#### 7\nand then more", "7", 0.0, False),
    ("#### 7 apples", "7", 0.0, False),
    ("", "7", 0.0, False),
])
def test_reward(response, answer, reward, well_formed):
    s = score(response, answer)
    assert (s.reward, s.well_formed, s.correct) == (reward, well_formed, reward == 1.0)
    assert (s.reason == "") == (reward == 1.0)


def write(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_loads_gsm8k_records(tmp_path):
    path = write(tmp_path, [
        json.dumps({"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"}),
        "",
        json.dumps({"question": "Big?", "answer": "#### 1,000", "id": "q2"}),
    ])
    problems = load_jsonl(path)
    assert [p.answer for p in problems] == ["7", "1,000"]
    assert problems[1].id == "q2"
    assert problems[0].solution.endswith("#### 7")
    assert score(" " + problems[0].solution, problems[0].answer).correct


@pytest.mark.parametrize("bad,needle", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"answer": "#### 3"}), "missing key 'question'"),
    (json.dumps({"question": "q", "answer": 3}), "'answer' must be a non-empty string"),
    (json.dumps({"question": "q", "answer": "three"}), "once, not 0 times"),
    (json.dumps({"question": "q", "answer": "a #### 3\nb #### 4"}), "once, not 2 times"),  # its reference scored 0
    ('{"question": "q\\ud800", "answer": "#### 3"}', "lone surrogate"),  # loaded, then no tokenizer could take it
    ('{"question": "q", "answer": "#### 3", "x": ' + "1" * 5000 + "}", "integer string conversion"),  # a ValueError
    (json.dumps({"question": "q", "answer": "#### three"}), "is not a number"),
    (json.dumps({"question": "q", "answer": "x ##### 7"}), "with '####' exactly"),  # was kept as 'x #\n#### 7'
    (json.dumps({"question": "q", "answer": "#### nan"}), "is not a number"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),  # not a RecursionError traceback
])
def test_jsonl_malformed_line_names_file_and_line(tmp_path, bad, needle):
    good = json.dumps({"question": "q", "answer": "#### 1"})
    path = write(tmp_path, [good, good, bad, good])
    with pytest.raises(DataFormatError) as e:
        load_jsonl(path)
    assert f"{path}:3:" in str(e.value) and needle in str(e.value)


def test_jsonl_line_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"question": "q", "answer": "#### 1"}\n{"question": "caf\xe9", "answer": "#### 1"}\n')
    with pytest.raises(DataFormatError, match=f"{path}:2: not UTF-8"):  # was a UnicodeDecodeError
        load_jsonl(path)


def test_a_jsonl_file_may_start_with_a_byte_order_mark_and_be_named_from_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"question": "q", "answer": "#### 1"}\r\n')
    assert [p.answer for p in load_jsonl("~/bom.jsonl")] == ["1"]


def test_jsonl_missing_or_empty_file(tmp_path):
    with pytest.raises(DataFormatError, match="no such data file"):
        load_jsonl(tmp_path / "absent.jsonl")
    with pytest.raises(DataFormatError, match="a directory, not a data file"):
        load_jsonl(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataFormatError, match="holds no records"):
        load_jsonl(tmp_path / "empty.jsonl")


def test_jsonl_dataset_cycles_epochs_in_seeded_order(tmp_path):
    path = write(tmp_path, [json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) for i in range(7)])
    ds = JsonlDataset(str(path), seed=1)
    first, second = [ds[i].answer for i in range(7)], [ds[i].answer for i in range(7, 14)]
    assert sorted(first, key=int) == sorted(second, key=int) == [str(i) for i in range(7)]
    assert first != second  # a new order each epoch
    assert [JsonlDataset(str(path), seed=1)[i].answer for i in range(14)] == first + second


def test_the_eval_set_is_fixed_and_never_holds_a_training_problem():
    from configs.load import load_config
    from tasks.dataset import eval_set, open_dataset

    cfg = load_config("grpo_tiny", ["data.eval_size=300"])
    problems = eval_set(cfg.data, cfg.seed)
    train = open_dataset(cfg.data, cfg.seed)
    training = {train[i].question for i in range(cfg.data.size)}
    questions = [p.question for p in problems]
    assert len(questions) == 300 == len(set(questions))  # no problem twice either
    assert not set(questions) & training
    assert [p.question for p in eval_set(cfg.data, cfg.seed)] == questions  # the same at every evaluation
    assert max(p.difficulty for p in problems) <= cfg.data.max_ops  # the training mix


def test_an_endless_training_stream_never_draws_a_held_out_problem():
    """With `data.size` 0 the built-in task draws a new problem per prompt from the whole problem space, where the
    held-out problems are too (53% of them were among the first 6,400 training prompts): a held-out question is
    drawn again at its cursor, from a stream of its own. Where the held-out set holds most problems, the load says
    so instead of an actor failing mid-run."""
    from configs.load import ConfigError, load_config
    from tasks.dataset import eval_set, open_dataset

    cfg = load_config("grpo_tiny", ["data.size=0"])
    held_out = {p.question for p in eval_set(cfg.data, cfg.seed)}
    train = open_dataset(cfg.data, cfg.seed)
    drawn = [train[i].question for i in range(6400)]
    assert not held_out & set(drawn)
    assert [train[i].question for i in range(6400)] == drawn  # the same stream every time
    plain = ArithmeticTask(seed=cfg.seed, max_ops=cfg.data.max_ops, max_operand=cfg.data.max_operand,
                           tail_exponent=cfg.data.tail_exponent)
    assert sum(plain[i].question in held_out for i in range(6400)) > 100  # (what it drew without: held-out ones)
    with pytest.raises(ConfigError, match="key 'data.eval_size' = 2: the held-out problems are 100% of what the"):
        load_config("grpo_tiny", ["data.size=0", "data.max_ops=1", "data.max_operand=1", "data.eval_size=2"])
    # where they are most of it, a cursor late in the run may find nothing else: the share is judged at load
    mostly = ["data.size=0", "data.max_ops=1", "data.max_operand=10", "data.eval_size=154"]
    with pytest.raises(ConfigError, match="held-out problems are 100% of what the endless training stream draws"):
        load_config("grpo_tiny", mostly)
    cfg = load_config("grpo_tiny", [*mostly[:-1], "data.eval_size=60"])  # a share that leaves room
    assert open_dataset(cfg.data, cfg.seed).held_out_share() < 0.9


def test_a_jsonl_eval_set_holds_no_training_question_and_none_twice(tmp_path):
    from configs.load import ConfigError, load_config

    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(9)))
    held_out.write_text("".join(json.dumps({"question": f"{i}+2?", "answer": f"#### {i + 2}"}) + "\n" for i in range(4)))
    given = [f"data.source={train}", f"data.eval_source={held_out}", "data.eval_size=4"]
    assert load_config("grpo_tiny", given)
    with held_out.open("a") as f:
        f.write(json.dumps({"question": "3+1?", "answer": "#### 4"}) + "\n")
    with pytest.raises(ConfigError, match=r"data.eval_source.*record eval-5 asks a question of data.source's"):
        load_config("grpo_tiny", [*given[:2], "data.eval_size=5"])
    held_out.write_text(held_out.read_text() + json.dumps({"question": "0+2?", "answer": "#### 2"}) + "\n")
    with pytest.raises(ConfigError, match=r"record eval-6 asks a question an earlier record asks"):
        load_config("grpo_tiny", [f"data.source=arithmetic", f"data.eval_source={held_out}", "data.eval_size=6"])


def test_a_jsonl_eval_set_is_its_first_records(tmp_path):
    from configs.load import ConfigError, load_config
    from tasks.dataset import eval_set

    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(9)))
    cfg = load_config("grpo_tiny", [f"data.eval_source={path}", "data.eval_size=4"])
    assert [p.answer for p in eval_set(cfg.data, cfg.seed)] == ["1", "2", "3", "4"]
    with pytest.raises(ConfigError, match=r"key 'data.eval_size'.*holds 9 problems"):  # was: 9 evaluated, silently
        load_config("grpo_tiny", [f"data.eval_source={path}", "data.eval_size=10"])


@pytest.mark.parametrize("max_ops, max_operand", [(1, 9), (4, 9), (24, 99)])
def test_no_problem_of_the_built_in_task_is_longer_than_its_longest_prompt(max_ops, max_operand):
    """The launcher checks `longest_prompt` against model.max_model_len before the run starts (tasks/dataset.py)."""
    task = ArithmeticTask(seed=5, max_ops=max_ops, max_operand=max_operand, tail_exponent=0.0)
    longest = task.longest_prompt()
    assert all(len(task[i].prompt) <= len(longest) for i in range(300))
    assert max(len(task.with_ops(max_ops, i).prompt) for i in range(50)) >= len(longest) - max_ops  # it is tight
