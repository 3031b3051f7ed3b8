import json
import subprocess
import sys
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from configs.load import CONFIG_DIR, ConfigError
from configs.schema import Dtype
from driver.preflight import load_run_config  # what the launcher loads: every check

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["grpo_tiny", "grpo_moe_tiny"])
def test_bundled_cpu_configs_load(name):
    cfg = load_run_config(name)
    assert cfg.model.path.startswith("builtin:")
    assert cfg.logging.dir == f"runs/{name}"
    assert OmegaConf.is_readonly(cfg)


def test_overrides_apply_with_types():
    cfg = load_run_config("grpo_tiny", ["trainer.steps=3", "model.dtype=bfloat16", "seed=5"])
    assert (cfg.trainer.steps, cfg.model.dtype, cfg.seed) == (3, Dtype.bfloat16, 5)


def test_path_to_yaml_works(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("model:\n  path: builtin:moe\nspeculation:\n  method: ngram\n")
    cfg = load_run_config(str(path))
    assert cfg.model.path == "builtin:moe" and cfg.speculation.method == "ngram"


def test_a_tensor_parallel_engine_splits_the_attention_and_kv_heads_as_vllm_can(tmp_path):
    """vLLM splits a model's attention heads among a tensor-parallel engine's devices, and its KV heads too (or
    replicates them where the devices are a multiple of them): anything else refused every actor's engine."""
    config = {"num_hidden_layers": 2, "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 64,
              "hidden_size": 1536, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(config))
    on_gpus = ["cluster.device=cuda", f"model.path={tmp_path}"]
    with pytest.raises(ConfigError, match="'rollout.tensor_parallel_size' = 3 .* its 8 KV heads"):
        load_run_config("grpo_tiny", [*on_gpus, "rollout.tensor_parallel_size=3"])  # 24 heads / 3: 8 KV heads not
    assert load_run_config("grpo_tiny", [*on_gpus, "rollout.tensor_parallel_size=8"])
    assert load_run_config("grpo_tiny", [*on_gpus, "rollout.tensor_parallel_size=24"])  # (KV heads replicated)


@pytest.mark.parametrize("text,key", [
    ("model: 5\n", "model"), ("rollout: [1]\n", "rollout"), ("speculation:\n  options: [1]\n", "speculation.options"),
    ("speculation:\n  distill: 3\n", "speculation.distill"),
])
def test_a_files_value_of_another_kind_than_its_section_names_its_key(tmp_path, text, key):
    """OmegaConf names no key where a value is of another kind than its section's (a number for a section)."""
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"mine.yaml: key '{key}': "):
        load_run_config(str(path))


