"""The rollout pool's supervision with stand-in actors on a real (embedded) Ray: a replacement that dies while it
catches up, or does not catch up in time, is replaced in turn while `rollout.max_restarts` allows; then the run
stops naming the limit. Each replacement re-issues the dead actor's work (rank 0's `reissue`)."""

import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

import driver.rollouts
from configs.load import load_config
from driver.placement import reserve
from driver.rollouts import RolloutPool
from tasks.schedule import CursorPlan

pytestmark = pytest.mark.engine  # each test starts a vLLM engine or a Ray cluster

NEWEST = 3  # the weight version rank 0 holds


class Rank0:
    def __init__(self, never_started: bool = False, heard: bool = False):
        """`heard`: actor 0 is always heard from (a peer holding its key speaks for it)."""
        self.reissued, self.never_started, self.heard = 0, never_started, heard

    def reissue(self, actor: int, incarnation: int) -> int:
        self.reissued += 1
        return 0

    def republish(self) -> int:
        return NEWEST

    def claims(self) -> dict[int, int]:
        return {}

    def take_gaps(self, sent: dict[int, int]) -> dict[int, int]:
        return {}

    def silences(self) -> dict[int, float]:  # actor 0 silent for long, once; its replacement speaks
        return {0: 1000.0} if self.reissued == 0 and not (self.never_started or self.heard) else {0: 0.1}

    def unstarted(self) -> dict[int, float]:  # or: actor 0 never speaks at all, once
        return {0: 1000.0} if self.reissued == 0 and self.never_started else {}

    def count(self) -> int:
        return self.reissued


class StandIn:
    """Takes a RolloutActor's arguments; incarnation `n` behaves as `behaviour[n]` says."""

    def __init__(self, *args, incarnation: int, keys, weight_group, drafter_off: str, behaviour: dict[int, str]):
        self.what = behaviour.get(incarnation, "healthy")
        self.stopping, self.drafter_off = threading.Event(), drafter_off

    def run(self) -> dict:
        if self.what == "fails":
            raise RuntimeError("engine died")
        self.stopping.wait(3600)
        return {"groups": 1}

    def stop(self) -> None:
        self.stopping.set()

    def wait_for_version(self, version: int, timeout_s: float) -> int:
        if self.what == "dies":
            os._exit(1)
        if self.what in ("stalls", "stuck in its drafter while catching up"):
            time.sleep(timeout_s)
            return version - 1
        return version

    def incarnation_behaviour(self) -> str:
        return self.what

    def turns(self) -> int:  # a hung run loop turns no more; an engine that never starts never answers
        if self.what == "never starts":
            self.stopping.wait(3600)
        self.turned = getattr(self, "turned", 0) + (self.what != "hung")
        return self.turned

    def stuck_drafter(self, after_s: float) -> str:
        return "its propose call had not returned after 31 s" if self.what.startswith("stuck in its drafter") else ""

    def why_drafter_off(self) -> str:
        return self.drafter_off


@pytest.fixture(scope="module")
def local_ray():
    here = Path(__file__).resolve().parent  # workers import the stand-ins from this module
    # logical CPUs: every pool keeps its placement bundles (1 CPU per actor) for the module's life
    ray.init(num_cpus=16, include_dashboard=False, configure_logging=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])}})
    yield
    ray.shutdown()


def pool(behaviour: dict[int, str], max_restarts: int, *overrides: str, earlier: int = 0,
         never_started: bool = False, heard: bool = False) -> RolloutPool:
    cfg = load_config("grpo_tiny", [f"rollout.max_restarts={max_restarts}", *overrides])
    p = object.__new__(RolloutPool)  # the pool without a run: its learners and actors are stand-ins
    p.cfg, p.model_dir, p.version, p.plan, p.restarts = cfg, "", 0, CursorPlan(0, 1, 1), 0
    p.allowed, p.drafters_off = max_restarts - earlier, {}
    p.learners = SimpleNamespace(rank0=ray.remote(Rank0).remote(never_started, heard), server_public=None,
                                 trajectory_endpoint="",
                                 weight_endpoint="")
    cls = ray.remote(num_cpus=0.1, max_concurrency=4, concurrency_groups={driver.rollouts.ASK: 3})(StandIn)
    p.cls = SimpleNamespace(options=lambda **kw: SimpleNamespace(
        remote=lambda *a, **k: cls.options(**kw).remote(*a, **k, behaviour=behaviour)))
    p.group = reserve(cfg, "rollout")
    p.actors = [p.spawn(0, first_ordinal=0)]
    p.runs = [p.actors[0].run.remote()]
    p.turned = {}
    return p


