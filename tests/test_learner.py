"""The learner's GRPO step moves the policy the right way: after a few steps on one batch, the rewarded
response of each group is more likely and the unrewarded ones less likely (real DeepSpeed, built-in policy); and
a step split over several ranks is the step one rank takes."""

import math
from pathlib import Path

import pytest
import torch
import transformers
from msgspec.structs import replace

import factories
from configs.load import load_config
from models.zoo import resolve
from sampling.coupled import processed_logprobs
from tasks.schedule import CursorPlan
from transport.messages import SCHEMA_VERSION, Trajectory

GROUPS = [("Question: 3+4=?\nAnswer:", [" 3+4=7\n#### 7", " 3+4=8\n#### 8", " 3+4=9\n#### 9", " 3+4=6\n#### 6"]),
          ("Question: 9-2=?\nAnswer:", [" 9-2=7\n#### 7", " 9-2=6\n#### 6", " 9-2=5\n#### 5", " 9-2=8\n#### 8"])]


def sequence_logprob(model, prompt: list[int], response: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
    rows = processed_logprobs(logits[len(prompt) - 1 : -1], 1.0)
    return rows.gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1).tolist()


def make_groups(model, tok, texts=GROUPS) -> list[list[Trajectory]]:
    """`texts` as trajectories sampled under `model`; the first response of each group is the rewarded one."""
    groups = []
    for g, (prompt, responses) in enumerate(texts):
        p = tok(prompt, add_special_tokens=False).input_ids
        rs = [tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id] for text in responses]
        groups.append([factories.trajectory(seq=i, group_id=g, group_size=4, sample_index=i, prompt_ids=p, response_ids=r,
                                            behaviour_logprobs=sequence_logprob(model, p, r), reward=1.0 if i == 0 else 0.0)
                       for i, r in enumerate(rs)])
    return groups


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_grpo_steps_raise_rewarded_and_lower_unrewarded_responses(kl_coef):
    from learner.learner import Learner

    model_dir = str(resolve("builtin:dense"))
    cfg = load_config("grpo_tiny", ["rollout.prompts_per_step=2", "rollout.group_size=4",
                                    "learner.micro_batch_size=4", "learner.lr=1e-5", f"algorithm.kl_coef={kl_coef}"])
    learner = Learner(cfg, model_dir, model_dir, CursorPlan(0, 1, 2))
    learner.start()
    groups = make_groups(learner.engine.module, transformers.AutoTokenizer.from_pretrained(model_dir))
    before = [[sum(sequence_logprob(learner.engine.module, t.prompt_ids, t.response_ids)) for t in g] for g in groups]
    steps = []
    for _ in range(3):
        learner.groups = groups  # what collect() gathers from the inbox
        steps.append(learner.train())
    after = [[sum(sequence_logprob(learner.engine.module, t.prompt_ids, t.response_ids)) for t in g] for g in groups]
    metrics = steps[-1]
    assert metrics["rl/reward_mean"] == pytest.approx(0.25)
    for b, a in zip(before, after):
        assert a[0] > b[0]  # rewarded: more likely
        assert sum(a[1:]) < sum(b[1:])  # unrewarded: less likely overall
    # the first step's ratios are 1 (behaviour logprobs were computed under these weights); later ones move
    assert steps[0]["rl/ratio_min"] == pytest.approx(1.0, abs=1e-5)
    assert steps[0]["rl/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert steps[-1]["rl/ratio_max"] > 1.0 > steps[-1]["rl/ratio_min"]
    assert steps[0]["rl/grad_norm"] > 0 and steps[0]["rl/entropy"] > 0
    sampled = [lp for g in groups for t in g for lp in t.behaviour_logprobs]  # -log p of each sampled token
    assert steps[0]["rollout/entropy_estimate"] == pytest.approx(-sum(sampled) / len(sampled)) and sum(sampled) < 0
    if kl_coef:  # the reference is the starting policy: no divergence at first, some after two updates
        assert steps[0]["rl/kl"] == pytest.approx(0.0, abs=1e-7) and steps[-1]["rl/kl"] > 1e-7
    else:
        assert "rl/kl" not in metrics


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_a_steps_gradient_does_not_depend_on_how_its_micro_batches_are_cut(aggregation):
    """The learner cuts a step into micro-batches of similar lengths; the gradient is the loss's over the whole step
    either way (token_mean: every token of the step weighs the same, not every token of its micro-batch)."""
    from learner.learner import Learner

    model_dir = str(resolve("builtin:dense"))
    texts = [("Question: 3+4=?\nAnswer:",
              [" 3+4=7\n#### 7", " 3 plus 4 is 8, so 3+4=8\n#### 8", " 9", " 3+4 = 6\n#### 6"]),
             ("Question: 9-2=?\nAnswer:", [" 9-2=7 as 9-1=8 and 8-1=7\n#### 7", " 6", " 9-2=5\n#### 5", " 8"])]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    norms = []
    for micro in (2, 8):
        cfg = load_config("grpo_tiny", ["rollout.prompts_per_step=2", "rollout.group_size=4",
                                        f"learner.micro_batch_size={micro}",
                                        f"algorithm.loss_aggregation={aggregation}"])
        learner = Learner(cfg, model_dir, model_dir, CursorPlan(0, 1, 2))
        learner.start()
        learner.groups = make_groups(learner.engine.module, tokenizer, texts)
        metrics = learner.train()
        norms.append((metrics["rl/grad_norm"], metrics["rl/loss"]))
    assert norms[0][0] == pytest.approx(norms[1][0], rel=1e-5) and norms[0][0] > 0
    assert norms[0][1] == pytest.approx(norms[1][1], rel=1e-5, abs=1e-6)


def test_step_rows_deal_every_live_row_once_and_keep_the_ranks_in_step():
    from learner.grpo import step_rows

    lengths = [5, 9, 3, 7, 7, 2, 8, 4, 6, 1]
    for live, world, micro in [(range(10), 1, 4), ([0, 2, 3, 7, 9], 2, 2), ([4], 3, 2), ([], 2, 4)]:
        cuts = [step_rows(lengths, list(live), r, world, micro) for r in range(world)]
        rows = [i for rank in cuts for batch in rank for i in batch]
        assert sorted(rows) == sorted(live)  # each live row once, nothing else
        assert len({len(rank) for rank in cuts}) == 1 and len(cuts[0]) >= 1  # as many passes on every rank
        assert all(len(batch) <= micro for rank in cuts for batch in rank)
        for rank in cuts:  # similar lengths together: each rank's rows in length order
            flat = [lengths[i] for batch in rank for i in batch]
            assert flat == sorted(flat)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_rows_with_zero_advantage_are_not_forwarded_and_the_step_is_unchanged(aggregation):
    """A group whose rewards are all equal has advantage 0 in every row: with no KL term its rows add nothing to
    the gradient, so the learner does not forward them. The step's loss and gradient are still those of the whole
    step (its normalisers count those rows), computed here directly over all rows; a step where every group is
    uniform still takes its optimizer step (AdamW's momentum moves the weights)."""
    from learner.grpo import Packed, group_advantages, policy_loss
    from learner.learner import Learner

    model_dir = str(resolve("builtin:dense"))
    texts = [*GROUPS, ("Question: 5+1=?\nAnswer:", [" 5+1=7\n#### 7", " 8", " 5+1=4\n#### 4", " 2"])]
    cfg = load_config("grpo_tiny", ["rollout.prompts_per_step=3", "rollout.group_size=4", "learner.micro_batch_size=2",
                                    f"algorithm.loss_aggregation={aggregation}", "learner.grad_clip=1e9"])
    learner = Learner(cfg, model_dir, model_dir, CursorPlan(0, 1, 3))
    learner.start()
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    groups = make_groups(reference, transformers.AutoTokenizer.from_pretrained(model_dir), texts)
    groups[2] = [replace(t, reward=0.0) for t in groups[2]]
    rows = [t for g in groups for t in g]
    advantages = group_advantages(torch.tensor([[t.reward for t in g] for g in groups]), True).flatten()
    packed = Packed(rows)  # the whole step at once, every row, the uniform group's included
    logits = reference(input_ids=packed.ids, attention_mask=packed.attention).logits
    logprobs = processed_logprobs(logits.gather(1, packed.index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])), 1.0)
    algo = cfg.algorithm
    loss, _ = policy_loss(logprobs.gather(-1, packed.targets.unsqueeze(-1)).squeeze(-1), packed.behaviour, advantages,
                          packed.mask, algo.clip_low, algo.clip_high, algo.loss_aggregation, cfg.rollout.max_tokens)
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
    forwarded = []
    learner.engine.module.register_forward_hook(lambda m, args, kwargs, out: forwarded.append(len(kwargs["input_ids"])),
                                                with_kwargs=True)
    learner.groups = groups
    metrics = learner.train()
    assert sum(forwarded) == 8  # the two mixed groups' rows; none of the uniform group's
    assert metrics["rl/zero_advantage_fraction"] == pytest.approx(1 / 3)
    assert metrics["rl/grad_norm"] == pytest.approx(norm, rel=1e-4) and norm > 0
    assert metrics["rl/loss"] == pytest.approx(loss.item(), rel=1e-4, abs=1e-7)
    before = {n: p.detach().clone() for n, p in learner.engine.module.named_parameters()}
    learner.groups = [groups[2], groups[2], groups[2]]  # nothing to learn from
    metrics = learner.train()
    assert metrics["rl/zero_advantage_fraction"] == 1.0 and metrics["rl/grad_norm"] == 0.0
    assert "rl/entropy" not in metrics and learner.engine.global_steps == 2  # no token trained, the step taken
    assert metrics["rollout/entropy_estimate"] > 0  # the rollout's estimate is there at every step
    assert any(not torch.equal(p.detach(), before[n]) for n, p in learner.engine.module.named_parameters())


