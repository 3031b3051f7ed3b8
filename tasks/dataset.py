"""Opens the datasets a config's `data` section names: the training stream and the held-out evaluation set."""

from __future__ import annotations

from omegaconf import DictConfig

from tasks.arithmetic import ArithmeticTask
from tasks.base import Dataset, Problem
from tasks.jsonl import JsonlDataset, load_jsonl

EVAL_SEED_OFFSET = 7_919  # the built-in eval set's problems come from seed + this (and never equal a training one)


def open_dataset(data: DictConfig, seed: int) -> Dataset:
    if data.source == "arithmetic":
        return ArithmeticTask(seed=seed, max_ops=data.max_ops, max_operand=data.max_operand,
                              tail_exponent=data.tail_exponent, size=data.size)
    return JsonlDataset(data.source, seed=seed)


def eval_set(data: DictConfig, seed: int) -> list[Problem]:
    """The fixed held-out problems of a run (the same at every evaluation): the first `eval_size` records of a
    JSONL `data.eval_source`, or built-in problems of the training mix drawn under another seed, leaving out any
    whose question is one of a finite training set's."""
    if data.eval_source != "arithmetic":
        return load_jsonl(data.eval_source)[: data.eval_size]
    train = open_dataset(data, seed)
    seen = {train[i].question for i in range(data.size)} if data.source == "arithmetic" and data.size else set()
    task = ArithmeticTask(seed=seed + EVAL_SEED_OFFSET, max_ops=data.max_ops, max_operand=data.max_operand,
                          tail_exponent=data.tail_exponent)
    problems, cursor = [], 0
    while len(problems) < data.eval_size:
        if cursor > 100 * data.eval_size:
            raise ValueError(f"data.eval_size = {data.eval_size}: fewer held-out problems exist outside the "
                             f"{len(seen)}-problem training set (raise data.max_ops or lower data.eval_size)")
        problem = task[cursor]
        if problem.question not in seen:
            problems.append(problem)
            seen.add(problem.question)  # and no problem twice
        cursor += 1
    return problems
