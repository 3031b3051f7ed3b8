"""Prompt-lookup drafting: find the longest recent n-gram that ends the history earlier in the history (prompt
or response) and propose what followed its latest occurrence. Incremental: per request, an index from every
n-gram (min_n..max_n) to the end of its latest occurrence, extended by each commit, so a proposal costs O(max_n + k)
and never scans the history. A request seen for the first time (or whose history is not the one indexed) is
indexed from its history once."""

from __future__ import annotations

from dataclasses import dataclass, field

from drafters.base import Drafter, DraftRequest


@dataclass
class _Index:
    tokens: list[int]
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end of its latest occurrence
    indexed: int = 0  # n-grams ending before this position are in `ends`


class NgramDrafter(Drafter):
    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.check_options(dict(min_n=min_n, max_n=max_n))
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[str, _Index] = {}

    @classmethod
    def check_options(cls, options: dict) -> dict:
        o = super().check_options(options)
        if not 1 <= o["min_n"] <= o["max_n"]:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={o['min_n']}, max_n={o['max_n']}")
        return o

    def propose(self, requests: list[DraftRequest], k: int) -> list[list[int]]:
        return [self.lookup(self._index(r), r.budget(k)) for r in requests]

    def _index(self, request: DraftRequest) -> _Index:
        history, index = request.token_ids, self.indexes.get(request.request_id)
        n = len(history)
        if index is None or len(index.tokens) != n or (n and index.tokens[-1] != int(history[-1])):
            index = self.indexes[request.request_id] = _Index([int(t) for t in history])
        tokens = index.tokens
        # index every n-gram that ends before the last token (the tail itself must match an *earlier* occurrence)
        for end in range(max(index.indexed, 1), len(tokens)):
            for size in range(self.min_n, min(self.max_n, end) + 1):
                index.ends[tuple(tokens[end - size : end])] = end
        index.indexed = max(len(tokens), 1)
        return index

    def lookup(self, index: _Index, k: int) -> list[int]:
        tokens = index.tokens
        for size in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            end = index.ends.get(tuple(tokens[-size:]))
            if end is not None:
                return tokens[end : end + k]
        return []

    def propose_ahead(self, requests: list[DraftRequest], k: int) -> list[list[int]]:
        """A lookup of each request's unverified tail in its committed history's index, which it leaves as it is."""
        out = []
        for r in requests:
            index, tail = self.indexes.get(r.request_id), [int(t) for t in r.token_ids[-self.max_n:]]
            ends = [] if index is None else [index.ends.get(tuple(tail[-size:]))
                                             for size in range(min(self.max_n, len(tail)), self.min_n - 1, -1)]
            end = next((e for e in ends if e is not None), None)
            out.append([] if end is None else index.tokens[end : end + r.budget(k)])
        return out

    def commit(self, request_id: str, committed: list[int]) -> None:
        index = self.indexes.get(request_id)
        if index is not None:
            index.tokens.extend(int(t) for t in committed)

    def remove(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)
