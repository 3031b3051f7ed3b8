"""Opens the datasets a config's `data` section names: the training stream and the held-out evaluation set."""

from __future__ import annotations

from omegaconf import DictConfig

from tasks.arithmetic import ArithmeticTask
from tasks.base import Dataset, Problem
from tasks.jsonl import DataFormatError, JsonlDataset, load_jsonl

EVAL_SEED_OFFSET = 7_919  # the built-in eval set's problems come from seed + this (and never equal a training one)


def open_dataset(data: DictConfig, seed: int) -> Dataset:
    """The training stream. The built-in task's endless stream (`data.size` 0) never draws a built-in held-out
    problem (`eval_set`), which a finite training set leaves out of the held-out problems instead."""
    if data.source == "arithmetic":
        held_out = frozenset(p.question for p in eval_set(data, seed)) if not data.size and \
            data.eval_source == "arithmetic" else frozenset()
        return ArithmeticTask(seed=seed, max_ops=data.max_ops, max_operand=data.max_operand,
                              tail_exponent=data.tail_exponent, size=data.size, held_out=held_out)
    return JsonlDataset(data.source, seed=seed)


def jsonl_sources(data: DictConfig) -> dict[str, str]:
    """The `data` keys that name a JSONL file (`data.source`, `data.eval_source`), each with its path."""
    return {f"data.{key}": data[key] for key in ("source", "eval_source") if data[key] != "arithmetic"}


def check_prompt_lengths(data: DictConfig, tokenizer, max_model_len: int) -> None:
    """Every prompt of a JSONL `data.source` / `data.eval_source`, and the built-in task's longest question, leaves
    the model room for a token of answer (vLLM refuses a longer one inside the actor, which would end the run);
    raises `DataFormatError` naming the key (and the file and the line of the first that does not)."""

    def fits(prompt: str) -> str | None:
        n = len(tokenizer(prompt, add_special_tokens=False).input_ids)
        return None if n < max_model_len else (f"the prompt is {n} tokens, and model.max_model_len = {max_model_len} "
                                               "leaves no room to answer it")

    if "arithmetic" in (data.source, data.eval_source):
        if wrong := fits(ArithmeticTask(max_ops=data.max_ops, max_operand=data.max_operand).longest_prompt()):
            raise DataFormatError(f"key 'data.max_ops' = {data.max_ops} (operands up to data.max_operand = "
                                  f"{data.max_operand}): the longest built-in question does not fit: {wrong}")

    for key, source in jsonl_sources(data).items():
        try:
            load_jsonl(source, fits=fits)
        except DataFormatError as e:
            raise DataFormatError(f"key '{key}' = {source!r}: {e}") from None


def eval_set(data: DictConfig, seed: int) -> list[Problem]:
    """The fixed held-out problems of a run (the same at every evaluation): the first `eval_size` records of a
    JSONL `data.eval_source` (a ValueError if it holds fewer), or built-in problems of the training mix drawn under
    another seed, leaving out any whose question is one of a finite training set's."""
    if data.eval_source != "arithmetic":
        problems = load_jsonl(data.eval_source)
        if len(problems) < data.eval_size:  # (every evaluation's figures would stand on fewer than asked)
            raise ValueError(f"key 'data.eval_size' = {data.eval_size}: data.eval_source = {data.eval_source!r} "
                             f"holds {len(problems)} problems (lower data.eval_size)")
        return problems[: data.eval_size]
    train = open_dataset(data, seed) if data.source == "arithmetic" and data.size else None
    seen = {train[i].question for i in range(data.size)} if train is not None else set()
    task = ArithmeticTask(seed=seed + EVAL_SEED_OFFSET, max_ops=data.max_ops, max_operand=data.max_operand,
                          tail_exponent=data.tail_exponent)
    problems, cursor = [], 0
    while len(problems) < data.eval_size:
        if cursor > 100 * data.eval_size:
            raise ValueError(f"key 'data.eval_size' = {data.eval_size}: fewer held-out problems exist"
                             + (f" outside the {data.size}-problem training set" if train is not None else "")
                             + " (raise data.max_ops or data.max_operand, or lower data.tail_exponent or "
                             "data.eval_size)")
        problem = task[cursor]
        if problem.question not in seen:
            problems.append(problem)
            seen.add(problem.question)  # and no problem twice
        cursor += 1
    return problems


def check_held_out(data: DictConfig, problems: list[Problem], training: list[Problem]) -> None:
    """A JSONL eval set's `problems` ask no question of a JSONL `data.source`'s (`training`, as parsed) and none twice
    (ValueError naming the record): checked once, at load (the built-in task's are held out by construction)."""
    trained = {p.question for p in training}
    asked: set[str] = set()
    for problem in problems:
        if problem.question in trained or problem.question in asked:
            raise ValueError(f"key 'data.eval_source' = {data.eval_source!r}: record {problem.id} asks a question "
                             + ("of data.source's: a held-out problem is never trained on" if problem.question
                                in trained else "an earlier record asks: each held-out problem counts once"))
        asked.add(problem.question)
