"""The coupled sampler's maths, without vLLM: exact marginals, noise keyed only by (seed, position, token),
and the verification rule."""

from pathlib import Path

import pytest
import torch

from sampling.coupled import (PLACEHOLDER, UNIFORM_BITS, coupled_draft, coupled_sample, gumbel, mask_top_k_top_p,
                              processed_logprobs, uniform_from_bits, verify)

VOCAB = 8
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = probs > 0
    chi2 = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2.double() / 2).item()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0), (0.7, 6, 0.8)])
def test_marginal_matches_softmax_after_top_k_top_p(temperature, top_k, top_p):
    draws = 200_000
    seeds = torch.full((draws,), 1234)
    positions = torch.arange(draws)  # one seed, many positions: the noise must be independent across them
    logits = LOGITS.expand(draws, VOCAB)
    tokens, logprobs = coupled_sample(logits, seeds, positions, torch.full((draws,), temperature),
                                      torch.full((draws,), top_k) if top_k else None,
                                      torch.full((draws,), top_p) if top_p < 1 else None)
    probs = mask_top_k_top_p((LOGITS / temperature).unsqueeze(0), torch.tensor([top_k]) if top_k else None,
                             torch.tensor([top_p]) if top_p < 1 else None).softmax(-1)[0]
    assert torch.allclose(logprobs.exp(), probs[tokens], atol=1e-6)  # each token's probability under that setting
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    assert counts[probs == 0].sum() == 0, "a masked token was sampled"
    assert chi_square_p_value(counts, probs.double()) > 1e-3


def test_a_wrong_distribution_fails_the_same_check():
    draws = 200_000
    tokens, _ = coupled_sample(LOGITS.expand(draws, VOCAB), torch.zeros(draws, dtype=torch.long),
                               torch.arange(draws), torch.full((draws,), 1.0))
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    assert chi_square_p_value(counts, (LOGITS / 1.1).softmax(-1).double()) < 1e-6


def test_masking_keeps_the_smallest_set_reaching_top_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = mask_top_k_top_p(probs.log(), None, torch.tensor([0.75])).isfinite()[0].tolist()
    assert kept == [True, True, False, False]
    kept = mask_top_k_top_p(probs.log(), torch.tensor([3]), torch.tensor([0.9])).isfinite()[0].tolist()
    assert kept == [True, True, True, False]
    assert mask_top_k_top_p(probs.log(), torch.tensor([0]), None).isfinite().all()  # k = 0: off


def test_noise_depends_only_on_seed_position_and_token():
    seeds, positions = torch.tensor([1, 2, 3, 1]), torch.tensor([0, 5, 7, 0])
    g = gumbel(seeds, positions, 300)
    assert torch.equal(g[0], g[3])  # same key, same noise, wherever the row sits
    assert not torch.equal(g[0], g[1])
    order = torch.tensor([2, 0, 1])
    assert torch.equal(gumbel(seeds[order], positions[order], 300), g[order])
    assert torch.equal(gumbel(seeds[:1], positions[:1], 100), g[:1, :100])  # token id keys, not vocab size
    seed_of_big = torch.tensor([2**62 + 17])  # 64-bit seeds are fine
    assert torch.isfinite(gumbel(seed_of_big, torch.tensor([3]), 10)).all()


def test_uniforms_stay_strictly_inside_zero_one_at_the_extreme_bits():
    """The largest draw used to round to exactly 1.0: Gumbel +inf, and on a masked token -inf + inf = NaN."""
    extremes = torch.tensor([0, 1, (1 << UNIFORM_BITS) - 2, (1 << UNIFORM_BITS) - 1])
    u = uniform_from_bits(extremes)
    assert (u > 0).all() and (u < 1).all()
    noise = -torch.log(-torch.log(u))
    assert torch.isfinite(noise).all()
    masked = torch.tensor([float("-inf"), 0.0]).double()
    assert (masked + noise[-1]).argmax() == 1  # a masked token can never win


