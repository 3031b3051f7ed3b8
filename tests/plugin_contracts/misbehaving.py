"""A drafter plugin that does what drafters/base.py forbids, to show the boundary holds: it tries to write into the
history it is handed (swallowing the error the read-only view raises, so it keeps drafting) and draws from every
global RNG on every call. Loaded by dotted path in the speculative-rollout and deterministic-run tests. And one
whose options are judged as a YAML file gives them (`StopsDrafter`, in the config tests), one that cannot be built
(`BrokenAtStart`), one whose constructor never returns (`HangsAtStart`) and one that never returns from a call
(`HangsDrafter`, in a live run)."""

import random
import threading

import numpy as np
import torch

from drafters.base import Drafter
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



class StopsDrafter(Drafter):
    """Options as a YAML file gives them: a list (`stops`), and an annotation only a type checker can resolve."""

    def __init__(self, stops: list | None = None, hint: "OnlyForTypeCheckers | None" = None):  # noqa: F821
        self.check_options(dict(stops=stops, hint=hint))

    @classmethod
    def check_options(cls, options: dict) -> dict:
        checked = super().check_options(options)
        if not isinstance(checked["stops"] or [], list):
            raise TypeError(f"option stops={checked['stops']!r} is not a list")
        return checked

    def propose(self, requests, k):
        return [[] for _ in requests]

    def commit(self, request_id, committed):
        pass

    def remove(self, request_id):
        pass


class BrokenAtStart(NgramDrafter):
    """Passes the check at load and fails to build on the actor (a model missing on that node, say)."""

    def __init__(self, **options):
        raise RuntimeError("its model is not on this node")


class HangsDrafter(NgramDrafter):
    """Drafts like the n-gram drafter, then never returns from its 40th proposal (a deadlock, a lost lock, a remote
    call with no timeout)."""

    calls = 0

    def propose(self, requests, k):
        self.calls += 1
        if self.calls == 40:
            threading.Event().wait()
        return super().propose(requests, k)


class HangsAtStart(NgramDrafter):
    """Never finishes building (a download with no timeout on a node without the network, say)."""

    def __init__(self, **options):
        threading.Event().wait()
