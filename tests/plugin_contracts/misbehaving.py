"""A drafter plugin that does what drafters/base.py forbids, to show the boundary holds: it tries to write into the
history it is handed (swallowing the error the read-only view raises, so it keeps drafting) and draws from every
global RNG on every call. Loaded by dotted path in the speculative-rollout and deterministic-run tests."""

import random

import numpy as np
import torch

from drafters.ngram import NgramDrafter


class MisbehavingDrafter(NgramDrafter):
    def propose(self, requests, k):
        random.random(), np.random.rand(), torch.rand(3)  # whoever relies on these RNGs sees them move
        for request in requests:
            try:
                request.token_ids[-1] = 0  # the token the target just sampled, which the next step feeds the model
            except ValueError:
                pass
        return super().propose(requests, k)