def test_rows_with_a_very_large_vocabulary_are_sampled_in_chunks_identically():
    """Rows processed (SAMPLE_ELEMENTS) and noised (NOISE_ELEMENTS) a chunk at a time give what the whole batch at
    once gives, token for token and logprob for logprob, with greedy rows and per-row top-k/top-p mixed in."""
    from sampling import coupled

    logits = torch.randn(7, 5000) * 3
    args = (torch.arange(7), torch.arange(7), torch.tensor([0.8, 0.0, 1.0, 0.7, 0.0, 1.3, 1.0]),
            torch.tensor([0, 0, 20, 0, 5, 0, 100]), torch.tensor([1.0, 1.0, 0.9, 0.95, 1.0, 1.0, 0.5]))
    whole = coupled_sample(logits, *args)
    limits = coupled.NOISE_ELEMENTS, coupled.SAMPLE_ELEMENTS
    try:
        coupled.NOISE_ELEMENTS, coupled.SAMPLE_ELEMENTS = 5000, 3 * 5000  # noise a row, process 3 rows, at a time
        chunked = coupled_sample(logits, *args)
    finally:
        coupled.NOISE_ELEMENTS, coupled.SAMPLE_ELEMENTS = limits
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    assert torch.equal(whole[0][[1, 4]], (logits[[1, 4]]).argmax(-1))  # greedy rows: the argmax, noise or not
    assert not torch.equal(whole[0], logits.argmax(-1))  # and the others sampled


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9), (1.0, 5, 1.0), (0.0, 0, 1.0)])
def test_the_learner_and_the_sampler_see_one_distribution(temperature, top_k, top_p):
    """The learner's logprobs (one setting for a [batch, time, vocab] block) at the sampled tokens are the ones the
    sampler records, bit for bit."""
    logits = torch.randn(2, 3, 64) * 3
    rows = 6
    tokens, sampler = coupled_sample(logits.reshape(rows, 64), torch.arange(rows), torch.arange(rows),
                                     torch.full((rows,), temperature), torch.full((rows,), top_k) if top_k else None,
                                     torch.full((rows,), top_p) if top_p < 1 else None)
    learner = processed_logprobs(logits, temperature, top_k, top_p)
    assert torch.equal(learner.reshape(rows, 64).gather(1, tokens.unsqueeze(1)).squeeze(1), sampler)
    if top_k or top_p < 1:  # and the masking matters: temperature alone is another distribution
        assert not torch.allclose(processed_logprobs(logits, temperature), learner)


def test_greedy_rows_take_the_argmax_whatever_the_noise():
    logits = torch.randn(16, 50)
    tokens, _ = coupled_sample(logits, torch.arange(16), torch.zeros(16, dtype=torch.long), torch.zeros(16))
    assert torch.equal(tokens, logits.argmax(-1))


def test_verify_accepts_the_agreeing_prefix_and_emits_the_target_sample():
    # request 0: 3 drafts, 2 agree then a mismatch -> 2 accepted + the target's token at the mismatch
    # request 1: 2 drafts, both agree -> both + bonus; request 2: no drafts -> its one sampled token
    target = torch.tensor([10, 11, 12, 13, 20, 21, 22, 30])
    drafts = torch.tensor([10, 11, 99, 20, 21])
    out = verify(target, drafts, torch.tensor([3, 2, 0]), max_drafts=3)
    P = PLACEHOLDER
    assert out.tolist() == [[10, 11, 12, P], [20, 21, 22, P], [30, P, P, P]]
    first_wrong = verify(torch.tensor([5, 6]), torch.tensor([7]), torch.tensor([1]), max_drafts=1)
    assert first_wrong.tolist() == [[5, P]]
    assert verify(torch.tensor([4, 8]), torch.empty(0, dtype=torch.long), torch.tensor([0, 0]), 0).tolist() == [[4], [8]]


def test_a_drafts_margin_is_how_far_the_target_may_differ_before_its_coupled_sample_changes():
    rows = 256
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    seeds, positions = torch.arange(rows), torch.arange(rows) % 7
    temperature = torch.where(torch.arange(rows) < 32, 0.0, 1.0)  # greedy rows too
    tokens, _ = coupled_sample(logits, seeds, positions, temperature)
    drafted, margins = coupled_draft(logits, seeds, positions, temperature)
    assert torch.equal(drafted, tokens) and (margins > 0).all()
    # a target whose logits differ by less than half the margin anywhere samples the same token
    wobble = torch.rand(rows, VOCAB, generator=torch.Generator().manual_seed(4)) - 0.5
    near = logits + wobble * 0.99 * margins[:, None]
    assert torch.equal(coupled_sample(near.float(), seeds, positions, temperature)[0], tokens)
    # one that moves its sample's logit down by more than the margin samples another token
    far = logits.clone()
    far[torch.arange(rows), tokens] -= margins.float() * 1.01
    assert (coupled_sample(far, seeds, positions, temperature)[0] != tokens).all()