@pytest.mark.parametrize("zero_advantage_rows", [True, False])
def test_the_distiller_learns_from_rows_with_zero_advantage_only_if_asked(monkeypatch, zero_advantage_rows):
    """With `speculation.distill.zero_advantage_rows`, the rows the GRPO step skips still get a forward (no backward):
    the draft LM's teacher sees every row of the step once, with the policy's distributions at the rollout
    temperature; those rows are forwarded only after the new weights went out (`publish`), so the actors never wait
    for them. Without it (the default) the distiller sees the trained rows only, and nothing is forwarded for it
    alone. A step that a busy distiller would skip forwards nothing for it and hands it nothing."""
    import learner.learner as module
    from learner.learner import Learner

    from learner import grpo

    forwards = []  # the forwards made for the distiller alone (the zero-advantage rows)

    def counted(*args):
        forwards.append(1)
        return grpo.response_logprobs(*args)

    monkeypatch.setattr(module, "response_logprobs", counted)

    class Distiller:  # stands in for the Ray-hosted RemoteDistiller: what rank 0 hands it
        def __init__(self):
            self.seen, self.free, self.deferred, self.started = [], True, [], []

        def ready(self):
            return self.free

        def observe(self, batch, full):  # full: [B, T, vocab]; a skipped row's forward carries no graph
            assert full.shape[:2] == (len(batch), max(len(t.response_ids) for t in batch))
            self.seen += [(t.group_id, t.sample_index, full.requires_grad) for t in batch]

        def defer(self, batch):
            self.deferred.append(batch)

        def start(self, version, teacher):  # as RemoteDistiller.start: the deferred rows forwarded, then handed over
            for batch in self.deferred:
                with torch.no_grad():
                    self.observe(batch, teacher(batch))
            self.deferred, self.started = [], self.started + [version]
            return {}

        def take_outgoing(self):
            return None

    model_dir = str(resolve("builtin:dense"))
    texts = [*GROUPS, ("Question: 5+1=?\nAnswer:", [" 5+1=7\n#### 7", " 8", " 5+1=4\n#### 4", " 2"])]
    overrides = ["rollout.prompts_per_step=3", "rollout.group_size=4", "learner.micro_batch_size=2"]
    learner = Learner(load_config("grpo_tiny", overrides), model_dir, model_dir, CursorPlan(0, 1, 3))
    learner.start()
    learner.cfg = load_config("grpo_tiny", [*overrides, "speculation.method=draft_lm",
                                            "speculation.distill.every_versions=1",
                                            f"speculation.distill.zero_advantage_rows={str(zero_advantage_rows).lower()}"])
    learner.distiller = Distiller()
    groups = make_groups(learner.engine.module, transformers.AutoTokenizer.from_pretrained(model_dir), texts)
    groups[2] = [replace(t, reward=0.0) for t in groups[2]]
    learner.groups = groups
    metrics = learner.train()
    assert metrics["rl/zero_advantage_fraction"] == pytest.approx(1 / 3) and metrics["rl/grad_norm"] > 0
    assert {g for g, _, _ in learner.distiller.seen} == {0, 1} and forwards == []  # group 2 waits for publish
    learner.publish()
    taught = range(3) if zero_advantage_rows else range(2)
    assert sorted((g, i) for g, i, _ in learner.distiller.seen) == [(g, i) for g in taught for i in range(4)]
    assert {(g, grad) for g, _, grad in learner.distiller.seen} == {(0, True), (1, True), (2, False)}.intersection(
        (g, g < 2) for g in taught)
    expected = [1, 1] if zero_advantage_rows else []  # group 2's four rows, two to a micro-batch
    assert forwards == expected and learner.distiller.started == [1]
    learner.distiller.free, learner.distiller.seen = False, []  # busy with the last step's rows
    assert learner.train()["rl/grad_norm"] > 0 and learner.distiller.seen == [] and learner.distiller.deferred == []
    learner.publish()
    assert learner.distiller.seen == [] and forwards == expected


