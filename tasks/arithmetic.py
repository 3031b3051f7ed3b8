"""The built-in task: multi-step integer arithmetic with a worked scratchpad.

Problem `cursor` under seed `s` is a pure function of (s, cursor), or of (s, size, cursor) for a training set
of `size` problems visited in epochs. The number of operations follows a truncated power law, so most solutions
are a line or two long and a few are many times longer: the long tail of generation lengths that RL rollouts
have on real reasoning data.

    Question: 12+7+30-5=?
    Answer: 12+7=19
    19+30=49
    49-5=44
    #### 44

With `wording` > 0 that share of the steps is written out in words instead (`19 plus 30 makes 49`), each step's way
drawn on its own: a worked solution of the same problem with two ways of writing a step, the worded one two tokens
longer (of 8-9), so that a policy SFT-trained on it can be taught by RL (a length penalty) to write otherwise.
"""

from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass, replace

from tasks.base import ANSWER_MARK, Problem, epoch_index, format_prompt


MAX_DRAWS = 1000  # draws at one cursor of an endless stream before it gives up finding a problem not held out


@dataclass(frozen=True)
class ArithmeticTask:
    seed: int = 0
    max_ops: int = 24  # the longest problems have this many operations
    tail_exponent: float = 1.5  # P(ops = k) is proportional to k ** -tail_exponent
    max_operand: int = 9  # one-digit operands: a small model learns the scratchpad in ~1000 SFT steps
    size: int = 0  # > 0: a training set of this many problems, repeated in epochs; 0: a new problem per cursor
    wording: float = 0.0  # the share of worked steps written out in words (SFT data; the questions are the same)
    held_out: frozenset[str] = frozenset()  # questions an endless stream never draws (the held-out problems')

    def __post_init__(self) -> None:
        if self.max_ops < 1:
            raise ValueError(f"max_ops must be >= 1, got {self.max_ops}")
        if self.size < 0:
            raise ValueError(f"size must be >= 0, got {self.size}")
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")
        if not 0.0 <= self.wording <= 1.0:
            raise ValueError(f"wording must be in [0, 1], got {self.wording}")

    @functools.cached_property
    def ops_cumulative_weights(self) -> list[float]:
        """P(ops = k) up to k, unnormalised, for `random.choices` (the weights `k ** -tail_exponent` summed as
        `choices` sums them: the same draws), made once: a draw is O(log max_ops)."""
        return list(itertools.accumulate(k ** -self.tail_exponent for k in range(1, self.max_ops + 1)))

    def __getitem__(self, cursor: int) -> Problem:
        if cursor < 0:
            raise IndexError(f"cursor must be >= 0, got {cursor}")
        if self.size:  # a finite training set: cursor walks epochs, each a fresh shuffle of the same problems
            cursor = epoch_index(cursor, self.size, f"arithmetic-epoch:{self.seed}")
        for draw in range(MAX_DRAWS):  # a held-out question is drawn again at this cursor, from a stream of its own
            rng = random.Random(f"arithmetic:{self.seed}:{cursor}" + (f":{draw}" if draw else ""))
            ops = rng.choices(range(1, self.max_ops + 1), cum_weights=self.ops_cumulative_weights)[0]
            problem = self.make(ops, rng, f"arith-{self.seed}-{cursor}")
            if problem.question not in self.held_out:
                return problem
        raise ValueError(f"{MAX_DRAWS} draws at cursor {cursor} were all held-out problems: the held-out set holds "
                         "most of the task's problems (raise data.max_ops or data.max_operand, or lower "
                         "data.eval_size)")

    def held_out_share(self, cursors: int = 2000) -> float:
        """The share of an endless stream's first draws, at its first `cursors` cursors, that are held-out questions
        (each drawn again, up to MAX_DRAWS times: a share p fails a cursor with probability p ** MAX_DRAWS)."""
        if not self.held_out:
            return 0.0
        free = replace(self, held_out=frozenset())
        return sum(free[cursor].question in self.held_out for cursor in range(cursors)) / cursors

    def with_ops(self, ops: int, cursor: int) -> Problem:
        """Problem `cursor` of a fixed number of operations (for evaluation splits by difficulty)."""
        rng = random.Random(f"arithmetic-ops:{self.seed}:{ops}:{cursor}")
        return self.make(ops, rng, f"arith-{self.seed}-ops{ops}-{cursor}")

    def longest_prompt(self) -> str:
        """A prompt at least as long as any this task makes: `max_ops` operations, every operand the widest."""
        widest = str(self.max_operand)
        return format_prompt(widest + f"+{widest}" * self.max_ops + "=?")

    def make(self, ops: int, rng: random.Random, problem_id: str) -> Problem:
        total = rng.randint(1, self.max_operand)
        question, lines = str(total), []
        words = random.Random(f"{problem_id}:wording")  # its own draws: `wording` never changes the questions
        for _ in range(ops):
            operand = rng.randint(1, self.max_operand)
            op = "-" if operand <= total and rng.random() < 0.5 else "+"
            new_total = total + operand if op == "+" else total - operand
            question += f"{op}{operand}"
            if self.wording and words.random() < self.wording:
                lines.append(f"{total} {'plus' if op == '+' else 'minus'} {operand} makes {new_total}")
            else:
                lines.append(f"{total}{op}{operand}={new_total}")
            total = new_total
        lines.append(f"{ANSWER_MARK} {total}")
        return Problem(problem_id, f"{question}=?", str(total), "\n".join(lines), difficulty=ops)
