"""A rollout's trace (`bench.rollout --trace FILE`): what the trace-driven simulator (bench/simulate.py) replays.

Speculation never changes a token, so one recorded rollout fixes, for every drafter, how many of its drafts the
verifier would accept at every position: a drafter's proposal is a function of the committed history (its weights,
the request's seed and position, the coupled noise). The trace holds:
- `requests`: per request its prompt length and its committed tokens' count (vanilla's, which every coupled system
  equals);
- `match`: per drafter, per request and output position `p`, how many of the `k` tokens it proposes from the history
  up to `p` equal the tokens committed at `p`, `p + 1`, ... (0..k), computed here by replaying the drafter along
  the committed sequences (`draft_lm`: the built-in draft LM, as `specactor` drafts; the oracle matches everywhere);
  `confidence`: the drafter's confidence in each of those proposed tokens (the bridge cuts a proposal at them);
- `systems`: per coupled system and repeat, the measured makespan and every engine step: its wall seconds, the
  tokens it computed (requests plus drafts, or a prefill's prompt tokens), the requests in it, and the seconds the
  coupled sampler, the drafter bridge and the drafter itself took in it (`step_record`).
Ints and a few floats per step and position: a long-tail trace is a few hundred KB.
"""

from __future__ import annotations

import json
from pathlib import Path

STEP_FIELDS = ("wall_s", "tokens", "requests", "sampler_s", "bridge_s", "drafter_s", "unseen_tokens")


def step_record(worker) -> list[float]:
    """In the engine's worker, after a step: the tokens it computed, the requests it ran, and the cumulative seconds
    of the coupled sampler, the bridge and the drafter and history tokens the drafter caught up on (differenced per
    step by `steps_of`)."""
    from actor.vllm_hooks import profile

    runner, spent = worker.model_runner, profile(worker)
    return [runner._sample.step_tokens, runner.input_batch.num_reqs, spent["sampler_s"], spent["bridge_s"],
            spent["drafter_s"], spent["unseen_tokens"]]


def steps_of(records: list[list[float]]) -> list[list[float]]:
    """`[wall, *step_record]` per step with the cumulative seconds made per step; the first record is the engine's
    before the run's first step (its counters hold what the engine spent before: a warm-up, earlier batches)."""
    out, last = [], records[0][3:]
    for wall, tokens, requests, *cumulative in records[1:]:
        out.append([round(wall, 6), int(tokens), int(requests),
                    *(round(c - p, 6) for c, p in zip(cumulative, last))])
        last = cumulative
    return out


def match_lengths(drafter, prompt_ids: list[list[int]], seeds: list[int], sequences: list[list[int]], k: int,
                  temperature: float) -> tuple[list[list[int]], list[list[list[float]]] | None]:
    """Per request and output position, how many of the drafter's `k` tokens proposed there are the committed ones,
    and the drafter's confidence in each of those tokens (None: it gives none): every request drafted at every
    position, batched across requests position by position (as an engine step asks)."""
    from drafters.base import DraftRequest

    matches: list[list[int]] = [[] for _ in sequences]
    sure: list[list[list[float]]] = [[] for _ in sequences]
    rated = True
    for p in range(max(len(s) for s in sequences)):
        live = [i for i, s in enumerate(sequences) if p < len(s)]
        requests = [DraftRequest(f"r{i}", seed=seeds[i], position=p, token_ids=prompt_ids[i] + sequences[i][:p],
                                 temperature=temperature, max_tokens=min(k, len(sequences[i]) - p))
                    for i in live]
        proposals = drafter.propose(requests, k)
        confidences = drafter.confidences()
        rated = rated and confidences is not None
        for j, (i, proposal) in enumerate(zip(live, proposals)):
            truth, n = sequences[i][p:], 0
            while n < len(proposal) and n < len(truth) and proposal[n] == truth[n]:
                n += 1
            matches[i].append(n)
            sure[i].append([round(float(c), 4) for c in confidences[j]] if rated else [])
        for i, s in enumerate(sequences):
            if len(s) == p + 1:
                drafter.remove(f"r{i}")
    return matches, sure if rated else None


def write(path: Path, config: dict, prompt_ids: list[list[int]], seeds: list[int], runs: dict[str, list[dict]],
          draft: Path, k: int, temperature: float) -> None:
    """The trace of one `bench.rollout` run: its coupled systems' steps, and the draft LM's match lengths."""
    from drafters.draft_lm import DraftLM

    sequences = runs["vanilla"][0]["sequences"]
    trace = {
        "config": {**config, "num_speculative_tokens": k, "temperature": temperature, "step_fields": STEP_FIELDS},
        "requests": [{"prompt_tokens": len(p), "tokens": len(s)} for p, s in zip(prompt_ids, sequences)],
        "match": {}, "confidence": {},
        "systems": {name: [{"makespan_s": round(r["makespan_s"], 4), "steps": steps_of(r["step_records"])}
                           for r in repeats] for name, repeats in runs.items() if "step_records" in repeats[0]},
    }
    trace["match"]["draft_lm"], trace["confidence"]["draft_lm"] = match_lengths(
        DraftLM(str(draft)), prompt_ids, seeds, sequences, k, temperature)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace, separators=(",", ":")))