def test_a_replacement_that_dies_while_catching_up_is_replaced(local_ray):
    p = pool({0: "fails", 1: "dies"}, max_restarts=3)
    p.replace(0)
    assert p.restarts == 2 and ray.get(p.learners.rank0.count.remote()) == 2
    assert ray.get(p.actors[0].incarnation_behaviour.remote()) == "healthy"
    assert ray.wait(p.runs, timeout=0.5)[0] == []  # the healthy replacement is generating
    ray.kill(p.actors[0])


def test_a_replacement_that_never_catches_up_is_replaced_until_the_limit(local_ray, monkeypatch):
    monkeypatch.setattr(driver.rollouts, "CATCH_UP_S", 3)
    p = pool({0: "fails", 1: "stalls", 2: "stalls"}, max_restarts=2)
    with pytest.raises(RuntimeError, match=r"after 2 restarts in this run \(rollout.max_restarts\)") as e:
        p.replace(0)
    assert "replacement 2 catching up: GetTimeoutError" in str(e.value)
    assert ray.get(p.learners.rank0.count.remote()) == 2
    ray.kill(p.actors[0])


def test_a_replacement_stuck_in_its_drafter_while_catching_up_is_replaced_by_one_without_it(local_ray, monkeypatch):
    monkeypatch.setattr(driver.rollouts, "CATCH_UP_S", 3)
    p = pool({0: "fails", 1: "stuck in its drafter while catching up"}, max_restarts=3)
    p.replace(0)
    assert p.restarts == 2 and ray.get(p.actors[0].why_drafter_off.remote()).startswith("its propose call")
    ray.kill(p.actors[0])


def test_replacements_before_a_learner_restart_count_against_the_runs_limit(local_ray, monkeypatch):
    """rollout.max_restarts holds per run: a pool started after a learner restart has only what is left of it."""
    monkeypatch.setattr(driver.rollouts, "CATCH_UP_S", 3)
    p = pool({0: "fails", 1: "stalls"}, max_restarts=2, earlier=1)
    with pytest.raises(RuntimeError, match=r"after 2 restarts in this run \(rollout.max_restarts\)"):
        p.replace(0)
    assert ray.get(p.learners.rank0.count.remote()) == 1
    ray.kill(p.actors[0])


def test_the_least_stall_timeout_is_several_heartbeats():
    """configs/ cannot import the actor; its floor on `rollout.stall_timeout_s` is written as a number that
    must stay five of the actor's heartbeat periods, or a healthy actor between two heartbeats is taken for hung."""
    from actor.rollout import HEARTBEAT_S
    from configs.schema import STALL_FLOOR_S

    assert STALL_FLOOR_S >= 5 * HEARTBEAT_S


@pytest.mark.parametrize("key,timeout_s,restarts", [("stall_timeout_s", 60, 1), ("stall_timeout_s", 0, 0),
                                                    ("start_timeout_s", 60, 1), ("start_timeout_s", 0, 0)],
                         ids=["hung", "hung-never", "never-started", "never-started-never"])
