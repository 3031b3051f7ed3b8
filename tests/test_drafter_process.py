"""A drafter in a process of its own (actor/drafter_process.py): the same drafts as in the engine's process, calls in
order, histories sent once, and every way the child can fail raised in the engine's process as an error."""

import gc
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from actor.drafter_process import MAX_QUEUED, start_drafter_process
from drafters.base import CompositeDrafter, Drafter, DraftRequest, prepares_ahead


class Recorder(Drafter):
    """Drafts what it saw of each request (history length, its sum mod 997, unverified tokens) and what it heard
    since (commits, removals, policies), to check the child gets the engine's requests and calls as sent."""

    def __init__(self, fail: str = ""):
        if fail == "build":
            raise ValueError("no weights here")
        if fail == "slow_build":
            time.sleep(60)
        self.fail, self.heard, self.told = fail, [], 0

    def propose(self, requests, k):
        if self.fail == "propose":
            raise ValueError("bad draft")
        if self.fail == "exit":
            os._exit(3)
        if self.fail == "unpicklable":
            return [[lambda: 1] for _ in requests]
        if self.fail == "lazy":  # read into lists in the child, as the engine's process reads them in-process
            return [(t for t in range(9)) for _ in requests]
        assert all(not r.token_ids.flags.writeable and r.token_ids.dtype.kind == "i" for r in requests)
        self.told = len(self.heard)
        answer = [[len(r.token_ids), int(np.sum(r.token_ids)) % 997, r.unverified, self.told] for r in requests]
        self.heard.clear()
        return answer

    def commit(self, request_id, committed):
        if self.fail == "commit":
            raise KeyError(request_id)
        self.heard.append(("commit", request_id, tuple(committed)))

    def remove(self, request_id):
        self.heard.append(("remove", request_id))

    def new_policy(self, version):
        self.heard.append(("policy", version))

    def propose_ahead(self, requests, k):  # (nothing prepared: no confidences asked)
        if self.fail == "hang":
            threading.Event().wait()
        return None

    def confidences(self):
        if self.fail == "ahead":
            raise RuntimeError("nothing proposed yet")
        return [[0.5] * 4] if self.told == 0 else None


def request(rid: str, tokens, unverified: int = 0) -> DraftRequest:
    array = np.asarray(tokens, dtype=np.int64)
    array.flags.writeable = False
    return DraftRequest(rid, seed=1, position=len(tokens), token_ids=array, unverified=unverified)


def recorder(**options) -> Drafter:
    return start_drafter_process(f"{__name__}.Recorder", options, "cpu")


def test_the_stand_in_is_named_and_kinded_as_the_plugin():
    drafter = recorder()
    assert type(drafter).__name__ == "Recorder" and prepares_ahead(drafter) and prepares_ahead(Recorder)
    assert not isinstance(drafter, CompositeDrafter) and not drafter.prepares_rejections


def test_histories_cross_once_and_the_child_sees_each_whole():
    drafter = recorder()
    history = list(range(3, 40))
    assert drafter.propose([request("a", history)], 4) == [[37, sum(history) % 997, 0, 0]]
    assert drafter.propose([request("a", history)], 4) == [[37, sum(history) % 997, 0, 0]]  # nothing new sent
    history += [5, 6]
    drafter.commit("a", [5, 6])
    drafter.new_policy(2)
    assert drafter.propose([request("a", history)], 4) == [[39, sum(history) % 997, 0, 2]]
    assert drafter.link.known == {"a": (39, 6)}
    ahead = history + [8, 9]  # two drafts under verification: not the child's history
    assert drafter.propose([request("a", ahead, unverified=2), request("b", [1, 2])], 4) == \
        [[41, sum(ahead) % 997, 2, 0], [2, 3, 0, 0]]
    assert drafter.link.known == {"a": (39, 6), "b": (2, 2)}
    history += [7]  # committed: 7, not the drafts 8, 9
    assert drafter.propose([request("a", history)], 4) == [[40, sum(history) % 997, 0, 0]]
    drafter.remove("a")
    assert drafter.link.known == {"b": (2, 2)}
    assert drafter.propose([request("a", [4, 4])], 4) == [[2, 8, 0, 1]]  # the removal heard; a new history


def test_a_history_that_shrinks_or_changes_is_sent_whole_again():
    drafter = recorder()
    for tokens in ([1, 2, 3, 4, 5], [1, 2, 3], [1, 2, 3, 50, 51], [9, 9, 9, 9, 9, 6], [9, 9, 9, 9, 9, 6, 7]):
        assert drafter.propose([request("a", tokens)], 4)[0][:2] == [len(tokens), sum(tokens) % 997]


def test_queued_calls_go_in_order_and_in_bounded_batches():
    drafter = recorder()
    for i in range(MAX_QUEUED + 5):
        drafter.commit("a", [i])
    assert len(drafter.link.queued) == 5  # the first MAX_QUEUED went on their own
    assert drafter.propose([request("a", [1])], 4)[0][3] == MAX_QUEUED + 5


def test_confidences_come_back_with_their_proposal():
    drafter = recorder()
    drafter.propose([request("a", [1, 2])], 4)
    assert drafter.confidences() == [[0.5] * 4]
    drafter.commit("a", [3])
    drafter.propose([request("a", [1, 2, 3])], 4)
    assert drafter.confidences() is None


@pytest.mark.parametrize("fail, said", [("propose", re.escape("propose: ValueError: bad draft")),
                                        ("commit", re.escape("commit: KeyError: 'a'")),  # queued: raised by the next
                                        ("unpicklable", "propose: .*Can't pickle"),
                                        ("exit", re.escape("the drafter's process ended (exit code 3) during propose"))])
