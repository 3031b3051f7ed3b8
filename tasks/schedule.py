"""Which prompt each rollout actor takes and which learner step consumes it: the one cursor-ownership rule.

A run (or a resumed run) starts at data cursor `start`. Actor `a` of `R` owns the cursors `start + k * R + a`
(its k-th group, k = 0, 1, ...), and the group of cursor `c` is meant for learner step `c // prompts_per_step`,
so an actor admits it only while that step is at most `max_staleness` versions ahead of its weights. A
replacement for actor `a` resumes at `a`'s first cursor not yet delivered whole.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass


@dataclass(frozen=True)
class CursorPlan:
    start: int  # the run's first data cursor (a resumed run: its checkpoint's data cursor)
    num_actors: int
    prompts_per_step: int

    def cursor(self, actor: int, k: int) -> int:
        """The data cursor of `actor`'s k-th group."""
        return self.start + k * self.num_actors + actor

    def owner(self, cursor: int) -> int:
        return (cursor - self.start) % self.num_actors

    def step(self, cursor: int) -> int:
        """The learner step the group of `cursor` is meant for."""
        return cursor // self.prompts_per_step

    def first_undelivered(self, actor: int, delivered: Container[int]) -> int:
        """The smallest k whose cursor `actor` owns and that is not in `delivered`."""
        k = 0
        while self.cursor(actor, k) in delivered:
            k += 1
        return k

    def first_of_step(self, actor: int, k: int) -> int:
        """`actor`'s first k whose group is meant for the same learner step as its k-th."""
        while k > 0 and self.step(self.cursor(actor, k - 1)) == self.step(self.cursor(actor, k)):
            k -= 1
        return k
