"""What a drafter's per-token confidence is worth: the probability that the verifier accepts a draft token given its
confidence (and that the tokens before it were accepted), learned online from what the verifier committed.

Every verify step labels a proposal exactly (the coupled sampler makes the committed tokens the target's own
samples, whoever drafted): its first token is labelled by the first committed token, and each later one, as long
as the ones before it agreed, by the next; the bonus token labels the first draft token past the verified ones,
and a request that was not verified at all labels its proposal's first token. Labels are counted per confidence
bucket with exponential forgetting, so the table follows the policy as it drifts."""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

EDGES = np.array([0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999])  # bucket b: EDGES[b-1] <= c < EDGES[b]
MIDDLES = (np.concatenate([[0.0], EDGES]) + np.concatenate([EDGES, [1.0]])) / 2
MAX_RATE = 0.99  # no draft token is ever counted on as certain
_EDGES, _MIDDLES = EDGES.tolist(), MIDDLES.tolist()


class Calibration:
    """Plain Python floats, not numpy: the engine asks for a few tokens' rates per request, every request of every
    step, where a numpy call costs more than the arithmetic (the bridge spent ~20 us of a drafted request's ~50 here).
    `bisect_right` buckets as `np.searchsorted(EDGES, c, side="right")` does, NaN included (past the last edge)."""

    def __init__(self, decay: float = 0.995, prior: float = 4.0):
        """`prior`: pseudo-labels per bucket at its middle confidence, so an empty bucket trusts the drafter."""
        self.decay, self.prior = decay, prior
        self.agreed = [0.0] * (len(_EDGES) + 1)
        self.labelled = [0.0] * (len(_EDGES) + 1)
        self.table: list[float] | None = None  # the rates per bucket, made again after new labels

    def observe(self, confidences: list[float], proposal: list[int], committed: list[int]) -> None:
        """Labels `proposal` (with its per-token `confidences`) by the tokens the verifier `committed` after it."""
        for confidence, draft, target in zip(confidences, proposal, committed):
            b = bisect_right(_EDGES, confidence)
            agreed = draft == target
            self.agreed[b] = self.decay * self.agreed[b] + agreed
            self.labelled[b] = self.decay * self.labelled[b] + 1
            self.table = None
            if not agreed:
                break

    def rates(self, confidences: list[float]) -> list[float]:
        """Per token, the probability that it is accepted if the ones before it were."""
        if self.table is None:
            self.table = [min((a + self.prior * m) / (n + self.prior), MAX_RATE)
                          for a, n, m in zip(self.agreed, self.labelled, _MIDDLES)]
        return [self.table[bisect_right(_EDGES, c)] for c in confidences]

    def gains(self, confidences: list[float]) -> list[float]:
        """Per token, the expected committed tokens it adds: the probability that it and all before it are accepted."""
        gains, reached = [], 1.0
        for rate in self.rates(confidences):
            reached *= rate
            gains.append(reached)
        return gains