def test_what_goes_wrong_in_the_child_is_raised_here(fail, said):
    drafter = recorder(fail=fail)
    drafter.commit("a", [1])
    with pytest.raises(RuntimeError, match=said):
        drafter.propose([request("a", [1, 2])], 4)


def test_answers_are_read_as_in_the_engines_process():
    assert recorder(fail="lazy").propose([request("a", [1])], 4) == [[0, 1, 2, 3]]  # a generator, cut at k
    assert recorder(fail="ahead").propose_ahead([request("a", [1])], 4) is None  # nothing prepared: no confidences


def test_a_constructor_past_its_deadline_is_refused_and_its_process_ends(monkeypatch):
    started = []

    class Started(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(subprocess, "Popen", Started)
    with pytest.raises(TimeoutError, match="its constructor had not returned after 3 s"):
        start_drafter_process(f"{__name__}.Recorder", {"fail": "slow_build"}, "cpu", 3.0)
    assert started[0].poll() == -9  # ended, not left to spin beside the engine


def test_a_constructor_that_raises_is_raised_here_and_its_process_ends():
    with pytest.raises(RuntimeError, match="build: ValueError: no weights here"):
        recorder(fail="build")
    with pytest.raises(RuntimeError, match="drafter 'nowhere.Nothing': cannot import"):
        start_drafter_process("nowhere.Nothing", {}, "cpu")


def test_the_child_ends_with_its_stand_in():
    drafter = recorder()
    process = drafter.link.process
    del drafter
    gc.collect()
    assert process.wait(timeout=10) == 0


def test_a_drafter_stuck_preparing_ahead_holds_up_neither_the_engines_exit_nor_its_own_end():
    """The engine's process ends while its drafter's thread waits on a child stuck in propose_ahead: the process
    exits (the thread is a daemon: a pool's worker would be joined for ever), and the child is ended with it."""
    script = (f"from actor.draft_ahead import DraftsAhead\n"
              f"from actor.drafter_process import start_drafter_process\n"
              f"drafter = start_drafter_process('{__name__}.Recorder', {{'fail': 'hang'}}, 'cpu')\n"
              f"print(drafter.link.process.pid, flush=True)\n"
              f"DraftsAhead().launch([], lambda: drafter.propose_ahead([], 5))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
    engine = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert engine.returncode == 0, engine.stderr
    child = int(engine.stdout.split()[0])
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and os.path.exists(f"/proc/{child}") and not zombie(child):
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{child}") or zombie(child)


def zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def same_confidences(remote, local):
    """To float32 rounding: the child's math library may sum in another order (its own thread count)."""
    theirs, ours = remote.confidences(), local.confidences()
    assert [len(c) for c in theirs] == [len(c) for c in ours]
    assert sum(theirs, []) == pytest.approx(sum(ours, []), rel=1e-4, abs=1e-5)


def test_a_draft_lm_in_a_process_drafts_what_it_drafts_in_the_engines():
    """Drafts, confidences and proposals ahead (outcomes past accepted and rejected drafts, second guesses) over
    steps that commit, leave and come back: exactly the in-process draft LM's."""
    from actor.draft_ahead import ahead
    from drafters.draft_lm import DraftLM

    remote, local = start_drafter_process("draft_lm", {}, "cpu"), DraftLM()
    assert type(remote).__name__ == "DraftLM" and prepares_ahead(remote) and remote.prepares_guesses
    rng = np.random.default_rng(0)
    histories = {f"r{i}": list(rng.integers(3, 50, 30 + i)) for i in range(6)}
    for step in range(4):
        requests = [DraftRequest(r, seed=i, position=len(h) - 30, token_ids=np.array(h), max_tokens=4,
                                 temperature=(0.0, 0.7, 1.0)[i % 3], top_p=(1.0, 0.9, 1.0)[i % 3])
                    for i, (r, h) in enumerate(histories.items())]
        drafts = local.propose(requests, 4)
        assert remote.propose(requests, 4) == drafts
        same_confidences(remote, local)
        outcomes = ahead([(r, drafts[n], j, g) for n, r in enumerate(requests) for j in range(len(drafts[n]) + 1)
                          for g in (0, 1)], 5)
        assert remote.propose_ahead(outcomes, 5) == local.propose_ahead(outcomes, 5)
        same_confidences(remote, local)
        for n, (rid, history) in enumerate(histories.items()):
            committed = drafts[n][:2] + [7]
            history += committed
            local.commit(rid, committed)
            remote.commit(rid, committed)
        if step == 1:
            local.remove("r0")
            remote.remove("r0")
            del histories["r0"]


def test_a_drafter_switched_off_takes_its_process_with_it():
    """The bridge switches off a drafter whose call raised; a child that is stuck or spinning would otherwise hold
    the core the engine leaves for as long as the engine runs."""
    from tests.plugin_contracts.test_drafter_bridge import bridge, propose

    drafter = recorder(fail="propose")
    b, _ = bridge(drafter, ["a-x", "b-y"], planning=False)
    assert propose(b, [[5], [6]]) == [[], []] and "bad draft" in b.failure
    assert drafter.link.process.wait(timeout=10) == -9


def test_an_endless_answer_is_read_in_the_drafters_process_one_proposal_past_what_was_asked_for():
    """The drafter's process reads a plugin's answer into lists before sending it: an endless generator is read one
    proposal (and confidence list) past the requests, which the engine's process then refuses, not until the host's
    memory is full."""
    import itertools

    from actor.drafter_process import proposed

    class Endless:
        def confidences(self):
            return itertools.repeat([0.5])

    answer, confidences, _ = proposed(Endless(), itertools.repeat(itertools.repeat(7)), 4, 2)
    assert answer == [[7, 7, 7, 7]] * 3 and confidences == [[0.5]] * 3

