"""The draft LM's one-token passes as CUDA graphs.

Every pass of a proposal after its first feeds each request one token. Eager, such a pass is about 120 small torch
calls and host-bound on a GPU: 3.5-4.3 ms on an H200 whatever the batch (bench/results/gpu_check_h200.json), where
the GPU's own work is a small part of it. Captured as one CUDA graph per bucket of rows (a power of two, at least
8) and of span (a multiple of SPAN_STEP positions), a pass is one replay. Rows past the batch feed a padding slot of
their own, and every row's positions past its own are masked as in the eager pass, so the logits are the eager
pass's up to rounding. A graph reads the slot cache, the rotary table and the packed weights where they were when it
was captured: it is dropped when any of them moves (the cache grows, a weight swap). A capture that fails leaves the
eager pass for good, with a warning: the same drafts, slower. Drafts only ever save time (every token is still the
target's coupled sample), so a graph that computed something else would cost acceptance, not correctness."""

from __future__ import annotations

import logging
from typing import Callable

import torch

SPAN_STEP = 256  # positions a graph's span is rounded up to (attention over the extra ones is masked)
MIN_ROWS = 8


class GraphedPasses:
    """`DraftLM`'s one-token passes through graphs kept per (rows, span) bucket."""

    def __init__(self, lm, capture: bool = True):
        """`lm`: the `drafters.draft_lm.DraftLM` whose passes these are. `capture`: record CUDA graphs (the draft LM
        on a GPU); False runs the same padded pass eagerly each time (what a test on a CPU checks)."""
        self.lm, self.capture = lm, capture
        self.passes: dict[tuple[int, int], tuple[torch.Tensor, Callable[[], torch.Tensor]]] = {}
        self.read_at: tuple | None = None  # where the slot cache and rotary table were when the passes were made
        self.pool = None
        self.pad_slot: int | None = None
        self.failed = False

    def clear(self) -> None:
        self.passes.clear()

    def __call__(self, states: list, chunks: list[list[int]]) -> torch.Tensor | None:
        """Feeds each state its one-token chunk, as `DraftLM._forward` does; each one's logits, or None where the
        eager pass is to run instead (a capture failed)."""
        if self.failed:
            return None
        lm, m = self.lm, len(states)
        if self.pad_slot is None:
            self.pad_slot = lm.cache.take()  # kept for good: padded rows write here
        rows = max(MIN_ROWS, 1 << (m - 1).bit_length())
        span = min(-(-max(len(s.fed) + 1 for s in states) // SPAN_STEP) * SPAN_STEP, lm.cache.max_len)
        lm.cache.reserve(span)
        lm.reserve_angles(span)
        read_at = (lm.cache.kv[0].data_ptr(), tuple(lm.cache.kv[0].shape), lm.cos.data_ptr(), tuple(lm.cos.shape))
        if read_at != self.read_at:
            self.passes.clear()
            self.read_at = read_at
        pad = [self.pad_slot] * (rows - m)
        host = torch.tensor([[c[0] for c in chunks] + [0] * (rows - m),
                             [len(s.fed) for s in states] + [0] * (rows - m),
                             [s.slot for s in states] + pad,
                             [s.slot if s.parent is None else s.parent.slot for s in states] + pad,
                             [s.shared for s in states] + [0] * (rows - m)])
        made = self.passes.get((rows, span))
        if made is None:
            made = self._make(host, span)
            if made is None:
                return None
            self.passes[rows, span] = made
        inputs, run = made
        inputs.copy_(host)
        logits = run()[:m].clone()
        for state, chunk in zip(states, chunks):
            state.fed.extend(chunk)
        return logits

    def _make(self, host: torch.Tensor, span: int) -> tuple[torch.Tensor, Callable[[], torch.Tensor]] | None:
        """The pass for `host`'s bucket over `span` positions: its input tensor (token, position, slot, the slot of
        its shared prefix and that prefix's length, per row) and what runs it (a graph's replay when capturing)."""
        lm = self.lm
        inputs = host.to(lm.device)

        def one_token_pass() -> torch.Tensor:
            ids, start, slots, source, shared = inputs
            hidden = lm.decode(ids[:, None], start[:, None], (slots, start), lambda new: new[:, 0],
                               per_position(slots, source, shared, span), span)
            return lm.logits(hidden[:, 0])

        if not self.capture:
            return inputs, one_token_pass
        try:
            with torch.cuda.device(lm.device):  # the draft LM's GPU, which may not be the current one (cuda:1)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up: writes these rows' keys and values, as the replay will again
                    one_token_pass()
                torch.cuda.current_stream().wait_stream(side)
                self.pool = self.pool or torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                # thread-local: with `speculation.decoupled` this runs on the drafter's thread beside the engine
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    out = one_token_pass()
        except Exception as e:  # noqa: BLE001 -- whatever the capture's failure, the eager pass still drafts
            logging.getLogger(__name__).warning(
                "draft LM: capturing a one-token pass as a CUDA graph failed (%s: %s); drafting with eager passes "
                "(same drafts, slower)", type(e).__name__, e)
            self.failed = True
            self.passes.clear()
            return None

        def replay() -> torch.Tensor:
            with torch.cuda.device(lm.device):
                graph.replay()
            return out
        return inputs, replay


def per_position(slots: torch.Tensor, source: torch.Tensor, shared: torch.Tensor, span: int) -> tuple:
    """Where each row's keys and values are, per position up to `span`: its first `shared` in `source`'s slot (an
    outcome's prefix in its request's slot), the rest in its own (40% slower than a gather by slot alone)."""
    at = torch.arange(span, device=slots.device)[None]
    return torch.where(at < shared[:, None], source[:, None], slots[:, None]), at
