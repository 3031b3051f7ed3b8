"""Speculation never changes a trajectory: with the coupled sampler installed in vLLM, every drafter emits
exactly the tokens, and the coupled sampler records the logprobs (to float32 rounding), of non-speculative
decoding with the same seeds, at T = 0, T = 0.7 with top-p 0.9, T = 1 and T = 0.8 with top-k 20, all mixed in one batch, with
requests cut by `max_tokens` inside a verify step, and under a plugin that tries to write into its histories and
draws from the global RNGs."""

import pytest

from actor.engine import close_engine, completion_text, make_engine
from actor.vllm_hooks import take_records
from configs.load import load_config
from models.zoo import resolve
from tasks.arithmetic import ArithmeticTask

pytestmark = pytest.mark.engine  # each test starts a vLLM engine or a Ray cluster

SETTINGS = [(0.0, 1.0, 0), (0.7, 0.9, 0), (1.0, 1.0, 0), (0.8, 1.0, 20)]  # (temperature, top_p, top_k)
PROMPTS = 12  # per setting
DRAFTERS = {"ngram": [], "draft_lm": [], "suffix": [], "examples.drafters.bigram.BigramDrafter": [],
            "fastest_of_n": ["speculation.drafters=[suffix,draft_lm]"],
            "tests.plugin_contracts.misbehaving.MisbehavingDrafter": [],
            # decoupled: the next step's drafts prepared while this one verifies (actor/draft_ahead.py)
            "draft_lm+decoupled": ["speculation.decoupled=true"],
            # (the planner gives n-gram and suffix drafts so few steps here that it might prepare none, or take none:
            # every step drafts; with the planner, suffix took 13-22 prepared drafts in two runs, and 0 in one)
            "ngram+decoupled": ["speculation.decoupled=true", "speculation.planner=false"],
            "suffix+decoupled": ["speculation.decoupled=true", "speculation.planner=false"],
            "fastest_of_n+decoupled": ["speculation.decoupled=true", "speculation.drafters=[suffix,draft_lm]"],
            }  # drafter (+ a mode) -> the overrides it needs


def max_tokens(i: int) -> int:
    """Most requests end at their answer; every third is cut by length at a point no step boundary favours."""
    return 160 if i % 3 else 17 + 2 * i


def rollouts(drafter: str, drafter_off: str = "", *overrides: str) -> tuple[list, dict]:
    from vllm import SamplingParams

    method = drafter.split("+")[0]
    cfg = load_config("grpo_tiny", [f"speculation.method={method}", "speculation.num_speculative_tokens=4",
                                    *DRAFTERS.get(drafter, []), *overrides])
    llm = make_engine(cfg, resolve("builtin:dense"), drafter_off)
    try:
        task = ArithmeticTask(seed=3)
        prompts, params = [], []
        for s, (temperature, top_p, top_k) in enumerate(SETTINGS):
            for i in range(PROMPTS):
                prompts.append(task[i].prompt)
                params.append(SamplingParams(seed=100 * s + i, temperature=temperature, top_p=top_p, top_k=top_k,
                                             max_tokens=max_tokens(i)))
        outputs = llm.generate(prompts, params, use_tqdm=False)
        records = llm.collective_rpc(take_records, args=([o.request_id for o in outputs],))[0]
        results = []
        for o in outputs:  # the tokens, and the logprobs the actor sends the learner (the coupled sampler's)
            c = o.outputs[0]
            results.append((list(c.token_ids), records[o.request_id].logprobs[: len(c.token_ids)], c.text,
                            c.finish_reason))
            assert len(records[o.request_id].logprobs) >= len(c.token_ids), f"{method}: request {o.request_id}"
        return results, [records[o.request_id].stats for o in outputs]
    finally:
        close_engine(llm)


@pytest.fixture(scope="module")
def plain():
    return rollouts("none")[0]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_speculative_rollouts_equal_plain_decoding(plain, drafter):
    speculative, stats = rollouts(drafter)
    assert sum(r[3] == "length" for r in plain) >= len(SETTINGS)  # some requests are cut by max_tokens
    for s, (temperature, top_p, top_k) in enumerate(SETTINGS):
        rows = range(s * PROMPTS, (s + 1) * PROMPTS)
        setting = f"{drafter} T={temperature} top_p={top_p} top_k={top_k}"
        same = [speculative[r][0] == plain[r][0] for r in rows]
        assert all(same), f"{setting}: {same.count(False)} sequences differ"
        for r in rows:  # to float32 rounding: a k-token verify pass and a 1-token pass can differ in the last bits
            assert speculative[r][1] == pytest.approx(plain[r][1], rel=1e-5, abs=1e-6), f"{setting}: sequence {r}"
        drafted, accepted = sum(stats[r].draft_tokens for r in rows), sum(stats[r].accepted_tokens for r in rows)
        assert drafted > 0 and accepted > 0, f"{setting}: drafted {drafted}, accepted {accepted}: nothing verified"
    if drafter.endswith("+decoupled"):  # drafts prepared ahead were taken (and, above, changed no token)
        assert sum(c.prepared_steps for c in stats) > 0
        assert all(c.prepared_steps <= c.verify_steps for c in stats)  # counted where they were verified


