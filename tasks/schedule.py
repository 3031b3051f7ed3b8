"""Which prompt each rollout actor takes and which learner step consumes it: the one cursor-ownership rule.

A run (or a resumed run) starts at data cursor `start`. Actor `a` of `R` owns the cursors `start + k * R + a`
(its groups by ordinal, 0, 1, ...), and the group of cursor `c` is meant for learner step `c // prompts_per_step`,
so an actor admits it only while that step is at most `max_staleness` versions ahead of its weights. The learner
trains a step's cursors, waiting for their stragglers (`algorithm.step_order: cursor`, learner/intake.py), or the
first whole groups to arrive (`arrival`); either way a group it drops as stale (overtaken by later ones, or come too
late for the wait) leaves every later cursor trained one place earlier than meant: `lead` counts those places (with
a resumed run's offset, when its data cursor is ahead of `prompts_per_step x version`), and admission goes by
`step(c - lead)`. Without it one
dropped group made the learner wait, every step after, for a group of the next step that could not yet start. A
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

    def cursor(self, actor: int, ordinal: int) -> int:
        """The data cursor of `actor`'s group `ordinal` (its first is 0)."""
        return self.start + ordinal * self.num_actors + actor

    def owner(self, cursor: int) -> int:
        return (cursor - self.start) % self.num_actors

    def step(self, cursor: int) -> int:
        """The learner step the group of `cursor` is meant for."""
        return cursor // self.prompts_per_step

    def admits(self, cursor: int, version: int, max_staleness: int, lead: int) -> bool:
        """Whether an actor holding weights `version` may start the group of `cursor`: the learner, `lead` cursors
        ahead of its steps, trains it at most `max_staleness` versions later."""
        return self.step(cursor - lead) <= version + max_staleness

    def lead_at(self, version: int, delivered: int) -> int:
        """The learner's lead at `version`, once `delivered` groups (trained or dropped) reached it since `start`."""
        return self.start + delivered - self.prompts_per_step * version

    def first_undelivered(self, actor: int, delivered: Container[int]) -> int:
        """The smallest group ordinal whose cursor `actor` owns and that is not in `delivered`."""
        ordinal = 0
        while self.cursor(actor, ordinal) in delivered:
            ordinal += 1
        return ordinal

    def first_of_step(self, actor: int, ordinal: int) -> int:
        """`actor`'s first group ordinal meant for the same learner step as its group `ordinal`."""
        while ordinal > 0 and self.step(self.cursor(actor, ordinal - 1)) == self.step(self.cursor(actor, ordinal)):
            ordinal -= 1
        return ordinal
