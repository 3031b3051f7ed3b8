"""Online distillation of the draft LM (learner/distill.py): the replay is exactly what the drafter would have
proposed, distillation on the policy's outputs raises the draft's acceptance, the gate keeps a worse candidate
out, and a broken running drafter raises the alarm."""

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch
from omegaconf import read_write

import factories
from configs.load import load_config
from drafters.base import DraftRequest
from drafters.draft_lm import DraftLM
from learner.distill import (DraftDistiller, RemoteDistiller, acceptance_walk, regrouped, save_draft,
                             teacher_batch)
from learner.grpo import Packed
from models.zoo import resolve
from sampling.coupled import coupled_sample, group_seed, processed_logprobs
from tasks.arithmetic import ArithmeticTask
from transport.messages import Trajectory

K = 4


def config(**distill):
    return load_config("grpo_tiny", ["speculation.method=draft_lm", f"speculation.num_speculative_tokens={K}",
                                     *(f"speculation.distill.{k}={v}" for k, v in {"every_versions": 1,
                                                                                    **distill}.items())])


def trajectory(cursor: int, index: int, prompt: list[int], response: list[int]) -> Trajectory:
    return factories.trajectory(group_id=cursor, group_size=8, sample_index=index, prompt_ids=prompt,
                                response_ids=response, behaviour_logprobs=[-1.0] * len(response), reward=0.0)


def test_acceptance_walk_counts_verify_steps():
    assert acceptance_walk([True] * 10, 4) == 2  # 4 accepted + 1, twice: 10 tokens
    assert acceptance_walk([False] * 6, 4) == 6  # nothing accepted: one token per step
    assert acceptance_walk([True, True, False, True, True, True, True, True], 4) == 2  # 2+1, then 4+1
    assert acceptance_walk([], 4) == 0


def test_replay_is_exactly_what_the_draft_lm_proposes():
    """Teacher-forced coupled drafts equal DraftLM.propose's, position by position, whenever the drafts before
    them were accepted (the only drafts a verify step ever looks at)."""
    cfg = config()
    distiller, drafter = DraftDistiller(cfg), DraftLM()
    tokenizer_prompt = [5, 17, 30, 9, 44]
    seed = group_seed(cfg.seed, 3, 8) + 2
    own = drafter.propose([DraftRequest("r", seed, 0, tokenizer_prompt, temperature=1.0)], 12)[0]
    response = list(own)
    response[5] = (response[5] + 1) % 272  # the verifier committed another token at position 5
    t = trajectory(3, 2, tokenizer_prompt, response)
    batch = teacher_batch(cfg, [t], torch.zeros(1, len(response), 272))
    replayed = distiller._drafts(batch, distiller._rows(distiller.running, batch))[0][0].tolist()
    assert replayed[:5] == own[:5] and replayed[5] == own[5] != response[5]
    for position in (6, 9):  # after the mismatch: drafts conditioned on the committed history
        drafter.remove("r")
        proposal = drafter.propose([DraftRequest("r", seed, position, tokenizer_prompt + response[:position],
                                                 temperature=1.0)], K)[0]
        assert proposal[0] == replayed[position]
        agree = next((j for j, (a, b) in enumerate(zip(proposal, response[position:])) if a != b), len(proposal))
        # the accepted drafts and the first rejected one, within the response (past its end nothing is verified)
        seen = min(agree + 1, K, len(response) - position)
        assert proposal[:seen] == replayed[position: position + seen]
    steps = acceptance_walk([a == b for a, b in zip(replayed, response)], K)
    assert distiller.step(1, [batch])["draft/replayed_acceptance"] == pytest.approx(len(response) / steps)


