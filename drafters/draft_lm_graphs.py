"""The draft LM's one-token passes as CUDA graphs.

Every pass of a proposal after its first feeds each request one token. Eager, such a pass is about 120 small torch
calls and host-bound on a GPU: 3.5-4.3 ms on an H200 whatever the batch (bench/results/gpu_check_h200.json), where
the GPU's own work is a small part of it. Captured as one CUDA graph per bucket of rows (a power of two, at least
8) and of span (a multiple of SPAN_STEP positions), a pass is one replay. Rows past the batch feed a padding slot of
their own, and every row's positions past its own are masked as in the eager pass, so the logits are the eager
pass's up to rounding.

Where graphs are made: only where the engine is idle, on its thread (`propose`, and `commit` for the buckets a
proposal ahead missed). A capture puts process-wide state in capture mode (torch's CUDA generator, the allocator)
and empties the allocator's cache, which must not happen beside the engine's forward; a proposal ahead, on the
drafter's thread while the engine verifies, replays graphs already made and drafts a missed bucket eagerly.

A graph reads the slot cache, the rotary table and the packed weights where they were when it was captured: it is
dropped when any of them moves (the cache grows, a weight swap). Each new graph is replayed once against its eager
warm-up; a capture that fails or disagrees leaves eager passes for good, with a warning: the same drafts, slower.
Drafts only ever save time (every token is still the target's coupled sample)."""

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
        self.wanted: set[tuple[int, int]] = set()  # buckets a proposal ahead missed, made at the next idle point
        self.outputs: dict[int, torch.Tensor] = {}  # logits per bucket of rows, outside the graphs' memory pool
        self.read_at: tuple | None = None  # where the slot cache and rotary table were when the passes were made
        self.pool = self.stream = None
        self.pad_slot: int | None = None
        self.failed = False

    def clear(self) -> None:
        self.passes.clear()
        self.pool = None  # a fresh pool for the graphs made after: the old one goes with its graphs

    def __call__(self, states: list, chunks: list[list[int]], may_capture: bool) -> torch.Tensor | None:
        """Feeds each state its one-token chunk, as `DraftLM._forward` does, and returns each one's logits; None
        where the eager pass is to run instead (no graph for this bucket where capturing is not allowed, or a
        capture failed)."""
        if self.failed:
            return None
        m = len(states)
        rows = max(MIN_ROWS, 1 << (m - 1).bit_length())
        span = self._ready(max(len(s.fed) + 1 for s in states))
        made = self.passes.get((rows, span))
        if made is None and not may_capture:
            self.wanted.add((rows, span))
            return None
        pad = [self.pad_slot] * (rows - m)
        host = torch.tensor([[c[0] for c in chunks] + [0] * (rows - m),
                             [len(s.fed) for s in states] + [0] * (rows - m),
                             [s.slot for s in states] + pad,
                             [s.slot if s.parent is None else s.parent.slot for s in states] + pad,
                             [s.shared for s in states] + [0] * (rows - m)])
        made = made or self._make(host, span)
        if made is None:
            return None
        inputs, run = made
        inputs.copy_(host)
        logits = run()[:m].clone()
        for state, chunk in zip(states, chunks):
            state.fed.extend(chunk)
        return logits

    def capture_wanted(self) -> None:
        """Makes the graphs proposals ahead missed (called where the engine is idle), each on padding rows only."""
        wanted, self.wanted = self.wanted, set()
        for rows, span in sorted(wanted):
            if not self.failed and self._ready(span) == span and (rows, span) not in self.passes:
                self._make(torch.tensor([[0] * rows, [0] * rows, [self.pad_slot] * rows, [self.pad_slot] * rows,
                                         [0] * rows]), span)

    def _ready(self, length: int) -> int:
        """The span bucket for `length` positions, with the slot cache and rotary table grown to it (every graph
        dropped if either moved) and the padding slot taken."""
        lm = self.lm
        if self.pad_slot is None:
            self.pad_slot = lm.cache.take()  # kept for good: padded rows write here
        span = min(-(-length // SPAN_STEP) * SPAN_STEP, lm.cache.max_len)
        lm.cache.reserve(span)
        lm.reserve_angles(span)
        read_at = (lm.cache.kv[0].data_ptr(), tuple(lm.cache.kv[0].shape), lm.cos.data_ptr(), tuple(lm.cos.shape))
        if read_at != self.read_at:
            self.clear()
            self.read_at = read_at
        return span

    def _make(self, host: torch.Tensor, span: int) -> tuple[torch.Tensor, Callable[[], torch.Tensor]] | None:
        """The pass for `host`'s bucket over `span` positions, kept: its input tensor (token, position, slot, the
        slot of its shared prefix and that prefix's length, per row) and what runs it (a graph's replay when
        capturing); None where the capture failed."""
        lm = self.lm
        inputs = host.to(lm.device)

        def one_token_pass() -> torch.Tensor:
            ids, start, slots, source, shared = inputs
            hidden = lm.decode(ids[:, None], start[:, None], (slots, start), lambda new: new[:, 0],
                               per_position(slots, source, shared, span), span)
            return lm.logits(hidden[:, 0])

        run = one_token_pass if not self.capture else self._capture(one_token_pass, host.shape[1])
        if run is not None:
            self.passes[host.shape[1], span] = inputs, run
        return None if run is None else (inputs, run)

    def _capture(self, one_token_pass: Callable[[], torch.Tensor], rows: int) -> Callable[[], torch.Tensor] | None:
        """`one_token_pass` as a CUDA graph writing into this bucket's output, checked once against its eager run."""
        lm = self.lm
        try:
            with torch.cuda.device(lm.device):  # the draft LM's GPU, which may not be the current one (cuda:1)
                out = self.outputs.get(rows)
                if out is None:
                    out = self.outputs[rows] = torch.empty(rows, lm.head.shape[0], device=lm.device)
                self.stream = self.stream or torch.cuda.Stream()
                self.pool = self.pool or torch.cuda.graph_pool_handle()
                warm = torch.cuda.Stream()
                warm.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(warm):  # writes these rows' keys and values, as every replay will again
                    expected = one_token_pass()
                torch.cuda.current_stream().wait_stream(warm)
                graph = torch.cuda.CUDAGraph()
                # thread-local: another thread's CUDA calls meanwhile (a weight receiver's) are not the capture's
                with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                    out.copy_(one_token_pass())
                graph.replay()
                if not torch.allclose(out, expected, rtol=1e-2, atol=1e-2):
                    raise RuntimeError("its first replay's logits differ from the eager pass's")
        except Exception as e:  # noqa: BLE001 -- whatever the capture's failure, the eager pass still drafts
            logging.getLogger(__name__).warning(
                "draft LM: a one-token pass as a CUDA graph failed (%s: %s); drafting with eager passes (same "
                "drafts, slower)", type(e).__name__, e)
            self.failed = True
            self.clear()
            return None

        def replay() -> torch.Tensor:
            with torch.cuda.device(lm.device):
                graph.replay()
            return out
        return replay


def per_position(slots: torch.Tensor, source: torch.Tensor, shared: torch.Tensor, span: int) -> tuple:
    """Where each row's keys and values are, per position up to `span`: its first `shared` in `source`'s slot (an
    outcome's prefix in its request's slot), the rest in its own (40% slower than a gather by slot alone)."""
    at = torch.arange(span, device=slots.device)[None]
    return torch.where(at < shared[:, None], source[:, None], slots[:, None]), at
