"""Contract of `drafters/`: what a drafter plugin is.

A drafter proposes up to `k` next tokens for each request of a batch, from the request's id, sampling seed,
output position, sampling settings and token history, optionally with a confidence per token. The verifier (the
target model, in `actor/`) decides what is kept; a drafter never changes a trajectory, it only changes how fast
it is produced. After every verify step the drafter is told what was committed, and it may keep state per request
until the request is removed.
Requests may arrive in any order and any subset from one call to the next; `token_ids` is always the whole
truth, so a drafter that lost or never had state for a request must still answer. A drafter that raises (or
breaks this contract) is switched off in its engine, which decodes on without drafts (actor/draft_bridge.py).

A plugin is a plain class implementing `Drafter`, constructed with keyword options from the config
(`speculation.options`) and named by a built-in name (`ngram`, `draft_lm`, `suffix`, `fastest_of_n`), a dotted path
(`pkg.mod.Class`) or the name of a `specactor.drafters` entry point. `tests/plugin_contracts/` checks every built-in
drafter and the example under `examples/`; run it on yours. A `CompositeDrafter` (a drafter made of members) adds
what the engine reports per member.
"""

from __future__ import annotations

import importlib
import inspect
import threading
import typing
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

BUILTIN = {"ngram": "drafters.ngram.NgramDrafter", "draft_lm": "drafters.draft_lm.DraftLM",
           "suffix": "drafters.suffix.SuffixDrafter", "fastest_of_n": "drafters.fastest_of_n.FastestOfN"}
ENTRY_POINT_GROUP = "specactor.drafters"


@dataclass(frozen=True)
class DraftRequest:
    request_id: str
    seed: int  # the coupled sampler's seed for this request
    position: int  # output position of the next token to be sampled (0 = first response token)
    # prompt followed by every committed output token: a read-only sequence of ints (a view of the bridge's copy of
    # the engine's history, never of the engine's buffer; valid during the call only: copy what you keep)
    token_ids: Sequence[int]
    temperature: float = 0.0  # the target's sampling settings, for drafters that sample with the coupled noise
    top_k: int = 0  # <= 0: no top-k
    top_p: float = 1.0
    max_tokens: int | None = None  # at most this many drafts for this request (None: the call's k); the planner
    # sets it per request, and a drafter that honours it saves work (the engine truncates longer proposals anyway)
    unverified: int = 0  # `propose_ahead` only: the last this many of token_ids are not committed yet (drafts being
    # verified, and a guess of the target's next token)
    rejected: int | None = None  # `propose_ahead` only (to a drafter that `prepares_rejections`): the outcome where
    # the draft after token_ids is rejected, so the target's token there is known not to be this one
    guess: int = 0  # `propose_ahead` only (to a drafter that `prepares_guesses`): the proposal's first token is the
    # drafter's `guess`-th likeliest for the target's next token (0: its best), one outcome prepared under several

    def budget(self, k: int) -> int:
        """How many drafts this request may get from a call for `k`: `k`, or `max_tokens` if smaller."""
        return k if self.max_tokens is None else min(k, self.max_tokens)


class Drafter(ABC):
    # `propose_ahead` takes several requests with one id in a call, one per outcome of the verify step under way (all
    # drafts accepted; the first j accepted and the next `rejected`), and guesses past a rejected token
    prepares_rejections: bool = False
    # `propose_ahead` honours `DraftRequest.guess`: an outcome may also come with its first token's runner-up guessed
    prepares_guesses: bool = False

    @abstractmethod
    def propose(self, requests: list[DraftRequest], k: int) -> list[list[int]]:
        """One list of at most `k` draft tokens per request, in the order given (an empty list: no draft)."""

    @abstractmethod
    def commit(self, request_id: str, committed: list[int]) -> None:
        """`committed` tokens were appended to `request_id` by the verifier since its last commit (one step's, or
        several after steps without drafts)."""

    @abstractmethod
    def remove(self, request_id: str) -> None:
        """The request finished or was aborted; drop its state."""

    def propose_ahead(self, requests: list[DraftRequest], k: int) -> list[list[int]] | None:
        """Optional (`speculation.decoupled`): proposals for histories that run `request.unverified` tokens past
        what is committed (the drafts the engine is verifying meanwhile, then a guess of the target's next token),
        called on a thread of its own while the engine verifies; never at the same time as another call of this
        drafter. It must leave the drafter as the committed history left it (count nothing unverified); its
        `confidences()` afterwards are these proposals'. None (the default): not supported, drafting stays serial.
        A drafter with `prepares_rejections` also gets the outcomes where a draft is rejected: a request may then come
        several times, with `rejected` set where the proposal's first token must guess past that token; one with
        `prepares_guesses`, an outcome again with `guess` = 1, where the first token is its second-likeliest."""
        return None

    def swap_weights(self, weights: list[tuple[str, Any]]) -> bool:
        """Optional: a drafter with weights of its own (a draft LM) takes a new version of them, named as its
        Hugging Face checkpoint names them, between two engine steps; True if it took them. No trajectory
        changes whatever the weights are (the verifier decides), only how many drafts are accepted."""
        return False

    def confidences(self) -> list[list[float]] | None:
        """Optional: for the last `propose` call, per request and draft token, how sure the drafter is (in [0, 1])
        that the target samples that token if it sampled the ones before it. The engine calibrates them online
        against what the verifier commits (drafters/calibration.py) and verifies each proposal only as far as that
        pays. None: the planner uses each request's acceptance so far, and asks for no more tokens than it keeps."""
        return None

    @classmethod
    def check_options(cls, options: dict) -> dict:
        """Judges `options` (`speculation.options`) at config load, before any actor starts: raises TypeError or
        ValueError naming the option that is wrong, and returns the constructor's arguments with its defaults. It
        must be cheap (no model loading). This one checks that the constructor takes these keywords and that each
        value has the type its annotation names (int, float, str or bool); a drafter with more rules (ranges)
        extends it and its constructor calls it, so a drafter built in code is judged the same."""
        bound = inspect.signature(cls).bind(**options)  # TypeError naming the keyword it does not take
        bound.apply_defaults()
        try:
            hints = typing.get_type_hints(cls.__init__)
        except NameError:  # annotations naming what only a type checker imports: the constructor judges the values
            hints = {}
        for name, value in bound.arguments.items():
            want = hints.get(name)
            if want in (int, float, str, bool) and not _is(value, want):
                raise TypeError(f"option {name}={value!r} is not of type {want.__name__}")
        return dict(bound.arguments)

    def remember(self, prompt_ids: list[int], response_ids: list[int], version: int) -> None:
        """Optional: a finished output of `prompt_ids` that another actor sampled, starting under policy `version`
        (the learner sends every step's outputs to every actor, since a prompt's next epoch may land on any of them):
        history for a drafter that keeps it, as its own finished requests are. Ignored by default."""

    def new_policy(self, version: int) -> None:
        """Optional: the verifier samples from policy `version` from the next engine step on (the actor applied new
        weights, or started with them). Ignored by default."""


