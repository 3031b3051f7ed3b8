"""`launch.py --plan`: the production shape (grpo_moe, a Qwen3-30B-A3B-shaped config.json, no weights) plans on a
described 2-node x 8-GPU cluster, learner ranks packed on one node and tensor-parallel actors on the other; a
cluster too small in GPUs or in memory is refused with the shortfall named; nothing is started."""

import pytest

import launch
from configs.load import load_config
from driver.plan import learner_bytes, rollout_bytes

MOE = ["--config", "grpo_moe", "model.path=configs/shapes/qwen3_30b_a3b", "--plan"]
QWEN3_30B_A3B = 30_532_122_624  # parameters


def test_grpo_moe_plans_on_two_nodes_of_eight_gpus(capsys):
    assert launch.main([*MOE, "--cluster", "2x8:80"]) == 0
    out = capsys.readouterr().out
    assert f"({QWEN3_30B_A3B:,})" in out and "61.06 GB per version" in out
    assert "node-0: " + ", ".join(f"learner-{r}" for r in range(8)) in out
    assert "node-1: " + ", ".join(f"rollout-{i}" for i in range(4)) in out
    assert "learner rank: weights 7.11 + gradients 7.11 + optimizer 42.65 = 56.87 GiB of 80" in out
    assert "rollout GPU: weights 28.44 + kv_cache 40.00 = 68.44 GiB of 80" in out
    # transport.weights nccl: a version's time per engine at NCCL's rate, each engine sent its own copy
    assert "~1.6 s per engine by NCCL" in out and "each of the 4 engines its own copy, ~6.4 s" in out
    assert out.strip().endswith("plan: the cluster holds the run")


def test_one_gpu_holds_a_learner_rank_and_an_engine_together(capsys):
    args = ["--config", "grpo_gpu1", "model.path=configs/shapes/qwen3_1.7b", "--plan", "--cluster"]
    assert launch.main([*args, "1x1:80"]) == 0
    out = capsys.readouterr().out
    assert "node-0: learner-0, rollout-0" in out and "together 44.84 GiB of 80" in out
    assert "nccl" not in out  # two processes on one GPU cannot form an NCCL group: not offered
    assert launch.main([*args, "1x1:40"]) == 3
    assert "the shared GPU needs 44.84 GiB, it has 40" in capsys.readouterr().out


@pytest.mark.parametrize("cluster,shortfall", [
    ("1x8:80", "no node has 2 GPU(s) left for rollout-0"),  # the learner ranks fill the only node
    ("2x8:40", "a learner rank needs 56.87 GiB, a GPU has 40"),
    ("6x3:80", "no node has 2 GPU(s) left for rollout-3"),  # 18 GPUs, but only 3 pairs on one node after ranks
])
def test_a_cluster_that_cannot_hold_the_run_is_refused_naming_the_shortfall(capsys, cluster, shortfall):
    assert launch.main([*MOE, "--cluster", cluster]) == 3
    assert f"plan: the cluster cannot hold the run: {shortfall}" in capsys.readouterr().out


@pytest.mark.parametrize("args", [["--cluster", "99999999x99999999:80"], ["--cluster", "2x8:0"],
                                  ["--gpu-gib", "nan"], ["--gpu-gib", "-3"]])
def test_a_described_cluster_or_gpu_memory_out_of_range_is_a_usage_error(capsys, args):
    """A described cluster was built node by node before anything was checked: 99999999 nodes never returned."""
    with pytest.raises(SystemExit) as exit_:
        launch.main([*MOE, *args])
    assert exit_.value.code == 2 and "is not" in capsys.readouterr().err


def test_memory_per_device_follows_the_zero_stage_and_tensor_parallelism():
    p = 1_000_000_000
    for stage, (weights, gradients, optimizer) in {0: (2, 2, 12), 1: (2, 2, 1.5), 2: (2, 0.25, 1.5),
                                                   3: (0.25, 0.25, 1.5)}.items():
        cfg = load_config("grpo_moe", ["model.path=configs/shapes/qwen3_30b_a3b", f"learner.zero_stage={stage}"])
        assert learner_bytes(cfg, p) == {"weights": weights * p, "gradients": gradients * p, "optimizer": optimizer * p}
    cfg = load_config("grpo_tiny", ["algorithm.kl_coef=0.1"])  # fp32, ZeRO-0: no master copy; a reference model
    assert learner_bytes(cfg, p) == {"weights": 4 * p, "gradients": 4 * p, "optimizer": 8 * p, "reference": 4 * p}
    cfg = load_config("grpo_moe", ["model.path=configs/shapes/qwen3_30b_a3b", "rollout.tensor_parallel_size=4"])
    assert rollout_bytes(cfg, p) == {"weights": 0.5 * p, "kv_cache": 40960 * 2.0**20}


def test_plan_on_this_machine_starts_nothing(capsys):
    import ray

    assert launch.main(["--config", "grpo_tiny", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "this machine: learner-0, rollout-0" in out and not ray.is_initialized()


def test_the_distiller_is_planned_on_its_share_of_rank_0s_gpu(capsys, monkeypatch):
    """With distillation on, the plan shows the draft LM distiller's memory where it runs, and counts it on rank
    0's GPU: the grpo_moe shape's rank 0 fits at 80 GiB alone, not with a (hypothetically) 1B-parameter draft LM."""
    from driver import plan

    spec = ["speculation.method=draft_lm", "speculation.distill.every_versions=4", "speculation.distill.num_gpus=0.25"]
    assert launch.main(["--config", "grpo_tiny", "--plan", "--cluster", "1x2:80", "cluster.device=cuda", *spec]) == 0
    draft = plan.parameters("builtin:draft")[1]
    out = capsys.readouterr().out
    assert f"draft LM distiller: {28 * draft / 2**20:.1f} MiB on a 0.25 share of rank 0's GPU" in out
    real = plan.parameters
    shape = "configs/shapes/qwen3_1.7b"  # a draft LM of the policy's vocabulary (distilled, it must share it)
    monkeypatch.setattr(plan, "parameters",  # the policy as planned, a 1B-parameter draft LM
                        lambda path: ("qwen3", 1_000_000_000) if path == shape else real(path))
    assert launch.main(["--config", "grpo_moe", "--plan", "--cluster", "2x8:80",
                        "model.path=configs/shapes/qwen3_30b_a3b", *spec, f"speculation.options.model={shape}"]) == 3
    assert "learner rank 0 with the distiller needs 82.95 GiB, a GPU has 80" in capsys.readouterr().out


def test_a_plan_on_cluster_address_without_a_cluster_says_what_to_do(capsys, monkeypatch):
    """grpo_moe names `cluster.address: auto`: with no Ray cluster running, --plan exits 2 saying how to start one
    or to describe it, not with a ConnectionError traceback."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert launch.main(MOE) == 2
    err = capsys.readouterr().err
    assert "no Ray cluster at cluster.address='auto'" in err and "--cluster NODESxGPUS" in err
    assert "Traceback" not in err


def test_a_plan_refuses_a_prompt_the_model_cannot_hold_as_the_run_would(tmp_path, capsys):
    """The prompt-length check needs the model's tokenizer: `--plan` makes it too where the model directory has one,
    so a data file the launch would refuse (exit 2, before Ray) is not passed by the plan."""
    import json

    (tmp_path / "long.jsonl").write_text(json.dumps({"question": "1+1=? " * 400, "answer": "1+1=2\n#### 2"}) + "\n")
    assert launch.main(["--config", "grpo_tiny", f"data.source={tmp_path / 'long.jsonl'}", "--plan"]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and "data.source" in err and "leaves no room" in err