@pytest.mark.parametrize("zero_stage", [0, 1])  # the plain optimizer (the learner skips) and ZeRO's (DeepSpeed does)
def test_a_step_whose_gradient_is_not_finite_is_skipped_and_counted(zero_stage):
    """A reward that reached the loss as NaN (the intake refuses it; here it is handed to the learner directly)
    makes its group's advantages and the gradient NaN: the step must leave every weight as it was and count itself;
    the next sound step trains."""
    from learner.learner import Learner

    model_dir = str(resolve("builtin:dense"))
    cfg = load_config("grpo_tiny", ["rollout.prompts_per_step=2", "rollout.group_size=4",
                                    "learner.micro_batch_size=4", f"learner.zero_stage={zero_stage}"])
    learner = Learner(cfg, model_dir, model_dir, CursorPlan(0, 1, 2))
    learner.start()
    groups = make_groups(learner.engine.module, transformers.AutoTokenizer.from_pretrained(model_dir))
    before = {n: p.detach().clone() for n, p in learner.engine.module.named_parameters()}
    poisoned = [g[:] for g in groups]
    bad = poisoned[0][1]
    poisoned[0][1] = replace(bad, reward=float("nan"))
    learner.groups = poisoned
    metrics = learner.train()
    assert metrics["rl/skipped_steps"] == 1.0 and learner.summary()["skipped_steps"] == 1
    for name, p in learner.engine.module.named_parameters():
        assert torch.equal(p.detach(), before[name]), name
    learner.groups = groups
    metrics = learner.train()
    assert metrics["rl/skipped_steps"] == 1.0 and metrics["rl/grad_norm"] > 0
    assert any(not torch.equal(p.detach(), before[n]) for n, p in learner.engine.module.named_parameters())


