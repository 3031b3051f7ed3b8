"""What the drafter bridge (actor/draft_bridge.py) shows a drafter plugin and checks of each call into it: histories
as read-only views of copies, never of the engine's buffer (`Histories`); that the call left torch's process-wide
settings as it found them and raised no exit (`guarded`), that its proposals are integer ids within the vocabulary
and its confidences numbers, one per draft token, read into plain lists inside the guarded call (`plain_answers`:
lazy code behind an answer runs under the same checks), and that a composite's reports
what a trajectory can carry (`sources_within`, `labels_within`). A call that fails a check switches the drafter
off; drafts only ever save time, so the engine decodes on without it. A call that never returns is found instead:
the constructor's by its deadline (`built_within`), any other by which call the engine's thread is in and since
when (`CallWatch`)."""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from functools import reduce
from itertools import islice
from typing import Any

import numpy as np
import torch

from drafters.base import Drafter, described, is_ctrl_c, printable
from transport.messages import MAX_DRAFTERS, MAX_NAME


def _flag(module, name: str):
    return (lambda: getattr(module, name)), (lambda value: setattr(module, name, value))


# the largest label count one `member_labels()` report may give (a proposal's tokens are far fewer): a request's sums
# over its reports stay within msgpack's integers, which the actor's stats travel in
MAX_COUNT = 2**31 - 1
# The process-wide torch settings a drafter shares with the target it runs beside, each able to change the target's
# logits or kernels: (what it is, how to read it, how to set it back). torch's per-backend fp32 precisions come before
# `get_float32_matmul_precision`, which raises while they disagree: setting them back first makes it readable again.
FP32_PRECISIONS = [(f"torch.backends.{path}.fp32_precision", *_flag(reduce(getattr, path.split("."), torch.backends),
                                                                     "fp32_precision"))
                   for path in ("cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")]
