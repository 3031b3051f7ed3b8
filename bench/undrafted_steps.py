"""What vLLM's plain path saves on an engine step that verifies no drafts (actor/undrafted_steps.py), measured in one
speculating engine with adjacent steps paired:

    python -m bench.undrafted_steps [--rollouts 60] [--out runs/bench/undrafted_steps.json]

The `policy` rollout preset's third epoch (the end-to-end benchmark's rollout: a 0.8M policy whose steps are mostly
vLLM's and the bridge's overhead) under the draft LM and the planner, which drafts on few steps. Each rollout is
stepped by hand, and consecutive steps (2j, 2j+1) form a pair: in the measured rollouts one step of each pair runs an
undrafted step on vLLM's speculative path (its metadata built, every request's empty drafts handed to the scheduler)
and the other on the plain path, alternating which comes first; in the control rollouts, interleaved with them, both
run the plain path (an A/A pair, labelled alike: what adjacent steps differ by anyway, a batch shrinking as its
requests end). Pairs with a step that verified drafts are left out. A busy host's speed drifts over seconds, not over
one ~5 ms step, so a pair sees the same host. Every rollout must emit the same tokens. It also profiles what else a
speculating engine spends on its steps: the drafter bridge's own and the drafter's milliseconds per step, on the
planner's rest steps and on planned ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from actor.engine import set_env_defaults
from bench.engine_process import in_fresh_process
from bench.stats import median_ci

PLAIN = [True]  # the worker's switch, set by the stepping loop (the engine runs in this process)
DRAFTED: list[bool] = []  # per engine step, whether it verified drafts (such pairs are left out)
BRIDGE: list = []  # the engine's drafter bridge, for the profile
RESTED: list[bool] = []  # per drafter bridge call, whether the step was one of the planner's rest


def _switchable(worker) -> None:
    """Puts vLLM's own `_prepare_inputs` and `take_draft_token_ids` beside actor/undrafted_steps.py's, per PLAIN."""
    runner, cls = worker.model_runner, type(worker.model_runner)
    plain_prepare, plain_take = runner._prepare_inputs, runner.take_draft_token_ids
    vllm_prepare, vllm_take = cls._prepare_inputs.__get__(runner), cls.take_draft_token_ids.__get__(runner)

    def prepare(scheduler_output, *args, **kwargs):
        DRAFTED.append(bool(scheduler_output.scheduled_spec_decode_tokens))
        return (plain_prepare if PLAIN[0] else vllm_prepare)(scheduler_output, *args, **kwargs)

    runner._prepare_inputs = prepare
    runner.take_draft_token_ids = lambda: (plain_take if PLAIN[0] else vllm_take)()
    bridge = runner.drafter
    rests = bridge._rests

    def recorded_rests(rows: int) -> bool:
        RESTED.append(rests(rows))
        return RESTED[-1]

    bridge._rests, BRIDGE[:] = recorded_rests, [bridge]


def _rollout(llm, prompt_ids: list[list[int]], params: list, pattern, profile: dict) -> tuple[list, list]:
    """Steps every request to its end with PLAIN = pattern(step) before each step: the step seconds, by step, and the
    tokens (and, in DRAFTED, which steps verified drafts); adds each step's bridge and drafter seconds to `profile`,
    by whether the planner rested."""
    from vllm.inputs.engine import tokens_input

    engine = llm.llm_engine
    for i, (ids, p) in enumerate(zip(prompt_ids, params)):
        engine.add_request(f"r{i}", tokens_input(ids), p)
    seconds, tokens, step, bridge = [], {}, 0, BRIDGE[0]
    DRAFTED.clear()
    while engine.has_unfinished_requests():
        PLAIN[0], calls, spent, drafter = pattern(step), len(RESTED), bridge.seconds, bridge.drafter_seconds
        start = time.perf_counter()
        outputs = engine.step()
        seconds.append(time.perf_counter() - start)
        if len(RESTED) > calls:  # (a step that ended the last requests calls no proposer)
            kind = profile["rest" if RESTED[-1] else "planned"]
            kind[0] += 1
            kind[1] += bridge.seconds - spent - (bridge.drafter_seconds - drafter)
            kind[2] += bridge.drafter_seconds - drafter
        tokens.update((o.request_id, list(o.outputs[0].token_ids)) for o in outputs if o.finished)
        step += 1
    return seconds, [tokens[f"r{i}"] for i in range(len(params))]


def _measure(rollouts: int) -> tuple[list, list, dict]:
    """In the engine's fresh process: the measured and control pairs of undrafted step seconds, and the profile."""
    from vllm import SamplingParams

    from actor.engine import close_engine
    from bench.rollout import PRESETS, SPECULATIVE_TOKENS, TEMPERATURE, make_llm, workload
    from models.zoo import resolve

    preset = PRESETS["policy"]  # (unpadded: the policy itself is the target)
    llm = make_llm("specactor", resolve("builtin:dense"), resolve("builtin:draft"), None, "cpu", SPECULATIVE_TOKENS)
    try:
        llm.collective_rpc(_switchable)
        tokenizer = llm.get_tokenizer()
        prompts, _ = workload(preset, 0)
        prompt_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]

        def params(epoch: int) -> list:
            return [SamplingParams(seed=s, temperature=TEMPERATURE, max_tokens=preset["max_tokens"], detokenize=False)
                    for s in workload(preset, 0, epoch=epoch)[1]]

        profile = {"rest": [0, 0.0, 0.0], "planned": [0, 0.0, 0.0]}  # steps, bridge s, drafter s
        for epoch in range(2):  # unmeasured: the planner and the draft LM's history as in the third epoch
            _rollout(llm, prompt_ids, params(epoch), lambda step: True, {"rest": [0] * 3, "planned": [0] * 3})
        measured, control, tokens = [], [], None
        for rollout in range(2 * rollouts):
            first_plain = rollout % 4 < 2  # which step of a pair runs plainly (or would), alternating
            ab = rollout % 2 == 0
            seconds, emitted = _rollout(llm, prompt_ids, params(2),
                                        (lambda step: (step % 2 == 0) == first_plain) if ab else (lambda step: True),
                                        profile)
            if tokens not in (None, emitted):
                raise RuntimeError(f"rollout {rollout} emitted other tokens than the first")
            tokens = emitted
            for j in range(0, len(seconds) - 1, 2):  # (vLLM's path, the plain one), or where it would be
                if not (DRAFTED[j] or DRAFTED[j + 1]):
                    first, second = seconds[j], seconds[j + 1]
                    (measured if ab else control).append((second, first) if first_plain else (first, second))
    finally:
        close_engine(llm)
    return measured, control, profile


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=60, help="measured rollouts, and as many control ones")
    parser.add_argument("--out", default="runs/bench/undrafted_steps.json")
    args = parser.parse_args(argv)
    if args.rollouts < 1:
        parser.error(f"--rollouts must be 1 or more, got {args.rollouts}")
    set_env_defaults()  # one engine thread, as a rollout actor's (inherited by the fresh process)
    measured, control, profile = in_fresh_process(Path(args.out).with_suffix(".log"), _measure, args.rollouts)
    if not (measured and control):
        raise SystemExit(f"bench.undrafted_steps: no pair of adjacent undrafted steps in the measured or the control "
                         f"rollouts (the planner drafted on one step of every pair); run more than {args.rollouts}")
    step_ms = 1000 * statistics.median(s for pair in measured for s in pair)
    result = {"preset": "policy", "epoch": 3, "drafter": "draft_lm", "planner": True, "rollouts": args.rollouts,
              "pairs": len(measured), "control_pairs": len(control), "step_ms": round(step_ms, 3)}
    for name, pairs in (("measured", measured), ("control", control)):
        ratio = median_ci([x / y for x, y in pairs])
        saved = median_ci([1000 * (x - y) for x, y in pairs])
        result[name] = {"step_ratio": [round(v, 4) for v in ratio], "ms_saved": [round(v, 4) for v in saved]}
    # the rest of a speculating engine's cost on a step without drafts: the bridge's own work and the drafter's
    result["profile_ms_per_step"] = {kind: {"steps": n, "bridge": round(1000 * b / max(n, 1), 4),
                                            "drafter": round(1000 * d / max(n, 1), 4)}
                                     for kind, (n, b, d) in profile.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