def test_the_learners_inbox_takes_trajectories_acks_and_heartbeats_only():
    """A weight bucket sent to the trajectory inbox (well-typed, but not for it) is dropped and counted before it
    reaches the learner, where it once raised AttributeError."""
    import msgspec
    import zmq

    from learner.learner import Learner
    from transport.messages import Heartbeat, TensorSpec, WeightBucket

    model_dir = str(resolve("builtin:dense"))
    learner = Learner(load_config("grpo_tiny", ["transport.auth=none"]), model_dir, model_dir, CursorPlan(0, 1, 2))
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.connect(learner.endpoints()[0])
    bucket = WeightBucket(SCHEMA_VERSION, 1, 0, 1, [TensorSpec("w", "float32", [1])])
    raw.send(msgspec.msgpack.encode(bucket))
    raw.send(msgspec.msgpack.encode(Heartbeat(SCHEMA_VERSION, 0, 5)))
    assert learner.inbox.recv(5000) == Heartbeat(SCHEMA_VERSION, 0, 5)
    assert learner.inbox.dropped == {"malformed": 1}
    raw.close(0)


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_deterministic_learner_takes_its_own_logprobs_as_the_behaviour_ones(deterministic):
    """trainer.deterministic (max_staleness 0): the tokens were sampled under the learner's current weights, so
    its own logprobs are the behaviour logprobs and the engine's (whose last bits depend on its batch) are unused:
    here they are off by 1 nat, and only the default learner's ratios show it."""
    from learner.learner import Learner

    model_dir = str(resolve("builtin:dense"))
    cfg = load_config("grpo_tiny", ["rollout.prompts_per_step=2", "rollout.group_size=4", "learner.micro_batch_size=4",
                                    "algorithm.max_staleness=0", f"trainer.deterministic={deterministic}"])
    learner = Learner(cfg, model_dir, model_dir, CursorPlan(0, 1, 2))
    learner.start()
    groups = make_groups(learner.engine.module, transformers.AutoTokenizer.from_pretrained(model_dir))
    learner.groups = [[replace(t, behaviour_logprobs=[lp - 1.0 for lp in t.behaviour_logprobs]) for t in g]
                      for g in groups]
    metrics = learner.train()
    if deterministic:
        assert metrics["rl/ratio_min"] == metrics["rl/ratio_max"] == 1.0 and metrics["rl/clip_fraction"] == 0.0
    else:
        assert metrics["rl/ratio_min"] == pytest.approx(math.e, rel=1e-4) and metrics["rl/clip_fraction"] == 1.0


