"""trainer.deterministic: the same config and seed end with byte-identical final weights, and so does a run whose
rollout actor dies mid-step (its replacement regenerates the step) and a run stopped at a checkpoint and resumed.
Real vLLM, DeepSpeed, Ray and ZeroMQ; held-out evaluations run too (they must not touch the training batches)."""

import hashlib
import json
import os
import time

import pytest

import launch

pytestmark = pytest.mark.slow
RUN = ["--config", "grpo_tiny", "trainer.deterministic=true", "algorithm.max_staleness=0", "trainer.steps=4",
       "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_tokens=96", "learner.micro_batch_size=4",
       "learner.lr=1e-3", "trainer.eval_every=2", "data.eval_size=8"]


def final_weights(logdir) -> str:
    return hashlib.sha256((logdir / "final" / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run every other one is compared with (it also checkpoints at step 2, for the resumed run)."""
    logdir = tmp_path_factory.mktemp("reference")
    assert launch.main([*RUN, f"logging.dir={logdir}", "trainer.checkpoint_every=2", "logging.rollouts=true"]) == 0
    return logdir


def rollouts(logdir) -> list[tuple]:
    """logging.rollouts' lines as (step, seed, response tokens), in the order trained."""
    lines = [json.loads(line) for line in (logdir / "rollouts.jsonl").read_text().splitlines()]
    return [(r["step"], r["seed"], r["response_ids"]) for r in lines]


def test_the_same_config_and_seed_give_byte_identical_final_weights(reference, tmp_path):
    from models.zoo import resolve

    assert launch.main([*RUN, f"logging.dir={tmp_path}"]) == 0
    assert final_weights(tmp_path) == final_weights(reference)
    start = hashlib.sha256((resolve("builtin:dense") / "model.safetensors").read_bytes()).hexdigest()
    assert final_weights(reference) != start  # it trained: equal bytes are not equal because nothing moved


def test_a_run_stopped_at_a_checkpoint_and_resumed_ends_byte_identical(reference, tmp_path):
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    assert launch.main([*RUN, "trainer.steps=2", f"logging.dir={first}"]) == 0  # stops at step 2
    assert launch.main([*RUN, f"trainer.resume_from={first}", f"logging.dir={resumed}"]) == 0
    assert json.loads((resumed / "summary.json").read_text())["learner"]["trained_groups"][0] == 2 * 4
    assert final_weights(resumed) == final_weights(reference)


def die_after(n: int):
    """Runs inside the rollout actor (Ray's `__ray_call__`; a closure, shipped by value): the process exits right
    after it has sent its n-th trajectory, as a crash would end it."""

    def inject(actor) -> None:
        from transport.messages import Trajectory

        send, count = actor.outbox.send, [0]

        def dying(message, timeout_ms=None):
            sent = send(message, timeout_ms)
            if isinstance(message, Trajectory):
                count[0] += 1
                if count[0] == n:
                    time.sleep(0.3)  # the message leaves the socket first
                    os._exit(1)
            return sent

        actor.outbox.send = dying

    return inject


def test_a_rollout_actor_killed_mid_step_changes_no_bit(reference, tmp_path, inject_into_actor):
    injection = inject_into_actor(die_after(22))  # step 1 (16 per step): one group sent, one half
    assert launch.main([*RUN, f"logging.dir={tmp_path}"]) == 0
    injection.join()
    summary = json.loads((tmp_path / "summary.json").read_text())
    learner = summary["learner"]
    assert injection.injected and summary["actor_restarts"] == 1 and learner["trained"] == 4 * 16
    # the replacement regenerated step 1 whole: its half-sent group was forgotten, its whole one came again
    assert learner["dropped_reissued"] == 2 and learner["dropped_duplicate"] == 4
    assert final_weights(tmp_path) == final_weights(reference)


@pytest.mark.parametrize("drafter", ["draft_lm", "tests.plugin_contracts.misbehaving.MisbehavingDrafter"])
def test_speculating_changes_no_bit_of_training(reference, tmp_path, drafter):
    """The coupled sampler makes the tokens the drafter's business only in speed; with the learner's own logprobs
    as the behaviour ones, the weights are the plain run's to the last bit, and every trajectory its tokens (both
    runs' logging.rollouts), even under a plugin that tries to write into its histories and draws from the global
    RNGs."""
    assert launch.main([*RUN, f"logging.dir={tmp_path}", f"speculation.method={drafter}",
                        "logging.rollouts=true"]) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["actors"][0]["accepted_tokens"] > 0
    assert final_weights(tmp_path) == final_weights(reference)
    plain = rollouts(reference)
    assert [step for step, _, _ in plain] == [step for step in range(4) for _ in range(16)]
    assert len({seed for _, seed, _ in plain}) == 4 * 16 and rollouts(tmp_path) == plain
