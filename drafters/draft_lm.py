"""A small draft LM run in torch inside the verifier's process, batched: every request of a step goes through one
forward per draft position, with keys and values kept in a slot cache (one slot per request) that rolls back to
the committed prefix after each verify step. It samples its drafts with the target's coupled noise (same seed,
same output positions, same temperature/top-k/top-p), so wherever its distribution agrees with the target's its
token is the target's token, and drafts are accepted as often as the two distributions allow.

The forward reuses the Hugging Face model's own modules (embeddings, norms, projections, MLPs, rotary embedding)
and replaces only attention, which reads the slot cache: any Llama-family decoder (Llama, Mistral, Qwen2, Qwen3)
without sliding windows works."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from drafters.base import Drafter, DraftRequest
from sampling.coupled import coupled_draft

REQUIRED_MODULES = ("model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head", "model.layers.0.mlp",
                    "model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
                    *(f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"))


@dataclass
class _State:
    slot: int
    fed: list[int] = field(default_factory=list)  # tokens whose keys/values are in the slot, in order
    verified: int = 0  # fed[:verified] equals the request's history (the rest are drafts, maybe rejected)


class SlotCache:
    """Keys and values of every live request: per layer `[slots, length, kv_heads, head_dim]`, both dimensions grown
    by doubling as needed (length up to `max_len`), so a draft model with a long context costs memory for the
    lengths actually drafted at, not for its whole context per slot."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype):
        self.heads, self.dtype, self.max_len = (kv_heads, head_dim), dtype, max_len
        self.keys = [torch.zeros(0, min(256, max_len), *self.heads, dtype=dtype) for _ in range(layers)]
        self.values = [torch.zeros(0, min(256, max_len), *self.heads, dtype=dtype) for _ in range(layers)]
        self.free: list[int] = []

    def _grow(self, dim: int, new: int) -> None:
        def grown(t: torch.Tensor) -> torch.Tensor:
            shape = list(t.shape)
            shape[dim] = new - shape[dim]
            return torch.cat([t, torch.zeros(shape, dtype=self.dtype)], dim=dim)

        self.keys, self.values = [grown(t) for t in self.keys], [grown(t) for t in self.values]

    def take(self) -> int:
        if not self.free:
            old = self.keys[0].shape[0]
            self._grow(0, max(2 * old, 8))
            self.free = list(range(self.keys[0].shape[0] - 1, old - 1, -1))
        return self.free.pop()

    def reserve(self, length: int) -> None:
        """Room for `length` positions in every slot."""
        if length > self.keys[0].shape[1]:
            self._grow(1, min(max(2 * self.keys[0].shape[1], length), self.max_len))

    def give_back(self, slot: int) -> None:
        self.free.append(slot)