class CompositeDrafter(Drafter):
    """A drafter made of member drafters (`fastest_of_n`): besides the `Drafter` contract, what the engine reports
    per member. A plain drafter has none of these."""

    @abstractmethod
    def member_labels(self) -> dict[str, dict[str, tuple[int, int]]]:
        """Per request committed since the last call, per member, the labels of that member's proposals on the
        committed tokens, chosen or not: draft tokens the verifier would have accepted and tokens it would have
        rejected (at most one a proposal: its first disagreement; tokens past the committed ones are unlabelled),
        reported as each member's token acceptance (`spec/member/<name>/token_acceptance`)."""

    @abstractmethod
    def failures(self) -> list[str]:
        """One line per member switched off for raising (its name and the exception), reported as a drafter switched
        off is (`spec/drafter_failed`, `spec/alarm`) while the other members draft on. Empty: none."""

    @abstractmethod
    def sources(self) -> list[str]:
        """For the last `propose` call, the name of the member that drafted each request ("" where none did),
        reported as choice shares (`spec/choice/<name>`)."""


def prepares_ahead(drafter: Drafter | type[Drafter]) -> bool:
    """Whether `drafter` (or a drafter class) implements `propose_ahead` (decoupled speculation), rather than
    inheriting the default."""
    cls = drafter if isinstance(drafter, type) else type(drafter)
    return cls.propose_ahead is not Drafter.propose_ahead


def _is(value: Any, kind: type) -> bool:
    if isinstance(value, bool) or kind is bool:  # a YAML `true` is no count, and a count no switch
        return isinstance(value, bool) and kind is bool
    return isinstance(value, (int, float) if kind is float else kind)


class DrafterLoadError(ValueError):
    pass


def printable(text: str) -> str:
    """`text` as UTF-8 can carry it (a lone surrogate, as in an exception's message, becomes an escape)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def is_ctrl_c(error: BaseException) -> bool:
    """Whether `error` is a real Ctrl-C: a KeyboardInterrupt on the main thread (no other thread receives one; a
    plugin raised it there), the one error of a plugin's call that passes."""
    return isinstance(error, KeyboardInterrupt) and threading.current_thread() is threading.main_thread()


def described(error: BaseException) -> str:
    """`Type: message` of what a plugin raised, printable, whatever the error's own `__str__` does (one that raises,
    an exit included, is said to have raised; only a Ctrl-C passes): the engine reports it and goes on."""
    try:
        message = str.__str__(str(error))  # (a str of its own, whose formatting would be the plugin's code again)
    except BaseException as e:
        if is_ctrl_c(e):
            raise
        message = f"<its message raised {type(e).__name__}>"
    return printable(f"{type(error).__name__}: {message}")


def drafter_class(name: str) -> type[Drafter]:
    """The class a built-in name, dotted path or `specactor.drafters` entry point names."""
    path = BUILTIN.get(name)
    if path is None:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if found:
            cls = found[0].load()
        elif "." in name:
            path = name
        else:
            raise DrafterLoadError(f"drafter '{name}': not a built-in ({', '.join(BUILTIN)}), not a dotted path "
                                   f"and no '{ENTRY_POINT_GROUP}' entry point of that name")
    if path is not None:
        module, _, attr = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise DrafterLoadError(f"drafter '{name}': cannot import {path}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, Drafter)):
        raise DrafterLoadError(f"drafter '{name}': {cls!r} is not a subclass of drafters.base.Drafter")
    if inspect.isabstract(cls):
        raise DrafterLoadError(f"drafter '{name}': {cls.__name__} does not implement "
                               f"{', '.join(sorted(cls.__abstractmethods__))} (drafters/base.py: Drafter)")
    return cls


def load_drafter(name: str, options: dict, device: str | None = None) -> Drafter:
    """The drafter `name` built with `options`. `device`: the engine's; a drafter whose constructor takes a
    `device` keyword gets it unless `options` names one, so its tensors live where the engine's do."""
    cls = drafter_class(name)
    if device is not None and "device" not in options and "device" in inspect.signature(cls).parameters:
        options = {**options, "device": device}
    return cls(**options)