def test_an_actor_silent_past_its_timeout_is_stopped_and_replaced(local_ray, monkeypatch, key, timeout_s, restarts):
    """While the learner waits, an actor rank 0 has not heard from for `rollout.stall_timeout_s` (a hung engine, a
    stopped process: alive to Ray, so nothing else would notice), or a first actor that has not spoken at all within
    `rollout.start_timeout_s` (an engine that never finishes starting), is killed, then replaced like a dead one."""
    monkeypatch.setattr(driver.rollouts, "GAP_CHECK_S", 0.2)
    p = pool({}, 3, f"rollout.{key}={timeout_s}", never_started=key == "start_timeout_s")
    hung = p.actors[0]
    waiting = ray.remote(num_cpus=0)(lambda: time.sleep(3) or "collected").remote()  # the learner's collect
    assert p.wait([waiting]) == ["collected"]
    assert p.restarts == restarts and ray.get(p.learners.rank0.count.remote()) == restarts
    assert (p.actors[0] is hung) == (restarts == 0)
    assert ray.get(p.actors[0].why_drafter_off.remote()) == ""  # it was not stuck in its drafter
    ray.kill(p.actors[0])


@pytest.mark.parametrize("behaviour,stall", [("hung", 60), ("never starts", 60), ("never starts", 0)])
def test_an_actor_whose_run_loop_stopped_is_replaced_though_rank_0_still_hears_it(local_ray, monkeypatch, behaviour,
                                                                                     stall):
    """A peer holding a hung actor's key can keep rank 0 hearing from it (forged heartbeats); the driver also asks
    the actor itself, over Ray, how far its run loop has turned, and one that has not turned for
    `rollout.stall_timeout_s`, or never answered within `rollout.start_timeout_s`, is replaced all the same."""
    monkeypatch.setattr(driver.rollouts, "GAP_CHECK_S", 0.2)
    monkeypatch.setattr(driver.rollouts, "ASK_ACTOR_S", 0.5)
    p = pool({0: behaviour}, 3, f"rollout.stall_timeout_s={stall}", "rollout.start_timeout_s=60", heard=True)
    hung = p.actors[0]
    assert ray.get(hung.incarnation_behaviour.remote()) == behaviour  # started, answering other questions
    p._ask_turns()
    p.turned[0] = (p.turned[0][0], time.monotonic() - 1000)  # as if asked, or last turned, 1,000 s ago
    assert (p.turned[0][0] is None) == (behaviour == "never starts")
    waiting = ray.remote(num_cpus=0)(lambda: time.sleep(3) or "collected").remote()
    assert p.wait([waiting]) == ["collected"]
    assert p.restarts == 1 and p.actors[0] is not hung  # the replacement turns: kept
    ray.kill(p.actors[0])


def test_an_actor_stuck_in_a_drafter_call_is_replaced_by_one_that_decodes_without_the_drafter(local_ray, monkeypatch):
    """A plugin call that never returns cannot be interrupted; a replacement running the same plugin would hang the
    same way until `rollout.max_restarts` ends the run. The silent actor is asked which call it is stuck in, and
    its replacements start with the drafter switched off (the engine then decodes plainly: drafts only save time)."""
    monkeypatch.setattr(driver.rollouts, "GAP_CHECK_S", 0.2)
    p = pool({0: "stuck in its drafter"}, 3, "rollout.stall_timeout_s=60")
    waiting = ray.remote(num_cpus=0)(lambda: time.sleep(3) or "collected").remote()
    assert p.wait([waiting]) == ["collected"] and p.restarts == 1
    assert ray.get(p.actors[0].why_drafter_off.remote()) == (
        "its propose call had not returned after 31 s on actor 0, which was taken for hung and replaced")
    ray.kill(p.actors[0])


def test_stopping_reports_a_dead_actor_instead_of_raising_over_the_error_that_ended_the_run(local_ray):
    """The run ran out of `rollout.max_restarts` (the error the user must read); the close that follows stops the
    actors, one of which is dead: its summary is an error entry, the healthy one's is its own."""
    p = pool({0: "fails"}, 0, "rollout.num_actors=2")
    with pytest.raises(RuntimeError, match=r"after 0 restarts"):
        p.replace(0)
    p.restarts = 1  # stand-ins behave by incarnation: the second actor is spawned as a healthy incarnation 1
    p.actors.append(p.spawn(1, first_ordinal=0))
    p.runs.append(p.actors[1].run.remote())
    summaries = p.stop(timeout_s=30)
    assert summaries[0]["actor"] == 0 and "engine died" in summaries[0]["error"]
    assert summaries[1] == {"groups": 1}
    ray.kill(p.actors[0])
    ray.kill(p.actors[1])


