"""Greedy accuracy of a checkpoint on the arithmetic task, split by difficulty, decoded with vLLM: how well the
built-in policies start RL (some signal on easy problems, room on hard ones).

    python -m bench.model_accuracy [--per-split N]     # the built-in dense and MoE policies
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from actor.engine import close_engine
from tasks.arithmetic import ArithmeticTask
from tasks.reward import score

EASY_OPS = (1, 2)
HARD_OPS = (8, 10, 12)
EVAL_SEED = 7  # neither the SFT data seed nor an RL config's seed


def accuracy_by_difficulty(model_dir: Path, per_split: int, max_operand: int = ArithmeticTask.max_operand,
                           max_tokens: int = 400) -> dict[str, float]:
    from vllm import LLM, SamplingParams

    task = ArithmeticTask(seed=EVAL_SEED, max_operand=max_operand)
    splits = {
        "easy": [task.with_ops(EASY_OPS[i % len(EASY_OPS)], i) for i in range(per_split)],
        "hard": [task.with_ops(HARD_OPS[i % len(HARD_OPS)], i) for i in range(per_split)],
    }
    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=1024,
              kv_cache_memory_bytes=256 << 20, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    result = {}
    for split, problems in splits.items():
        outputs = llm.generate([p.prompt for p in problems], params, use_tqdm=False)
        result[split] = sum(score(o.outputs[0].text, p.answer).correct for o, p in zip(outputs, problems)) / len(problems)
    close_engine(llm)
    return result


def main(argv: list[str] | None = None) -> None:
    from models.zoo import build

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-split", type=int, default=64, help="problems per difficulty split")
    args = parser.parse_args(argv)
    if args.per_split < 1:
        parser.error(f"--per-split must be 1 or more, got {args.per_split}")
    path = build()
    for name in ("dense", "moe"):
        print(name, json.dumps(accuracy_by_difficulty(path / name, args.per_split)))


if __name__ == "__main__":
    main()
