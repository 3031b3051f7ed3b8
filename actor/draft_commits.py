"""What the drafter has heard of each request's committed tokens (actor/draft_bridge.py tells it). A step of the
planner's rest does no work per request, so the drafter does not hear that step's commits then: it hears them at the
next plan, read from the engine's buffer, or, for a request vLLM drops meanwhile, from the request's state as vLLM
drops it (the runner's `_on_request_state_removed`). Either way it hears every committed token once, in order,
a request preempted across a rest included."""

from __future__ import annotations


class Commits:
    def __init__(self):
        self.told: dict[str, int] = {}  # per request, the history length the drafter has heard of (at the last plan)
        self.rested = False  # a step of rest since the last plan: its commits are unheard
        self.tails: dict[str, tuple[list[int], int]] = {}  # requests vLLM dropped: unheard outputs, output length

    def since_last_plan(self, req_ids: list[str], sampled_token_ids, lengths: list[int], prompt_lengths: list[int],
                        token_ids_cpu) -> list[tuple[int, list[int]]]:
        """Per row with tokens the drafter has not heard of, the row and those tokens: this step's (`sampled_token_ids`)
        or, after a rest, every one since the last plan (the engine's buffer, `token_ids_cpu`, holds them); so too for
        a request out of the batch at the plan after a rest (preempted) that is back."""
        commits = []
        for row, (r, n, p, ids) in enumerate(zip(req_ids, lengths, prompt_lengths, sampled_token_ids[: len(req_ids)])):
            start = self.told.get(r, p if self.rested else n - len(ids))  # (unheard of: from its prompt's end)
            if start < n - len(ids):  # tokens from before this step: a rest's, or one it missed the plan after
                commits.append((row, token_ids_cpu[row, start:n].tolist()))
            elif ids:
                commits.append((row, list(ids)))
        self.told.update(zip(req_ids, lengths))
        self.rested = False
        return commits

    def left(self, req_id: str, state) -> None:
        """vLLM drops a finished or aborted request (`state`: its CachedRequestState), its tokens with it: keeps the
        outputs the drafter has not heard of (it ended during a rest) and its output length. No drafter call here:
        decoupled, the drafter's thread may be drafting."""
        if state is None or state.prompt_token_ids is None:
            return
        outputs, prompt = state.output_token_ids, len(state.prompt_token_ids)
        unheard = list(outputs[max(self.told.get(req_id, prompt) - prompt, 0) :])
        self.tails[req_id] = (unheard if all(t >= 0 for t in unheard) else [], len(outputs))  # (-1: a placeholder)

    def forget(self, req_id: str) -> tuple[list[int], int | None]:
        """A request that left: its unheard outputs, and its output length where vLLM's hook saw it leave."""
        self.told.pop(req_id, None)
        unheard, length = self.tails.pop(req_id, ([], None))
        return unheard, length
