"""A "cost-padded" target for rollout benchmarks on small machines.

A model big enough for speculation to matter cannot be trained here, and a sub-million-parameter policy is
overhead-bound. So the benchmark's target is the trained Qwen3 policy made expensive without changing what it
computes:
- `zero_layers` extra decoder layers are put *in front* of the trained ones; their attention and MLP weights are
  random (every matmul is computed) but their output projections (`o_proj`, `down_proj`) are exactly zero, so
  the residual stream leaves them unchanged (in front, not behind: vLLM's fused add+RMSNorm would round it);
- every layer is widened to `num_heads` attention heads (key/value heads in the same ratio) and
  `intermediate_size` MLP units; the trained layers' extra heads and units have zero output columns;
- optionally the residual stream is widened to `hidden_size` (`c` times the trained width, `c` a power of four):
  the extra dimensions are zero in the embedding and receive only zero rows of every output projection, so they stay
  zero; the RMSNorms, which now average over `c` times as many dimensions, get their weights divided by `sqrt(c)`
  and their epsilon by `c`, which gives the same normalised values (exactly, in binary floating point: every factor
  is a power of two). Without it a narrow residual stream (128) beside wide MLPs makes a step's activations, not its
  weights, the memory it moves: on a GPU such a target's step cost grows with its tokens from the first few, unlike a
  real model's (bench/step_cost.py, docs/benchmarks.md).
The trained part's tokens are therefore reproduced up to fp32 summation order in the wider matmuls;
`python -m bench.rollout` measures and reports how often the padded target's greedy tokens equal the policy's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.zoo import copy_tokenizer


def build_padded_target(src: Path, dst: Path, zero_layers: int, num_heads: int, intermediate_size: int,
                        seed: int = 0, hidden_size: int | None = None) -> dict:
    """Writes the padded checkpoint to `dst` (a Hugging Face directory) and returns its config; `hidden_size`: the
    widened residual stream (None: the trained width)."""
    config = json.loads((src / "config.json").read_text())
    if config.get("model_type") != "qwen3":
        raise ValueError(f"{src}: cost padding is written for Qwen3 dense checkpoints, got {config.get('model_type')}")
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    hidden, layers, inter = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    if num_heads % heads or intermediate_size < inter:
        raise ValueError(f"num_heads must be a multiple of {heads} and intermediate_size >= {inter}")
    wide = hidden_size or hidden
    widening = wide // hidden
    if wide % hidden or widening & (widening - 1) or widening.bit_length() % 2 == 0:
        raise ValueError(f"hidden_size must be the trained {hidden} times a power of four, got {hidden_size}")
    norm = widening ** -0.5  # a power of two: the RMSNorms' rescaling is exact
    new_kv = kv_heads * num_heads // heads  # keeps every trained query head on its own key/value head
    gen = torch.Generator().manual_seed(seed)
    weights = load_file(str(src / "model.safetensors"))

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * shape[-1] ** -0.5

    def padded(t: torch.Tensor, rows: int, cols: int, zero: bool) -> torch.Tensor:
        out = torch.zeros(rows, cols) if zero else random(rows, cols)
        out[: t.shape[0], : t.shape[1]] = t
        return out

    def rms(weight: torch.Tensor) -> torch.Tensor:  # a residual-stream norm's weight, for the widened stream
        return padded((weight * norm).unsqueeze(0), 1, wide, True)[0]

    def layer(i: int, trained: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        p = f"model.layers.{i}."
        if trained is None:  # an expensive no-op: random everywhere except exactly-zero output projections
            t = {"self_attn.q_proj.weight": random(num_heads * head_dim, wide),
                 "self_attn.k_proj.weight": random(new_kv * head_dim, wide),
                 "self_attn.v_proj.weight": random(new_kv * head_dim, wide),
                 "self_attn.o_proj.weight": torch.zeros(wide, num_heads * head_dim),
                 "self_attn.q_norm.weight": torch.ones(head_dim), "self_attn.k_norm.weight": torch.ones(head_dim),
                 "mlp.gate_proj.weight": random(intermediate_size, wide),
                 "mlp.up_proj.weight": random(intermediate_size, wide),
                 "mlp.down_proj.weight": torch.zeros(wide, intermediate_size),
                 "input_layernorm.weight": torch.ones(wide), "post_attention_layernorm.weight": torch.ones(wide)}
        else:
            t = dict(trained)
            t["self_attn.q_proj.weight"] = padded(t["self_attn.q_proj.weight"], num_heads * head_dim, wide, False)
            t["self_attn.k_proj.weight"] = padded(t["self_attn.k_proj.weight"], new_kv * head_dim, wide, False)
            t["self_attn.v_proj.weight"] = padded(t["self_attn.v_proj.weight"], new_kv * head_dim, wide, False)
            t["self_attn.o_proj.weight"] = padded(t["self_attn.o_proj.weight"], wide, num_heads * head_dim, True)
            t["mlp.gate_proj.weight"] = padded(t["mlp.gate_proj.weight"], intermediate_size, wide, False)
            t["mlp.up_proj.weight"] = padded(t["mlp.up_proj.weight"], intermediate_size, wide, False)
            t["mlp.down_proj.weight"] = padded(t["mlp.down_proj.weight"], wide, intermediate_size, True)
            for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                t[name] = rms(t[name])
        return {p + k: v.contiguous() for k, v in t.items()}

    out = {k: v for k, v in weights.items() if not k.startswith("model.layers.")}
    if widening > 1:  # the embedding (and the LM head, tied or not) read and write only the trained dimensions
        for name, value in out.items():
            if value.dim() == 2 and value.shape[1] == hidden:
                out[name] = padded(value, value.shape[0], wide, True)
        out["model.norm.weight"] = rms(out["model.norm.weight"])
    for i in range(zero_layers):
        out.update(layer(i, None))
    for i in range(layers):
        prefix = f"model.layers.{i}."
        trained = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        out.update(layer(zero_layers + i, trained))
    config.update(hidden_size=wide, rms_norm_eps=config["rms_norm_eps"] / widening,
                  num_hidden_layers=zero_layers + layers, num_attention_heads=num_heads,
                  num_key_value_heads=new_kv, intermediate_size=intermediate_size,
                  max_window_layers=zero_layers + layers, layer_types=None)
    config = {k: v for k, v in config.items() if v is not None}
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(src, dst)
    return config


def parameter_count(config: dict) -> int:
    h, v, hd = config["hidden_size"], config["vocab_size"], config["head_dim"]
    q, kv, inter = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd, config["intermediate_size"]
    per_layer = h * (2 * q + 2 * kv) + 3 * h * inter + 2 * h + 2 * hd
    return v * h + config["num_hidden_layers"] * per_layer + h