class DraftLM(Drafter):
    def __init__(self, model: str = "builtin:draft", dtype: str = "float32"):
        from transformers import AutoModelForCausalLM

        from models.zoo import resolve

        self.model = AutoModelForCausalLM.from_pretrained(str(resolve(model)), dtype=getattr(torch, dtype)).eval()
        config = self.model.config
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            raise ValueError(f"DraftLM: {config.architectures} with sliding-window attention is not supported")
        missing = []
        for path in REQUIRED_MODULES:
            try:
                self.model.get_submodule(path)
            except AttributeError:
                missing.append(path)
        if missing:
            raise ValueError(f"DraftLM: {config.architectures} is not a Llama-family decoder (no {', '.join(missing)})")
        self.rotate = importlib.import_module(type(self.model).__module__).apply_rotary_pos_emb
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.cache = SlotCache(config.num_hidden_layers, config.num_key_value_heads, self.head_dim,
                               config.max_position_embeddings, self.model.dtype)
        self.states: dict[str, _State] = {}
        self.sureness: list[list[float]] = []  # the last proposal's confidences

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], k: int) -> list[list[int]]:
        budgets = [k if r.max_tokens is None else min(k, r.max_tokens) for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        self.sureness = [[] for _ in requests]
        active, chunks = [], []
        for i, request in enumerate(requests):
            if budgets[i] > 0 and 0 < len(request.token_ids) <= self.cache.max_len - budgets[i]:
                active.append(i)
                chunks.append(self._catch_up(request))
        for j in range(max((budgets[i] for i in active), default=0)):
            states = [self.states[requests[i].request_id] for i in active]
            logits = self._forward(states, chunks)
            rows = [requests[i] for i in active]
            tokens, margins = coupled_draft(
                logits, torch.tensor([r.seed for r in rows]), torch.tensor([r.position + j for r in rows]),
                torch.tensor([r.temperature for r in rows], dtype=torch.float32),
                torch.tensor([r.top_k for r in rows]) if any(r.top_k > 0 for r in rows) else None,
                torch.tensor([r.top_p for r in rows], dtype=torch.float32) if any(r.top_p < 1 for r in rows) else None)
            for i, token, margin in zip(active, tokens.tolist(), margins.tolist()):
                drafts[i].append(token)
                self.sureness[i].append(1.0 - math.exp(-margin))
            active = [i for i in active if len(drafts[i]) < budgets[i]]
            chunks = [drafts[i][-1:] for i in active]
        return drafts

    def confidences(self) -> list[list[float]]:
        """`1 - exp(-margin)` per draft token: the target samples the same token unless its log-probabilities differ
        from the draft's by about the margin of the draft's noisy winner over the runner-up (sampling/coupled.py)."""
        return self.sureness

    def _catch_up(self, request: DraftRequest) -> list[int]:
        """Rolls the request's slot back to the longest prefix it shares with the history (only the tail past the
        last verified position is compared) and returns the history tokens still to feed (at least the last)."""
        history, state = request.token_ids, self.states.get(request.request_id)
        if state is None:
            state = self.states[request.request_id] = _State(self.cache.take())
        keep = state.verified
        if keep > len(history) or (keep and state.fed[keep - 1] != int(history[keep - 1])):
            keep = 0  # not the history this slot was fed: start over
        keep = min(keep, len(history) - 1)  # always re-feed at least the last token: its logits draft the next
        limit = min(len(state.fed), len(history) - 1)
        while keep < limit and state.fed[keep] == int(history[keep]):
            keep += 1
        del state.fed[keep:]
        state.verified = len(history)
        return [int(t) for t in history[keep:]]

    def _forward(self, states: list[_State], chunks: list[list[int]]) -> torch.Tensor:
        """Feeds each state its chunk (appending keys/values to its slot) and returns each one's last logits."""
        inner, m = self.model.model, len(chunks)
        lengths = torch.tensor([len(c) for c in chunks])
        q = int(lengths.max())
        ids = torch.zeros(m, q, dtype=torch.long)
        for i, chunk in enumerate(chunks):
            ids[i, : len(chunk)] = torch.tensor(chunk)
        start = torch.tensor([len(s.fed) for s in states])
        positions = start[:, None] + torch.arange(q)  # [m, q]
        valid = torch.arange(q)[None, :] < lengths[:, None]
        rows, cols = valid.nonzero(as_tuple=True)
        slots = torch.tensor([s.slot for s in states])
        span = int((start + lengths).max())
        self.cache.reserve(span)
        mask = (torch.arange(span)[None, None, :] <= positions[:, :, None])[:, None]  # [m, 1, q, span]
        hidden = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(hidden, positions)
        for layer, keys, values in zip(inner.layers, self.cache.keys, self.cache.values):
            attn, x = layer.self_attn, _norm(layer.input_layernorm, hidden)
            shape = (m, q, -1, self.head_dim)
            query, key, value = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), attn.v_proj(x).view(shape)
            if hasattr(attn, "q_norm"):
                query, key = _norm(attn.q_norm, query), _norm(attn.k_norm, key)
            query, key = self.rotate(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
            keys[slots[rows], positions[rows, cols]] = key.transpose(1, 2)[rows, cols]
            values[slots[rows], positions[rows, cols]] = value[rows, cols]
            out = F.scaled_dot_product_attention(
                query, keys[slots, :span].transpose(1, 2), values[slots, :span].transpose(1, 2), attn_mask=mask,
                scale=attn.scaling, enable_gqa=True)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(m, q, -1))
            hidden = hidden + layer.mlp(_norm(layer.post_attention_layernorm, hidden))
        for state, chunk in zip(states, chunks):
            state.fed.extend(chunk)
        last = _norm(inner.norm, hidden[torch.arange(m), lengths - 1])
        return self.model.lm_head(last).float()

    def commit(self, request_id: str, committed: list[int]) -> None:
        pass  # the next proposal rolls the slot back to the longest prefix it shares with the history

    @torch.inference_mode()
    def swap_weights(self, weights: list[tuple[str, torch.Tensor]]) -> bool:
        """New weights in place (every tensor of the model, checkpoint names); the slot caches, computed by the old
        weights, are refilled from each request's history at its next proposal."""
        self.model.load_state_dict(dict(weights), strict=True)
        for state in self.states.values():
            state.fed.clear()
            state.verified = 0
        return True

    def remove(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.cache.give_back(state.slot)


def _norm(module, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm as one fused op (the module's eager form is seven small ones per call)."""
    return F.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)