@pytest.mark.parametrize("override,needles", [
    ("trainer.no_such_key=1", ["no_such_key", "command-line override", "grpo_tiny.yaml"]),
    ("trainer.steps=many", ["trainer.steps", "many"]),
    ("model.dtype=fp8", ["model.dtype", "fp8"]),
    ("rollout.top_p=0", ["rollout.top_p", "(0, 1]"]),
    ("rollout.group_size=1", ["rollout.group_size"]),
    ("rollout.update_wait_s=-1", ["rollout.update_wait_s", ">= 0"]),
    ("rollout.stall_timeout_s=1", ["rollout.stall_timeout_s", "[10, ", "hung"]),  # took healthy actors for hung
    ("rollout.stall_timeout_s=-5", ["rollout.stall_timeout_s", "0 (never)"]),
    ("trainer.step_timeout_s=1e17", ["trainer.step_timeout_s", "10000000"]),  # passed, then overflowed in ray.get
    ("speculation.num_speculative_tokens=100000", ["speculation.num_speculative_tokens", "[1, 64]"]),
    ("cluster.address=''", ["cluster.address", "not empty"]),  # passed, then ray.init refused the address
    ("logging.dir=''", ["logging.dir", "not empty"]),  # the working directory, which overwrite: true would clear
    ("learner.zero_stage=4", ["learner.zero_stage"]),
    ("model.path=/nowhere", ["model.path", "/nowhere", "config.json"]),
    ("model.path=builtin:huge", ["model.path", "builtin:huge"]),
    ("data.source=/nowhere.jsonl", ["data.source"]),
    ("trainer.eval_every=-1", ["trainer.eval_every", ">= 0"]),
    ("data.eval_size=0", ["data.eval_size"]),
    ("model.max_model_len=4096", ["model.max_model_len", "1024 positions"]),  # more than the model was built for
    # a 2-problem task of one operation on operands 1..2 has 8 problems in all: 300 held-out ones cannot exist
    ("trainer.eval_every=5 data.max_ops=1 data.max_operand=2 data.size=2 data.eval_size=300",
     ["data.eval_size", "fewer held-out problems"]),
    ("rollout.min_p=0.1", ["rollout.min_p"]),  # a sampling parameter the coupled sampler does not honour
    ("logging.engine_level=loud", ["logging.engine_level", "loud"]),
    ("trainer.steps", ["key=value"]),
    ("speculation.drafters=[ngram", ["speculation.drafters=[ngram", "not valid YAML"]),  # was a yaml traceback
    ("trainer=5", ["trainer=5", "TrainerConfig"]),  # a section given a value: the message was "None"
    ("rollout.group_size=99999999999", ["rollout.group_size", "1048576 trajectories a step"]),  # loaded, then OOM
    ("rollout.max_tokens=5000", ["rollout.max_tokens", "model.max_model_len"]),
    ("data.source=${no.such.key}", ["data.source", "no.such.key"]),
    ("transport.auth=none transport.host=0.0.0.0", ["transport.auth", "curve"]),  # plain TCP beyond loopback
    ("transport.auth=none cluster.address=auto", ["transport.auth", "single-user", "curve"]),  # others could speak
    ("transport.auth=tls", ["transport.auth", "tls"]),
    ("transport.host=192.0.2.1", ["transport.host", "192.0.2.1", "cannot be bound"]),  # TEST-NET: not this machine
    ("transport.host=no-such-host.invalid", ["transport.host", "not an address"]),
    ("transport.host=''", ["transport.host", "0.0.0.0"]),  # passed, then ZeroMQ could not bind 'tcp://:*'
    ("transport.host=0", ["transport.host", "0.0.0.0"]),  # bound, but told peers to dial 'tcp://0:port'
    ("transport.host=\uff4cocalhost", ["transport.host", "not ASCII"]),  # Python resolved it, ZeroMQ could not bind
    ("logging.dir=/proc/specactor-run", ["logging.dir", "/proc", "writable"]),
    (f"logging.dir={Path(__file__).resolve()}/run", ["logging.dir", "test_config.py", "writable"]),  # under a file
    ("seed=-1", ["seed", "must be in [0, "]),
    ("model.max_model_len=1000000000000", ["model.max_model_len", "1048576"]),  # was an unserializable error in Ray
    ("transport.trajectory_queue=1000000", ["transport.trajectory_queue", "16384 MiB"]),  # x 96 KiB trajectories
    ("transport.weight_bucket_mib=0", ["transport.weight_bucket_mib"]),
    ("speculation.distill.num_gpus=0.5", ["speculation.distill.num_gpus", "cluster.device", "'cpu'"]),  # no GPU
    ("speculation.distill.num_gpus=1 cluster.device=cuda", ["speculation.distill.num_gpus", "[0, 1)", "rank 0"]),
    # found by fuzzing every key with bad values: each raised something other than a ConfigError, or was taken
    ("learner.num_ranks=0", ["learner.num_ranks", ">= 1"]),  # was a ZeroDivisionError
    ("data.max_ops=99999999999", ["data.max_ops", "[1, 10000]"]),  # was a MemoryError building the held-out set
    # the engine refused to start in the actor and each replacement, and the run ended there
    ("rollout.kv_cache_mib=1", ["rollout.kv_cache_mib", "model.max_model_len = 1024", "at least 3 MiB"]),
    # 2 MiB holds 1,024 tokens of 2,048 bytes, but vLLM holds whole blocks of 128 tokens and one null block
    ("rollout.kv_cache_mib=2", ["rollout.kv_cache_mib", "model.max_model_len = 1024", "at least 3 MiB"]),
    ("rollout.kv_cache_mib=100000000", ["rollout.kv_cache_mib", "rollout.num_actors = 1", "this machine's memory"]),
    ("data.size=99999999999", ["data.size", "[0, 1000000]"]),  # was a MemoryError
    ("data.eval_size=99999999999", ["data.eval_size", "[1, 10000]"]),  # built held-out problems for hours
    ("learner.micro_batch_size=0", ["learner.micro_batch_size", ">= 1"]),  # was a ZeroDivisionError
    ("speculation.drafters={}", ["speculation.drafters", "incompatible"]),  # was a TypeError
    # a name no trajectory could carry (its member choices would be refused at the learner, every one)
    (f"speculation.method=fastest_of_n speculation.drafters=[ngram,pkg.{'x' * 300}.Drafter]",
     ["speculation.drafters", "256 characters"]),
    ("learner.lr=inf", ["learner.lr", "finite"]),
    ("rollout.temperature=inf", ["rollout.temperature", "finite"]),
    ("rollout.temperature=0", ["rollout.temperature", "[0.01, 2]"]),  # greedy: every advantage 0, it trained nothing
    ("rollout.temperature=2.5", ["rollout.temperature", "refuses"]),  # vLLM refused it in every actor
    ("rollout.temperature=0.001", ["rollout.temperature", "0.01"]),  # vLLM sampled at 0.01, the learner scored 0.001
    ("rollout.top_k=9223372036854775808", ["rollout.top_k", "2147483647"]),  # overflowed in the learner's sampler
    ("cluster.learner_resource=CPU", ["cluster.learner_resource", "Ray's own"]),  # a traceback from ray.init
    ("cluster.rollout_resource=node:10.0.0.1", ["cluster.rollout_resource", "Ray's own"]),  # dropped by Ray
    ("cluster.num_cpus=1099511627776", ["cluster.num_cpus", "1000000"]),  # Ray's node never started
    ("cluster.address=auto transport.auth=curve cluster.num_cpus=4", ["cluster.num_cpus", "embedded Ray"]),
    ("rollout.tensor_parallel_size=2", ["rollout.tensor_parallel_size", "cuda"]),  # ignored on a CPU
    # vLLM refused these in every actor's engine, and the run ended there
    ("cluster.device=cuda rollout.tensor_parallel_size=3", ["rollout.tensor_parallel_size", "4 attention heads"]),
    # 4 KV heads on 8 GPUs: vLLM keeps one on each, not half of one
    ("cluster.device=cuda model.path=configs/shapes/qwen3_30b_a3b rollout.tensor_parallel_size=8 "
     "model.max_model_len=32768 rollout.kv_cache_mib=1000", ["rollout.kv_cache_mib", "1537 MiB"]),
    ("trainer.resume_from=''", ["trainer.resume_from", "not empty"]),  # was a fresh run
    ("speculation.drafters=${seed}", ["speculation.drafters", "int is not a ListConfig"]),  # named no key
    (f"data.max_operand=1{'0' * 4400}", ["data.max_operand", "not valid YAML", "4300"]),  # a traceback naming nothing
    ("learner.grad_clip=nan", ["learner.grad_clip", "finite"]),
    ("algorithm.length_penalty=1.5", ["algorithm.length_penalty", "[0, 1]"]),
    ("learner.grad_clip=-1", ["learner.grad_clip", ">= 0"]),
    ("learner.weight_decay=-0.1", ["learner.weight_decay", ">= 0"]),
    ("speculation.planner=-1", ["speculation.planner", "true or false"]),  # was taken as true
    ("logging.overwrite=0", ["logging.overwrite", "true or false"]),  # was taken as false
    # a drafter's options are its constructor's keywords: a name it does not take fails here, not in the actor
    ("speculation.method=ngram speculation.options.min_k=5", ["speculation.options", "min_k", "NgramDrafter"]),
    ("speculation.options.max_n=3", ["speculation.options", "method names a drafter"]),  # method none: it did nothing
    ("speculation.decoupled=true", ["speculation.decoupled", "method names a drafter"]),
    ("speculation.num_speculative_tokens=8", ["speculation.num_speculative_tokens", "method names a drafter"]),
    ("speculation.method=draft_lm speculation.distill.top_k=5", ["speculation.distill.top_k", "every_versions > 0"]),
    # found by a review: each passed load and failed, or did nothing, in the live run
    ("algorithm.max_staleness=1000000", ["algorithm.max_staleness", "trainer.steps (300)"]),  # queued 16M groups
    ("speculation.method=draft_lm speculation.distill.every_versions=300",  # distilled every step, offered nothing
     ["speculation.distill.every_versions", "< trainer.steps (300)"]),
    ("speculation.method=fastest_of_n speculation.drafters=[suffix,draft_lm] speculation.options.suffix.bogus=1",
     ["speculation.options.suffix", "bogus", "SuffixDrafter"]),
    # and its values as far as the drafter can judge them without being built (they failed in the actor: rc 1)
    ("speculation.method=ngram speculation.options.max_n=abc", ["speculation.options", "max_n='abc'", "int"]),
    ("speculation.method=ngram speculation.options.max_n=true", ["speculation.options", "max_n=True", "int"]),
    ("speculation.method=suffix speculation.options.min_share=7", ["speculation.options", "0 < min_share <= 1"]),
    ("speculation.method=fastest_of_n speculation.drafters=[suffix,draft_lm] speculation.options.suffix.max_n=1",
     ["speculation.options.suffix", "min_n <= max_n", "SuffixDrafter"]),
    ("speculation.method=draft_lm speculation.options.dtype=int8", ["speculation.options", "dtype='int8'", "DraftLM"]),
])
def test_bad_override_names_the_key(override, needles):
    with pytest.raises(ConfigError) as e:
        load_run_config("grpo_tiny", override.split(" "))
    for needle in needles:
        assert needle in str(e.value)