LR = 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("ranks,zero_stage", [(2, 0), (2, 3)])
def test_ranks_share_a_step_and_take_the_same_step_as_one_rank(tmp_path, ranks, zero_stage):
    """Data parallelism is exact: two ranks (each training half the groups, gradients all-reduced; ZeRO-3 with
    sharded weights) end a step with the weights one rank gets from the same groups sent over the inbox. The step
    has rows with zero advantage (a uniform group, two ties with their group's mean), which no rank forwards, so the
    ranks get 4 and 3 rows, one micro-batch apart: the rank with fewer passes a zero loss to stay in step."""
    import os

    import ray
    from safetensors.torch import load_file

    from driver.learners import LearnerGroup
    from transport.zmq import Outbox

    model_dir = str(resolve("builtin:dense"))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    texts = [*GROUPS, ("Question: 5+1=?\nAnswer:", [" 5+1=7\n#### 7", " 8", " 5+1=4\n#### 4", " 2"])]
    rewards = [[1.0, 0.0, 0.0, 0.0], [1.0, 0.5, 0.25, 0.25], [0.0] * 4]  # 4 + 3 + 0 rows with a gradient
    trajectories = [replace(t, reward=r)
                    for g, rs in zip(make_groups(model, transformers.AutoTokenizer.from_pretrained(model_dir), texts),
                                     rewards) for t, r in zip(g, rs)]
    env = {k: os.environ[k] for k in ("DS_ACCELERATOR", "OMP_NUM_THREADS")}
    weights = {}
    for world, stage in [(1, 0), (ranks, zero_stage)]:
        cfg = load_config("grpo_tiny", ["rollout.prompts_per_step=3", "rollout.group_size=4", f"learner.lr={LR}",
                                        "learner.warmup_steps=0", "transport.weight_bucket_mib=1",  # 4 gathers
                                        "learner.micro_batch_size=3", f"learner.num_ranks={world}",
                                        f"learner.zero_stage={stage}"])
        ray.init(num_cpus=world, include_dashboard=False, runtime_env={"env_vars": env})
        try:
            learner = LearnerGroup(cfg, model_dir, model_dir, CursorPlan(0, 1, 3), num_gpus=0)
            learner.start(resume=None)
            outbox = Outbox(learner.trajectory_endpoint, hwm=64)
            for t in trajectories:
                outbox.send(t)
            ray.get(learner.rank0.collect.remote())
            metrics = ray.get(learner.all("train"))
            ray.get(learner.all("publish"))
            ray.get(learner.all("save_pretrained", str(tmp_path / f"{world}-{stage}")))
            outbox.close()
        finally:
            ray.shutdown()
        assert metrics[0]["rollout/trajectories"] == 12 and all(m == {} for m in metrics[1:])
        assert metrics[0]["rl/zero_advantage_fraction"] == pytest.approx(5 / 12)
        weights[world] = load_file(tmp_path / f"{world}-{stage}" / "model.safetensors")
    base = load_file(os.path.join(model_dir, "model.safetensors"))
    assert all(not torch.equal(w, base[name]) for name, w in weights[1].items())  # the step moved every tensor
    # Adam's first step moves each weight by lr * g / (|g| + eps): equal gradients give equal weights, except where
    # g is ~0 and the all-reduce's summation order shows through (1 weight in 820k here); a wrong share of the
    # groups or a missing all-reduce changes most of them
    differ = sum(((weights[ranks][n] - w).abs() > 0.01 * LR).sum().item() for n, w in weights[1].items())
    assert differ <= 1e-4 * sum(w.numel() for w in weights[1].values()), differ


