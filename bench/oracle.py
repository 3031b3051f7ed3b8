"""The ceiling of speculation on a machine: a drafter that replays a reference rollout's tokens (the `vanilla`
system's, same seeds), so every draft is accepted, at no drafting cost. A benchmark instrument, not a drafter to
train with: it knows the future."""

from __future__ import annotations

import json
from pathlib import Path

from drafters.base import Drafter, DraftRequest


class OracleDrafter(Drafter):
    def __init__(self, path: str):
        """`path`: JSON {request seed: the response tokens the reference emitted for it}."""
        self.tokens = {int(seed): tokens for seed, tokens in json.loads(Path(path).read_text()).items()}

    def propose(self, requests: list[DraftRequest], k: int) -> list[list[int]]:
        return [self.tokens.get(r.seed, [])[r.position : r.position + k] for r in requests]

    def commit(self, request_id: str, committed: list[int]) -> None:
        pass

    def remove(self, request_id: str) -> None:
        pass
