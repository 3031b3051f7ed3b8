"""The coupled sampler's bookkeeping inside vLLM (actor/vllm_hooks.py): behaviour logprobs kept by output position,
noise seeds that no global RNG moves, and records that leave with their requests."""

import pytest
import torch

from actor.vllm_hooks import CoupledSampling, RequestRecord, noise_seed


def test_a_position_sampled_again_overwrites_its_logprob_and_never_shifts_the_later_ones():
    """What a preempting weight update does to a request whose next token was already sampled (vLLM with async
    scheduling): the position is sampled again, under the new weights, and its logprob must replace the old one."""
    sampler = CoupledSampling(runner=None)
    sampler.held["r-x"] = RequestRecord()
    sampler._record(["r-x"], [1], [0], [-0.1], [1])
    sampler._record(["r-x"], [4], [1, 2, 3, 4], [-0.2, -0.3, -0.4, -0.5], [3])  # a verify step: 3 tokens emitted
    assert sampler.held["r-x"].logprobs == [-0.1, -0.2, -0.3, -0.4]
    sampler._record(["r-x"], [1], [2], [-0.9], [1])  # position 2 again: 3 is no longer committed either
    assert sampler.held["r-x"].logprobs == [-0.1, -0.2, -0.9]
    sampler._record(["r-x"], [1], [-3], [-7.0], [1])  # a partial prefill's row: nothing emitted
    assert sampler.held["r-x"].logprobs == [-0.1, -0.2, -0.9]
    with pytest.raises(RuntimeError, match="sampled output position 5 with only 3 recorded"):
        sampler._record(["r-x"], [1], [5], [-0.1], [1])


def test_where_the_planner_is_in_charge_each_emitting_request_counts_the_step_and_the_planners_error():
    """`planned_steps` and `cost_error` are counted in the loop every sampling step runs over its requests, so that a
    step of the planner's rest costs the drafter bridge nothing per request."""
    sampler = CoupledSampling(runner=None)
    sampler.held.update({"a-x": RequestRecord(), "b-x": RequestRecord()})
    sampler._record(["a-x", "b-x"], [1, 1], [0, 0], [-0.1, -0.1], [1, 1])  # no planner (vanilla, or switched off)
    sampler.planning, sampler.step_error = True, 0.25
    sampler._record(["a-x", "b-x"], [1, 1], [1, -2], [-0.1, -0.1], [1, 1])  # b-x: a partial prefill emits nothing
    sampler.step_error = 0.5
    sampler._record(["a-x", "b-x"], [2, 1], [2, 3, 0], [-0.1, -0.1, -0.1], [2, 1])
    sampler._record(["a-x"], [1], [4], [-0.1], [1])  # the bridge was not called after the last step: no new error
    a, b = sampler.held["a-x"].stats, sampler.held["b-x"].stats
    assert (a.planned_steps, a.cost_error, b.planned_steps, b.cost_error) == (3, 0.75, 1, 0.5)


def test_an_unseeded_requests_noise_seed_is_its_ids_and_no_global_rng_moves_it():
    first = noise_seed("7-0-abcdef12")
    torch.manual_seed(123), torch.rand(5)
    assert noise_seed("7-0-abcdef12") == first and noise_seed("7-0-abcdef13") != first
    assert 0 <= first < 2**62


@pytest.mark.engine
def test_the_records_of_ten_thousand_finished_requests_are_gone():
    """Without a drafter too: vLLM-id records are dropped on the first step after a request leaves, the caller-id
    counts once taken (half the requests unseeded, half seeded)."""
    from vllm import SamplingParams

    from actor.engine import close_engine, make_engine
    from actor.vllm_hooks import take_records
    from configs.load import load_config
    from models.zoo import resolve

    llm = make_engine(load_config("grpo_tiny"), resolve("builtin:dense"))
    try:
        prompts = [{"prompt_token_ids": [1 + i % 50, 2 + i % 7]} for i in range(10_000)]
        params = [SamplingParams(max_tokens=2, seed=None if i % 2 else i) for i in range(10_000)]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        taken = llm.collective_rpc(take_records, args=([o.request_id for o in outputs],))[0]
        assert all(len(taken[o.request_id].logprobs) >= len(o.outputs[0].token_ids) >= 1 for o in outputs)
        llm.generate([{"prompt_token_ids": [3]}], SamplingParams(max_tokens=1, seed=1), use_tqdm=False)
        sizes = llm.collective_rpc(lambda worker: {name: len(getattr(worker.model_runner._sample, name))
                                                   for name in ("held", "records")})[0]
        assert sizes["held"] <= 1 and sizes["records"] <= 2, sizes
    finally:
        close_engine(llm)


def test_a_step_without_drafts_is_prepared_without_speculation_and_hands_the_scheduler_no_empty_drafts():
    """actor/undrafted_steps.py: `_prepare_inputs` sees no speculative config exactly when the step verifies no
    drafts (and gets it back after, even if it raised); an all-empty proposal is not handed to the scheduler."""
    from types import SimpleNamespace

    from actor.undrafted_steps import run_undrafted_steps_plainly

    seen = []

    def prepare(scheduler_output, tokens):
        seen.append(runner.speculative_config)
        if tokens is None:
            raise ValueError("vLLM raised")
        return tokens

    runner = SimpleNamespace(speculative_config="spec", _prepare_inputs=prepare, _draft_token_ids=None,
                             take_draft_token_ids=lambda: "vLLM's drafts")
    run_undrafted_steps_plainly(runner)
    drafted, undrafted = (SimpleNamespace(scheduled_spec_decode_tokens=d) for d in ({"r-x": [5, 6]}, {}))
    assert runner._prepare_inputs(drafted, 3) == 3 and runner._prepare_inputs(undrafted, 4) == 4
    with pytest.raises(ValueError, match="vLLM raised"):
        runner._prepare_inputs(undrafted, None)
    assert seen == ["spec", None, None] and runner.speculative_config == "spec"
    runner._draft_token_ids = [[], []]
    assert runner.take_draft_token_ids() is None
    runner._draft_token_ids = [[], [7]]
    assert runner.take_draft_token_ids() == "vLLM's drafts"
