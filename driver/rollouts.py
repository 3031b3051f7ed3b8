"""The rollout actors of a run as Ray actors, each generating until stopped; one that dies is replaced and its
unfinished groups are re-issued (learner rank 0 forgets their partial trajectories and names where the
replacement starts; the replacement catches up to the newest weights before it admits a prompt). One that rank 0
has not heard from for `rollout.stall_timeout_s` while it waits for groups, or whose run loop (asked over Ray) has
not turned that long, is taken for hung and killed first; if
its engine was stuck in a call of the drafter plugin (which nothing can interrupt), its replacements decode without
the drafter, same tokens, and every trajectory says why."""

from __future__ import annotations

import sys
import time

import ray
from omegaconf import DictConfig

from actor.engine import engine_preload
from actor.rollout import RolloutActor
from driver.learners import LearnerGroup
from driver.placement import reserve, slot
from tasks.schedule import CursorPlan
from transport.auth import ClientKeys, keypair


CATCH_UP_S = 900  # a replacement's engine start and first weights (a large checkpoint takes minutes to load)
GAP_CHECK_S = 5.0  # how often, while waiting on the learner, the driver asks rank 0 for lost trajectories
ASK_ACTOR_S = 5.0  # how long an actor has to answer the driver's questions (its sent count, a stuck drafter call)
ASK = "questions"  # the actors' Ray concurrency group for the driver's questions
# a drafter call this old in an actor taken for hung is why (a healthy one takes milliseconds to seconds); its silence
# itself is no measure, as it counts from before the engine started
STUCK_CALL_S = 30.0