def test_the_actor_decodes_a_finished_completion_as_vllms_detokenizer_does(plain):
    """The actor asks vLLM for no text (no per-step detokenization) and decodes each finished completion once; the
    reward must see the text vLLM would have made."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve("builtin:dense"))
    assert sum(tokenizer.eos_token_id in ids for ids, *_ in plain) > 0  # special tokens to skip are there
    assert [completion_text(tokenizer, ids) for ids, *_ in plain] == [text for _, _, text, _ in plain]


def test_no_silent_fallback_to_vllms_own_sampler(monkeypatch):
    """An engine whose sampling is not the coupled sampler's is refused, and so is a request with a sampling
    parameter the coupled sampler (and the learner) would not honour."""
    from vllm import LLM, SamplingParams

    from actor.engine import check_coupled, engine_kwargs
    from actor.vllm_hooks import unsupported_sampling

    cfg = load_config("grpo_tiny")
    model = resolve("builtin:dense")
    plain = LLM(**engine_kwargs(cfg, model))  # no hooks installed: vLLM samples by itself
    try:
        plain.generate(["Question: 1+1=?\nAnswer:"], SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(RuntimeError, match="coupled sampler is not installed"):
            check_coupled(plain)
    finally:
        close_engine(plain)
    llm = make_engine(cfg, model)  # checks itself: installed and used for its warm-up token
    try:
        with pytest.raises(ValueError, match="min_p=0.1"):
            llm.generate(["Question: 1+1=?\nAnswer:"], SamplingParams(seed=1, min_p=0.1, max_tokens=4), use_tqdm=False)
    finally:
        close_engine(llm)
    from vllm.sampling_params import StructuredOutputsParams

    for bad, name in [({"logit_bias": {5: 2.0}}, "logit_bias"), ({"repetition_penalty": 1.2}, "repetition_penalty"),
                      ({"min_tokens": 3}, "min_tokens"), ({"bad_words": ["7"]}, "bad_words"),
                      ({"structured_outputs": StructuredOutputsParams(regex="[0-9]+")}, "structured_outputs"),
                      ({"thinking_token_budget": 8}, "thinking_token_budget"), ({"logprobs": 0}, "logprobs"),
                      ({"prompt_logprobs": 0}, "prompt_logprobs")]:  # an allow-list: whatever is not honoured
        assert unsupported_sampling(SamplingParams(**bad)).startswith(name)
    assert unsupported_sampling(SamplingParams(seed=3, temperature=0.7, top_k=20, top_p=0.9, max_tokens=9)) is None
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # V2 has no _sample to hook: refused before any engine starts
    with pytest.raises(RuntimeError, match="VLLM_USE_V2_MODEL_RUNNER must be 0"):
        make_engine(cfg, model)


def stepped_rollouts(overrides: list[str], between_steps) -> tuple[dict, dict, int, dict]:
    """The rollouts of `rollouts()`, stepped by hand with `between_steps(llm, steps, lengths)` after each engine step
    (`lengths`: each request's output tokens so far): each request's tokens, the step it finished at, the steps taken
    and the speculation counts."""
    from vllm import SamplingParams
    from vllm.inputs.engine import tokens_input

    llm = make_engine(load_config("grpo_tiny", [*overrides, "speculation.num_speculative_tokens=4"]),
                      resolve("builtin:dense"))
    try:
        engine, tokenizer, task = llm.llm_engine, llm.get_tokenizer(), ArithmeticTask(seed=3)
        for s, (temperature, top_p, top_k) in enumerate(SETTINGS):
            for i in range(PROMPTS):
                ids = tokenizer(task[i].prompt, add_special_tokens=False).input_ids
                engine.add_request(f"{s}-{i}", tokens_input(ids), SamplingParams(
                    seed=100 * s + i, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens(i)))
        done, finished_at, lengths, steps = {}, {}, {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                lengths[out.request_id] = len(out.outputs[0].token_ids)
                if out.finished:
                    done[out.request_id], finished_at[out.request_id] = list(out.outputs[0].token_ids), steps
            steps += 1
            between_steps(llm, steps, lengths)
        return done, finished_at, steps, llm.collective_rpc(take_records, args=(list(done),))[0]
    finally:
        close_engine(llm)


@pytest.mark.parametrize("method", ["draft_lm", "fastest_of_n"])
def test_a_draft_lm_swapped_mid_rollout_leaves_every_trajectory_unchanged(plain, method):
    """New draft LM weights (here: the draft's own, perturbed, then zeroed) swapped in between engine steps while
    requests are in flight, alone or as a member of fastest-of-N: the drafts change, the tokens do not."""
    import torch
    from transformers import AutoModelForCausalLM

    from actor.vllm_hooks import swap_draft_weights

    state = AutoModelForCausalLM.from_pretrained(str(resolve("builtin:draft"))).state_dict()
    generator = torch.Generator().manual_seed(0)
    versions = [[(n, t + 0.05 * torch.randn(t.shape, generator=generator)) for n, t in state.items()],
                [(n, torch.zeros_like(t)) for n, t in state.items()]]

    def swap(llm, steps: int, lengths: dict) -> None:
        if steps in (5, 15):  # mid-rollout: every request is still running
            assert llm.collective_rpc(swap_draft_weights, args=(versions.pop(0),)) == [True]

    members = ["speculation.drafters=[suffix,draft_lm]"] if method == "fastest_of_n" else []
    done, _, steps, records = stepped_rollouts([f"speculation.method={method}", *members], swap)
    assert not versions and steps > 15
    for s in range(len(SETTINGS)):
        for i in range(PROMPTS):
            assert done[f"{s}-{i}"] == plain[s * PROMPTS + i][0], f"request {s}-{i} changed after a draft swap"
    assert sum(c.stats.accepted_tokens for c in records.values()) > 0
    if method == "fastest_of_n":  # every member's proposals were labelled, the draft LM's through all three versions
        labelled = {name for c in records.values() for name, (yes, no) in c.stats.drafter_labels.items() if yes + no}
        assert labelled == {"suffix", "draft_lm"}


def _watch_sampling(worker) -> list:
    """From the first call on, each sampling step's longest draft (None: no speculative metadata at all)."""
    sampler = worker.model_runner._sample
    if not hasattr(sampler, "watched"):
        sample, sampler.watched = sampler._sample, []

        def watched(logits, spec):
            sampler.watched.append(None if spec is None else spec.max_spec_len)
            return sample(logits, spec)

        sampler._sample = watched
    return list(sampler.watched)


def test_a_step_without_drafts_runs_vllms_plain_path_and_a_step_with_drafts_verifies_them(plain):
    """actor/undrafted_steps.py in a speculating engine under the planner: the steps it drafts nothing for carry no
    speculative metadata (vLLM would build it on every step), the others verify their drafts, and no token moves."""
    steps_seen = []
    done, _, steps, _ = stepped_rollouts(["speculation.method=draft_lm"], lambda llm, steps, lengths: steps_seen.append(
        llm.collective_rpc(_watch_sampling)[0]))
    seen = steps_seen[-1]
    assert len(seen) >= steps - 2 and None in seen and any(seen)  # (watched from the end of the first step on)
    assert 0 not in seen, "a step without drafts carried speculative metadata"
    for s in range(len(SETTINGS)):
        for i in range(PROMPTS):
            assert done[f"{s}-{i}"] == plain[s * PROMPTS + i][0], f"request {s}-{i} differs from plain decoding"


def _break_the_drafter(worker) -> None:
    """The engine's drafter plugin (under fastest-of-N: its draft LM member) raises from its next proposal on (what a
    buggy plugin does mid-run)."""
    def propose(requests, k):
        raise ZeroDivisionError("a plugin's bug")

    drafter = worker.model_runner.drafter.drafter
    (drafter.members[drafter.names.index("draft_lm")] if hasattr(drafter, "members") else drafter).propose = propose


BROKEN = {"ngram": "drafter NgramDrafter switched off: ZeroDivisionError: a plugin's bug",
          "fastest_of_n": "drafter FastestOfN: member draft_lm switched off: ZeroDivisionError: a plugin's bug"}


@pytest.mark.parametrize("method", BROKEN)
def test_a_drafter_that_raises_mid_rollout_is_switched_off_and_leaves_every_trajectory_unchanged(plain, method):
    """The rollout goes on without drafts (actor/draft_bridge.py switch_off), or under fastest-of-N without the
    broken member, emitting plain decoding's tokens; every request running from then on carries the reason for the
    learner's spec/alarm."""
    members = ["speculation.drafters=[suffix,draft_lm]"] if method == "fastest_of_n" else []
    done, finished_at, steps, records = stepped_rollouts(
        [f"speculation.method={method}", *members, "speculation.planner=false"],  # no planner: drafts from step 1
        lambda llm, steps, lengths: steps == 10 and llm.collective_rpc(_break_the_drafter))
    assert steps > 10 and len(done) == len(SETTINGS) * PROMPTS
    for s in range(len(SETTINGS)):
        for i in range(PROMPTS):
            assert done[f"{s}-{i}"] == plain[s * PROMPTS + i][0], f"request {s}-{i} changed when its drafter broke"
    assert sum(c.stats.draft_tokens for c in records.values()) > 0  # it drafted before it broke
    later = [r for r, step in finished_at.items() if step > 11]  # still running when it proposed next
    assert later and {records[r].stats.drafter_failure for r in later} == {BROKEN[method]}
    drafted = max(records[r].stats.verify_steps for r in later)  # engine steps that verified drafts for one request
    # no request drafted after the break (at most the 11 steps before it), or under fastest-of-N the suffix member did
    assert drafted > 11 if method == "fastest_of_n" else drafted <= 11


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_a_preempting_weight_update_leaves_every_logprob_at_its_position_under_its_version(method):
    """New policy weights applied mid-rollout, preempting every running request (what an actor does after
    `rollout.update_wait_s`): each recorded behaviour logprob is the one of its own output position under the version
    it was sampled with (the old weights before the switch, the new ones after), recomputed by transformers from the
    two checkpoints; none shifted to a neighbour's position, with or without drafts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actor.vllm_hooks import apply_weights
    from sampling.coupled import processed_logprobs

    old = AutoModelForCausalLM.from_pretrained(str(resolve("builtin:dense")), dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    new_state = [(n, t + 0.02 * t.abs().mean() * torch.randn(t.shape, generator=generator))
                 for n, t in old.state_dict().items() if n != "lm_head.weight" or not old.config.tie_word_embeddings]
    new = AutoModelForCausalLM.from_pretrained(str(resolve("builtin:dense")), dtype=torch.float32).eval()
    new.load_state_dict(dict(new_state), strict=False)
    switched_at = {}

    def update(llm, steps: int, lengths: dict) -> None:
        if steps == 6:  # every request still running
            llm.collective_rpc(apply_weights, args=(new_state,))
            assert llm.reset_prefix_cache(reset_running_requests=True)
            switched_at.update(lengths)

    done, _, steps, records = stepped_rollouts([f"speculation.method={method}", "speculation.planner=false"], update)
    assert switched_at and steps > 6
    tokenizer, task, moved = AutoTokenizer.from_pretrained(resolve("builtin:dense")), ArithmeticTask(seed=3), 0
    for s, (temperature, top_p, top_k) in enumerate(SETTINGS):
        for i in range(PROMPTS):
            rid, prompt = f"{s}-{i}", tokenizer(task[i].prompt, add_special_tokens=False).input_ids
            ids, m = done[rid], switched_at[rid]
            with torch.no_grad():
                rows = slice(len(prompt) - 1, len(prompt) - 1 + len(ids))
                expected = [processed_logprobs(model(input_ids=torch.tensor([prompt + ids])).logits[0, rows],
                                               temperature, top_k, top_p).gather(1, torch.tensor(ids)[:, None])[:, 0]
                            for model in (old, new)]
            want = torch.cat([expected[0][:m], expected[1][m:]])
            recorded = torch.tensor(records[rid].logprobs[: len(ids)])
            assert torch.allclose(recorded, want, atol=1e-4), f"{method} request {rid}: switched after {m} tokens"
            moved += int((expected[0][m:] - expected[1][m:]).abs().max() > 1e-3) if len(ids) > m else 0
    assert moved > PROMPTS, "the new weights barely change the logprobs: the test could not tell the versions apart"


@pytest.mark.parametrize("drafter, drafter_off, reason", [
    ("tests.plugin_contracts.misbehaving.BrokenAtStart", "",
     "BrokenAtStart switched off: RuntimeError: its model is not on this node"),
    # (rollout.start_timeout_s = 10: the constructor gets 5 s)
    ("tests.plugin_contracts.misbehaving.HangsAtStart", "",
     "HangsAtStart switched off: TimeoutError: its constructor had not returned after 5 s"),
    ("suffix", "its propose call had not returned after 31 s on actor 0",
     "suffix switched off: RuntimeError: its propose call had not returned after 31 s on actor 0")],
    ids=["cannot-be-built", "never-built", "hung-an-earlier-engine"])
def test_a_drafter_that_cannot_run_leaves_the_engine_decoding_plainly(plain, drafter, drafter_off, reason):
    """A plugin that passed the check at load but fails to build on the actor, does not finish building in time, or
    that hung an earlier engine of the actor (driver/rollouts.py), does not take the engine (and the actor, and each
    replacement) down with it: drafts only save time, so the engine decodes without them, the same tokens, and every
    trajectory says why (TensorBoard's spec/alarm)."""
    results, stats = rollouts(drafter, drafter_off, "rollout.start_timeout_s=10")
    assert [r[0] for r in results] == [r[0] for r in plain] and sum(s.draft_tokens for s in stats) == 0
    assert all(reason in s.drafter_failure for s in stats)
