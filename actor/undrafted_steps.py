"""An engine step that verifies no drafts runs vLLM's plain decoding path (vllm 0.32.0's V1 model runner).

With a speculative config, vLLM 0.32 builds speculative metadata on every step, drafts or not, and hands every
request's draft list (empty ones too) to the scheduler after every step. Most steps of a planner that drafts where it
pays carry no drafts, so both are skipped where nothing is drafted: `_prepare_inputs` runs as an engine without
speculation runs it (one logit row per request), and an all-empty proposal reaches the scheduler as no proposal,
whose requests' draft lists the scheduler already emptied when it scheduled them. No token changes: the coupled
sampler draws the same sample on either path. What it saves: docs/benchmarks.md, `bench/undrafted_steps.py`.
"""

from __future__ import annotations


def run_undrafted_steps_plainly(runner) -> None:
    """Wraps the runner's `_prepare_inputs` and `take_draft_token_ids` (instance attributes, as vLLM calls them)."""
    prepare, take = runner._prepare_inputs, runner.take_draft_token_ids

    def prepare_inputs(scheduler_output, *args, **kwargs):
        if scheduler_output.scheduled_spec_decode_tokens:
            return prepare(scheduler_output, *args, **kwargs)
        config, runner.speculative_config = runner.speculative_config, None  # the only switch _prepare_inputs reads
        try:
            return prepare(scheduler_output, *args, **kwargs)
        finally:
            runner.speculative_config = config

    def take_draft_token_ids():
        drafts = runner._draft_token_ids  # the custom proposer's: a list of lists per request of the last step
        return None if isinstance(drafts, list) and not any(drafts) else take()

    runner._prepare_inputs, runner.take_draft_token_ids = prepare_inputs, take_draft_token_ids