def test_regrouped_batches_keep_each_trajectory_with_its_own_targets():
    """The policy's micro-batches re-cut for distillation: every trajectory once, shortest first, each row's top-k
    targets still its own (a misaligned row would teach one response another's distributions)."""
    cfg = config()
    lengths, batches = [[7, 2, 9], [4, 11], [3, 5, 6]], []
    for b, batch in enumerate(lengths):
        rows = [trajectory(10 * b + i, 0, [1, 2, 3], [20 + n] * n) for i, n in enumerate(batch)]
        teacher = torch.full((len(rows), max(batch), 272), -50.0)
        for i, n in enumerate(batch):
            teacher[i, :n, 20 + n] = 0.0  # the policy's favourite at every position is the row's own token
        batches.append(teacher_batch(cfg, rows, teacher))
    out = sorted(regrouped(batches, 3, cfg.seed, order=1), key=lambda b: b.lengths[0])
    assert [len(b.lengths) for b in out] == [3, 3, 2]
    assert [n for b in out for n in b.lengths] == sorted(n for batch in lengths for n in batch)
    for batch in out:
        assert batch.classes.shape[1] == max(batch.lengths) == batch.packed.targets.shape[1]
        for row, n in enumerate(batch.lengths):
            assert (batch.classes[row, :n, 0] == batch.packed.targets[row, :n]).all()  # its own targets
            assert (batch.probs[row, n:] == 0).all() and (batch.packed.mask[row, :n] == 1).all()
            assert batch.seeds[row] == group_seed(cfg.seed, batch.trajectories[row].group_id, 8)


@pytest.fixture(scope="module")
def policy_batches():
    """64 responses sampled from the built-in policy with the coupled sampler (T = 1), and its distributions."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = config()
    path = resolve("builtin:dense")
    policy, tokenizer = AutoModelForCausalLM.from_pretrained(str(path)).eval(), AutoTokenizer.from_pretrained(str(path))
    task, out = ArithmeticTask(seed=11), []
    for b in range(8):
        rows = []
        for i in range(8):
            prompt = tokenizer(task[8 * b + i].prompt, add_special_tokens=False).input_ids
            seed, ids = group_seed(cfg.seed, 8 * b + i, 8), list(prompt)
            with torch.no_grad():
                for position in range(24):
                    logits = policy(input_ids=torch.tensor([ids])).logits[0, -1:]
                    token, _ = coupled_sample(logits, torch.tensor([seed]), torch.tensor([position]),
                                              torch.tensor([1.0]))
                    ids.append(int(token))
            rows.append(trajectory(8 * b + i, 0, prompt, ids[len(prompt):]))
        packed = Packed(rows)
        with torch.no_grad():
            logits = policy(input_ids=packed.ids, attention_mask=packed.attention).logits
            teacher = processed_logprobs(logits.gather(1, packed.index.unsqueeze(-1).expand(-1, -1, 272)), 1.0)
        out.append((rows, teacher))
    return out


def learnt(policy_batches) -> list:
    """The fixture's micro-batches as a policy step hands them to the distiller."""
    return [teacher_batch(config(), rows, teacher) for rows, teacher in policy_batches]


def test_distillation_raises_replayed_acceptance_and_the_gate_publishes_only_better(policy_batches):
    distiller = DraftDistiller(config(lr=3e-4))
    before = None
    for step in range(1, 9):
        metrics = distiller.step(step, learnt(policy_batches))
        before = before or metrics["draft/replayed_acceptance"]
        outgoing = distiller.take_outgoing()
        gated = step > 1  # the first step has no trained candidate to compare yet
        assert ("draft/candidate_acceptance" in metrics) == gated
        assert (outgoing is not None) == (gated and metrics["draft/candidate_acceptance"]
                                          >= metrics["draft/replayed_acceptance"])
        if outgoing is not None:  # what goes out is the running drafter, every tensor under its checkpoint name
            running = distiller.running.state_dict()
            assert outgoing[0] == distiller.version and len(outgoing[1]) == len(running)
            assert all(torch.equal(t, running[n]) for n, t in outgoing[1])
    assert distiller.version >= 1 and metrics["draft/alarm"] == 0.0
    after = distiller.step(9, learnt(policy_batches))["draft/replayed_acceptance"]  # the running one's, before the gate
    assert after > before * 1.05, f"replayed acceptance {before:.3f} -> {after:.3f}"


def test_a_worse_candidate_is_kept_out_and_a_broken_drafter_raises_the_alarm(policy_batches):
    distiller = DraftDistiller(config(lr=1e-9))
    assert distiller.step(1, learnt(policy_batches))["draft/loss"] > 0  # trains the candidate (by nothing)
    with torch.no_grad():
        for p in distiller.model.parameters():
            p.zero_()  # the candidate: zeroed weights, the failure peers shipped silently
    metrics = distiller.step(2, learnt(policy_batches))
    assert metrics["draft/candidate_acceptance"] < metrics["draft/replayed_acceptance"]
    assert distiller.take_outgoing() is None and distiller.version == 0 and metrics["draft/rejected_swaps"] == 1
    distiller.running.load_state_dict(distiller.model.state_dict())  # had it gone out: the alarm
    assert distiller.step(3, learnt(policy_batches))["draft/alarm"] == 1.0


