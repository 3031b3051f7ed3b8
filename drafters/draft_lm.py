"""A small draft LM run in torch inside the verifier's process. It samples its drafts with the target's coupled
noise (same seed, same output positions, same temperature/top-k/top-p), so wherever its distribution agrees
with the target's its token is the target's token, and drafts are accepted as often as the two distributions
allow. Keeps a KV cache per request and rolls it back to the committed prefix after each verify step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from drafters.base import Drafter, DraftRequest
from sampling.coupled import coupled_sample


@dataclass
class _State:
    cache: object
    fed: list[int] = field(default_factory=list)  # tokens whose keys/values are in `cache`


class DraftLM(Drafter):
    def __init__(self, model: str = "builtin:draft", dtype: str = "float32"):
        from transformers import AutoModelForCausalLM

        from models.zoo import resolve

        self.model = AutoModelForCausalLM.from_pretrained(str(resolve(model)), dtype=getattr(torch, dtype)).eval()
        self.states: dict[str, _State] = {}

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], k: int) -> list[list[int]]:
        return [self.draft(r, k) for r in requests]

    def draft(self, request: DraftRequest, k: int) -> list[int]:
        from transformers import DynamicCache

        history = request.token_ids
        state = self.states.get(request.request_id)
        if state is None:
            state = self.states[request.request_id] = _State(DynamicCache())
        keep = 0
        limit = min(len(state.fed), len(history) - 1)  # always re-feed at least the last token
        while keep < limit and state.fed[keep] == history[keep]:
            keep += 1
        if keep < len(state.fed):
            state.cache.crop(keep - len(state.fed))  # negative: drop that many trailing positions
            del state.fed[keep:]
        feed, drafts = history[keep:], []
        for j in range(k):
            logits = self.model(input_ids=torch.tensor([feed]), past_key_values=state.cache, use_cache=True).logits
            state.fed.extend(feed)
            token, _ = coupled_sample(
                logits[:, -1], torch.tensor([request.seed]), torch.tensor([request.position + j]),
                torch.tensor([request.temperature]),
                torch.tensor([request.top_k]) if request.top_k > 0 else None,
                torch.tensor([request.top_p]) if request.top_p < 1 else None)
            drafts.append(int(token))
            feed = drafts[-1:]
        return drafts

    def commit(self, request_id: str, committed: list[int]) -> None:
        pass  # the next proposal rolls the cache back to the longest prefix it shares with the history

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)