def test_a_draft_with_its_noise_made_beforehand_is_the_same_draft():
    """A drafter may make a whole proposal's noise in one call (drafters/draft_lm.py): rows of it, taken in any
    order, give the tokens and margins `coupled_draft` makes on its own, greedy and top-k/top-p rows included."""
    rows = 64
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    seeds, positions = torch.arange(rows) * 3, torch.arange(rows) % 5
    temperature = torch.where(torch.arange(rows) % 4 == 0, 0.0, 0.8)
    top_k, top_p = torch.where(torch.arange(rows) % 3 == 0, 3, 0), torch.where(torch.arange(rows) % 2 == 0, 0.9, 1.0)
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(6))
    made = gumbel(seeds[order], positions[order], VOCAB)[order.argsort()]
    expected = coupled_draft(logits, seeds, positions, temperature, top_k, top_p)
    given = coupled_draft(logits, seeds, positions, temperature, top_k, top_p, noise=made)
    assert torch.equal(given[0], expected[0]) and torch.equal(given[1], expected[1])
    other = gumbel(seeds + 1, positions, VOCAB)
    wrong = coupled_draft(logits, seeds, positions, temperature, top_k, top_p, noise=other)
    assert not torch.equal(wrong[0], expected[0])  # the noise given is the noise used


def test_a_fused_noise_kernel_that_fails_to_compile_leaves_the_same_tokens_unfused(monkeypatch, caplog):
    """On a node where torch.compile cannot build the kernel (no Triton or C compiler), sampling goes on unfused,
    with one warning and no second attempt."""
    from sampling import coupled

    attempts = []

    def broken(*args, **kwargs):
        attempts.append(1)
        raise RuntimeError("no C compiler")

    monkeypatch.setattr(coupled.torch, "compile", lambda fn, **kwargs: broken)
    fused = coupled._Fused()
    masked, seeds, positions = torch.randn(5, 300), torch.arange(5), torch.arange(5)
    expected = (masked.double() + coupled.gumbel(seeds, positions, 300)).argmax(-1)
    with caplog.at_level("WARNING"):
        assert torch.equal(fused(masked, seeds, positions), expected)
        assert torch.equal(fused(masked, seeds, positions), expected)
    assert len(attempts) == 1 and "did not compile" in caplog.text and "no C compiler" in caplog.text


MEMORY_PROBE = """
import re, sys, torch
from sampling import coupled

def rss_kib(field):
    return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))

coupled.SAMPLE_ELEMENTS = coupled.NOISE_ELEMENTS = 1 << 20  # 64 rows of this vocabulary at a time
rows, vocab = int(sys.argv[1]), 16384
logits = torch.randn(rows, vocab)
args = (torch.arange(rows), torch.arange(rows), torch.full((rows,), 0.7), None, torch.full((rows,), 0.9))
coupled.coupled_sample(logits[:8], *(a[:8] if a is not None else None for a in args))  # warm-up: allocator, kernels
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from what is resident now
before = rss_kib("VmRSS")
coupled.coupled_sample(logits, *args)
print((rss_kib("VmHWM") - before) / 1024)
"""


def test_a_sampler_calls_memory_is_bounded_whatever_rows_x_vocab():
    """The peak memory one call adds (top-p, the sorting case) stays within its chunks' temporaries: at 2,048 rows
    what it is at 256, though a [rows, vocab] fp32 matrix alone grows by 112 MiB between the two."""
    import os
    import subprocess
    import sys

    def growth_mib(rows: int) -> float:
        # a fixed mmap threshold: freed temporaries go back to the system, so the peak is what was live at once
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(rows)], capture_output=True, text=True,
                             check=True, cwd=Path(__file__).resolve().parent.parent, env=env)
        return float(out.stdout.strip())

    small, large = growth_mib(256), growth_mib(2048)
    assert large < 48 and large - small < 8, f"{small:.0f} MiB at 256 rows, {large:.0f} MiB at 2,048"