def test_a_batch_whose_loss_is_not_finite_is_skipped_and_the_candidate_stays_finite(policy_batches):
    """The policy's forward of a step the learner skipped (not finite) reached the distiller: one such batch scaled
    every gradient by NaN, and the candidate stayed NaN for the rest of the run, rejected at every gate."""
    distiller = DraftDistiller(config(lr=3e-4))
    batches = learnt(policy_batches)
    batches[0].probs = torch.full_like(batches[0].probs, float("nan"))
    metrics = distiller.step(1, batches)
    assert metrics["draft/nonfinite_batches"] >= 1 and math.isfinite(metrics["draft/loss"])  # (its rows regrouped)
    assert all(torch.isfinite(p).all() for p in distiller.model.parameters())


@pytest.mark.engine
def test_distillation_never_holds_the_learner_back(policy_batches, tmp_path):
    """The distiller runs in a Ray actor of its own, scheduled as idle; a step that ends while it is still
    busy is skipped and counted, not waited for; what it learns comes back to the learner's handle; if it dies, it
    is replaced from the newest draft version handed out, and past `max_restarts` the learner goes on without it."""
    import ray

    ray.init(num_cpus=1, include_dashboard=False)
    try:
        distiller = RemoteDistiller(config(lr=3e-4, max_restarts=1))
        assert distiller.tensors == len(DraftDistiller(config()).running.state_dict())

        def step(version: int) -> dict[str, float]:
            for rows, teacher in policy_batches:
                distiller.observe(rows, teacher)
            return distiller.start(version)

        assert step(1) == {}  # handed over; nothing finished yet
        assert step(2) == {"draft/skipped_steps": 1.0} and distiller.batches == []  # the actor is busy with step 1
        ray.get(distiller.running)
        assert distiller.ready()  # so the learner forwards step 3's rows for it
        metrics = step(3)  # step 1's metrics, as step 3 is handed over
        assert metrics["draft/loss"] > 0 and metrics["draft/skipped_steps"] == 1.0 and metrics["draft/version"] == 0
        ray.get(distiller.running)
        assert step(4)["draft/version"] == 1 and distiller.take_outgoing()[0] == 1  # step 3 gated a trained one
        ray.get(distiller.running)
        # a step that began while it was busy teacher_batch nothing (`ready`): skipped and counted, step 4's metrics given
        assert set(distiller.start(4)) >= {"draft/loss", "draft/skipped_steps"} and distiller.running is None
        assert distiller.skipped == 2
        policy = ray.get(distiller.worker.__ray_call__.remote(lambda worker: os.sched_getscheduler(0)))
        assert policy == os.SCHED_IDLE  # the thread that runs its calls takes only CPU nothing else wants
        distiller.save(tmp_path / "draft")  # rank 0's copy of the newest version handed out: no call to wait on
        assert json.loads((tmp_path / "draft" / "version.json").read_text())["version"] >= 1
        step(5)
        ray.get(distiller.running)
        ray.kill(distiller.worker)  # a distiller that dies mid-run is replaced, from the draft version handed out
        assert step(6)["draft/restarts"] == 0.0  # step 5's metrics; step 6 goes to the dead actor
        version, published = distiller.newest
        ray.wait([distiller.running], timeout=30)  # step 6's call fails once Ray has seen the death
        assert step(7) == {"draft/restarts": 1.0} and distiller.batches == []  # step 7 is lost to it
        ray.get(distiller.running, timeout=120)  # the replacement's first call: adopting that version
        adopted, running = ray.get(distiller.worker.__ray_call__.remote(
            lambda worker: (worker.version, worker.running.state_dict())))
        assert adopted == version >= 1 and len(running) == len(published)
        assert all(torch.equal(running[n], t) for n, t in published)
        assert step(8) == {} and distiller.running is not None  # handed over to the replacement
        distiller.save(tmp_path / "replaced")  # while step 8 is learnt: the version the replacement adopted
        assert json.loads((tmp_path / "replaced" / "version.json").read_text())["version"] == version
        ray.get(distiller.running)
        metrics = step(9)  # step 8's metrics, learnt by the replacement
        assert metrics["draft/version"] == version and metrics["draft/loss"] > 0 and metrics["draft/restarts"] == 1.0
        ray.get(distiller.running)
        ray.kill(distiller.worker)  # dies again: past speculation.distill.max_restarts the run goes on without it
        step(10)
        ray.wait([distiller.running], timeout=30)
        assert step(11) == {"draft/alarm": 1.0, "draft/off": 1.0, "draft/restarts": 1.0}
        assert step(12) == {} and distiller.batches == []
        distiller.save(tmp_path / "after")  # the version the actors keep, for a run resumed from this checkpoint
        assert json.loads((tmp_path / "after" / "version.json").read_text())["version"] == version
    finally:
        ray.shutdown()


