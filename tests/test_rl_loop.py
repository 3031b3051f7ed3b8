"""End to end with real vLLM, DeepSpeed, Ray and ZeroMQ: a few asynchronous GRPO steps on the built-in policy."""

import json
import os
import re

import pytest
import torch
import transformers

import launch
from configs.load import load_config
from models.zoo import resolve
from tasks.schedule import CursorPlan

pytestmark = pytest.mark.slow
SMALL = ["rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_tokens=96",
         "learner.micro_batch_size=4", "learner.lr=1e-3", "algorithm.max_staleness=1"]


def at_checkpoint(logdir, step: int, act):
    """Starts a thread that calls `act()` once the run in `logdir` has sealed checkpoint `step` (a failure injected
    mid-run, at a known point); join it after the run."""
    import threading
    import time

    def wait_then_act():
        deadline = time.time() + 300
        while not (logdir / "checkpoints" / f"step_{step}" / "state.json").is_file() and time.time() < deadline:
            time.sleep(0.2)
        act()

    thread = threading.Thread(target=wait_then_act, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("ranks", [["learner.num_ranks=1"], ["learner.num_ranks=2", "learner.zero_stage=3"]],
                         ids=["one_rank", "two_ranks_zero3"])
def test_launch_runs_logs_and_loses_nothing(tmp_path, ranks):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "run"
    assert launch.main(["--config", "grpo_tiny", "trainer.steps=3", f"logging.dir={logdir}", "trainer.eval_every=2",
                        "data.eval_size=12", *SMALL, *ranks]) == 0
    summary = json.loads((logdir / "summary.json").read_text())
    learner, actors = summary["learner"], summary["actors"]
    sent = sum(a["trajectories"] for a in actors)
    # every trajectory sent was trained on, dropped for staleness, or is still waiting for its group
    assert sent >= learner["received"] == (learner["trained"] + learner["dropped_stale"] + learner["pending"]
                                           + learner["dropped_duplicate"] + learner["dropped_reissued"])
    assert learner["trained"] == 3 * 2 * 4 and learner["dropped_messages"] == {}
    assert learner["lost"] == 0 and learner["dropped_invalid"] == 0
    assert sum(a["sent_while_generating"] for a in actors) > 0  # groups stream out while others still generate
    # the engine's own profile, read from the engine at stop: every engine step samples through the coupled sampler
    assert all(a["engine_steps"] > 0 and 0 < a["sampler_seconds"] < a["generate_seconds"] for a in actors)
    assert (logdir / "config.yaml").is_file() and load_config(str(logdir / "config.yaml")).trainer.steps == 3
    events = EventAccumulator(str(logdir)).Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ["rl/reward_mean", "rl/loss", "rl/staleness_max", "rl/grad_norm", "rollout/tokens_per_s",
                "rollout/trajectories", "rollout/truncated_fraction", "rollout/response_length_max",
                "sync/weight_seconds", "sync/weight_bytes", "transport/lost_trajectories"]:
        assert tag in tags
    assert max(e.value for e in events.Scalars("rl/staleness_max")) <= 1
    for tag in ["rl/grad_norm", "rl/zero_advantage_fraction", "rollout/truncated_fraction"]:  # every step
        assert [e.step for e in events.Scalars(tag)] == [0, 1, 2]
    # per-token statistics of the rows trained on: at every step where some group's rewards differ
    trained = [e.step for e in events.Scalars("rl/zero_advantage_fraction") if e.value < 1]
    for tag in ["rl/entropy", "rl/ratio_max", "rl/ratio_min", "rl/clip_fraction"]:
        assert [e.step for e in events.Scalars(tag)] == trained if trained else tag not in tags
    # held-out evaluations at steps 0 and 2 and of the final weights (3); they add no trajectory to training
    assert [e.step for e in events.Scalars("eval/reward_mean")] == [0, 2, 3]
    assert all(0 <= e.value <= 1 for e in events.Scalars("eval/reward_greedy"))
    assert all(e.value > 0 for e in events.Scalars("eval/response_length"))
    assert all(e.value > 0 for e in events.Scalars("sync/weight_bytes"))


def test_a_resumed_run_continues_step_counter_data_cursor_and_logs(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first, second = tmp_path / "first", tmp_path / "second"
    distill = ["speculation.method=draft_lm", "speculation.distill.every_versions=1"]
    assert launch.main(["--config", "grpo_tiny", "trainer.steps=2", f"logging.dir={first}", *SMALL, *distill]) == 0
    state = json.loads((first / "checkpoints" / "step_2" / "state.json").read_text())
    assert state["version"] == 2 and state["data_cursor"] >= 2 * 2 and state["counts"]["trained"] == 2 * 2 * 4
    assert launch.main(["--config", "grpo_tiny", "trainer.steps=4", f"trainer.resume_from={first}",
                        f"logging.dir={second}", *SMALL, "learner.lr=5e-4", "learner.warmup_steps=10", *distill]) == 0
    learner = json.loads((second / "summary.json").read_text())["learner"]
    # the distilled draft LM handed out was checkpointed (none yet: the base one), and the resumed run's actor took
    # it (or a newer one)
    saved = first / "checkpoints" / "step_2" / "draft" / "version.json"
    draft = json.loads(saved.read_text())["version"] if saved.exists() else 0
    assert json.loads((second / "summary.json").read_text())["actors"][0]["draft_version"] >= draft
    assert learner["version"] == 4 and learner["trained"] == 4 * 2 * 4  # counters carried over
    assert learner["received"] == (learner["trained"] + learner["dropped_stale"] + learner["pending"]
                                   + learner["dropped_duplicate"] + learner["dropped_reissued"]
                                   + learner["dropped_invalid"] + learner["dropped_at_resume"])
    assert learner["dropped_at_resume"] == state["pending"]
    # the resumed run continues the first one's lineage: its checkpoints carry the same run id
    assert json.loads((second / "run.json").read_text()) == json.loads((first / "run.json").read_text())
    assert json.loads((first / "checkpoints" / "step_2" / "manifest.json").read_text())["files"]
    assert learner["trained_groups"][0] >= state["data_cursor"]  # no prompt of the first run is trained again
    events = EventAccumulator(str(second)).Reload()
    assert [e.step for e in events.Scalars("rl/reward_mean")] == [2, 3]
    # the warmup goes on where it stopped (lr x (step + 1) / (warmup + 1)), under the resumed run's learner.lr
    assert [e.value for e in events.Scalars("rl/lr")] == pytest.approx([5e-4 * 3 / 11, 5e-4 * 4 / 11])
    assert (second / "checkpoints" / "step_4" / "state.json").is_file()
    # a fresh run told to overwrite `second` (the embedded default is): the old run's checkpoints and events go
    assert launch.main(["--config", "grpo_tiny", "trainer.steps=1", f"logging.dir={second}", *SMALL,
                        "logging.overwrite=true"]) == 0
    assert sorted(p.name for p in (second / "checkpoints").iterdir()) == ["step_1"]
    assert json.loads((second / "run.json").read_text()) != json.loads((first / "run.json").read_text())
    assert [e.step for e in EventAccumulator(str(second)).Reload().Scalars("rl/reward_mean")] == [0]


def kill(name: str) -> None:
    import ray

    ray.kill(ray.get_actor(name))


def sigstop(name: str) -> None:
    """Stops the process of Ray actor `name`: alive to Ray, silent to everyone."""
    import signal

    import ray

    os.kill(ray.get(ray.get_actor(name).__ray_call__.remote(lambda actor: os.getpid())), signal.SIGSTOP)


def hit_once(logdir, name: str, hit=kill, steps: int = 5, *overrides: str) -> dict:
    """A `steps`-step run into `logdir` whose Ray actor `name` is hit (`hit(name)`) once checkpoint 2 is sealed: its
    summary.json."""
    hitter = at_checkpoint(logdir, 2, lambda: hit(name))
    assert launch.main(["--config", "grpo_tiny", f"trainer.steps={steps}", "trainer.checkpoint_every=1",
                        f"logging.dir={logdir}", *SMALL, *overrides]) == 0
    hitter.join()
    return json.loads((logdir / "summary.json").read_text())


@pytest.mark.parametrize("weights", ["zmq", "nccl"])
def test_a_dead_rollout_actor_is_replaced_and_its_work_reissued(tmp_path, weights):
    """With `transport.weights: nccl` (gloo here) the replacement joins a weight-sync group of its own."""
    summary = hit_once(tmp_path / "run", "rollout-0", kill, 5, f"transport.weights={weights}")
    learner, replacement = summary["learner"], summary["actors"][0]
    assert summary["actor_restarts"] == 1 and learner["version"] == 5
    assert learner["trained"] == 5 * 2 * 4  # every step still got its groups
    assert learner["received"] == (learner["trained"] + learner["dropped_stale"] + learner["pending"]
                                   + learner["dropped_duplicate"] + learner["dropped_reissued"])
    assert replacement["start_version"] >= 2  # it generated nothing before catching up with the learner's weights


def test_a_hung_rollout_actor_is_taken_for_dead_and_replaced(tmp_path, capsys):
    """A rollout actor stopped with SIGSTOP is alive to Ray, so only its silence tells: past
    `rollout.stall_timeout_s` it is killed and replaced, and the run ends with every step trained."""
    summary = hit_once(tmp_path / "run", "rollout-0", sigstop, 6, "rollout.stall_timeout_s=15")
    assert summary["actor_restarts"] == 1 and summary["learner"]["version"] == 6
    assert summary["learner"]["trained"] == 6 * 2 * 4
    assert "rollout actor 0 sent nothing for" in capsys.readouterr().err


def test_a_drafter_that_never_returns_is_dropped_by_the_hung_actors_replacement(tmp_path, capsys):
    """A plugin call that never returns stalls its actor, which is taken for hung; the replacement decodes without
    the drafter (running it again would hang it the same way until rollout.max_restarts ends the run), the same
    tokens, and says why in every trajectory."""
    logdir = tmp_path / "run"
    assert launch.main(["--config", "grpo_tiny", "trainer.steps=4", f"logging.dir={logdir}", *SMALL,
                        "speculation.method=tests.plugin_contracts.misbehaving.HangsDrafter",
                        "speculation.planner=false", "rollout.stall_timeout_s=15"]) == 0
    summary = json.loads((logdir / "summary.json").read_text())
    assert summary["actor_restarts"] == 1 and summary["learner"]["trained"] == 4 * 2 * 4
    assert "its propose call had not returned after" in summary["actors"][0]["drafter_failure"]
    assert "rollout actor 0's drafter is stuck (its propose call" in capsys.readouterr().err


def test_a_dead_learner_restarts_every_process_from_the_newest_checkpoint(tmp_path, capsys):
    """Learner rank 0 killed after step 2's checkpoint: every process starts again from it, and the run ends at its
    last step with every step trained once, in the counters and in TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "run"
    summary = hit_once(logdir, "learner-0")
    learner = summary["learner"]
    assert summary["learner_restarts"] == 1 and learner["version"] == 5
    assert learner["trained"] == 5 * 2 * 4  # the checkpoint's counters, then the steps after it
    assert re.search(r"learner rank 0 is gone \(\w+\) at step \d; restart 1 of 2 .*step_2 \(step 2\)",
                     capsys.readouterr().err)
    assert sorted({e.step for e in EventAccumulator(str(logdir)).Reload().Scalars("rl/reward_mean")}) == [0, 1, 2, 3, 4]


def test_a_stopped_learner_rank_is_taken_for_lost_and_the_run_restarts_from_its_checkpoint(tmp_path, capsys):
    """A learner rank stopped with SIGSTOP is alive to Ray, so nothing else would notice (its peers would wait in a
    collective for a day): past `trainer.step_timeout_s` without progress it is lost like a dead one, and every
    process starts again from the newest checkpoint."""
    summary = hit_once(tmp_path / "run", "learner-0", sigstop, 5, "trainer.step_timeout_s=15")
    assert summary["learner_restarts"] == 1 and summary["learner"]["version"] == 5
    assert summary["learner"]["trained"] == 5 * 2 * 4
    assert "the learner ranks made no progress" in capsys.readouterr().err


def test_a_dead_learner_ends_the_run_saying_where_to_resume(tmp_path, capsys):
    """Without restarts (trainer.max_learner_restarts 0), learner rank 0 killed after step 2's checkpoint: the run
    stops with that error, every process shut down, summary.json written with the actors' counters, and the console
    names the checkpoint to resume from."""
    import ray

    from driver.run import LearnerLost

    logdir = tmp_path / "run"
    killer = at_checkpoint(logdir, 2, lambda: ray.kill(ray.get_actor("learner-0")))
    with pytest.raises(LearnerLost):
        launch.main(["--config", "grpo_tiny", "trainer.steps=50", "trainer.checkpoint_every=1",
                     "trainer.max_learner_restarts=0", f"logging.dir={logdir}", *SMALL])
    killer.join()
    summary = json.loads((logdir / "summary.json").read_text())
    assert "learner_error" in summary and summary["actors"][0]["groups"] > 0
    err = capsys.readouterr().err
    assert "learner rank 0 is gone" in err and f"trainer.resume_from={logdir}" in err
    assert re.search(r"newest checkpoint is \S+step_(\d+) \(step \1\)", err)
    assert not ray.is_initialized()



@pytest.mark.parametrize("which", [(3,), (8,)], ids=["mid_group", "last_of_a_step"])
def test_lost_trajectories_are_regenerated_even_without_staleness(tmp_path, which, inject_into_actor):
    """With algorithm.max_staleness 0 the actor waits for new weights after each step's groups, so a group left
    short by a lost trajectory would stall the run for good. The gap shows at the actor's next trajectory, or (the
    step's last one) at its next heartbeat; the actor regenerates from the learner's first missing group."""
    def lose_trajectories(actor) -> None:
        """Runs inside the rollout actor (Ray's `__ray_call__`; a closure, so shipped by value): from now on its
        outbox loses the trajectories it sends at positions `which`, as a connection reset loses what was in
        flight (the actor believes they went out)."""
        from transport.messages import Trajectory

        send, count = actor.outbox.send, [0]

        def lossy(message, timeout_ms=None):
            if isinstance(message, Trajectory):
                count[0] += 1
                if count[0] in which:
                    return True
            return send(message, timeout_ms)

        actor.outbox.send = lossy

    injection = inject_into_actor(lose_trajectories)
    logdir = tmp_path / "run"
    small = [o for o in SMALL if not o.startswith("algorithm.max_staleness")]
    assert launch.main(["--config", "grpo_tiny", "trainer.steps=3", f"logging.dir={logdir}",
                        "algorithm.max_staleness=0", *small]) == 0
    injection.join()
    assert injection.injected
    summary = json.loads((logdir / "summary.json").read_text())
    learner, actor = summary["learner"], summary["actors"][0]
    assert learner["lost"] == 1 and actor["rewinds"] == 1 and learner["version"] == 3
    assert learner["trained"] == 3 * 2 * 4 and learner["dropped_reissued"] + learner["dropped_duplicate"] >= 1
    assert learner["received"] == (learner["trained"] + learner["dropped_stale"] + learner["pending"]
                                   + learner["dropped_duplicate"] + learner["dropped_reissued"])

def test_speculative_run_logs_acceptance_planner_and_choices(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "spec"
    assert launch.main(["--config", "grpo_tiny", "trainer.steps=3", f"logging.dir={logdir}", *SMALL,
                        "speculation.method=fastest_of_n", "speculation.drafters=[suffix,draft_lm]",
                        "speculation.distill.every_versions=1", "speculation.distill.zero_advantage_rows=true"]) == 0
    events = EventAccumulator(str(logdir)).Reload()
    # the draft LM distilled beside the policy: trained every step (on every row: with 2 groups a step may train
    # none), offered from the second on, swapped if better; its scalars come one step late (the last step's
    # distillation ends with the run)
    assert all(e.value >= 0 for e in events.Scalars("draft/loss")) and len(events.Scalars("draft/loss")) == 2
    versions = [e.value for e in events.Scalars("draft/version")]
    assert versions == sorted(versions) and len(events.Scalars("draft/candidate_acceptance")) == 1
    assert all(1 <= e.value <= 5 for e in events.Scalars("draft/replayed_acceptance"))
    summary = json.loads((logdir / "summary.json").read_text())
    actor, draft = summary["actors"][0], summary["learner"]["draft"]
    assert actor["draft_version"] <= draft["version"] <= versions[-1] and actor["draft_swaps"] <= actor["draft_version"]
    assert draft["distiller_restarts"] == 0 and not draft["distillation_off"]
    # drafts were accepted (not necessarily every step: the planner may decide not to draft in one)
    assert any(e.value > 1 for e in events.Scalars("spec/acceptance_length"))
    assert any(e.value > 0 for e in events.Scalars("spec/draft_tokens"))
    assert "spec/accepted_tokens" in events.Tags()["scalars"]
    planned = [e.value for e in events.Scalars("spec/planned_tokens")]  # the planner's choices
    assert all(0 <= v <= 4 for v in planned) and any(v > 0 for v in planned)
    assert "spec/planner_cost_error" in events.Tags()["scalars"]
    per_step: dict[int, float] = {}  # which member drafted, as shares of each step's draft steps
    for tag in [t for t in events.Tags()["scalars"] if t.startswith("spec/choice/")]:
        assert tag in ("spec/choice/suffix", "spec/choice/draft_lm")
        for e in events.Scalars(tag):
            per_step[e.step] = per_step.get(e.step, 0.0) + e.value
    assert per_step and all(v == pytest.approx(1.0) for v in per_step.values())
    members = {t for t in events.Tags()["scalars"] if t.startswith("spec/member/")}  # scored on every proposal
    assert members <= {"spec/member/suffix/token_acceptance", "spec/member/draft_lm/token_acceptance"} and members
    assert all(0 <= e.value <= 1 for tag in members for e in events.Scalars(tag))


def test_each_actors_history_drafter_learns_what_the_other_actors_sampled(tmp_path):
    """A prompt's next epoch may land on any actor: the learner sends every trained output to every actor, and each
    hands the others' to its history drafter."""
    logdir = tmp_path / "history"
    assert launch.main(["--config", "grpo_tiny", "trainer.steps=3", f"logging.dir={logdir}", *SMALL,
                        "rollout.num_actors=2", "speculation.method=suffix"]) == 0
    summary = json.loads((logdir / "summary.json").read_text())
    remembered = [actor["remembered_outputs"] for actor in summary["actors"]]
    # the first two steps' outputs at least (the last step's history may arrive after an actor stopped); each actor
    # samples half of a step's groups, so the other half reaches it this way
    assert len(remembered) == 2 and all(n >= 2 * 4 for n in remembered), remembered


@pytest.mark.parametrize("model,weights", [("builtin:dense", "zmq"), ("builtin:moe", "zmq"), ("builtin:dense", "nccl")])
def test_after_a_sync_the_actor_samples_what_the_learner_computes(model, weights):
    """A weight version published over ZeroMQ (or its bytes pulled over the weight-sync group: gloo here) is what
    the actor's vLLM engine samples from: every behaviour logprob of a trajectory sampled under it equals the
    learner's processed logprob under those weights, with top-k and top-p on (MoE experts included, in the
    checkpoint layout the learner sends)."""
    import ray
    from transformers.core_model_loading import revert_weight_conversion

    from actor.rollout import RolloutActor
    from sampling.coupled import processed_logprobs
    from transport.collective import WeightGroups
    from transport.zmq import Inbox, WeightPublisher, pack_buckets

    cfg = load_config("grpo_tiny", [*SMALL, f"model.path={model}", "rollout.top_p=0.9", "rollout.top_k=20"])
    model_dir = str(resolve(cfg.model.path))
    policy = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():  # version 1: every weight moved
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05 * p.std())
    state = {name: p.detach().clone() for name, p in policy.named_parameters()}
    buckets = pack_buckets(iter(revert_weight_conversion(policy, state).items()), 1 << 20)
    inbox, publisher = Inbox("127.0.0.1", 64 << 20), WeightPublisher("127.0.0.1")
    groups = WeightGroups("127.0.0.1", "cpu") if weights == "nccl" else None
    env = {k: os.environ[k] for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "DS_ACCELERATOR", "OMP_NUM_THREADS")}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        actor = ray.remote(num_cpus=1, max_concurrency=2)(RolloutActor).remote(
            cfg, 0, model_dir, inbox.endpoint, publisher.endpoint, 0, CursorPlan(0, 1, 2),
            weight_group=groups.open(0, 0, workers=1) if groups else None)
        if groups:
            groups.offer(1, buckets)
        publisher.publish(1, buckets, inline=groups is None)
        while ray.get(actor.wait_for_version.remote(1, 2.0)) < 1:  # a subscription may miss the first send
            publisher.publish(1, buckets, inline=groups is None)
        run = actor.run.remote()
        trajectories = []
        while len(trajectories) < 8:
            message = inbox.recv(60_000)
            assert message is not None, "no trajectory within a minute"
            if hasattr(message, "response_ids"):
                trajectories.append(message)
        ray.get(actor.stop.remote())
        ray.get(run)
    finally:
        ray.shutdown()
        inbox.close()
        publisher.close()
        pulls = groups.take_seconds() if groups else None
        if groups:
            groups.close()
    assert pulls is None or pulls, "nothing was pulled over the weight-sync group"
    worst_processed = worst_plain = 0.0
    for t in trajectories:
        assert set(t.policy_versions) == {1}
        with torch.no_grad():
            logits = policy(input_ids=torch.tensor([t.prompt_ids + t.response_ids])).logits[0]
        rows, targets = logits[len(t.prompt_ids) - 1 : -1], torch.tensor(t.response_ids).unsqueeze(-1)
        processed = processed_logprobs(rows, 1.0, 20, 0.9).gather(-1, targets).squeeze(-1)
        plain = processed_logprobs(rows, 1.0).gather(-1, targets).squeeze(-1)  # temperature only
        behaviour = torch.tensor(t.behaviour_logprobs)
        worst_processed = max(worst_processed, (processed - behaviour).abs().max().item())
        worst_plain = max(worst_plain, (plain - behaviour).abs().max().item())
    assert worst_processed < 1e-4, worst_processed
    assert worst_plain > 1e-3  # the check can tell: ignoring top-k/top-p gives other ratios


def test_ctrl_c_stops_every_process_and_keeps_the_counters(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    logdir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "launch.py", "--config", "grpo_tiny", "trainer.steps=1000",
                             "trainer.checkpoint_every=1", f"logging.dir={logdir}", *SMALL],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (logdir / "checkpoints" / "step_1" / "state.json").is_file() and time.time() < deadline:
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground process group
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted at step" in stderr
    assert json.loads((logdir / "summary.json").read_text())["learner"]["version"] >= 1
    time.sleep(2)
    with pytest.raises(ProcessLookupError):  # nothing of the run is left: no learner, actor, raylet or GCS
        os.killpg(proc.pid, 0)


def test_the_console_shows_progress_not_engine_chatter(tmp_path):
    """A run's console holds the configuration, the progress line, real warnings and the summary; the engines' info
    lines (and vLLM's expected reload warnings) are not there, and the full engine log is in logging.dir/run.log."""
    import subprocess
    import sys

    logdir = tmp_path / "run"
    done = subprocess.run([sys.executable, "launch.py", "--config", "grpo_tiny", "trainer.steps=4",
                           f"logging.dir={logdir}", *SMALL], capture_output=True, text=True, timeout=600)
    console = done.stdout + done.stderr
    assert done.returncode == 0, console[-3000:]
    lines = console.splitlines()  # a progress-bar redraw is a carriage return inside one line
    assert len(lines) < 60, "\n".join(lines)
    assert "Failed to load weights" not in console
    assert not re.search(r"Triton|libiomp|SSM cache", console)  # vLLM's CPU notices, answered (actor/engine.py)
    from actor.engine import TCMALLOC

    assert "libtcmalloc" not in console or not TCMALLOC.is_file()
    assert "tensorboard --logdir" in console and "transport: trajectories tcp://" in console
    # 4 steps: training reward over the first and the last 2, held-out at the first and the final evaluation
    assert re.search(r"done: step 4, reward \d\.\d{3} -> \d\.\d{3} \(means over the first and the last 2 steps\), "
                     r"held-out \d\.\d{3} \(step 0\) -> \d\.\d{3} \(step 4\);", console), console[-2000:]
    engine_log = (logdir / "run.log").read_text()
    assert "Reloading and processing weights" in engine_log  # vLLM's info lines went to the file


def maps_containing(name: str):
    """Runs inside the rollout actor (a closure, shipped by value): asserts its process has `name` mapped."""

    def check(actor) -> None:
        with open("/proc/self/maps") as f:
            assert name in f.read(), f"{name} is not loaded in the rollout actor's process"

    return check


def test_a_cpu_rollout_actors_engine_allocates_with_tcmalloc(tmp_path, inject_into_actor):
    """Where `make` installed tcmalloc, the rollout actor's process is started with it preloaded (vLLM's CPU advice,
    measured to pay: docs/benchmarks.md); the run is otherwise the same."""
    from actor.engine import TCMALLOC

    if not TCMALLOC.is_file():
        pytest.skip(f"{TCMALLOC} is not installed (make fetches it with apt-get download)")
    injection = inject_into_actor(maps_containing(TCMALLOC.name))
    assert launch.main(["--config", "grpo_tiny", "trainer.steps=1", f"logging.dir={tmp_path}", *SMALL]) == 0
    injection.join(60)
    assert injection.injected, "the check inside the rollout actor failed (its log says why)"