def test_a_sampled_token_outside_the_learners_top_p_set_is_counted_and_trains_nothing():
    """Under staleness > 0 the learner's top-p set (newer weights) can exclude a token the actor sampled: logprob
    -inf, a zero ratio and a zero gradient, and rl/outside_mask_fraction says how often (padding never counts)."""
    import torch

    from configs.schema import LossAggregation
    from learner.grpo import policy_loss

    logprobs = torch.tensor([[-0.5, float("-inf"), -0.2, -0.1], [-0.3, -0.4, float("-inf"), float("-inf")]],
                            requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    loss, stats = policy_loss(logprobs, torch.full((2, 4), -0.3), torch.tensor([1.0, -1.0]), mask, 0.2, 0.2,
                              LossAggregation.token_mean, 4)
    loss.backward()
    assert stats["outside_mask_fraction"] == pytest.approx(1 / 6) and torch.isfinite(loss)
    assert logprobs.grad[0, 1] == 0 and torch.isfinite(logprobs.grad).all()


def test_dual_clip_bounds_a_negative_advantage_tokens_share_whatever_its_behaviour_logprob():
    """A behaviour logprob 19.9 below the policy's (accepted: inside what a float32 softmax gives) and a negative
    advantage: PPO's clip leaves the ratio e^19.9 whole, and that one token took the whole gradient; dual clip holds
    its loss at dual_clip x |A|, with no gradient from it, and counts it."""
    import torch

    from configs.schema import LossAggregation
    from learner.grpo import policy_loss

    def step(dual_clip: float):
        logprobs = torch.full((2, 4), -0.5, requires_grad=True)
        behaviour = torch.full((2, 4), -0.5)
        behaviour[1, 0] = -20.4  # a forged (or very stale) row
        loss, stats = policy_loss(logprobs, behaviour, torch.tensor([1.0, -1.0]), torch.ones(2, 4), 0.2, 0.2,
                                  LossAggregation.token_mean, 4, dual_clip=dual_clip)
        loss.backward()
        return loss, stats, logprobs.grad

    loss, stats, grad = step(0.0)
    assert loss > 1e7 and grad[1, 0].abs() > 1e6 * grad[0, 0].abs()
    loss, stats, grad = step(3.0)
    assert loss.item() == pytest.approx((-4 * 1.0 + 3 * 1.0 + 3.0) / 8) and grad[1, 0] == 0  # the others: ratio 1
    assert stats["dual_clip_fraction"] == pytest.approx(1 / 8) and grad[0, 0] != 0


def test_the_rank_rendezvous_listens_on_the_nodes_address_only_and_holds_its_port():
    """Rank 0's torch.distributed store: bound on the address the other ranks dial (not every interface, as a store
    torch makes itself is), and held from the moment it is named, so no other process can take the port."""
    import socket

    from learner.learner import Learner
    from tests.test_weight_groups import listening_addresses

    learner = object.__new__(Learner)
    learner.listener = None
    host, port = learner.master_address().rsplit(":", 1)
    assert learner.master_address() == f"{host}:{port}"  # named once
    assert listening_addresses(int(port)) == {"127.0.0.1"} == {host}  # no Ray here: the loopback address
    with pytest.raises(OSError):
        socket.create_server(("127.0.0.1", int(port)))
    learner.listener.close()


@pytest.mark.parametrize("group_size", [2, 3, 6, 8, 16])
def test_a_group_of_equal_rewards_has_no_advantage_whatever_their_value(group_size):
    """GRPO learns nothing from a group whose samples scored alike: exactly 0 for every sample (a length-penalised
    reward's float mean misses it by a rounding error, and over a std near 0 that became an advantage of noise,
    trained as a live row), while a group that differs still gets its normalised advantages."""
    from learner.grpo import group_advantages
    from tasks.reward import length_penalized

    equal = [length_penalized(1.0, n, 400, 0.1) for n in (1, 7, 133, 399)]
    rewards = torch.tensor([[r] * group_size for r in equal] + [[1.0] + [0.0] * (group_size - 1)])
    for normalize_std in (True, False):
        advantages = group_advantages(rewards, normalize_std)
        assert torch.equal(advantages[:-1], torch.zeros(len(equal), group_size))
        assert advantages[-1, 0] > 0 and (advantages[-1, 1:] < 0).all()


def test_a_checkpoint_never_seals_what_a_crashed_save_left_in_its_partial_directory(tmp_path):
    """A save that crashed left `step_0.partial/` with a stray file and an optimizer shard of another layout: the next
    save of that step starts from an empty directory, so neither is sealed into (nor listed by) the checkpoint."""
    from learner.checkpoint import manifest, partial
    from learner.learner import Learner

    model_dir = str(resolve("builtin:dense"))
    learner = Learner(load_config("grpo_tiny", ["transport.auth=none"]), model_dir, model_dir, CursorPlan(0, 1, 2))
    learner.start()
    root = tmp_path / "checkpoints"
    leftover = partial(root / "step_0")
    (leftover / "draft").mkdir(parents=True)
    (leftover / "draft" / "model.safetensors").write_bytes(b"a draft LM no version handed out")
    (leftover / "deepspeed" / "state").mkdir(parents=True)
    (leftover / "deepspeed" / "state" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"rank 1 of 2")
    sealed = Path(learner.seal_checkpoint(str(root), "run", [learner.save_checkpoint(str(root))]))
    listed = manifest(sealed)["files"]
    assert not (sealed / "draft").exists() and not any("rank_1" in name for name in listed)
    assert any(name.startswith("deepspeed/") for name in listed) and not leftover.exists()


def test_a_learner_start_builds_no_deepspeed_op(monkeypatch):
    """DeepSpeed's init JIT-loaded its shared-memory all-reduce (CPU inference only) under a lock file in the torch
    extensions directory: a rank killed meanwhile left the lock, and every later learner start on the host waited
    on it for ever. A start now loads no op (here loading one fails the test instead of waiting on a lock)."""
    import deepspeed.comm.comm
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    from learner.learner import Learner

    def load(self, *args, **kwargs):
        raise AssertionError(f"a learner start loaded DeepSpeed's {self.NAME}")

    monkeypatch.setattr(ShareMemCommBuilder, "load", load)
    monkeypatch.setattr(deepspeed.comm.comm, "cdb", None)  # DeepSpeed's backend anew, as in a fresh rank process
    model_dir = str(resolve("builtin:dense"))
    learner = Learner(load_config("grpo_tiny", ["transport.auth=none"]), model_dir, model_dir, CursorPlan(0, 1, 2))
    learner.start()
    assert learner.engine is not None and deepspeed.comm.comm.cdb.shm_comm_op is None
