"""Example drafter plugin: propose the chain of most frequent successors seen in the request's own history.

Use it with `speculation.method=examples.drafters.bigram.BigramDrafter` (dotted path, run from the repository
root), or register it from your own package under the `specactor.drafters` entry point group:

    [project.entry-points."specactor.drafters"]
    bigram = "mypkg.bigram:BigramDrafter"

and write `speculation.method=bigram`. Options come from `speculation.options` (here: `min_count`).
Check it with `pytest tests/plugin_contracts` after adding it to the list there.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from drafters.base import Drafter, DraftRequest


class BigramDrafter(Drafter):
    def __init__(self, min_count: int = 2):
        self.min_count = min_count
        self.tables: dict[str, tuple[dict[int, Counter], int]] = {}  # request -> (successor counts, tokens counted)

    def propose(self, requests: list[DraftRequest], k: int) -> list[list[int]]:
        return [self.chain(r, k) for r in requests]

    def chain(self, request: DraftRequest, k: int) -> list[int]:
        history = request.token_ids
        successors, counted = self.tables.get(request.request_id, (None, 0))
        if successors is None or counted > len(history):  # unknown request, or a history we did not see grow
            successors, counted = defaultdict(Counter), 1
        for prev, nxt in zip(history[counted - 1 :], history[counted:]):
            successors[prev][nxt] += 1
        self.tables[request.request_id] = (successors, len(history))
        drafts, token = [], history[-1]
        while len(drafts) < k and successors.get(token):
            token, count = successors[token].most_common(1)[0]
            if count < self.min_count:
                break
            drafts.append(token)
        return drafts

    def commit(self, request_id: str, committed: list[int]) -> None:
        pass  # the next proposal extends the table from the history

    def remove(self, request_id: str) -> None:
        self.tables.pop(request_id, None)
