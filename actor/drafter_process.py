"""A drafter in a process of its own: decoupled speculation's drafting beside a CPU engine.

A drafting thread in the engine's process shares the interpreter's lock (the GIL) with the engine's thread, which
each take between torch calls: on the 2-core host every millisecond the thread drafts adds about 0.3 ms to the
engine's step, while the same drafting in a process of its own adds a fraction of that (bench/draft_contention.py).
So with `speculation.decoupled` on a CPU engine a plugin with `propose_ahead` is built and called in a child process
(within the constructor's deadline, or the child is ended), and the engine's process holds a stand-in
(`start_drafter_process`): an instance of a class named as the plugin's, with its kind (`prepares_rejections`,
`prepares_guesses`, whether it has `propose_ahead`, whether it is a `CompositeDrafter`), whose every method is the
plugin's, called over a socket. The decoupled thread waits on that socket without the lock.

- A call that answers (`propose`, `propose_ahead`, `swap_weights`, a composite's reports) is one round trip; a
  proposal's answer carries its `confidences()` and (a composite's) `sources()`. Calls that answer nothing (`commit`,
  `remove`, `remember`, `new_policy`) are queued and go, in order, with the next call that answers (or once
  `MAX_QUEUED` are waiting).
- A request's history crosses once: the child keeps each request's committed tokens, and a call sends only what it
  has not seen (and, for a proposal ahead, the unverified drafts and guess); a history that is not the one the child
  holds (shorter, or another last token) is sent whole.
- Messages are pickled by the standard pickler (tensors by value): the child is the engine's own, built from the
  config's drafter name and options. The child exits when the engine's process closes the socket, or dies.
- A proposal is read in the child as the engine's process reads one in-process (into lists, at most k tokens each).
- A child that raises, answers what cannot be pickled or dies makes the call raise RuntimeError saying so (a queued
  call's error is raised by the next call that answers, naming the queued one): the bridge switches the drafter
  off, as it does one that raises in-process, and ends the child; drafts only ever save time.

On a GPU engine the drafter stays in the engine's process and drafts on a CUDA stream of its own
(drafters/draft_lm.py): a child would need a CUDA context and a copy of the weights of its own."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from itertools import islice
from multiprocessing.connection import Connection

import numpy as np

from drafters.base import CompositeDrafter, Drafter, DraftRequest, described, load_drafter, prepares_ahead

MAX_QUEUED = 4096  # calls that answer nothing, queued before they are sent on their own
PROPOSALS = ("propose", "propose_ahead")
REPORTS = ("member_labels", "failures")  # a composite's, asked as calls that answer


def start_drafter_process(path: str, options: dict, device: str, deadline_s: float | None = None) -> Drafter:
    """The drafter `path` built with `options` on `device` in a child process, and its stand-in here. Raises
    RuntimeError with the child's error where its constructor raised, or the process ended before it answered, and
    TimeoutError where it had not answered after `deadline_s` seconds (None: no deadline); the child then ends."""
    ours, theirs = socket.socketpair()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}  # (imports as here)
    process = subprocess.Popen([sys.executable, "-m", "actor.drafter_process", str(theirs.fileno())],
                               pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
    theirs.close()
    link = _Link(Connection(ours.detach()), process)
    try:
        name, rejections, guesses, ahead, composite = link.ask("build", (path, options, device), deadline_s)
    except BaseException:
        link.process.kill()
        link.close()
        raise
    kind = {"prepares_rejections": rejections, "prepares_guesses": guesses, "__module__": __name__}
    if ahead:
        kind["propose_ahead"] = ProcessDrafter._propose_ahead
    drafter = type(name, (ProcessComposite if composite else ProcessDrafter,), kind)(link)
    weakref.finalize(drafter, link.close)  # (the stand-in's end ends the child)
    return drafter


class _Link:
    """The socket to the child and its process: queued calls, round trips, and what the child's histories hold."""

    def __init__(self, connection: Connection, process: subprocess.Popen):
        self.connection, self.process = connection, process
        self.queued: list[tuple[str, tuple]] = []
        # per request, how many committed tokens of its history the child holds, and the last of them
        self.known: dict[str, tuple[int, int]] = {}

    def queue(self, method: str, args: tuple) -> None:
        self.queued.append((method, args))
        if len(self.queued) >= MAX_QUEUED:
            self.ask(None, ())

    def ask(self, method: str | None, args: tuple, deadline_s: float | None = None):
        """Sends the queued calls and `method(*args)` (None: the queued calls only), and returns the answer (waited
        for `deadline_s` seconds at most: None, for ever)."""
        queued, self.queued = self.queued, []
        try:
            self.connection.send_bytes(pickle.dumps((queued, method, args), protocol=pickle.HIGHEST_PROTOCOL))
            answered = deadline_s is None or self.connection.poll(deadline_s)
            status, value = pickle.loads(self.connection.recv_bytes()) if answered else ("", None)
        except (EOFError, OSError) as e:
            raise RuntimeError(f"the drafter's process ended (exit code {self.exit_code()}) during {method}") from e
        if not answered:
            raise TimeoutError(f"its {'constructor' if method == 'build' else method} had not returned after "
                               f"{deadline_s:g} s")
        if status != "ok":
            raise RuntimeError(f"in the drafter's process: {value}")
        return value

    def exit_code(self):
        try:
            return self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return None

    def wire(self, requests: list[DraftRequest]) -> list[tuple]:
        """Each request as sent: its fields, with `token_ids` cut to what the child has not seen of its history."""
        sent = []
        for r in requests:
            committed = len(r.token_ids) - r.unverified
            held, last = self.known.get(r.request_id, (0, 0))
            if held > committed or (held and int(r.token_ids[held - 1]) != last):
                held = 0  # not the history the child holds (shorter, or another): all of it again
            sent.append((r.request_id, r.seed, r.position, r.temperature, r.top_k, r.top_p, r.max_tokens,
                         r.unverified, r.rejected, r.guess, held, np.asarray(r.token_ids[held:]).tolist()))
            self.known[r.request_id] = (committed, int(r.token_ids[committed - 1]) if committed else 0)
        return sent

    def close(self) -> None:
        self.connection.close()  # (the child exits on the closed socket)
        try:
            self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()