@pytest.mark.engine
def test_a_distiller_hung_in_a_step_past_the_step_timeout_is_replaced(policy_batches):
    """A distiller process stopped mid-step is alive to Ray, so only time tells: its step is skipped while within
    the run's longer deadline (`trainer.step_timeout_s`, `rollout.start_timeout_s`), and past it the distiller is
    taken for dead and replaced (not skipped for ever). The
    replacements are counted per run, across a learner restart's new rank 0."""
    import signal

    import ray

    ray.init(num_cpus=1, include_dashboard=False)
    try:
        cfg = config(max_restarts=1)
        with read_write(cfg):  # (below what the loader allows, to keep the test short)
            cfg.trainer.step_timeout_s = cfg.rollout.start_timeout_s = 3.0
        distiller = RemoteDistiller(cfg)
        hung = distiller.worker
        os.kill(ray.get(hung.__ray_call__.remote(lambda worker: os.getpid())), signal.SIGSTOP)

        def step(version: int) -> dict[str, float]:
            for rows, teacher in policy_batches:
                distiller.observe(rows, teacher)
            return distiller.start(version)

        assert step(1) == {}  # handed to the stopped process
        assert step(2) == {"draft/skipped_steps": 1.0}  # busy, within the timeout
        time.sleep(3.5)
        assert step(3) == {"draft/restarts": 1.0} and distiller.worker is not hung
        assert step(4) == {} and ray.get(distiller.running, timeout=120)[0]["draft/loss"] > 0  # the replacement learns
        # after a learner restart rank 0's new distiller goes on from the run's count: max_restarts is per run
        carried = RemoteDistiller(cfg, restarts=1)
        for rows, teacher in policy_batches:
            carried.observe(rows, teacher)
        assert carried.start(1) == {}
        ray.kill(carried.worker)
        ray.wait([carried.running], timeout=30)
        assert carried.start(2) == {"draft/alarm": 1.0, "draft/off": 1.0, "draft/restarts": 1.0} and carried.failed
    finally:
        ray.shutdown()


def test_rank_0s_distiller_is_placed_in_rank_0s_bundle():
    """Made by a process in a placement group (learner rank 0, in bundle 0 of the learner's group), the distiller's
    actor goes into that bundle, whose resources (a share of rank 0's GPU on GPU clusters) are already reserved."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    here = Path(__file__).resolve().parent  # the stand-in rank 0 below is this module's: its workers import it
    ray.init(num_cpus=1, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])}})
    try:
        group = placement_group([{"CPU": 1.0}])
        ray.get(group.ready(), timeout=60)

        @ray.remote(num_cpus=1)
        class Rank0:
            def distiller_group(self) -> str:
                distiller = RemoteDistiller(config())
                return ray.get(distiller.worker.__ray_call__.remote(
                    lambda worker: ray.util.get_current_placement_group().id.hex()))

        rank0 = Rank0.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0)).remote()
        assert ray.get(rank0.distiller_group.remote(), timeout=120) == group.id.hex()
    finally:
        ray.shutdown()


def test_a_checkpointed_draft_lm_resumes_and_goes_out_first(policy_batches, tmp_path):
    distiller = DraftDistiller(config(lr=3e-3))
    for step in (1, 2):
        distiller.step(step, learnt(policy_batches))
    distiller.version += 1  # as if the gate had let it out
    save_draft(tmp_path / "draft", distiller.version, list(distiller.running.state_dict().items()))
    resumed = DraftDistiller(config())
    resumed.load(tmp_path / "draft")
    version, weights = resumed.take_outgoing()
    assert version == distiller.version and resumed.take_outgoing() is None
    running = distiller.running.state_dict()
    assert all(torch.equal(t, running[n]) for n, t in weights) and len(weights) == len(running)
    assert all(torch.equal(t, running[n]) for n, t in resumed.model.state_dict().items())
