"""How often a speculative rollout equals the plain one, at scale: for each built-in drafter and each sampling
setting, the fraction of sequences whose tokens equal non-speculative decoding with the same seeds, and the
largest logprob difference on equal sequences. Prompts come in groups of `GROUP` samples, as GRPO draws them.

    python -m bench.exactness [--sequences 1000] [--out runs/bench/exactness.json]
                              [--settings T=1 ...] [--drafters suffix ...] [--epochs N] [--speculative-tokens K]

Drafts are always k per request and step (the planner off), so the drafts accepted and the drafter's seconds compare
drafters on the same tokens whatever the host's speed. `--epochs N` generates the same prompts N times with each
epoch's seeds, as GRPO revisits its prompts (the history drafter then holds their earlier outputs), and reports
each epoch; settings run one after another in one engine per drafter, so choose one setting to compare drafters.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from actor.engine import set_env_defaults
from bench.engine_process import in_fresh_process
from transport.messages import total

SETTINGS = {"T=0": (0.0, 1.0), "T=0.7,top_p=0.9": (0.7, 0.9), "T=1": (1.0, 1.0)}
DRAFTERS = {"ngram": [], "draft_lm": [], "suffix": [],  # every built-in, with its overrides of grpo_tiny
            "fastest_of_n": ["speculation.drafters=[suffix,draft_lm,ngram]"]}
GROUP = 8  # samples per prompt, as GRPO draws them (the history drafter drafts from a prompt's other samples)


def rollouts(method: str, sequences: int, max_tokens: int, seed: int, settings: list[str], epochs: int,
             k: int) -> dict:
    from vllm import SamplingParams

    from actor.engine import close_engine, make_engine
    from actor.vllm_hooks import profile, take_records
    from sampling.coupled import group_seed
    from configs.load import load_config
    from models.zoo import resolve
    from tasks.arithmetic import ArithmeticTask

    cfg = load_config("grpo_tiny", [f"speculation.method={method}", "rollout.kv_cache_mib=1024",
                                    f"speculation.num_speculative_tokens={k}",
                                    *(["speculation.planner=false"] if method != "none" else []),  # always k drafts
                                    *DRAFTERS.get(method, [])])
    llm = make_engine(cfg, resolve(cfg.model.path))
    task = ArithmeticTask(seed=seed)
    results = {}
    try:
        for name in settings:
            temperature, top_p = SETTINGS[name]
            for epoch in range(epochs):  # the data cursor runs on across epochs: other seeds for the same prompts
                groups = (sequences + GROUP - 1) // GROUP
                params = [SamplingParams(seed=group_seed(seed, epoch * groups + i // GROUP, GROUP) + i % GROUP,
                                         temperature=temperature, top_p=top_p, max_tokens=max_tokens)
                          for i in range(sequences)]
                drafting = llm.collective_rpc(profile)[0]["drafter_s"]
                outputs = llm.generate([task[i // GROUP].prompt for i in range(sequences)], params, use_tqdm=False)
                taken = llm.collective_rpc(take_records, args=([o.request_id for o in outputs],))[0]
                # each token and the logprob the coupled sampler recorded for it (what an actor sends the learner)
                rows = [(list(o.outputs[0].token_ids), taken[o.request_id].logprobs[: len(o.outputs[0].token_ids)])
                        for o in outputs]
                spec = total(r.stats for r in taken.values())  # a check that drafted nothing proves nothing
                results[label(name, epoch, epochs)] = {
                    "rows": rows, "draft_tokens": spec.draft_tokens, "accepted_tokens": spec.accepted_tokens,
                    "drafter_s": llm.collective_rpc(profile)[0]["drafter_s"] - drafting}
    finally:
        close_engine(llm)
    return results


def label(setting: str, epoch: int, epochs: int) -> str:
    return setting if epochs == 1 else f"{setting} epoch {epoch + 1}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=1000, help="per drafter and sampling setting")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/bench/exactness.json")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--drafters", nargs="+", choices=list(DRAFTERS), default=list(DRAFTERS))
    parser.add_argument("--epochs", type=int, default=1, help="generations of the same prompts, each with new seeds")
    parser.add_argument("--speculative-tokens", type=int, default=4, help="drafts per request and step")
    args = parser.parse_args(argv)
    set_env_defaults()
    runs = {}
    for method in ["none", *args.drafters]:  # a fresh process per engine
        runs[method] = in_fresh_process(Path(args.out).with_suffix(".log"), rollouts, method, args.sequences,
                                        args.max_tokens, args.seed, args.settings, args.epochs,
                                        args.speculative_tokens)
    report = {}
    for method in args.drafters:
        for name in [label(s, e, args.epochs) for s in args.settings for e in range(args.epochs)]:
            plain, spec = runs["none"][name]["rows"], runs[method][name]["rows"]
            same = [a[0] == b[0] for a, b in zip(plain, spec)]
            diff = max((abs(p - q) for a, b, s in zip(plain, spec, same) if s for p, q in zip(a[1], b[1])), default=0.0)
            drafted, accepted = runs[method][name]["draft_tokens"], runs[method][name]["accepted_tokens"]
            report[f"{method} {name}"] = {"identical_fraction": sum(same) / len(same), "sequences": len(same),
                                          "mismatched": same.count(False), "max_logprob_diff": diff,
                                          "tokens": sum(len(a[0]) for a in plain), "draft_tokens": drafted,
                                          "accepted_tokens": accepted,
                                          "drafter_s": round(runs[method][name]["drafter_s"], 3)}
            print(f"{method:12s} {name:24s} identical {sum(same)}/{len(same)}  max |dlogprob| {diff:.2e}  "
                  f"drafts accepted {accepted}/{drafted}  drafter {runs[method][name]['drafter_s']:.2f} s", flush=True)
    result = {"results": report, "config": {"model": "builtin:dense (fp32)", "sequences": args.sequences,
                                            "max_tokens": args.max_tokens, "seed": args.seed,
                                            "group_size": GROUP, "num_speculative_tokens": args.speculative_tokens,
                                            "epochs": args.epochs}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
