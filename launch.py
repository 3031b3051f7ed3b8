"""SpecActor launcher:  python launch.py --config NAME_OR_PATH [section.key=value ...]

Today (foundation): validate the config, build or find the models, then sample GRPO groups from the
policy with vLLM for `trainer.steps` rounds, score them with the task's reward and log to TensorBoard.
The learner, the transport and weight sync arrive with the asynchronous RL loop.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="SpecActor: asynchronous RL post-training with speculative rollouts")
    parser.add_argument("--config", required=True, help="a name in configs/ (e.g. grpo_tiny) or a YAML path")
    parser.add_argument("overrides", nargs="*", help="section.key=value, validated like the file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from configs.load import ConfigError, load_config

    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)  # every check runs before any process starts
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "DS_ACCELERATOR": cfg.cluster.device.value,
                       "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(key, value)

    from torch.utils.tensorboard import SummaryWriter
    from tqdm import trange
    from vllm import LLM

    from actor.engine import engine_kwargs, sampling_params
    from models.zoo import resolve
    from tasks.dataset import open_dataset
    from tasks.reward import score

    model_dir = resolve(cfg.model.path)
    dataset = open_dataset(cfg.data, cfg.seed)
    writer = SummaryWriter(cfg.logging.dir)
    llm = LLM(**engine_kwargs(cfg, model_dir))
    groups, n = cfg.rollout.prompts_per_step, cfg.rollout.group_size

    for step in trange(cfg.trainer.steps, desc="rollout"):
        cursors = range(step * groups, (step + 1) * groups)
        problems = [dataset[c] for c in cursors]
        start = time.time()
        outputs = llm.generate([p.prompt for p in problems],
                               [sampling_params(cfg, seed=cfg.seed * 1_000_003 + c * n, n=n) for c in cursors],
                               use_tqdm=False)
        seconds = time.time() - start
        rewards = [score(o.text, p.answer).reward for p, out in zip(problems, outputs) for o in out.outputs]
        tokens = sum(len(o.token_ids) for out in outputs for o in out.outputs)
        writer.add_scalar("rl/reward_mean", sum(rewards) / len(rewards), step)
        writer.add_scalar("rollout/tokens_per_s", tokens / seconds, step)
        writer.add_scalar("rollout/trajectories", len(rewards), step)
    writer.close()
    print(f"done: TensorBoard logs in {cfg.logging.dir}  (tensorboard --logdir {cfg.logging.dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
