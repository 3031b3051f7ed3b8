"""The rollout benchmark's command line without engines: the GPU preset refuses a machine without CUDA at once,
in one line naming what is missing (no traceback, no model built)."""

import time

import pytest
import torch

from bench.rollout import PRESETS, main


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the preset would run")
def test_gpu_preset_exits_at_once_without_cuda(capsys):
    start = time.time()
    with pytest.raises(SystemExit) as e:
        main(["--preset", "gpu", "--out", "/nonexistent/never-written.json"])
    assert e.value.code == 2 and time.time() - start < 5
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--preset gpu" in err and "CUDA" in err


def test_gpu_preset_runs_the_long_tail_workload_with_a_wider_sweep():
    assert PRESETS["gpu"]["ops"] == PRESETS["longtail"]["ops"] and PRESETS["gpu"]["device"] == "cuda"
    assert max(PRESETS["gpu"]["sweep"]) > max(PRESETS["longtail"]["sweep"])
