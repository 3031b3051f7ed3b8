"""The rollout benchmark's smoke preset end to end: every system runs, the JSON has the promised shape, and
SpecActor's speculative rollouts are exactly vanilla's."""

import importlib.util
import json

import pytest

from bench.rollout import main

pytestmark = pytest.mark.slow


def test_smoke_benchmark_writes_json_and_png(tmp_path, capsys):
    out = tmp_path / "rollout.json"
    main(["--preset", "smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    systems = result["systems"]
    suffix_tree = importlib.util.find_spec("arctic_inference") is not None  # `make vllm-suffix` built it
    assert set(systems) == {"vllm", "vanilla", "vllm_spec_draft", "vllm_spec_ngram", "oracle", "specactor",
                            "specactor_decoupled", "specactor_ngram", "specactor_suffix", "specactor_fastest",
                            "specactor_fastest_decoupled"} | ({"vllm_spec_suffix"} if suffix_tree else set())
    for run in systems.values():
        assert run["makespan_s"] > 0 and run["tokens"] > 0 and run["tokens_per_s"] > 0 and run["acceptance_length"] >= 1
        assert run["speedup"] > 0
    for name in ("specactor", "oracle", "specactor_decoupled", "specactor_ngram", "specactor_suffix",
                 "specactor_fastest", "specactor_fastest_decoupled"):  # coupled speculation: exactly vanilla's tokens
        assert result["identical_fraction"][name] == 1.0 and systems[name]["tokens"] == systems["vanilla"]["tokens"]
    # the oracle drafts vanilla's own tokens: nearly every draft accepted (k + 1 = 5 tokens per verify step)
    assert systems["oracle"]["acceptance_length"] > 4.5
    assert set(systems["specactor"]["profile_ms_per_step"]) == {"sampler", "bridge", "drafter", "engine"}
    assert 0 <= systems["specactor"]["planner"]["planned_tokens"] <= 4  # the planner's choices are reported
    assert systems["oracle"]["planner"]["planned_tokens"] > 3  # every draft accepted: it drafts nearly always
    assert 0 < result["workload"]["tail_share_last_10pct"] < 1 and result["workload"]["max_over_median"] > 1
    assert set(result["sweep"]) == {"1", "16"} and "share_of_oracle_speedup" in result
    assert result["config"]["target_params"] > 50_000_000 and "cost-padded" in result["config"]["target"]
    assert out.with_suffix(".png").stat().st_size > 0
    console = capsys.readouterr().out  # the table, not the engines' start-up logs (those are in the .log file)
    assert "| specactor |" in console and "WARNING" not in console and "Loading" not in console
    assert out.with_suffix(".log").stat().st_size > 0


def test_a_later_epoch_gives_the_history_drafter_the_prompts_earlier_outputs(tmp_path):
    """`--epochs-before 1`: each engine first generates the prompts with the first epoch's seeds, unmeasured; the
    measured epoch's tokens are still exactly vanilla's, and the suffix drafter, now holding every prompt's earlier
    outputs, is accepted more than with only the running group's siblings."""
    run = ["--preset", "smoke", "--systems", "specactor_suffix", "--no-sweep"]
    first = main([*run, "--out", str(tmp_path / "first.json")])
    second = main([*run, "--epochs-before", "1", "--out", str(tmp_path / "second.json")])
    assert first["config"]["epochs_before"] == 0 and second["config"]["epochs_before"] == 1
    assert second["identical_fraction"]["specactor_suffix"] == 1.0
    assert (second["systems"]["specactor_suffix"]["acceptance_length"]
            > first["systems"]["specactor_suffix"]["acceptance_length"])


def test_a_warm_up_on_other_prompts_warms_the_planner_and_gives_history_nothing(tmp_path):
    """`--warm-up`: each engine first generates another draw of the workload, unmeasured. The oracle replays it too
    (every draft of the measured run is accepted), the tokens are still vanilla's, and the history drafter, which
    holds only other prompts' outputs, gains nothing like what the same prompts' earlier epoch gives it."""
    run = ["--preset", "smoke", "--systems", "oracle", "specactor_suffix", "--no-sweep"]
    warm = main([*run, "--warm-up", "--out", str(tmp_path / "warm.json")])
    again = main([*run, "--epochs-before", "1", "--out", str(tmp_path / "again.json")])
    assert warm["config"]["warm_up"] and warm["identical_fraction"]["specactor_suffix"] == 1.0
    assert warm["systems"]["oracle"]["acceptance_length"] > 4.5
    assert (warm["systems"]["specactor_suffix"]["acceptance_length"]
            < again["systems"]["specactor_suffix"]["acceptance_length"])


def test_the_contention_benchmark_times_steps_beside_a_drafting_thread_and_process(tmp_path):
    """Each mode's steps are timed beside a drafting call that ran (its seconds measured), in as many triples as
    asked at least."""
    from bench.draft_contention import main as draft_contention

    out = tmp_path / "contention.json"
    result = draft_contention(["--triples", "6", "--out", str(out)])
    assert json.loads(out.read_text()) == result and result["triples"] >= 6 and result["step_ms_without_drafting"] > 0
    for mode in ("thread", "process"):
        low, high = result[mode]["step_ratio"][1:]
        assert result[mode]["drafting_call_ms"] > 0 and 0 < low <= result[mode]["step_ratio"][0] <= high
