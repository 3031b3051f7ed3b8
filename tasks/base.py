"""Contract of `tasks/`: what a problem is, how a prompt is written, how an answer is scored.

A *dataset* maps a cursor (0, 1, 2, ...) to a `Problem`, deterministically, so that a run's data position
is one integer that a checkpoint can store and a resumed run can continue from.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Protocol

ANSWER_MARK = "####"


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    answer: str  # the canonical final answer, e.g. "44"
    solution: str  # a worked solution ending in "#### <answer>" (the SFT target; may be "" for eval-only data)
    difficulty: int = 0  # task-specific; for the arithmetic task: the number of operations

    @property
    def prompt(self) -> str:
        return format_prompt(self.question)


def format_prompt(question: str) -> str:
    """The one prompt template used for training, rollout and evaluation."""
    return f"Question: {question}\nAnswer:"


def format_completion(solution: str) -> str:
    """What the policy should write after the prompt (a leading space, then the worked solution)."""
    return " " + solution


class Dataset(Protocol):
    def __getitem__(self, cursor: int) -> Problem: ...


def epoch_index(cursor: int, size: int, key: str) -> int:
    """Which of a finite dataset's `size` items `cursor` names when the data is visited in epochs, each in its own
    seeded order: the order of epoch `e` is a shuffle seeded by f"{key}:{e}"."""
    epoch, offset = divmod(cursor, size)
    return _epoch_order(f"{key}:{epoch}", size)[offset]


@functools.lru_cache(maxsize=4)
def _epoch_order(shuffle_seed: str, size: int) -> list[int]:
    order = list(range(size))
    random.Random(shuffle_seed).shuffle(order)
    return order
