"""Prompt-lookup drafting: find the longest recent n-gram that ends the history earlier in the history (prompt
or response) and propose what followed its latest occurrence. Stateless: the history is the whole truth."""

from __future__ import annotations

from drafters.base import Drafter, DraftRequest


class NgramDrafter(Drafter):
    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NgramDrafter: need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[DraftRequest], k: int) -> list[list[int]]:
        return [self.lookup(r.token_ids, k) for r in requests]

    def lookup(self, history: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(history) - 1), self.min_n - 1, -1):
            tail = history[-n:]
            for start in range(len(history) - n - 1, -1, -1):  # latest earlier occurrence first
                if history[start : start + n] == tail:
                    return history[start + n : start + n + k]
        return []

    def commit(self, request_id: str, committed: list[int]) -> None:
        pass

    def remove(self, request_id: str) -> None:
        pass