def test_the_summary_is_written_even_when_stopping_the_actors_fails(tmp_path):
    """`Run.close` with stand-ins for Ray and the processes: the actors' stop raises (a dead node, a timeout), yet
    summary.json holds the learner's counters, Ray is shut down, and the error still reaches the caller."""
    from driver.run import Run

    class Unreachable(Exception):
        pass

    def stop(timeout_s):
        raise Unreachable("rollout-0 did not answer")

    counters = {"version": 3, "trained": 24, "lost": 0, "skipped_steps": 0, "received": 24}
    shut = []
    run = Run.__new__(Run)
    run.dir, run.interrupted, run.placement, run.log_handlers, run.last = tmp_path, False, {}, [], {}
    run.earlier_actor_restarts = run.learner_restarts = 0
    run.rollouts = SimpleNamespace(restarts=0, stop=stop)
    run.learners = SimpleNamespace(rank0=SimpleNamespace(summary=SimpleNamespace(remote=lambda: "ref")))
    run.writer = SimpleNamespace(close=lambda: None)
    run.ray = SimpleNamespace(get=lambda ref, timeout: counters, shutdown=lambda: shut.append(True),
                              is_initialized=lambda: True)
    with pytest.raises(Unreachable):
        run.close()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["learner"] == counters and "actors" not in summary and shut == [True]


def test_a_dead_learner_leaves_a_summary_and_says_where_to_go_on_from(tmp_path, capsys):
    """`Run.close` when learner rank 0 is gone: no second traceback over the first, summary.json names the error,
    and the console says there is no checkpoint to resume from (the live case is a slow test in test_rl_loop)."""
    import ray

    from driver.run import Run

    def dead(ref, timeout):
        raise ray.exceptions.ActorDiedError()

    run = Run.__new__(Run)
    run.dir, run.interrupted, run.placement, run.log_handlers, run.last = tmp_path, False, {}, [], {}
    run.earlier_actor_restarts = run.learner_restarts = 0
    run.rollouts = SimpleNamespace(restarts=0, stop=lambda timeout_s: [{"groups": 3}])
    run.learners = SimpleNamespace(rank0=SimpleNamespace(summary=SimpleNamespace(remote=lambda: "ref")))
    run.writer = SimpleNamespace(close=lambda: None)
    run.ray = SimpleNamespace(get=dead, shutdown=lambda: None, exceptions=ray.exceptions, is_initialized=lambda: True)
    summary = run.close()
    assert summary["learner_error"].startswith("ActorDiedError") and summary["actors"] == [{"groups": 3}]
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    err = capsys.readouterr().err
    assert "learner rank 0 is gone (ActorDiedError" in err and "no checkpoint was written" in err


def test_only_a_learner_ranks_death_is_taken_for_a_lost_learner():
    """`Run.learners_alive`: a rank's process that died becomes `LearnerLost` (the launcher restarts the run from a
    checkpoint); another actor's death, or an error raised by training code, stands as it is."""
    import ray

    from driver.run import LearnerLost, Run

    rank = SimpleNamespace(_actor_id=SimpleNamespace(hex=lambda: "ab12"))
    run = Run.__new__(Run)
    run.ray, run.learners = SimpleNamespace(exceptions=ray.exceptions), SimpleNamespace(ranks=[rank])
    with pytest.raises(LearnerLost, match="a learner rank is gone"):  # Ray did not say which actor
        with run.learners_alive():
            raise ray.exceptions.ActorDiedError()
    with pytest.raises(LearnerLost, match="learner rank 0 is gone"):
        with run.learners_alive():
            raise ray.exceptions.RayActorError(actor_id="ab12")
    with pytest.raises(ray.exceptions.RayActorError):
        with run.learners_alive():
            raise ray.exceptions.RayActorError(actor_id="cd34")  # not a learner rank
    with pytest.raises(ValueError):
        with run.learners_alive():
            raise ValueError("a bug in training")