class RolloutPool:
    def __init__(self, cfg: DictConfig, model_dir: str, learners: LearnerGroup, version: int, plan: CursorPlan,
                 num_gpus: int, earlier_restarts: int = 0, drafters_off: dict[int, str] | None = None):
        """`earlier_restarts`: actor replacements before this pool (a learner restart starts a new one), counted
        against `rollout.max_restarts`, which holds per run; `drafters_off`: actors whose drafter hung an engine
        before this pool, and why (they start without it)."""
        self.cfg, self.model_dir, self.learners, self.version, self.plan = cfg, model_dir, learners, version, plan
        self.allowed = cfg.rollout.max_restarts - earlier_restarts
        # threads: run(), stop() or a replacement's wait_for_version(), evaluations waiting on run(); and apart, so
        # that evaluations left waiting never hold them up, the driver's questions (`ASK`: turns, sent, stuck_drafter)
        self.cls = ray.remote(num_cpus=1, num_gpus=num_gpus, max_concurrency=4,
                              concurrency_groups={ASK: 3})(RolloutActor)
        self.restarts = 0
        self.drafters_off = dict(drafters_off or {})  # actor -> why its replacements run without the drafter (it hung)
        self.group = reserve(cfg, "rollout")  # a bundle per actor, on the rollout nodes; its replacements take it
        self.actors = [self.spawn(i, first_ordinal=0) for i in range(cfg.rollout.num_actors)]
        self.runs = [a.run.remote() for a in self.actors]
        self.turned: dict[int, tuple[int, float]] = {}  # actor -> its run loop's turns when last asked, since when

    def spawn(self, i: int, first_ordinal: int):
        name = f"rollout-{i}" if self.restarts == 0 else f"rollout-{i}-r{self.restarts}"
        keys = None
        if self.learners.server_public is not None:  # a key of its own, admitted as actor-<i> (the last one revoked)
            keys = ClientKeys(keypair(), self.learners.server_public)
            self._ask(self.learners.rank0.admit, f"actor-{i}", keys.own.public)
        group = None  # transport.weights nccl: a weight-sync group of its own with rank 0 (the last one closed)
        if self.cfg.transport.weights.value == "nccl":
            group = self._ask(self.learners.rank0.open_weight_group, i, self.restarts)
        preload = engine_preload(self.cfg.cluster.device)  # its engine's allocator (actor/engine.py)
        return self.cls.options(name=name, scheduling_strategy=slot(self.group, i),
                                runtime_env={"env_vars": {"LD_PRELOAD": preload}} if preload else None).remote(
            self.cfg, i, self.model_dir, self.learners.trajectory_endpoint, self.learners.weight_endpoint,
            self.version, self.plan, first_ordinal, incarnation=self.restarts, keys=keys, weight_group=group,
            drafter_off=self.drafters_off.get(i, ""))

    def wait(self, refs: list[ray.ObjectRef], timeout_s: float = 0.0) -> list:
        """`ray.get(refs)`, replacing every rollout actor that stops meanwhile; the first error among `refs` is raised
        as soon as it happens (a failed learner rank would otherwise leave the others waiting in a collective), and a
        `TimeoutError` once `timeout_s` (0: none) passes without them, or when rank 0 does not answer its
        bookkeeping calls within `trainer.step_timeout_s` (a stopped process)."""
        pending, deadline = list(refs), time.monotonic() + timeout_s if timeout_s > 0 else None
        while pending:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no answer within {timeout_s:g} s")
            ready = ray.wait([*pending, *self.runs], num_returns=1, timeout=GAP_CHECK_S)[0]
            if not ready:  # meanwhile: an actor whose trajectories were lost regenerates the groups they belonged to
                sent = self._sent(self._ask(self.learners.rank0.claims))
                for i, first_ordinal in self._ask(self.learners.rank0.take_gaps, sent).items():
                    print(f"rollout actor {i} lost trajectories; it generates again from data cursor "
                          f"{self.plan.cursor(i, first_ordinal)}", file=sys.stderr)
                    self.actors[i].rewind.remote(first_ordinal)
                self.stop_silent()
                continue
            ready = ready[0]
            if ready in pending:
                ray.get(ready)
                pending.remove(ready)
            else:
                self.replace(self.runs.index(ready))
        return ray.get(refs)

    def stop_silent(self) -> None:
        """Kills every actor rank 0 has heard nothing from for `rollout.stall_timeout_s` while it waits for groups
        (a hung engine, a stopped process), whose run loop has not turned that long (asked over Ray: a peer holding
        the actor's key can speak for it to rank 0, never to the driver), or that has not spoken at all, or answered
        the driver, within `rollout.start_timeout_s` (an engine that never finishes starting), and replaces it at
        once like a dead one (not when its run ref next resolves: the call waiting on groups may return first, and
        the next call find a step's actor missing)."""
        rank0, r = self.learners.rank0, self.cfg.rollout
        if r.stall_timeout_s > 0 or r.start_timeout_s > 0:
            self._ask_turns()
        for key, limit, silences, what in [
                ("stall_timeout_s", r.stall_timeout_s, lambda: self._ask(rank0.silences), "sent nothing"),
                ("stall_timeout_s", r.stall_timeout_s, self._stalled, "made no progress"),
                ("start_timeout_s", r.start_timeout_s, lambda: self._ask(rank0.unstarted), "never spoke"),
                ("start_timeout_s", r.start_timeout_s, self._unanswered, "never answered")]:
            if limit <= 0:
                continue
            for i, silent in silences().items():
                if silent > limit:
                    print(f"rollout actor {i} {what} for {silent:.0f} s (rollout.{key} = {limit:g}): taken for hung "
                          "and stopped", file=sys.stderr)
                    self._stuck_drafter(i, min(STUCK_CALL_S, limit / 2))
                    ray.kill(self.actors[i])
                    self.replace(i)

    def _stuck_drafter(self, i: int, after_s: float) -> None:
        """Asks silent actor `i` whether its engine is in a drafter call older than `after_s`: if so, its
        replacements start with the drafter switched off (drafts only save time), rather than hang the same way."""
        try:
            stuck = ray.get(self.actors[i].stuck_drafter.options(concurrency_group=ASK).remote(after_s),
                            timeout=ASK_ACTOR_S)
        except ray.exceptions.RayError:  # no answer: it stopped, or is stuck elsewhere
            return
        if stuck:
            self.drafters_off[i] = f"{stuck} on actor {i}, which was taken for hung and replaced"
            print(f"rollout actor {i}'s drafter is stuck ({stuck}): its replacements decode without it",
                  file=sys.stderr)

    def _ask(self, method, *args):
        """Rank 0's answer to a bookkeeping call: a `GetTimeoutError` (a TimeoutError) if it gives none within
        `trainer.step_timeout_s`."""
        return ray.get(method.remote(*args), timeout=self.cfg.trainer.step_timeout_s or None)

    def _ask_turns(self) -> None:
        """Asks every actor at once how far its run loop has turned (`turns`: over Ray, which a peer holding its key
        cannot answer for), noting when each answer last changed, or when an actor that never answered was first
        asked; one that does not answer in `ASK_ACTOR_S` (stopped, or dead and about to be replaced) has not turned."""
        asked = {i: actor.turns.options(concurrency_group=ASK).remote() for i, actor in enumerate(self.actors)}
        answered = set(ray.wait(list(asked.values()), num_returns=len(asked), timeout=ASK_ACTOR_S)[0])
        now = time.monotonic()
        for i, ref in asked.items():
            try:
                turns = ray.get(ref) if ref in answered else None
            except ray.exceptions.RayError:
                turns = None
            if turns is not None and self.turned.get(i, (None,))[0] != turns:
                self.turned[i] = (turns, now)
            elif i not in self.turned:  # asked for the first time, and no answer yet
                self.turned[i] = (None, now)

    def _stalled(self) -> dict[int, float]:
        """Seconds since each actor that has answered `_ask_turns` last turned."""
        now = time.monotonic()
        return {i: now - since for i, (turns, since) in self.turned.items() if turns is not None}

    def _unanswered(self) -> dict[int, float]:
        """Seconds each actor that has never answered `_ask_turns` has been asked (an engine still starting, or one
        that never will, however often a peer holding its key speaks for it to rank 0)."""
        now = time.monotonic()
        return {i: now - since for i, (turns, since) in self.turned.items() if turns is None}

    def _sent(self, claimed: dict[int, int]) -> dict[int, int]:
        """How many messages each actor whose heartbeat claims lost trajectories says it sent, asked over Ray (which
        a peer holding the actor's key cannot speak for); an actor that does not answer in `ASK_ACTOR_S` (dead,
        replaced, busy) is left out, its claim left standing."""
        sent = {}
        for i in claimed:
            try:
                sent[i] = ray.get(self.actors[i].sent.options(concurrency_group=ASK).remote(), timeout=ASK_ACTOR_S)
            except ray.exceptions.RayError:
                continue
        return sent

    def replace(self, i: int) -> None:
        """Replaces actor `i`, which stopped: a replacement that dies or does not catch up within `CATCH_UP_S` is
        replaced in turn, while `rollout.max_restarts` allows."""
        try:
            ray.get(self.runs[i])
            error = "its run() returned"
        except Exception as e:  # noqa: BLE001 -- any failure of the actor is handled the same way
            error = one_line(e)
        self.turned.pop(i, None)
        while True:
            if self.restarts >= self.allowed:
                raise RuntimeError(f"rollout actor {i} stopped ({error}) after "
                                   f"{self.cfg.rollout.max_restarts - self.allowed + self.restarts} restarts in this "
                                   "run (rollout.max_restarts)")
            self.restarts += 1
            ray.kill(self.actors[i])
            first_ordinal = self._ask(self.learners.rank0.reissue, i, self.restarts)
            self.actors[i] = actor = self.spawn(i, first_ordinal)
            try:
                target = self.catch_up(actor)
                break
            except ray.exceptions.RayError as e:  # it died, or the deadline passed (GetTimeoutError)
                print(f"rollout actor {i} stopped ({error}); replacement {self.restarts} failed to catch up",
                      file=sys.stderr)
                if isinstance(e, ray.exceptions.GetTimeoutError):  # alive: stuck in its drafter, perhaps
                    self._stuck_drafter(i, STUCK_CALL_S)
                error = f"replacement {self.restarts} catching up: {one_line(e)}"
        print(f"rollout actor {i} stopped ({error}); replacement {self.restarts} runs weights v{target} from data "
              f"cursor {self.plan.cursor(i, first_ordinal)}", file=sys.stderr)
        self.runs[i] = actor.run.remote()

    def catch_up(self, actor) -> int:
        """Has a new `actor` start its engine and apply the newest weights (rank 0 re-sends them until it holds
        them: its subscription may miss a send) within `CATCH_UP_S`; returns their version."""
        deadline = time.monotonic() + CATCH_UP_S
        target = self._ask(self.learners.rank0.republish)
        while ray.get(actor.wait_for_version.remote(target, 2.0), timeout=max(0.0, deadline - time.monotonic())) \
                < target:
            target = self._ask(self.learners.rank0.republish)
        return target

    def stop(self, timeout_s: float) -> list[dict]:
        """Each actor's summary or, for one that died (the last failed replacement of a run that ran out of
        `rollout.max_restarts`, say) or does not answer within `timeout_s`, `{"actor": i, "error": ...}`: never
        raised, so that the error that ended the run is the one its console shows last."""
        for a in self.actors:
            a.stop.remote()
        deadline, summaries = time.monotonic() + timeout_s, []
        for i, run in enumerate(self.runs):
            try:
                summaries.append(ray.get(run, timeout=max(0.0, deadline - time.monotonic())))
            except ray.exceptions.RayError as e:
                summaries.append({"actor": i, "error": one_line(e)})
        return summaries


def one_line(e: BaseException) -> str:
    """An actor's failure in one line: the exception its task raised (not Ray's wrapper, whose first line is the
    task's process title), or Ray's own error (the actor died, a timeout); for an actor that died in its creation
    task, Ray's first clause and the last line of the traceback it carries (the error its constructor raised)."""
    if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
        e = e.cause
    lines = [line for line in str(e).splitlines() if line.strip()] or [""]
    if isinstance(e, ray.exceptions.RayActorError) and len(lines) > 1:
        return f"{type(e).__name__}: {lines[0].split(',')[0]}: {lines[-1].strip()}"
    return f"{type(e).__name__}: {lines[0]}"