@pytest.mark.parametrize("key", ["data.source", "data.eval_source"])
def test_a_malformed_data_file_fails_at_load_naming_key_file_and_line(tmp_path, key):
    path = tmp_path / "eval.jsonl"
    path.write_text('{"question": "1+1?", "answer": "2 #### 2"}\n{"question": "no answer"}\n')
    with pytest.raises(ConfigError) as e:
        load_run_config("grpo_tiny", [f"{key}={path}"])
    assert key in str(e.value) and f"{path}:2" in str(e.value) and "answer" in str(e.value)


def test_the_held_out_file_cannot_be_the_training_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(f'{{"question": "{i}+1?", "answer": "#### {i + 1}"}}\n' for i in range(300)))
    with pytest.raises(ConfigError, match=r"'data.eval_source'.*would be the training problems"):
        load_run_config("grpo_tiny", [f"data.source={path}",  # (the same file, by another path)
                                      f"data.eval_source={tmp_path}/../{tmp_path.name}/train.jsonl"])
    assert load_run_config("grpo_tiny", [f"data.source={path}", f"data.eval_source={path}", "trainer.eval_every=0"])


def test_a_logging_dir_under_home_is_expanded_once_at_load(tmp_path, monkeypatch):
    """`~/runs/x` was written to ./~/runs/x (and so escaped the check for another run's checkpoints there)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_run_config("grpo_tiny", ["logging.dir=~/runs/x"]).logging.dir == f"{tmp_path}/runs/x"


def test_a_loopback_transport_host_is_refused_on_a_cluster_with_nodes_elsewhere(monkeypatch):
    """Processes on another node would dial their own loopback for rank 0 and wait out rollout.start_timeout_s."""
    from driver import placement

    def node(address: str, **resources: float) -> dict:
        return {"NodeManagerAddress": address, "Alive": True, "Resources": resources}

    cfg = load_run_config("grpo_tiny")
    nodes = [node("10.0.0.1", CPU=2), node("10.0.0.1", CPU=2), node("10.0.0.9", CPU=0)]  # and a head node of no CPU
    monkeypatch.setattr(placement.ray, "nodes", lambda: nodes)
    placement.check_reachable(cfg)  # one machine's nodes (a local multi-node cluster): loopback reaches them all
    nodes.append(node("10.0.0.2", CPU=2))
    with pytest.raises(ConfigError, match=r"'transport.host' = '127.0.0.1'.*10.0.0.1, 10.0.0.2: "):
        placement.check_reachable(cfg)
    roles = load_run_config("grpo_tiny", ["cluster.learner_resource=learner", "cluster.rollout_resource=rollout"])
    nodes[-1] = node("10.0.0.2", CPU=2, other=1)  # a node no role can use
    nodes[0]["Resources"].update(learner=1, rollout=1)
    placement.check_reachable(roles)


def test_bad_file_names_the_key_and_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("learner:\n  lr: fast\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*learner\.lr"):
        load_run_config(str(path))
    path.write_text("learner: {typo_key: 1}\nmodel: {path: builtin:dense}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*learner\.typo_key"):
        load_run_config(str(path))
    path.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*not valid YAML"):
        load_run_config(str(path))
    path.write_bytes(b"\xff\xfe\x00model: 1\n")  # UTF-16, say: was a UnicodeDecodeError traceback
    with pytest.raises(ConfigError, match=r"bad\.yaml: not UTF-8 text"):
        load_run_config(str(path))


@pytest.mark.parametrize("name", ["grpo_moe", "grpo_gpu1"])
def test_gpu_configs_require_a_model_path(tmp_path, name):
    with pytest.raises(ConfigError, match=name + r"\.yaml.*'model\.path' is not set.*model\.path="):
        load_run_config(name)
    (tmp_path / "config.json").write_text("{}")
    cfg = load_run_config(name, [f"model.path={tmp_path}"])
    assert cfg.cluster.device.value == "cuda"


@pytest.mark.parametrize("override,key", [
    ("cluster.device=cpu", "cluster.share_gpu"), ("learner.num_ranks=2", "cluster.share_gpu"),
    ("transport.weights=nccl", "transport.weights"), ("speculation.distill.num_gpus=0.5", "speculation.distill.num_gpus")])
def test_one_shared_gpu_holds_one_learner_rank_and_one_engine_with_weights_over_zeromq(tmp_path, override, key):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_run_config("grpo_gpu1", [f"model.path={tmp_path}", override])


def test_unknown_config_name_lists_bundled_ones():
    with pytest.raises(ConfigError, match="grpo_tiny"):
        load_run_config("no_such_config")


def test_every_bundled_yaml_is_checked_here():
    assert {p.stem for p in CONFIG_DIR.glob("*.yaml")} == {"grpo_tiny", "grpo_moe_tiny", "grpo_moe", "grpo_gpu1"}


@pytest.mark.parametrize("override", ["trainer.no_such_key=1", "trainer.steps=abc"])
def test_launcher_fails_fast_and_names_the_key(override, tmp_path):
    cache, logs = tmp_path / "cache", tmp_path / "run"  # where a model build and a run would write first
    proc = subprocess.run([sys.executable, "launch.py", "--config", "grpo_tiny", override, f"logging.dir={logs}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SPECACTOR_CACHE": str(cache)})
    assert proc.returncode == 2, proc.stderr
    assert override.split("=")[0] in proc.stderr and "grpo_tiny.yaml" in proc.stderr
    assert not cache.exists() and not logs.exists()  # no model build, no run directory, so no cluster either
    assert "Traceback" not in proc.stderr


def test_a_built_in_question_the_model_cannot_hold_fails_before_anything_starts(tmp_path):
    """The built-in task's longest question (data.max_ops operations of the widest operand) must fit as well: 600
    operations passed the load and would have ended the run in its actors."""
    proc = subprocess.run([sys.executable, "launch.py", "--config", "grpo_tiny", "data.max_ops=600",
                           f"logging.dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "key 'data.max_ops' = 600" in proc.stderr and "max_model_len = 1024" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["data.source", "data.eval_source"])
def test_a_data_prompt_the_model_cannot_hold_fails_before_anything_starts(tmp_path, key):
    """vLLM refuses a prompt longer than model.max_model_len inside the actor, which ended the run after ~70 s of
    restarts; the launcher now refuses it first, naming the key, the file and the line, and writes nothing."""
    data = tmp_path / "data.jsonl"
    records = [{"question": f"What is 2 + {i}?", "answer": f"#### {2 + i}"} for i in range(5)]
    records[3] = {"question": "What is " + " + ".join(["1"] * 400) + "?", "answer": "#### 400"}
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = subprocess.run([sys.executable, "launch.py", "--config", "grpo_tiny", f"{key}={data}",
                           "data.eval_size=4", f"logging.dir={tmp_path / 'run'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert f"key '{key}'" in proc.stderr and f"{data}:4:" in proc.stderr and "max_model_len = 1024" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_resume_from_must_name_a_checkpoint_that_is_behind_trainer_steps(tmp_path):
    from learner.checkpoint import partial, seal

    with pytest.raises(ConfigError, match="trainer.resume_from.*complete checkpoint"):
        load_run_config("grpo_tiny", [f"trainer.resume_from={tmp_path}"])
    final = tmp_path / "checkpoints" / "step_30"
    for part in ("hf", "deepspeed"):
        (partial(final) / part).mkdir(parents=True)
        (partial(final) / part / "weights").write_bytes(b"w")
    seal(final, {"version": 30, "data_cursor": 120, "counts": {}, "run_id": "r"})
    with pytest.raises(ConfigError, match="at step 30 but trainer.steps = 30.*weights, a Hugging Face checkpoint, "
                                          "are in .*step_30/hf"):
        load_run_config("grpo_tiny", [f"trainer.resume_from={tmp_path}", "trainer.steps=30"])
    assert load_run_config("grpo_tiny", [f"trainer.resume_from={tmp_path}", "trainer.steps=40"]).trainer.steps == 40


def test_speculation_method_must_name_a_drafter():
    with pytest.raises(ConfigError, match="speculation.method.*no_such"):
        load_run_config("grpo_tiny", ["speculation.method=no_such"])
    with pytest.raises(ConfigError, match="key .speculation.options.model. = ./nowhere. is not a Hugging Face"):
        load_run_config("grpo_tiny", ["speculation.method=draft_lm", "speculation.options.model=/nowhere"])


def test_a_draft_lm_must_share_the_policys_tokenizer_and_to_be_distilled_its_vocabulary(tmp_path):
    """Refused at load, naming the key: built-in models of another recipe (tokenizers of their own, whatever their
    sizes: in the run, the draft's proposals are never the policy's tokens), and, for distillation, a draft of another
    vocabulary size (its distiller cannot learn from the policy's distributions: it failed on every restart). One
    tokenizer padded to two sizes, as a model family's small and large checkpoints often are, drafts."""
    with pytest.raises(ConfigError, match="options.model. = .builtin:wordy_draft. and model.path = .builtin:dense. "
                                          "are built-in models with tokenizers of their own"):
        load_run_config("grpo_tiny", ["speculation.method=draft_lm", "speculation.options.model=builtin:wordy_draft"])
    policy, draft = tmp_path / "policy", tmp_path / "draft"
    for directory, size in ((policy, 152064), (draft, 151936)):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({"vocab_size": size}))
    drafting = [f"model.path={policy}", "speculation.method=draft_lm", f"speculation.options.model={draft}"]
    assert load_run_config("grpo_tiny", drafting)
    distilled = [*drafting, "speculation.distill.every_versions=4"]
    with pytest.raises(ConfigError, match="options.model. = .*draft. has 151936 token ids against the 152064 of "
                                          "model.path = .*policy.: distilling it"):
        load_run_config("grpo_tiny", distilled)
    with pytest.raises(ConfigError, match="key .speculation.options.draft_lm.model. = .*151936 token ids"):
        load_run_config("grpo_tiny", [f"model.path={policy}", "speculation.method=fastest_of_n",
                                      "speculation.drafters=[suffix,draft_lm]", "speculation.distill.every_versions=4",
                                      f"speculation.options.draft_lm.model={draft}"])
    (draft / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 152064}}))  # (a multimodal config)
    assert load_run_config("grpo_tiny", distilled)
    assert load_run_config("grpo_tiny", ["model.path=builtin:wordy_dense", "speculation.method=draft_lm",
                                         "speculation.options.model=builtin:wordy_draft"])


