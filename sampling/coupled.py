"""Contract of `sampling/`: the coupled sampler (docs/design.md). Every token is

    argmax_v ( z[v] + G(seed, position, v) )      (argmax_v z[v] when T = 0)

with `z = processed_logits(...)`: the logits over T, then top-k/top-p masked (the one definition of the
distribution a rollout samples, used by the rollout engine, the drafters and the learner's logprobs), and `G`
Gumbel noise from a counter-based integer hash of (seed, output position, token id). Pure torch integer ops, so
the noise's bits are the same on CPU and GPU (the float64 logs turning them into G may differ in their last bits,
which changes a sample only on a near-exact tie) and it needs no per-request generators. Verification accepts a
draft token only where it equals the target's own coupled sample and emits the target's sample at the first
mismatch (or the bonus token), so a speculative rollout emits exactly the tokens of plain decoding.

This package imports nothing but torch: the actor's vLLM glue, drafter plugins and the learner all use it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (vLLM's _SAMPLING_EPS)
PLACEHOLDER = -1  # vLLM's padding for rejected positions in a verify output


SEED_STRIDE = 1_000_003  # runs with seeds s and s + 1 share no request seed for their first ~10^6 samples
MAX_RUN_SEED = (1 << 62) // SEED_STRIDE  # below it every request seed (`group_seed` + i) fits an int64


def group_seed(run_seed: int, cursor: int, group_size: int) -> int:
    """Sample `i` of the group for data cursor `cursor` samples with seed `group_seed(...) + i`."""
    return run_seed * SEED_STRIDE + cursor * group_size


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_MUL1, _MUL2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)  # splitmix64 finaliser
_SEED_KEY, _POSITION_KEY = _signed(0x9E3779B97F4A7C15), _signed(0xD1B54A32D192ED03)


def _shift_right(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s).bitwise_and_((1 << (64 - s)) - 1)  # logical shift on int64 (torch shifts arithmetically)


def _mix_(z: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser of every element of `z`, in place (and returned): the noise makes [rows, vocab] of
    these, and a fresh tensor per operation (~1 MB each at a verify step's 384 rows) cost more than the arithmetic."""
    for shift, factor in ((30, _MUL1), (27, _MUL2), (31, None)):
        z ^= _shift_right(z, shift)
        if factor is not None:
            z *= factor  # int64 products wrap identically on CPU and GPU
    return z


UNIFORM_BITS = 53


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """`UNIFORM_BITS` uniform bits -> float64 strictly inside (0, 1). (bits + 0.5) / 2^53 rounds to exactly 1.0 for
    the largest draws, where -log(-log(u)) is +inf (and -inf + inf = NaN on a masked token); those are clamped to
    the largest float64 below 1, leaving every other draw as it was."""
    u = bits.double()
    u += 0.5
    u *= 2.0**-UNIFORM_BITS
    return u.clamp_(max=1.0 - 2.0**-53)


def noise_bits(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] int64 holding `UNIFORM_BITS` random bits, row r a function of (seeds[r], positions[r]) alone:
    integer ops only, so they are bit for bit the same on every device."""
    row = _mix_(_mix_(seeds.long() * _SEED_KEY) ^ (positions.long() * _POSITION_KEY))
    tokens = torch.arange(vocab_size, device=seeds.device, dtype=torch.long)
    bits = _mix_(row.unsqueeze(1) ^ tokens.unsqueeze(0))
    bits >>= 64 - UNIFORM_BITS
    return bits.bitwise_and_((1 << UNIFORM_BITS) - 1)


def gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] float64 Gumbel(0, 1) noise, always finite; row r depends only on (seeds[r], positions[r]).
    Its bits are device-independent; the float64 logs may differ by an ulp between devices' math libraries."""
    return uniform_from_bits(noise_bits(seeds, positions, vocab_size)).log_().neg_().log_().neg_()


_MASK = (1 << 64) - 1


def _mix_int(z: int) -> int:  # `_mix_` on one unsigned 64-bit Python int
    z = ((z ^ (z >> 30)) * (_MUL1 & _MASK)) & _MASK
    z = ((z ^ (z >> 27)) * (_MUL2 & _MASK)) & _MASK
    return z ^ (z >> 31)


def gumbel_at(seed: int, position: int, tokens: Iterable[int]) -> list[float]:
    """`gumbel` of one (seed, position) at the given token ids only, in plain Python: the same bits, so the same
    noise up to the last bit of a log. For a drafter weighing a few candidate tokens, where a torch call per
    position would cost more than the whole choice."""
    row = _mix_int(_mix_int((seed * _SEED_KEY) & _MASK) ^ ((position * _POSITION_KEY) & _MASK))
    noise = []
    for token in tokens:
        bits = _mix_int(row ^ token) >> (64 - UNIFORM_BITS)
        u = min((bits + 0.5) * 2.0**-UNIFORM_BITS, 1.0 - 2.0**-53)
        noise.append(-math.log(-math.log(u)))
    return noise


