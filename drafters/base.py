"""Contract of `drafters/`: what a drafter plugin is.

A drafter proposes up to `k` next tokens for each request of a batch, from the request's id, sampling seed,
output position and token history. The verifier (the target model, in `actor/`) decides what is kept; a drafter
never changes a trajectory, it only changes how fast it is produced. After every verify step the drafter is
told what was committed, and it may keep state per request until the request is removed.

A plugin is a plain class implementing `Drafter`, named in a config by dotted path (`pkg.mod.Class`) or by
the name of a `specactor.drafters` entry point.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class DraftRequest:
    request_id: str
    seed: int  # the coupled sampler's seed for this request
    position: int  # output position of the next token to be sampled
    token_ids: list[int]  # prompt followed by every committed output token


class Drafter(ABC):
    @abstractmethod
    def propose(self, requests: list[DraftRequest], k: int) -> list[list[int]]:
        """One list of at most `k` draft tokens per request, in the order given (an empty list: no draft)."""

    @abstractmethod
    def commit(self, request_id: str, committed: list[int]) -> None:
        """`committed` tokens were appended to `request_id` by the verifier."""

    @abstractmethod
    def remove(self, request_id: str) -> None:
        """The request finished or was aborted; drop its state."""