SHARED_STATE = [
    ("torch.get_num_threads()", torch.get_num_threads, torch.set_num_threads),
    ("torch.get_default_dtype()", torch.get_default_dtype, torch.set_default_dtype),
    ("torch.get_default_device()", torch.get_default_device, torch.set_default_device),
    ("torch.are_deterministic_algorithms_enabled() and its warn_only",
     lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
     lambda both: torch.use_deterministic_algorithms(both[0], warn_only=both[1])),
    *FP32_PRECISIONS,
    ("torch.get_float32_matmul_precision()", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    ("torch.is_grad_enabled()", torch.is_grad_enabled, torch.set_grad_enabled),
    ("torch.backends.mkldnn.enabled", *_flag(torch.backends.mkldnn, "enabled")),
    ("torch.backends.cuda.matmul.allow_tf32", *_flag(torch.backends.cuda.matmul, "allow_tf32")),
    ("torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
     *_flag(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction")),
    ("torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
     *_flag(torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction")),
    ("torch.backends.cudnn.allow_tf32", *_flag(torch.backends.cudnn, "allow_tf32")),
    ("torch.backends.cudnn.benchmark", *_flag(torch.backends.cudnn, "benchmark")),
    ("torch.backends.cudnn.deterministic", *_flag(torch.backends.cudnn, "deterministic")),
    *((f"torch.is_autocast_enabled({device!r})", lambda device=device: torch.is_autocast_enabled(device),
       lambda on, device=device: torch.set_autocast_enabled(device, on)) for device in ("cpu", "cuda")),
    *((f"torch.get_autocast_dtype({device!r})", lambda device=device: torch.get_autocast_dtype(device),
       lambda dtype, device=device: torch.set_autocast_dtype(device, dtype)) for device in ("cpu", "cuda")),
]


def _read(get: Callable[[], Any]) -> Any:
    """A setting's value, or what reading it raised (as a string: it compares, and is never set back)."""
    try:
        return get()
    except Exception as e:  # noqa: BLE001 -- e.g. get_float32_matmul_precision while the backends disagree
        return f"unreadable: {type(e).__name__}: {e}"


class Histories:
    """Each drafting request's history as drafters see it: a copy of the engine's, kept per request and extended by
    what the request committed since it was last shown; `DraftRequest.token_ids` is a read-only view of it. The
    engine's own token buffer never reaches a plugin: one that makes its view writable (`torch.from_numpy`, the
    `writeable` flag, `.base`) writes into this copy, which misleads only its own drafts, never the tokens."""

    def __init__(self):
        self.copies: dict[str, tuple[np.ndarray, int]] = {}  # per request: its copy (grown by doubling), its length

    def view(self, request_id: str, history: np.ndarray) -> np.ndarray:
        """A read-only view of the copy of `history` (the engine's, of request `request_id`)."""
        copy, copied = self.copies.get(request_id, (None, 0))
        n = len(history)
        if copied > n or (copied and copy[copied - 1] != history[copied - 1]):  # not what was copied: copy it all
            copied = 0
        if copy is None or len(copy) < n:
            grown = np.empty(max(2 * n, 64), dtype=history.dtype)
            if copied:
                grown[:copied] = copy[:copied]
            copy = grown
        copy[copied:n] = history[copied:n]
        self.copies[request_id] = (copy, n)
        view = copy[:n]
        view.flags.writeable = False
        return view

    def drop(self, request_id: str) -> None:
        self.copies.pop(request_id, None)


def built_within(build: Callable[[], Drafter], deadline_s: float | None) -> Drafter:
    """`build()` (the plugin's constructor) on a thread of its own, waited for `deadline_s` seconds (None: for ever).
    A constructor that never returns (a download without a timeout, a lock) cannot be interrupted: it is left
    running, and the drafter is refused with a TimeoutError (the engine then decodes plainly)."""
    built: dict[str, Any] = {}

    def run() -> None:
        try:
            built["drafter"] = build()
        except BaseException as e:  # noqa: BLE001 -- handed to the engine's thread, which judges it
            built["error"] = e

    thread = threading.Thread(target=run, name="drafter-build", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        raise TimeoutError(f"its constructor had not returned after {deadline_s:g} s")
    error = built.get("error")
    if error is not None and not isinstance(error, Exception):  # an exit: the plugin's error like any other
        raise RuntimeError(f"its constructor raised {described(error)}") from error
    if error is not None:
        raise error
    return built["drafter"]


class CallWatch:
    """Which of the drafter's hooks the engine's thread is in, and since when. A call that never returns cannot be
    interrupted: it stalls its actor, which the driver takes for hung; first it asks `stuck` from another thread, and
    the actor's replacements start with the drafter switched off (driver/rollouts.py)."""

    def __init__(self):
        self.call: tuple[str, float] | None = None  # the hook and when it began (one object: read whole elsewhere)

    @contextmanager
    def running(self, hook: str):
        self.call = (hook, time.monotonic())
        try:
            yield
        finally:
            self.call = None

    def stuck(self, after_s: float) -> str:
        """The call running for more than `after_s` seconds, said as a reason (\"\": none)."""
        call = self.call
        seconds = time.monotonic() - call[1] if call else 0.0
        return f"its {call[0]} call had not returned after {seconds:.0f} s" if call and seconds > after_s else ""


@contextmanager
def guarded(drafter: Drafter | str):
    """Runs a drafter's call (`drafter`: it, or the name of one being built) and checks that it left torch's
    process-wide settings (SHARED_STATE) as it found them: one it changed is set back at once, and the call raises
    (the bridge then switches the drafter off). Whatever a plugin raises is its error, `SystemExit`, `GeneratorExit`,
    a `CancelledError` or a `BaseException` of its own included; only a `KeyboardInterrupt` on the main thread (a real
    Ctrl-C) passes."""
    before = [_read(get) for _, get, _ in SHARED_STATE]
    try:
        yield
    except Exception:
        raise
    except BaseException as e:
        if is_ctrl_c(e):
            raise
        raise RuntimeError(f"drafter {_name(drafter)} raised {described(e)}") from e
    finally:
        changed = []
        for (name, get, put), value in zip(SHARED_STATE, before):  # in order: each read after those before it are back
            if _read(get) != value:
                changed.append(name)
                if not (isinstance(value, str) and value.startswith("unreadable: ")):
                    put(value)
    if changed:
        raise RuntimeError(f"drafter {_name(drafter)} changed {', '.join(changed)}, which the target shares "
                           "(set back; drafters/base.py: a drafter leaves process-wide state as it found it)")


def _name(drafter: Drafter | str) -> str:
    return drafter if isinstance(drafter, str) else type(drafter).__name__


TEXT = (str, bytes, bytearray)


def plain_answers(proposals, confidences, budgets: list[int], vocab_size: int, drafter: str
                  ) -> tuple[list[list[int] | None], list[list[float] | None] | None]:
    """A drafter's proposals (and confidences) for requests allowed `budgets` tokens, read into plain lists: call it
    inside the drafter's `guarded` call, since reading them runs the plugin's code (a generator, a list subclass, an
    id's `__index__`). Per request: its ids cut to its budget, or None where they are not ids of the vocabulary (no
    drafts for it this step); its confidences, one float per id kept (`confidences_for`)."""
    proposals = list(islice(proposals, len(budgets) + 1))  # (an endless iterator: one too many is enough to refuse)
    confidences = None if confidences is None else list(islice(confidences, len(budgets) + 1))
    if len(proposals) != len(budgets) or (confidences is not None and len(confidences) != len(budgets)):
        raise RuntimeError(f"drafter {drafter} returned {len(proposals)} proposals and "
                           f"{'no' if confidences is None else len(confidences)} confidence lists for {len(budgets)} "
                           "requests (drafters/base.py: one of each per request)")
    ids = [token_ids_within(p, budget, vocab_size) for p, budget in zip(proposals, budgets)]
    if confidences is None:
        return ids, None
    return ids, [None if c is None or i is None else confidences_for(c, len(i), drafter)
                 for i, c in zip(ids, confidences)]


def confidences_for(values, tokens: int, drafter: str) -> list[float]:
    """A plugin's confidences for a proposal of `tokens` tokens as floats in [0, 1] (NaN counts as 0)."""
    try:
        if isinstance(values, TEXT):
            raise TypeError("text is no number")  # (float() would parse it)
        values = list(islice(values, tokens))
        if any(isinstance(v, TEXT) for v in values):
            raise TypeError("text is no number")
        floats = list(map(float, values))
    except (TypeError, ValueError) as e:
        raise RuntimeError(f"drafter {drafter}: confidences must be numbers, got {values!r:.200}") from e
    if len(floats) < tokens:
        raise RuntimeError(f"drafter {drafter}: {len(floats)} confidences for a proposal of {tokens} tokens "
                           "(drafters/base.py: one per draft token)")
    return [v if 0.0 <= v <= 1.0 else (1.0 if v > 1.0 else 0.0) for v in floats]  # NaN fails every comparison: 0


def token_ids_within(proposal, budget: int, vocab_size: int) -> list[int] | None:
    """The first `budget` tokens of `proposal` as plain ints when every one is an integer id in [0, vocab_size) (the
    rest is never read); None otherwise."""
    try:
        tokens = list(islice(proposal, max(budget, 0)))
        ids = list(map(operator.index, tokens))
    except TypeError:
        return None
    if any(type(t) is bool for t in tokens):  # (operator.index takes True for 1)
        return None
    return ids if not ids or (min(ids) >= 0 and max(ids) < vocab_size) else None


def _plain_names(names: list, seen: set[str], drafter: str, where: str) -> list[str] | None:
    """Member names as `SpecStats` carries them: each a plain string (a subclass's characters, whatever its methods
    say), escaped for UTF-8, of at most MAX_NAME characters; None if one is not. They join `seen`, the names of the
    engine's life, and more than MAX_DRAFTERS of those raise, naming `where` they came from."""
    plain = [printable(str.__str__(n)) for n in names if isinstance(n, str)]
    if len(plain) != len(names) or any(len(n) > MAX_NAME for n in plain):
        return None
    seen.update(n for n in plain if n)  # ("": none drafted, in `sources()`; never a key of `SpecStats`)
    if len(seen) > MAX_DRAFTERS:
        raise RuntimeError(f"drafter {drafter}: more than {MAX_DRAFTERS} member names in {where}")
    return plain


def sources_within(names, requests: int, seen: set[str], drafter: str) -> list[str]:
    """A composite's `sources()`: one member name per request (`_plain_names`), as `SpecStats.drafter_choices`
    carries them."""
    names = list(islice(names, requests + 1))
    plain = _plain_names(names, seen, drafter, "sources()") if len(names) == requests else None
    if plain is None:
        raise RuntimeError(f"drafter {drafter}: sources() must name one member per request as a string of at most "
                           f"{MAX_NAME} characters, got {names!r:.200}")
    return plain


def labels_within(labels, known: set[str], seen: set[str], drafter: str) -> dict[str, dict[str, tuple[int, int]]]:
    """A composite's `member_labels()`, for the requests the engine holds (`known`): per member name
    (`_plain_names`, not empty) two counts, each within 0..MAX_COUNT."""
    checked = {}
    try:
        for request_id, members in labels.items():
            pairs = {name: (operator.index(a), operator.index(r)) for name, (a, r) in members.items()}
            plain = _plain_names(list(pairs), seen, drafter, "member_labels()")
            if plain is None or "" in plain or not all(0 <= c <= MAX_COUNT for p in pairs.values() for c in p):
                raise TypeError(f"member names must be strings, not empty, and counts within 0..{MAX_COUNT}")
            if request_id in known:
                checked[request_id] = dict(zip(plain, pairs.values()))
    except (AttributeError, TypeError, ValueError) as e:
        raise RuntimeError(f"drafter {drafter}: member_labels() must map request ids to member names to two counts "
                           f"(drafters/base.py): {described(e)}") from e
    return checked