class FailsToStart:
    def __init__(self):
        raise ValueError("its KV cache does not fit")

    def run(self) -> dict:
        return {}


def test_an_actor_that_dies_starting_is_reported_with_the_error_its_constructor_raised(local_ray):
    """Ray's error for an actor that died in its creation task starts with the task's title; the cause (an engine
    that cannot allocate its KV cache, say) is on its last line, which the console and summary.json must show."""
    actor = ray.remote(num_cpus=0)(FailsToStart).remote()
    with pytest.raises(ray.exceptions.RayActorError) as e:
        ray.get(actor.run.remote())
    said = driver.rollouts.one_line(e.value)
    assert said.startswith("ActorDiedError: The actor died because of an error raised in its creation task")
    assert said.endswith("ValueError: its KV cache does not fit")


class HangsStarting:
    """A learner rank whose `start` never returns (a stopped process, a distiller that hangs in its constructor)."""

    def __init__(self, cfg, policy_dir, reference_dir, plan, rank, **rank0_only):
        pass

    def endpoints(self) -> tuple[str, str]:
        return "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"

    def master_address(self) -> str:
        return "127.0.0.1:3"

    def start(self, master: str, resume: str | None) -> None:
        time.sleep(3600)


def test_learner_ranks_that_hang_while_starting_are_given_up_after_the_step_timeout(local_ray, monkeypatch):
    """The ranks' start had no deadline: one stopped while it started (or rank 0's distiller, in its constructor)
    held the run, or its automatic restart, for ever. Past the longer of trainer.step_timeout_s and
    rollout.start_timeout_s (a start may load a multi-GB checkpoint) it is a TimeoutError, which
    `Run.learners_alive` takes for a lost learner (below)."""
    import driver.learners

    monkeypatch.setattr(driver.learners, "Learner", HangsStarting)
    cfg = load_config("grpo_tiny", ["trainer.step_timeout_s=10", "rollout.start_timeout_s=12"])
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not start within 12 s"):  # the longer of the two
        driver.learners.LearnerGroup(cfg, "policy", "policy", CursorPlan(0, 1, 4), num_gpus=0).start(None)
    assert time.monotonic() - started < 60


def test_a_restart_whose_ranks_hang_while_starting_is_tried_again_within_the_limit(tmp_path, capsys):
    """`Run.restart`: a start that is lost again (ranks hung while starting) counts as another restart and is tried
    again while trainer.max_learner_restarts allows; then the error stands. Its handles of the cluster it shut
    down are dropped, so `close` never calls them."""
    from driver.run import LearnerLost, Run

    run = Run.__new__(Run)
    run.cfg = load_config("grpo_tiny", ["trainer.max_learner_restarts=2"])
    run.dir, run.origin, run.step, run.learner_restarts = tmp_path, (None, {"version": 0}), 4, 0
    run.earlier_actor_restarts, run.drafters_off = 0, {}
    run.rollouts = SimpleNamespace(restarts=1, drafters_off={}, stop=lambda timeout_s: None)
    run.learners, run.ray = "the old group", SimpleNamespace(shutdown=lambda: None)
    starts = []

    def start(checkpoint, state):
        starts.append(state["version"])
        raise LearnerLost("the learner ranks made no progress (did not start)")

    run._start = start
    with pytest.raises(LearnerLost, match="did not start"):
        run.restart(LearnerLost("learner rank 0 is gone"))
    assert starts == [0, 0] and run.learner_restarts == 2 and run.earlier_actor_restarts == 1
    assert run.learners is None and run.rollouts is None
    assert capsys.readouterr().err.count("every process starts again from the start of the run") == 2