@pytest.mark.parametrize("overrides,needle", [
    (["speculation.method=fastest_of_n", "speculation.drafters=[suffix]"], "two or more distinct"),
    (["speculation.method=fastest_of_n", "speculation.drafters=[suffix,no_such]"], "speculation.drafters.*no_such"),
    (["speculation.method=fastest_of_n", "speculation.drafters=[suffix,draft_lm]",
      "speculation.options.draft_lm.model=/nowhere"], "speculation.options.draft_lm.model"),
    (["speculation.method=fastest_of_n", "speculation.drafters=[suffix,ngram]",
      "speculation.options.draft_lm.model=builtin:draft"],
     "not among speculation.drafters"),
    (["speculation.method=draft_lm", "speculation.drafters=[suffix,ngram]"], "fastest_of_n only"),
])
def test_fastest_of_n_members_are_checked_at_load(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_run_config("grpo_tiny", overrides)
    assert load_run_config("grpo_tiny", ["speculation.method=fastest_of_n", "speculation.drafters=[suffix,draft_lm]"])


def test_a_plugins_options_reach_its_check_as_plain_yaml_values():
    """A plugin judges its options as the engine will build it with them: a YAML list is a list, not OmegaConf's
    ListConfig; options that are not a mapping are refused naming the key."""
    plugin = "speculation.method=tests.plugin_contracts.misbehaving.StopsDrafter"
    assert load_run_config("grpo_tiny", [plugin, "speculation.options.stops=[5,6]"])
    with pytest.raises(ConfigError, match="stops=7 is not a list"):
        load_run_config("grpo_tiny", [plugin, "speculation.options.stops=7"])


def test_a_plugin_annotation_only_a_type_checker_resolves_leaves_the_check_to_the_constructor():
    from tests.plugin_contracts.misbehaving import StopsDrafter

    assert StopsDrafter.check_options({"hint": 3}) == {"stops": None, "hint": 3}


def test_a_deterministic_run_needs_the_synchronous_schedule():
    with pytest.raises(ConfigError, match="key 'algorithm.max_staleness' = 1 must be 0 when trainer.deterministic"):
        load_run_config("grpo_tiny", ["trainer.deterministic=true"])
    assert load_run_config("grpo_tiny", ["trainer.deterministic=true", "algorithm.max_staleness=0"]).trainer.deterministic


def test_every_key_fuzzed_loads_or_names_itself():
    """Every key of the schema with values of the wrong kind or range: the loader either accepts the value or raises
    a ConfigError that names the key (found this way: ZeroDivisionError, TypeError, and non-finite numbers taken)."""
    from omegaconf import DictConfig

    def keys(node, prefix=""):
        for key, value in node.items():
            yield from keys(value, f"{prefix}{key}.") if isinstance(value, DictConfig) else [f"{prefix}{key}"]

    for key in keys(load_run_config("grpo_tiny")):
        for value in ["-1", "0", "0.5", "abc", "''", "[]", "{}", "null", "nan", "inf", "99999999999"]:
            try:
                load_run_config("grpo_tiny", [f"{key}={value}"])
            except ConfigError as e:
                assert key in str(e), (key, value, str(e))


@pytest.mark.parametrize("fields, expected", [
    ({}, 2 * 36 * 8 * 128 * 2),  # Qwen3-8B's shape: 36 layers, 8 KV heads of 128
    ({"head_dim": None}, 2 * 36 * 8 * 128 * 2),  # head_dim from hidden_size / heads
    ({"num_key_value_heads": None}, None),  # KV heads not named (a multi-query model marks it its own way)
    ({"num_attention_heads": 0, "head_dim": None}, None),
    ({"use_sliding_window": True}, None),  # windowed: a token past the window takes nothing
    ({"layer_types": ["full_attention", "sliding_attention"]}, None),
    ({"kv_lora_rank": 512}, None),  # compressed (MLA)
    ({"num_hidden_layers": "many"}, None),
])
def test_what_a_token_takes_in_the_kv_cache_is_read_from_plain_attention_configs_only(tmp_path, fields, expected):
    from configs.load import kv_bytes_per_token

    config = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
              "hidden_size": 4096, "sliding_window": None, "use_sliding_window": False, **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert kv_bytes_per_token(str(tmp_path), 2) == expected
