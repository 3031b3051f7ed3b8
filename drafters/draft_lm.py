"""A small draft LM run in torch inside the verifier's process, batched: every request of a step goes through one
forward per draft position, with keys and values kept in a slot cache (one slot per request) that rolls back to
the committed prefix after each verify step. It samples its drafts with the target's coupled noise (same seed,
same output positions, same temperature/top-k/top-p), so wherever its distribution agrees with the target's its
token is the target's token, and drafts are accepted as often as the two distributions allow.

The forward computes what the Hugging Face model's modules compute, from their weights packed once per weight
version (q, k and v in one matrix, gate and up in another, the rotary angles in a table), and attention reads the
slot cache: any Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) without sliding windows works. A draft LM
worth drafting with is small, so its cost is the number of torch calls per pass rather than arithmetic: a pass
makes about a dozen per layer (on a GPU the one-token passes replay CUDA graphs: draft_lm_graphs.py), and the
coupled noise of a whole proposal is made in one go."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from drafters.base import Drafter, DraftRequest
from drafters.draft_lm_graphs import GraphedPasses, per_position
from models.zoo import resolve
from sampling.coupled import GREEDY_BELOW, NOISE_ELEMENTS, coupled_draft, gumbel

REQUIRED_MODULES = ("model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head",
                    *(f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")),
                    "model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
                    *(f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"))
# attention without cuDNN's: it builds a plan for every new shape, and a draft's span grows at every pass (measured
# on an H200 with torch's profiler: about 16 ms of the built-in draft LM's 20 ms a pass)
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class _State:
    slot: int
    fed: list[int] = field(default_factory=list)  # tokens whose keys/values are in the slot, in order
    verified: int = 0  # fed[:verified] equals the request's history (the rest are drafts, maybe rejected)
    # an outcome of `propose_ahead` drafted beside its request (a scratch slot): the keys and values of fed[:shared]
    # are read from the request's own state's slot, nothing copied
    parent: _State | None = None
    shared: int = 0


class SlotCache:
    """Keys and values of every live request: per layer `[slots, length, 2 * kv_heads, head_dim]` (keys, then values),
    both dimensions grown by doubling as needed (length up to `max_len`), so a draft model with a long context costs
    memory for the lengths actually drafted at, not for its whole context per slot."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device):
        self.heads, self.max_len = (2 * kv_heads, head_dim), max_len
        self.kv = [torch.zeros(0, min(256, max_len), *self.heads, dtype=dtype, device=device) for _ in range(layers)]
        self.free: list[int] = []

    def _grow(self, dim: int, new: int) -> None:
        shape = list(self.kv[0].shape)  # (the zeros appended along `dim`)
        shape[dim] = new - shape[dim]
        self.kv = [torch.cat([t, t.new_zeros(shape)], dim=dim) for t in self.kv]

    def take(self) -> int:
        if not self.free:
            old = self.kv[0].shape[0]
            self._grow(0, max(2 * old, 8))
            self.free = list(range(self.kv[0].shape[0] - 1, old - 1, -1))
        return self.free.pop()

    def reserve(self, length: int) -> None:
        """Room for `length` positions in every slot up to the last one in use: the free ones past it (most often a
        large proposal ahead's scratch slots) are not copied, and are made again when taken."""
        if length > self.kv[0].shape[1]:
            top = max(set(range(len(self.kv[0]))) - set(self.free), default=-1) + 1
            self.kv, self.free = [t[:top] for t in self.kv], [s for s in self.free if s < top]
            self._grow(1, min(max(2 * self.kv[0].shape[1], length), self.max_len))

    def give_back(self, slot: int) -> None:
        self.free.append(slot)