class ProcessDrafter(Drafter):
    """The stand-in for a drafter in a child process (`start_drafter_process` names a subclass as the plugin)."""

    def __init__(self, link: _Link):
        self.link = link
        self.last: tuple[list[list[float]] | None, list[str] | None] = (None, None)  # confidences, sources

    def propose(self, requests: list[DraftRequest], k: int) -> list[list[int]]:
        return self._proposal("propose", requests, k)

    def _propose_ahead(self, requests: list[DraftRequest], k: int) -> list[list[int]] | None:
        return self._proposal("propose_ahead", requests, k)

    def _proposal(self, method: str, requests: list[DraftRequest], k: int):
        proposals, *self.last = self.link.ask(method, (self.link.wire(requests), k))
        return proposals

    def confidences(self) -> list[list[float]] | None:
        return self.last[0]

    def commit(self, request_id: str, committed: list[int]) -> None:
        self.link.queue("commit", (request_id, list(committed)))

    def remove(self, request_id: str) -> None:
        self.link.known.pop(request_id, None)
        self.link.queue("remove", (request_id,))

    def remember(self, prompt_ids: list[int], response_ids: list[int], version: int) -> None:
        self.link.queue("remember", (list(prompt_ids), list(response_ids), version))

    def new_policy(self, version: int) -> None:
        self.link.queue("new_policy", (version,))

    def swap_weights(self, weights) -> bool:
        return self.link.ask("swap_weights", (list(weights),))

    def end(self) -> None:
        """Ends the child at once, wherever it is (the bridge switched the drafter off)."""
        self.link.process.kill()
        self.link.process.wait()


class ProcessComposite(ProcessDrafter, CompositeDrafter):
    def member_labels(self):
        return self.link.ask("member_labels", ())

    def failures(self) -> list[str]:
        return self.link.ask("failures", ())

    def sources(self) -> list[str]:
        return self.last[1]


def serve(connection: Connection) -> None:
    """The child's loop: builds the drafter, then runs each message's queued calls and its call, answering it."""
    histories: dict[str, np.ndarray] = {}  # per request, its committed tokens as far as sent

    def request(fields: tuple) -> DraftRequest:
        rid, seed, position, temperature, top_k, top_p, max_tokens, unverified, rejected, guess, held, tail = fields
        tokens = np.asarray(tail, dtype=np.int64)
        if held:
            tokens = np.concatenate([histories[rid][:held], tokens])
        tokens.flags.writeable = False
        histories[rid] = tokens[: len(tokens) - unverified]  # (as the engine's process counts what it sent)
        return DraftRequest(rid, seed, position, tokens, temperature, top_k, top_p, max_tokens, unverified,
                            rejected, guess)

    drafter = None
    while True:
        try:
            queued, method, args = pickle.loads(connection.recv_bytes())
        except (EOFError, OSError):
            return
        called = method  # (the call an error is reported under)
        try:
            if method == "build":
                drafter = load_drafter(*args)
                answer = (type(drafter).__name__, drafter.prepares_rejections, drafter.prepares_guesses,
                          prepares_ahead(drafter), isinstance(drafter, CompositeDrafter))
            for name, queued_args in queued:
                called = name
                if name == "remove":
                    histories.pop(queued_args[0], None)
                getattr(drafter, name)(*queued_args)
            called = method
            if method in PROPOSALS:
                requests, k = args
                answer = proposed(drafter, getattr(drafter, method)([request(r) for r in requests], k), k,
                                  len(requests))
            elif method in REPORTS or method == "swap_weights":
                answer = getattr(drafter, method)(*args)
            elif method is None:
                answer = None
            message = pickle.dumps(("ok", answer), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as e:  # noqa: BLE001 -- the plugin's error (an exit too) is the engine's to judge
            message = pickle.dumps(("error", f"{called}: {described(e)}"))
            if method == "build":
                connection.send_bytes(message)
                return
        connection.send_bytes(message)


def proposed(drafter: Drafter, proposals, k: int, requests: int) -> tuple:
    """A proposal's answer for `requests` requests: the plugin's proposals read into lists (at most `k` tokens each,
    and one proposal past `requests` at most, for the engine's process to refuse: a generator or a lazy sequence is
    read here, as the engine's process reads one in-process), its confidences likewise and a composite's sources;
    (None, None, None) where it proposed nothing ahead."""
    if proposals is None:
        return None, None, None
    proposals = [p if p is None else list(islice(p, k)) for p in islice(proposals, requests + 1)]
    confidences = drafter.confidences()
    if confidences is not None:
        confidences = [c if c is None else list(islice(c, k)) for c in islice(confidences, requests + 1)]
    return proposals, confidences, drafter.sources() if isinstance(drafter, CompositeDrafter) else None


def _exit_with_parent(parent: int) -> None:
    """Ends the child once the engine's process is gone, even where the plugin never returns to read the socket."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the engine's process's to handle; it closes the socket
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    serve(Connection(int(sys.argv[1])))
