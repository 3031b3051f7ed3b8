"""The rollout benchmark's smoke preset end to end: every system runs, the JSON has the promised shape, and
SpecActor's speculative rollouts are exactly vanilla's."""

import json

import pytest

from bench.rollout import main

pytestmark = pytest.mark.slow


def test_smoke_benchmark_writes_json_and_png(tmp_path):
    out = tmp_path / "rollout.json"
    main(["--preset", "smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    systems = result["systems"]
    assert {"vanilla", "vllm_spec_draft", "vllm_spec_ngram", "specactor"} <= set(systems)
    for run in systems.values():
        assert run["makespan_s"] > 0 and run["tokens"] > 0 and run["tokens_per_s"] > 0 and run["acceptance_length"] >= 1
    assert result["identical_fraction"]["specactor"] == 1.0
    assert systems["specactor"]["tokens"] == systems["vanilla"]["tokens"]
    assert result["config"]["target_params"] > 50_000_000 and "cost-padded" in result["config"]["target"]
    assert out.with_suffix(".png").stat().st_size > 0
