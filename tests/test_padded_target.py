"""The rollout benchmark's cost-padded target (bench/padded_target.py) computes what the trained policy computes:
its extra layers, heads, MLP units and residual dimensions change no logit beyond fp32 summation order."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.padded_target import build_padded_target
from models.zoo import resolve


@pytest.mark.parametrize("hidden_size", [None, 512])
def test_the_padded_target_gives_the_policy_s_logits(tmp_path, hidden_size):
    policy = resolve("builtin:dense")
    config = build_padded_target(policy, tmp_path, zero_layers=2, num_heads=8, intermediate_size=1024,
                                 hidden_size=hidden_size)
    assert config["hidden_size"] == (hidden_size or 128) and config["num_hidden_layers"] == 6
    tokens = torch.tensor([[1, 5, 9, 17, 33, 2, 8, 100, 200, 7]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(str(policy), dtype=torch.float32)(tokens).logits
        padded = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
        got = padded(tokens).logits
    assert padded.config.hidden_size == (hidden_size or 128)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_widening_that_is_not_a_power_of_four_is_refused(tmp_path):
    with pytest.raises(ValueError, match="hidden_size must be the trained 128 times a power of four, got 256"):
        build_padded_target(resolve("builtin:dense"), tmp_path, zero_layers=1, num_heads=8, intermediate_size=1024,
                            hidden_size=256)
