"""The built-in checkpoints: Hugging Face format that vLLM and transformers both load and agree on."""

import dataclasses
import hashlib
import json

import pytest
import torch
import transformers

from actor.engine import close_engine
from models import zoo
from models.recipe import RECIPE_VERSION, WORDY, Recipe, SftSpec
from models.zoo import ModelNotFoundError, builtin_dir, resolve

PROMPTS = ["Question: 12+7=?\nAnswer:", "Question: 50-8+33=?\nAnswer:", "Question: 9+9+9+9=?\nAnswer:", "Hello"]


def vllm_greedy(path, prompts, max_tokens):
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(path), dtype="float32", enforce_eager=True, max_model_len=512,
              kv_cache_memory_bytes=64 << 20, seed=0)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    close_engine(llm)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.engine
@pytest.mark.parametrize("name", ["dense", "moe", "draft"])
def test_vllm_and_transformers_agree_on_greedy_continuations(name):
    path = resolve(f"builtin:{name}")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
        expected.append(out[: out.index(tok.eos_token_id) + 1] if tok.eos_token_id in out else out)
    assert vllm_greedy(path, PROMPTS, 24) == expected


@pytest.mark.engine
def test_policies_solve_easy_problems_and_fail_hard_ones():
    from bench.model_accuracy import accuracy_by_difficulty

    for name in ("dense", "moe"):
        acc = accuracy_by_difficulty(resolve(f"builtin:{name}"), per_split=48)
        assert acc["easy"] >= 0.25, (name, acc)  # GRPO has signal
        assert acc["hard"] <= 0.6 * acc["easy"], (name, acc)  # and room to improve
        assert acc["hard"] < 0.5, (name, acc)


def test_tokenizer_keeps_digits_apart_and_round_trips_any_text():
    tok = transformers.AutoTokenizer.from_pretrained(resolve("builtin:dense"))
    pieces = tok.convert_ids_to_tokens(tok("12345+678=13023", add_special_tokens=False).input_ids)
    assert [p for p in pieces if p.isdigit()] == list("12345678") + list("13023")
    text = "Naïve café: 3 €, ünïcode ✓ and\ttabs\n"
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text
    assert tok.eos_token == "<|endoftext|>"


def test_build_report_describes_each_model():
    report = json.loads((builtin_dir() / "build.json").read_text())
    assert report["key"] == Recipe().key()
    arch = {k: v["architecture"] for k, v in report["models"].items()}
    assert arch == {"dense": "Qwen3ForCausalLM", "moe": "Qwen3MoeForCausalLM", "draft": "Qwen3ForCausalLM"}
    sizes = {k: v["parameters"] for k, v in report["models"].items()}
    assert sizes["draft"] * 5 < sizes["dense"]  # a much smaller draft LM
    for name, m in report["models"].items():
        assert m["loss_last"] < 0.5 * m["loss_first"], name  # SFT learned


def tiny_recipes(monkeypatch, tmp_path, **changes) -> Recipe:
    """The built-in names resolved to a recipe of 2 SFT steps (with `changes`), cached under `tmp_path`."""
    monkeypatch.setenv("SPECACTOR_CACHE", str(tmp_path))
    tiny = dataclasses.replace(Recipe(), policy_sft=SftSpec(steps=2, lr=1e-3, warmup_steps=1),
                               draft_sft=SftSpec(steps=2, lr=1e-3, warmup_steps=1), **changes)
    monkeypatch.setattr(zoo, "BUILTIN_MODELS", {name: (tiny, model) for name, (_, model) in zoo.BUILTIN_MODELS.items()})
    return tiny


def test_a_new_recipe_builds_in_its_own_keyed_directory(tmp_path, monkeypatch):
    tiny = tiny_recipes(monkeypatch, tmp_path)
    assert tiny.key() != Recipe().key()
    with pytest.raises(ModelNotFoundError, match="not built yet"):
        resolve("builtin:dense", build_if_missing=False)
    path = resolve("builtin:moe")
    assert path == tmp_path / "models" / tiny.key() / "moe"
    stamp = (path.parent / "build.json").stat().st_mtime_ns
    assert resolve("builtin:draft") == path.parent / "draft"  # reused, not rebuilt
    assert (path.parent / "build.json").stat().st_mtime_ns == stamp
    assert transformers.AutoConfig.from_pretrained(path).model_type == "qwen3_moe"
    with pytest.raises(ModelNotFoundError, match="unknown built-in"):
        resolve("builtin:giant")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve(str(tmp_path))


def test_the_wordy_models_have_their_own_recipe_key_and_tokenizer_and_no_moe(tmp_path, monkeypatch):
    """`builtin:wordy_*` names `models.recipe.WORDY`: only the wording and the MoE differ from the default recipe
    (whose key, and so every machine's built models, the new field leaves as it was)."""
    assert dataclasses.replace(WORDY, wording=0.0, moe=Recipe().moe) == Recipe()
    without = {k: v for k, v in dataclasses.asdict(Recipe()).items() if k != "wording"}
    text = json.dumps({"version": RECIPE_VERSION, **without}, sort_keys=True)
    assert Recipe().key() == hashlib.sha256(text.encode()).hexdigest()[:12] and WORDY.key() != Recipe().key()
    assert zoo.BUILTIN_MODELS["wordy_dense"] == (WORDY, "dense")
    tiny = tiny_recipes(monkeypatch, tmp_path, wording=0.5, moe=None)
    policy = resolve("builtin:wordy_dense")
    assert sorted(p.name for p in policy.parent.iterdir() if p.is_dir()) == ["dense", "draft"]
    tok = transformers.AutoTokenizer.from_pretrained(policy)
    assert len(tok(" plus", add_special_tokens=False).input_ids) == 1  # its tokenizer learnt the words
    assert policy.parent.name == tiny.key()