def mask_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keeps each row's `top_k` largest logits (k <= 0 or >= vocab: all), then the smallest set whose probability
    reaches `top_p`; the rest become -inf. Same rule as vLLM's `apply_top_k_top_p_pytorch`."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k).long()
        threshold = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p.unsqueeze(1).to(cumulative.dtype)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def processed_logits(
    logits: torch.Tensor,  # [rows, vocab]
    temperature: torch.Tensor,  # [rows]
    top_k: torch.Tensor | None = None,  # [rows]; <= 0: off
    top_p: torch.Tensor | None = None,  # [rows]; 1: off
) -> torch.Tensor:
    """The distribution a row samples from, as fp32 logits: z / T with top-k/top-p applied (-inf outside); greedy
    rows (T ~ 0) keep z unmasked. `log_softmax` of this is what rollouts record as behaviour logprobs and what
    the learner's ratios must compare with."""
    logits = logits.float()
    greedy = temperature < GREEDY_BELOW
    scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1).to(logits.dtype)
    if top_k is None and top_p is None:
        return scaled
    return torch.where(greedy.unsqueeze(1), scaled, mask_top_k_top_p(scaled, top_k, top_p))


# rows x vocab made or processed at once: bounds the sampler's temporaries whatever the batch. Each chunk costs
# ~0.4 ms of calls on a GPU: at 2^24 (110 rows of a 151,936-token vocabulary) 160 rows took 0.8 ms against 4.2 ms
# at 2^22 on an H200, for 128 MiB of workspace (833 MiB under top-p); docs/benchmarks.md has the sampler's figures
NOISE_ELEMENTS = 1 << 24  # of float64 noise (the fused GPU kernel keeps none: there it only sets the chunk)
SAMPLE_ELEMENTS = 1 << 24  # of processed logits (top-k/top-p sorting, log-softmax)


def coupled_sample(
    logits: torch.Tensor,  # [rows, vocab]
    seeds: torch.Tensor,  # [rows] int64
    positions: torch.Tensor,  # [rows] output position of the token each row samples
    temperature: torch.Tensor,  # [rows]
    top_k: torch.Tensor | None = None,  # [rows]
    top_p: torch.Tensor | None = None,  # [rows]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [rows] and each one's processed log-probability [rows] under the distribution it was drawn from (the
    behaviour logprob a rollout records). A chunk of rows at a time, and nothing of [rows, vocab] kept: the
    temporaries stay bounded by SAMPLE_ELEMENTS and NOISE_ELEMENTS whatever the batch (vLLM's memory profiling does
    not see them), and on a GPU there is no host synchronisation."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    step = max(1, SAMPLE_ELEMENTS // vocab)
    for start in range(0, rows, step):
        part = slice(start, start + step)
        masked = processed_logits(logits[part], temperature[part], None if top_k is None else top_k[part],
                                  None if top_p is None else top_p[part])
        tokens[part] = _noisy_top(masked, seeds[part], positions[part], temperature[part], margins=False)[0]
        logprobs[part] = masked.log_softmax(dim=-1).gather(1, tokens[part].unsqueeze(1)).squeeze(1)
    return tokens, logprobs


