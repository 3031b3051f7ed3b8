"""The benchmarks' command lines without engines: the rollout GPU preset refuses a machine without CUDA at once,
in one line naming what is missing (no traceback, no model built), as do bad arguments; a later epoch's workload;
the weight-sync benchmark runs small."""

import itertools
import json

import pytest
import torch

from bench.rollout import PRESETS, main, workload


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the preset would run")
def test_gpu_preset_exits_at_once_without_cuda(capsys, monkeypatch):
    import bench.padded_target

    def built(*args, **kwargs):
        raise AssertionError("the gpu preset built its target model on a machine without CUDA")

    monkeypatch.setattr(bench.padded_target, "build_padded_target", built)
    with pytest.raises(SystemExit) as e:
        main(["--preset", "gpu", "--out", "/nonexistent/never-written.json"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--preset gpu" in err and "CUDA" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the benchmark would run")
def test_the_gpu_torch_benchmark_exits_at_once_without_cuda(capsys):
    from bench import gpu_torch

    assert gpu_torch.main(["--out", "/nonexistent/never-written.json"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bench.gpu_torch" in err and "CUDA" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the benchmark would run")
def test_the_step_cost_benchmark_exits_at_once_without_cuda(capsys):
    from bench import step_cost

    assert step_cost.main(["--out", "/nonexistent/never-written.json"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bench.step_cost" in err and "CUDA" in err


def test_the_step_cost_benchmark_times_the_presets_own_targets():
    """bench.step_cost's preset targets have the matmul shapes of the targets bench.rollout's presets build, and a
    measurement gives every token count and the verify/decode ratio where both were timed."""
    from bench.rollout import TARGETS
    from bench.step_cost import CPU_SHAPES, SHAPES, step_cost
    from models.zoo import resolve

    c = json.loads((resolve("builtin:dense") / "config.json").read_text())
    for shape, t in ((SHAPES["gpu_preset_target"], TARGETS["cuda"]), (CPU_SHAPES["cpu_preset_target"], TARGETS["cpu"])):
        kv = c["num_key_value_heads"] * t["num_heads"] // c["num_attention_heads"] * c["head_dim"]  # as padded
        assert shape == (t.get("hidden_size", c["hidden_size"]), t["num_heads"] * c["head_dim"], kv,
                         t["intermediate_size"], t["zero_layers"] + c["num_hidden_layers"], c["vocab_size"])
    result = step_cost((64, 64, 32, 256, 2, 100), (1, 5, 8), device="cpu", dtype=torch.float32)
    assert set(result["ms_by_tokens"]) == {1, 5, 8} and min(result["ms_by_tokens"].values()) > 0
    assert set(result["verify_k4_over_decode_by_requests"]) == {1}
    assert result["parameters"] == 2 * 64 * (2 * 64 + 2 * 32 + 3 * 256) + 100 * 64


@pytest.mark.parametrize("shape", ["512", "512,x", "0,4"])
def test_the_gpu_torch_benchmark_refuses_a_bad_draft_shape_by_name(shape, capsys):
    from bench import gpu_torch

    with pytest.raises(SystemExit) as e:
        gpu_torch.main(["--out", "/nonexistent/never-written.json", "--draft-shapes", "256,2", shape])
    assert e.value.code == 2 and "--draft-shapes" in capsys.readouterr().err


def test_a_draft_of_a_given_shape_is_a_draft_lm_the_distiller_loads(tmp_path):
    """bench.gpu_torch times the distiller on larger draft LMs: one written by `draft_of_shape` has that shape,
    the built-in draft LM's tokenizer, and loads as `speculation.options.model`."""
    from bench.gpu_torch import draft_of_shape
    from configs.load import load_config
    from learner.distill import DraftDistiller

    parameters = draft_of_shape(128, 3, tmp_path)
    cfg = load_config("grpo_tiny", ["speculation.method=draft_lm", f"speculation.options.model={tmp_path}"])
    model = DraftDistiller(cfg).model
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (128, 3)
    assert sum(p.numel() for p in model.parameters()) == parameters and (tmp_path / "tokenizer.json").exists()


def test_gpu_preset_runs_the_long_tail_workload_with_a_wider_sweep():
    assert PRESETS["gpu"]["ops"] == PRESETS["longtail"]["ops"] and PRESETS["gpu"]["device"] == "cuda"
    assert max(PRESETS["gpu"]["sweep"]) > max(PRESETS["longtail"]["sweep"])


def test_a_later_epoch_samples_the_same_prompts_with_other_seeds():
    prompts, seeds = workload(PRESETS["longtail"], seed=0)
    later_prompts, later_seeds = workload(PRESETS["longtail"], seed=0, epoch=1)
    assert later_prompts == prompts and len(set(seeds)) == len(seeds) and not set(seeds) & set(later_seeds)


@pytest.mark.parametrize("flag, value", [("--epochs-before", "-1"), ("--speculative-tokens", "0")])
def test_bad_arguments_are_refused_by_name_before_any_model_is_built(flag, value, capsys):
    with pytest.raises(SystemExit):
        main(["--preset", "smoke", flag, value])
    assert f"{flag} must be" in capsys.readouterr().err


def test_the_undrafted_steps_benchmark_refuses_no_rollouts_before_any_engine_starts(capsys):
    from bench.undrafted_steps import main as undrafted_steps

    with pytest.raises(SystemExit):
        undrafted_steps(["--rollouts", "0"])
    assert "--rollouts must be 1 or more" in capsys.readouterr().err


def test_the_contention_benchmark_refuses_no_triples_before_any_engine_starts(capsys):
    from bench.draft_contention import main as draft_contention

    with pytest.raises(SystemExit):
        draft_contention(["--triples", "0"])
    assert "--triples must be 1 or more" in capsys.readouterr().err


def test_vllms_suffix_method_is_run_only_where_its_dependency_was_built(capsys, monkeypatch):
    """vLLM's `suffix` speculation imports arctic-inference's suffix tree (`make vllm-suffix`): asked for without it,
    the benchmark says so before any model is built."""
    import bench.rollout

    monkeypatch.setattr(bench.rollout.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit) as e:
        main(["--systems", "vllm_spec_suffix"])
    assert e.value.code == 2 and "make vllm-suffix" in capsys.readouterr().err


def test_weight_sync_benchmark_measures_every_channel_against_raw_zeromq(tmp_path):
    """Every system delivers whole versions (the subscriber acknowledges each one), and the JSON pairs each with
    raw ZeroMQ and names CURVE's cost."""
    import json

    from bench.weight_sync import SYSTEMS
    from bench.weight_sync import main as weight_sync

    out = tmp_path / "weight_sync.json"
    weight_sync(["--mib", "8", "--bucket-mib", "2", "--repeats", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["config"]["bytes"] >= 8 << 20 and set(result["systems"]) == set(SYSTEMS)
    for system in result["systems"].values():
        assert system["gb_per_s"] > 0 and len(system["seconds"]) == 1 and system["of_raw"]["speedup"] > 0
    assert result["systems"]["raw"]["of_raw"]["speedup"] == 1.0 and result["curve_cost"]["speedup"] > 0


@pytest.mark.parametrize("flag,value", [("--staleness", "0"), ("--repeats", "0")])
def test_end_to_end_benchmark_refuses_bad_arguments_by_name_before_any_run(flag, value, capsys):
    from bench.e2e import main as e2e

    with pytest.raises(SystemExit) as e:
        e2e(["--preset", "smoke", "--out", "/nonexistent/never-written.json", flag, value])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_end_to_end_benchmark_refuses_a_misspelt_set_key_by_name_before_any_run(capsys):
    from bench.e2e import main as e2e

    with pytest.raises(SystemExit) as e:
        e2e(["--preset", "smoke", "--out", "/nonexistent/never-written.json", "--systems", "oracle",
             "--set", "learner.lrr=3e-4"])
    assert e.value.code == 2 and "learner.lrr" in capsys.readouterr().err


def test_end_to_end_benchmark_against_async_runs_no_sync_and_pairs_each_system_with_async(tmp_path, monkeypatch):
    """`--reference async` (the do-no-harm measurement): each repeat runs async and the listed systems, never sync,
    and a system's speed-up is paired per repeat over async; the oracle, which replays sync, is refused without it."""
    import bench.e2e

    ran = []
    step_s = {"async": [1.0, 2.0, 1.5], "frozen": [0.8, 2.0, 1.2]}  # per repeat: 1.25x, 1.0x, 1.25x
    accepted = {"async": [[], [], []], "frozen": [[1.0], [2.0, 2.0], [3.0, 2.0, 4.0]]}  # live, per repeat and step

    def fake_run(system, steps, overrides, logdir, log):
        ran.append(system)
        return {"step_s": step_s[system][sum(r == system for r in ran) - 1], "rollout_s": 0.5,
                "profile": {"train_s": 0.2, "learner_wait_s": 0.1, "actor_idle_s": 0.0},
                "engine_profile": {"steps": 10.0}, "drafting": {"planned_tokens": 0.0},
                "acceptance_by_step": accepted[system][sum(r == system for r in ran) - 1],
                "member_acceptance_by_step": {}, "heldout_reward": 0.1, "dropped_stale": 0}

    monkeypatch.setattr(bench.e2e, "run", fake_run)
    result = bench.e2e.main(["--preset", "smoke", "--out", str(tmp_path / "e2e.json"), "--systems", "frozen",
                             "--reference", "async", "--repeats", "3"])
    assert sorted(ran) == ["async"] * 3 + ["frozen"] * 3
    assert set(result["systems"]) == {"async", "frozen"}
    assert result["systems"]["frozen"]["speedup_over_async"]["speedup"] == 1.25
    assert "speedup_over_sync" not in result["systems"]["frozen"]
    assert result["systems"]["frozen"]["acceptance"] == 2.0  # the repeats' means are 1, 2 and 3 (the first's: 1)
    assert result["systems"]["async"]["acceptance"] == 1.0
    with pytest.raises(SystemExit) as e:
        bench.e2e.main(["--preset", "smoke", "--out", str(tmp_path / "never.json"), "--systems", "oracle",
                        "--reference", "async"])
    assert e.value.code == 2


def test_every_end_to_end_system_is_a_valid_run_config():
    """bench.e2e launches each system as grpo_tiny plus overrides: every combination must pass the launcher's
    config checks (a misspelt key would only surface minutes into the benchmark)."""
    from bench.e2e import PRESETS, SYSTEMS, system_config

    assert list(SYSTEMS) == ["sync", "async", "frozen", "distilled", "fastest_of_n", "oracle"]  # the order
    for preset, staleness in itertools.product(PRESETS.values(), (1, 2)):
        for name in SYSTEMS:
            cfg = system_config(name, preset["overrides"], staleness, preset["steps"])
            assert cfg.algorithm.max_staleness == (0 if name in ("sync", "oracle") else staleness)
            assert cfg.trainer.deterministic == (name in ("sync", "oracle"))
            assert cfg.logging.rollouts == (name == "sync")
            assert (cfg.speculation.method == "none") == (name in ("sync", "async"))
            assert (cfg.speculation.distill.every_versions > 0) == (name in ("distilled", "fastest_of_n"))


def test_end_to_end_seconds_per_step_is_the_run_mean_not_the_median_gap():
    """Asynchronous steps come in pairs (a long wait for a step's groups, then a short step whose groups were made
    meanwhile): the median gap picks one mode, the run's mean does not."""
    from bench.e2e import seconds_per_step

    times = [0.0, 20.0]  # the first step holds the engines' start and is left out
    for gap in [1.4, 0.2] * 10 + [1.4]:
        times.append(times[-1] + gap)
    assert seconds_per_step(times) == pytest.approx((1.4 * 11 + 0.2 * 10) / 21)
    with pytest.raises(ValueError, match="3 or more"):
        seconds_per_step([0.0, 1.0])


def test_a_system_whose_rollout_actor_ended_with_an_error_is_not_measured(tmp_path, monkeypatch):
    """The launch exited 0 but an actor's summary is an error (its counters died with it): the benchmark stops,
    naming the system, the actor and its error, instead of reporting a rollout time without that actor's seconds."""
    import json
    import subprocess

    import bench.e2e

    def launch(command, **kwargs):  # what a run that lost its actor at the close leaves behind
        logdir = next(a.split("=", 1)[1] for a in command if a.startswith("logging.dir="))
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "summary.json").write_text(json.dumps(
            {"learner": {"trained": 0}, "actors": [{"actor": 0, "error": "RuntimeError: engine died"}]}))
        assert logdir == str(tmp_path / "run")
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(bench.e2e.subprocess, "run", launch)
    with pytest.raises(RuntimeError, match=r"async: rollout actor 0 ended with RuntimeError: engine died"):
        bench.e2e.run("async", 4, [], tmp_path / "run", tmp_path / "log.txt")


def test_distillation_is_judged_paired_on_the_same_tokens_as_well_as_by_its_trend():
    from bench.e2e import late_gain, trend

    # a run whose policy drifted far: both draft LMs fall, the distilled one less (same tokens, same steps)
    run = {"replayed_acceptance_by_step": [3.6, 3.6, 3.2, 3.0, 3.0, 3.0, 2.9, 3.0],
           "initial_replayed_acceptance_by_step": [3.6, 3.6, 3.0, 2.6, 2.5, 2.4, 2.4, 2.5]}
    assert trend(run["replayed_acceptance_by_step"]) == pytest.approx(2.95 / 3.6, abs=1e-3)
    assert late_gain(run) == pytest.approx(2.95 / 2.45, abs=1e-3)
    assert late_gain({"replayed_acceptance_by_step": [3.0], "initial_replayed_acceptance_by_step": [3.0]}) is None


def test_the_oracle_replays_the_sync_run_of_its_repeat_right_after_it(tmp_path):
    from bench.e2e import oracle_replay, order
    from bench.oracle import OracleDrafter
    from drafters.base import DraftRequest

    names = ["sync", "async", "fastest_of_n", "oracle"]
    assert [order(names, r) for r in range(3)] == [["sync", "oracle", "async", "fastest_of_n"],
                                                   ["async", "fastest_of_n", "sync", "oracle"],
                                                   ["fastest_of_n", "sync", "oracle", "async"]]
    (tmp_path / "sync-0").mkdir()
    (tmp_path / "sync-0" / "rollouts.jsonl").write_text(
        "".join(json.dumps({"step": 0, "seed": s, "response_ids": r}) + "\n" for s, r in [(8, [1, 2, 3]), (9, [4])]))
    override = oracle_replay(tmp_path / "sync-0", tmp_path / "replay.json")
    oracle = OracleDrafter(override.split("=", 1)[1])
    requests = [DraftRequest(request_id="a", seed=8, position=1, token_ids=[0, 1]),
                DraftRequest(request_id="b", seed=5, position=0, token_ids=[0])]
    assert oracle.propose(requests, 2) == [[2, 3], []]  # from its position on; a seed sync never sampled: nothing


def test_each_member_of_fastest_of_n_gets_its_acceptance_over_the_run(tmp_path, monkeypatch):
    """bench.e2e reads a run's TensorBoard scalars: fastest-of-N's members' token acceptance, step by step."""
    import json
    import subprocess

    from torch.utils.tensorboard import SummaryWriter

    import bench.e2e

    def launch(command, **kwargs):  # a finished 4-step run: its events and summary
        logdir = tmp_path / "run"
        writer = SummaryWriter(str(logdir))
        for step in range(4):
            for tag, value in {"rl/reward_mean": 0.5, "rl/train_seconds": 0.1, "rl/wait_seconds": 0.2,
                               "rl/zero_advantage_fraction": 0.5, "spec/acceptance_length": 2.0,
                               "spec/member/suffix/token_acceptance": 0.5 + step / 10}.items():
                writer.add_scalar(tag, value, step, walltime=100.0 + step)
            if step != 2:  # the draft LM made no proposal at step 2
                writer.add_scalar("spec/member/draft_lm/token_acceptance", 0.8, step, walltime=100.0 + step)
        writer.add_scalar("eval/reward_mean", 0.3, 4)
        writer.close()
        (logdir / "summary.json").write_text(json.dumps(
            {"learner": {"trained": 32, "dropped_stale": 0},
             "actors": [{"actor": 0, "generate_seconds": 2.0, "idle_seconds": 0.0, "engine_steps": 200,
                         "sampler_seconds": 0.4, "bridge_seconds": 0.2, "drafter_seconds": 0.1}]}))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(bench.e2e.subprocess, "run", launch)
    run = bench.e2e.run("fastest_of_n", 4, [], tmp_path / "run", tmp_path / "log.txt")
    assert run["member_acceptance_by_step"] == {"suffix": [[0, 0.5], [1, 0.6], [2, 0.7], [3, 0.8]],
                                                "draft_lm": [[0, 0.8], [1, 0.8], [3, 0.8]]}
    assert run["acceptance_by_step"] == [2.0] * 4
    assert run["engine_profile"] == {"engine_steps": 50, "sampler_s": 0.1, "bridge_s": 0.05, "drafter_s": 0.025}


def test_the_gpu_check_fits_its_window_and_runs_with_only_what_a_gpu_machine_has(tmp_path):
    """`--dry-run` lists every section within the 8 minutes one GPU check may take; the check itself, run small on
    this CPU, finishes every section importing nothing the GPU machines lack (ZeroMQ, Ray, vLLM: blocked here)."""
    import subprocess
    import sys

    from bench.gpu_check import LIMIT_S, SECTIONS, START_S

    dry = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run"], capture_output=True, text=True)
    assert dry.returncode == 0 and all(name in dry.stdout for name in SECTIONS)
    assert START_S + sum(s for s, _ in SECTIONS.values()) <= LIMIT_S <= 480
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        "class Absent(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in {'zmq', 'ray', 'vllm'}:\n"
        "            raise ImportError(name + ' is not on the GPU machine')\n"
        "sys.meta_path.insert(0, Absent())\n")
    import os

    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.getcwd()}"}
    run = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--quick", "--out",
                          str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300)
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert run.returncode == 0, report
    sections = report["sections"]
    assert list(sections) == list(SECTIONS) and not any("error" in s for s in sections.values())
    assert sections["learner"]["result"]["logprob_gap_max"] < 1e-3  # fp32 here: the learner's are the decode's
    assert all(v["ms_per_draft_position"] > 0 for v in sections["draft_lm"]["result"]["builtin_draft"]["eager"]
               .values())
    side_by_side = sections["overlap"]["result"]["by_requests"]["4"]  # the drafting thread ran beside the verify
    assert side_by_side["draft_ms_side_by_side"] > 0 and side_by_side["verify_slowdown"] > 0


def _mapped_libraries() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


def test_preloaded_libraries_are_loaded_by_the_engine_processes_started_meanwhile(tmp_path):
    """`bench.rollout --preload LIB`: the spawned engine process has LIB mapped before anything imported it; the
    benchmark's own environment is as it was afterwards."""
    import os
    import sys
    from pathlib import Path

    from bench.engine_process import in_fresh_process
    from bench.rollout import preloaded

    library = Path(sys.prefix) / "lib" / "libiomp5.so"  # intel-openmp, a dependency of vLLM's CPU build
    before = os.environ.get("LD_PRELOAD")
    with preloaded([library]):
        assert str(library.resolve()) in in_fresh_process(tmp_path / "log", _mapped_libraries)
    assert os.environ.get("LD_PRELOAD") == before
    assert str(library.resolve()) not in in_fresh_process(tmp_path / "log", _mapped_libraries)