@dataclass
class _Layer:
    """One decoder layer's weights as the forward uses them (packed from the Hugging Face modules)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor  # q_proj, k_proj and v_proj stacked: [heads + 2 * kv_heads, head_dim] rows of output
    qkv_bias: torch.Tensor | None
    head_norms: torch.Tensor | None  # [heads + kv_heads, head_dim]: q_norm's weight per query head, k_norm's per key
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor  # gate_proj and up_proj stacked
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    act: object  # the MLP's activation (its module's act_fn)
    scaling: float


class DraftLM(Drafter):
    prepares_rejections = prepares_guesses = True

    def __init__(self, model: str = "builtin:draft", dtype: str = "float32", device: str = "cpu"):
        """`device`: where its weights, slot cache and drafting live (built by the engine: the engine's device, a
        GPU's when the engine runs on one; a config may name another, e.g. a drafter GPU of its own)."""
        from transformers import AutoModelForCausalLM

        self.check_options(dict(model=model, dtype=dtype, device=device))
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(str(resolve(model)), dtype=getattr(torch, dtype)).eval()
        self.model.to(self.device)
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
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.cache = SlotCache(config.num_hidden_layers, self.kv_heads, self.head_dim,
                               config.max_position_embeddings, self.model.dtype, self.device)
        # rotary angles per position, grown as needed (from the rotary module's buffers: no weight swap changes them)
        self.cos = self.sin = torch.zeros(0, self.head_dim, device=self.device)
        # on a GPU: a CUDA stream of its own (beside the engine's work, not behind it), one-token passes as graphs
        cuda = self.device.type == "cuda"
        self.stream, self.graphs = (torch.cuda.Stream(self.device), GraphedPasses(self)) if cuda else (None, None)
        self._pack()
        self.states: dict[str, _State] = {}
        self.last_confidences: list[list[float]] = []  # the last proposal's confidences

    @classmethod
    def check_options(cls, options: dict) -> dict:
        o = super().check_options(options)
        dtype = getattr(torch, o["dtype"], None)
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype={o['dtype']!r} is not a torch floating-point dtype (float32, bfloat16, float16)")
        try:
            torch.device(o["device"])
        except RuntimeError as e:
            raise ValueError(f"device={o['device']!r} is not a torch device (cpu, cuda, cuda:1)") from e
        return o

    def _pack(self) -> None:
        """The model's weights as the forward reads them (again after every weight swap)."""
        inner = self.model.model
        self.embed, self.final_norm = inner.embed_tokens.weight, inner.norm.weight
        self.head, self.head_bias = self.model.lm_head.weight, self.model.lm_head.bias
        self.eps = inner.norm.variance_epsilon

        def cat(*tensors):
            return None if tensors[0] is None else torch.cat(tensors)

        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            norms = None
            if hasattr(attn, "q_norm"):
                norms = torch.cat([attn.q_norm.weight.expand(self.heads, -1),
                                   attn.k_norm.weight.expand(self.kv_heads, -1)])
            self.layers.append(_Layer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight, cat(*(p.weight for p in qkv)),
                cat(*(p.bias for p in qkv)), norms, attn.o_proj.weight, attn.o_proj.bias,
                cat(mlp.gate_proj.weight, mlp.up_proj.weight), cat(mlp.gate_proj.bias, mlp.up_proj.bias),
                mlp.down_proj.weight, mlp.down_proj.bias, mlp.act_fn, attn.scaling))
        if self.graphs is not None:  # no graph reads the old weights, and its stream reads the new once they are in
            self.graphs.clear()
            torch.cuda.current_stream(self.device).synchronize()

    def reserve_angles(self, length: int) -> None:
        """The rotary embedding's cos and sin for positions [0, length) at least, computed by the model's module."""
        if length > self.cos.shape[0]:
            n = min(max(2 * self.cos.shape[0], length, 256), self.cache.max_len)
            cos, sin = self.model.model.rotary_emb(torch.zeros(1, dtype=self.model.dtype, device=self.device),
                                                   torch.arange(n, device=self.device)[None])
            self.cos, self.sin = cos[0], sin[0]

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], k: int) -> list[list[int]]:
        with self._own_stream():
            return self._propose(requests, k, scratch=None)

    @torch.inference_mode()
    def propose_ahead(self, requests: list[DraftRequest], k: int) -> list[list[int]]:
        """As `propose` (the slot cache rolls back to the committed prefix at the next proposal: only what is committed
        counts as verified). Several requests with one id are outcomes of the verify step under way: the first is
        drafted in the request's slot, each other one in a scratch slot that reads the keys and values it shares with
        the first from the request's slot (nothing copied), given back when the call ends. An outcome whose draft was
        rejected (`DraftRequest.rejected`) guesses the target's token there as the draft's best other token under the
        same noise: where the target's own noisy winner is not the draft's, it is most often the draft's runner-up;
        an outcome with `guess` = g starts from the token left winning once the g likeliest are set aside."""
        scratch: list[_State] = []
        try:
            with self._own_stream():
                return self._propose(requests, k, scratch)
        finally:
            for state in scratch:
                self.cache.give_back(state.slot)

    def _propose(self, requests: list[DraftRequest], k: int, scratch: list[_State] | None) -> list[list[int]]:
        """Drafts for `requests`; `scratch` (ahead only): where states made for a request's further outcomes go."""
        budgets = [r.budget(k) for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        self.last_confidences = [[] for _ in requests]
        active, chunks, states, first = [], [], [], {}
        for i, request in enumerate(requests):
            if budgets[i] > 0 and 0 < len(request.token_ids) <= self.cache.max_len - budgets[i]:
                active.append(i)
                if scratch is not None and request.request_id in first:
                    state, chunk = self._branch(request, first[request.request_id])
                    scratch.append(state)
                else:
                    chunk = self._catch_up(request)
                    state = first[request.request_id] = self.states[request.request_id]
                chunks.append(chunk)
                states.append(state)
        if not active:
            return drafts
        rows = [requests[i] for i in active]
        passes = max(budgets[i] for i in active)
        on = dict(device=self.device)
        seeds, positions = torch.tensor([r.seed for r in rows], **on), torch.tensor([r.position for r in rows], **on)
        temperature = torch.tensor([r.temperature for r in rows], dtype=torch.float32, **on)
        top_k = torch.tensor([r.top_k for r in rows], **on) if any(r.top_k > 0 for r in rows) else None
        top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32, **on) \
            if any(r.top_p < 1 for r in rows) else None
        vocab = self.head.shape[0]
        noise = None  # the coupled noise of every position the proposal may reach, in one go where it is small
        if len(rows) * passes * vocab <= NOISE_ELEMENTS and any(r.temperature >= GREEDY_BELOW for r in rows):
            offsets = torch.arange(passes, **on)
            noise = gumbel(seeds.repeat_interleave(passes), (positions[:, None] + offsets).flatten(), vocab)
            noise = noise.view(len(rows), passes, vocab)
        live = torch.arange(len(rows), **on)  # the rows still drafting
        excluded = [(n, r.rejected) for n, r in enumerate(rows)
                    if r.rejected is not None and 0 <= r.rejected < vocab]
        for j in range(passes):
            logits = self._pass([states[n] for n in live.tolist()], chunks, ahead=scratch is not None)
            if j == 0 and excluded:  # an outcome with a rejected draft: the target's token there is another one
                logits[[n for n, _ in excluded], [t for _, t in excluded]] = float("-inf")
            for g in range(max(r.guess for r in rows) if j == 0 else 0):  # set aside the guess-th likeliest first
                n = torch.tensor([n for n, r in enumerate(rows) if r.guess > g], **on)
                winners, _ = coupled_draft(logits[n], seeds[n], positions[n], temperature[n],
                                           None if top_k is None else top_k[n], None if top_p is None else top_p[n],
                                           noise=None if noise is None else noise[n, 0])
                logits[n, winners] = float("-inf")
            tokens, margins = coupled_draft(
                logits, seeds[live], positions[live] + j, temperature[live],
                None if top_k is None else top_k[live], None if top_p is None else top_p[live],
                noise=None if noise is None else noise[live, j])
            for i, token, margin in zip(active, tokens.tolist(), margins.tolist()):
                drafts[i].append(token)
                self.last_confidences[i].append(1.0 - math.exp(-margin))
            going = [n for n, i in enumerate(active) if len(drafts[i]) < budgets[i]]
            if len(going) < len(active):
                active, live = [active[n] for n in going], live[going]
            chunks = [drafts[i][-1:] for i in active]
        return drafts

    def confidences(self) -> list[list[float]]:
        """`1 - exp(-margin)` per draft token: the target samples the same token unless its log-probabilities differ
        from the draft's by about the margin of the draft's noisy winner over the runner-up (sampling/coupled.py)."""
        return self.last_confidences

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
        state.verified = len(history) - request.unverified
        return [int(t) for t in history[keep:]]

    def _branch(self, request: DraftRequest, parent: _State) -> tuple[_State, list[int]]:
        """A scratch state for another outcome of `parent`'s request: it shares the longest prefix of `parent`'s
        fed tokens that its history starts with (at least its last token is its own), and the history tokens past
        that to feed."""
        history = request.token_ids
        limit = min(len(parent.fed), len(history) - 1)
        same = np.asarray(parent.fed[:limit]) == np.asarray(history[:limit])
        shared = limit if same.all() else int(same.argmin())
        state = _State(self.cache.take(), fed=parent.fed[:shared], parent=parent, shared=shared)
        return state, [int(t) for t in history[shared:]]

    def _pass(self, states: list[_State], chunks: list[list[int]], ahead: bool) -> torch.Tensor:
        """Feeds each state its chunk and returns each one's last logits: a one-token pass as a CUDA graph where the
        draft LM has them (on a GPU; a proposal `ahead` makes none), else the eager forward."""
        one_token = self.graphs is not None and max(map(len, chunks)) == 1
        logits = self.graphs(states, chunks, may_capture=not ahead) if one_token else None
        return self._forward(states, chunks) if logits is None else logits

    def _forward(self, states: list[_State], chunks: list[list[int]]) -> torch.Tensor:
        """Feeds each state its chunk (appending keys/values to its slot) and returns each one's last logits."""
        m, lengths = len(chunks), [len(c) for c in chunks]
        q, on = max(lengths), dict(device=self.device)
        start, slots = torch.tensor([len(s.fed) for s in states], **on), torch.tensor([s.slot for s in states], **on)
        if q == 1:  # every pass after a proposal's first: one token each, no ragged chunks
            ids, positions = torch.tensor(chunks, **on), start[:, None]
            written, pick = (slots, start), (lambda new: new[:, 0])
        else:
            ids = torch.tensor([c + [0] * (q - len(c)) for c in chunks], **on)
            positions = start[:, None] + torch.arange(q, **on)  # [m, q]
            rows, cols = (torch.arange(q, **on)[None, :] < torch.tensor(lengths, **on)[:, None]).nonzero(
                as_tuple=True)
            written, pick = (slots[rows], positions[rows, cols]), (lambda new: new[rows, cols])
        span = max(len(s.fed) + n for s, n in zip(states, lengths))
        self.cache.reserve(span)
        self.reserve_angles(span)
        reading = (slots, slice(0, span))  # where each row's keys and values are: its slot (a gather, as the slots)
        if any(s.parent is not None for s in states):  # an outcome's shared prefix is in its request's slot
            shared = torch.tensor([s.shared for s in states], **on)
            source = torch.tensor([s.slot if s.parent is None else s.parent.slot for s in states], **on)
            reading = per_position(slots, source, shared, span)
        hidden = self.decode(ids, positions, written, pick, reading, span)
        for state, chunk in zip(states, chunks):
            state.fed.extend(chunk)
        return self.logits(hidden[:, 0] if q == 1 else hidden[torch.arange(m, **on), torch.tensor(lengths, **on) - 1])

    @sdpa_kernel(ATTENTION_BACKENDS)
    def decode(self, ids: torch.Tensor, positions: torch.Tensor, written: tuple, pick, reading: tuple,
               span: int) -> torch.Tensor:
        """The decoder layers on `ids` [m, q] at `positions` [m, q]: each layer's keys and values of the rows `pick`
        takes written to the slot cache at `written`, attention over the cache at `reading` up to `span` positions,
        each row's own masked past its position; the hidden states [m, q, hidden]. Tensor ops only, the same calls
        for the same shapes (the one-token passes run it as a CUDA graph: drafters/draft_lm_graphs.py)."""
        m, q = ids.shape
        hd, heads, kv_heads = self.head_dim, self.heads, self.kv_heads
        mask = (torch.arange(span, device=self.device) <= positions[:, :, None]).unsqueeze(1)  # [m, 1, q, span]
        # a short chunk's padding runs past its row's last position, and can run past `span` (a long history fed one
        # token beside a new request's prompt): its outputs are never read, so it takes the last angle there is
        inside = positions.clamp(max=span - 1)
        cos, sin = self.cos[inside].unsqueeze(2), self.sin[inside].unsqueeze(2)  # [m, q, 1, head_dim]
        hidden = F.embedding(ids, self.embed)
        for layer, cache in zip(self.layers, self.cache.kv):
            qkv = F.linear(_norm(hidden, layer.input_norm, self.eps), layer.qkv, layer.qkv_bias).view(m, q, -1, hd)
            qk = qkv[:, :, : heads + kv_heads]  # the queries' and keys' heads, normed and rotated together
            if layer.head_norms is not None:
                qk = F.rms_norm(qk, (hd,), None, self.eps) * layer.head_norms
            qk = qk * cos + torch.cat((-qk[..., hd // 2 :], qk[..., : hd // 2]), dim=-1) * sin
            new = torch.cat((qk[:, :, heads:], qkv[:, :, heads + kv_heads :]), dim=2)  # keys, values [m, q, 2kv, hd]
            cache[written] = pick(new)
            past = cache[reading].transpose(1, 2)  # [m, 2 kv_heads, span, head_dim]
            out = F.scaled_dot_product_attention(qk[:, :, :heads].transpose(1, 2), past[:, :kv_heads],
                                                 past[:, kv_heads:], attn_mask=mask, scale=layer.scaling,
                                                 enable_gqa=True)
            hidden = hidden + F.linear(out.transpose(1, 2).reshape(m, q, -1), layer.o, layer.o_bias)
            gate, up = F.linear(_norm(hidden, layer.post_norm, self.eps), layer.gate_up,
                                layer.gate_up_bias).chunk(2, dim=-1)
            hidden = hidden + F.linear(layer.act(gate) * up, layer.down, layer.down_bias)
        return hidden

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        return F.linear(_norm(last, self.final_norm, self.eps), self.head, self.head_bias).float()

    def commit(self, request_id: str, committed: list[int]) -> None:
        # the next proposal rolls the slot back to the longest prefix it shares with the history; the engine is idle
        # here, where the graphs proposals ahead missed are made
        if self.graphs is not None and self.graphs.wanted:
            with torch.inference_mode(), self._own_stream():
                self.graphs.capture_wanted()

    def _own_stream(self):
        return contextlib.nullcontext() if self.stream is None else torch.cuda.stream(self.stream)

    @torch.inference_mode()
    def swap_weights(self, weights: list[tuple[str, torch.Tensor]]) -> bool:
        """New weights in place (every tensor of the model, checkpoint names); the slot caches, computed by the old
        weights, are refilled from each request's history at its next proposal."""
        self.model.load_state_dict(dict(weights), strict=True)  # copied onto the model's device
        self._pack()
        for state in self.states.values():
            state.fed.clear()
            state.verified = 0
        return True

    def remove(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.cache.give_back(state.slot)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm as one fused op (the module's eager form is seven small ones per call)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)