def coupled_draft(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor,
                  top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                  noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafter's coupled samples [rows] (the tokens `coupled_sample` draws from the same arguments) and each one's
    margin [rows]: how far its noisy score `z[v] + G` is ahead of the runner-up's. The target's sample is the same
    token unless its log-probabilities differ from these by about that much, so the margin is how sure the draft is
    (a margin of 0.6 was accepted about half the time on the built-in pair, one over 5 nearly always). `noise`:
    `gumbel(seeds, positions, vocab)` made beforehand (a drafter makes a whole proposal's at once), else made here."""
    masked = processed_logits(logits, temperature, top_k, top_p)
    return _noisy_top(masked, seeds, positions, temperature, margins=True, noise=noise)


def _noisy_argmax(masked: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return gumbel(seeds, positions, masked.shape[-1]).add_(masked).argmax(dim=-1)


class _Fused:
    """`_noisy_argmax` compiled into one GPU kernel (hash, logs, add, argmax) that never writes the noise out:
    ~25 elementwise passes over [rows, vocab] int64/float64 tensors become one read of `masked`. Where it cannot be
    compiled (no Triton or C compiler on the node), the same function runs eagerly: the same tokens, slower."""

    def __init__(self):
        self.compiled = None

    def __call__(self, masked: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.compiled is None:
            self.compiled = torch.compile(_noisy_argmax, dynamic=True)
        if self.compiled is not _noisy_argmax:
            try:
                return self.compiled(masked, seeds, positions)
            except Exception as e:  # noqa: BLE001 - a compiler's failure, whatever its type, leaves the eager path
                logging.getLogger(__name__).warning("coupled sampler: the fused noise kernel did not compile (%s: %s)"
                                                    "; sampling with the unfused one (same tokens, slower)",
                                                    type(e).__name__, e)
                self.compiled = _noisy_argmax
        return _noisy_argmax(masked, seeds, positions)


_fused_noisy_argmax = _Fused()


def _noisy_top(masked: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor,
               margins: bool, noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """argmax of `masked + G` per row (of `masked` on greedy rows) and, with `margins`, its lead over the second.
    On a GPU noise is made for every row, greedy ones too: finding the sampled rows would be a host
    synchronisation. On the CPU, where it costs nothing, only the sampled rows get noise."""
    greedy = temperature < GREEDY_BELOW
    # the plain argmax is the greedy rows' sample; on the CPU it is skipped when every row samples
    tokens = masked.argmax(dim=-1) if masked.is_cuda or bool(greedy.any()) else \
        torch.empty(masked.shape[0], dtype=torch.long, device=masked.device)
    lead = None
    if margins:
        top = masked.topk(min(2, masked.shape[-1]), dim=-1).values.double()
        lead = top[:, 0] - top[:, -1] if top.shape[-1] == 2 else torch.full_like(top[:, 0], float("inf"))
    noisy_argmax = _fused_noisy_argmax if masked.is_cuda and not margins else _noisy_argmax
    chunk = max(1, NOISE_ELEMENTS // masked.shape[-1])  # noise for a chunk of rows at a time, never [rows, vocab]
    if masked.is_cuda:
        chunks = [slice(start, start + chunk) for start in range(0, masked.shape[0], chunk)]
    else:
        sampled = (~greedy).nonzero().flatten()
        chunks = [sampled[start : start + chunk] for start in range(0, sampled.numel(), chunk)]
    for rows in chunks:
        if margins and masked.shape[-1] >= 2:
            noisy = masked[rows].double() + (gumbel(seeds[rows], positions[rows], masked.shape[-1]) if noise is None
                                             else noise[rows])
            top = noisy.topk(2, dim=-1).values
            tokens[rows] = torch.where(greedy[rows], tokens[rows], noisy.argmax(dim=-1))
            lead[rows] = torch.where(greedy[rows], lead[rows], top[:, 0] - top[:, 1])
        else:
            tokens[rows] = torch.where(greedy[rows], tokens[rows], noisy_argmax(masked[rows], seeds[rows],
                                                                                  positions[rows]))
    return tokens, lead


def processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """`log_softmax(processed_logits)` of `logits` [..., vocab] under one sampling setting for every row: what a
    rollout records as behaviour logprobs, differentiable, for the learner's ratios (a token outside the current
    top-k/top-p set has -inf)."""
    flat = logits.reshape(-1, logits.shape[-1])
    rows, device = flat.shape[0], flat.device
    masked = processed_logits(flat, torch.full((rows,), float(temperature), device=device),
                              torch.full((rows,), top_k, device=device) if top_k > 0 else None,
                              torch.full((rows,), float(top_p), device=device) if top_p < 1 else None)
    return masked.log_softmax(dim=-1).reshape(logits.shape)


def verify(target: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, max_drafts: int) -> torch.Tensor:
    """Coupled verification of a flat batch of draft chains.

    `target` [sum(num_drafts + 1)]: the target's coupled samples, per request its draft rows then its bonus row.
    `drafts` [sum(num_drafts)]: the draft tokens. Returns [requests, max_drafts + 1]: per request the target's
    samples up to and including the first position where the draft disagrees (or the bonus), then PLACEHOLDER.
    """
    requests = num_drafts.shape[0]
    device = target.device
    column = torch.arange(max_drafts + 1, device=device)
    rows_per_request = num_drafts + 1
    starts = torch.cumsum(rows_per_request, 0) - rows_per_request
    valid = column.unsqueeze(0) < rows_per_request.unsqueeze(1)  # [requests, max_drafts + 1]
    flat_index = (starts.unsqueeze(1) + column.unsqueeze(0)).clamp(max=target.shape[0] - 1)
    samples = torch.where(valid, target[flat_index], PLACEHOLDER)
    draft_starts = starts - torch.arange(requests, device=device)  # drafts have no bonus row
    draft_valid = column[:max_drafts].unsqueeze(0) < num_drafts.unsqueeze(1)
    draft_index = (draft_starts.unsqueeze(1) + column[:max_drafts].unsqueeze(0)).clamp(max=max(drafts.shape[0] - 1, 0))
    padded_drafts = drafts[draft_index] if drafts.numel() else torch.full_like(draft_index, PLACEHOLDER)
    agree = draft_valid & (padded_drafts == samples[:, :max_drafts])
    accepted = torch.cumprod(agree.long(), dim=1).sum(dim=1)  # leading agreements per request
    return torch.where(column.unsqueeze(0) <= accepted.unsqueeze(1), samples, PLACEHOLDER)
