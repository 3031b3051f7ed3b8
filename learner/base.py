"""Contract of `learner/`: what the learner consumes and its bounded-asynchrony rule.

The learner trains on `transport.messages.Trajectory` groups. A trajectory sampled (in part) under policy
version `v` may be trained on at learner version `V` only while `V - v <= max_staleness`, where `v` is the
oldest version among its tokens; older ones are dropped and counted, never trained on and never lost silently.

The learner is `learner.num_ranks` DeepSpeed ranks (`learner.Learner`, placed by `driver/`): rank 0 owns the
trajectory inbox, its bookkeeping (`intake.Intake`) and the weight publisher, collects each step's groups and
broadcasts them; every rank trains on its share and DeepSpeed all-reduces the gradients, so a step over R ranks is
the step one rank would take. With `algorithm.kl_coef > 0` every rank also holds a frozen reference policy (the
run's starting weights, sharded like the policy under ZeRO-3) and the loss adds a k3 KL penalty to it.

A checkpoint is a directory `checkpoints/step_N/` of a run: `deepspeed/` (weights and optimizer), `hf/` (the
weights as a Hugging Face checkpoint, what resumed actors load) and `state.json` (`version` = step counter,
`data_cursor` = one past the newest prompt trained on, counters), written last. A resumed run continues at
that step and that cursor; prompts in flight but untrained at checkpoint time are skipped, not repeated.
"""

from __future__ import annotations

import json
from pathlib import Path


def staleness(policy_versions: list[int], learner_version: int) -> int:
    """How many versions behind the learner the oldest token of a trajectory is."""
    return learner_version - min(policy_versions, default=learner_version)


def admissible(policy_versions: list[int], learner_version: int, max_staleness: int) -> bool:
    return staleness(policy_versions, learner_version) <= max_staleness


def find_checkpoint(path: str) -> Path:
    """`path` is a checkpoint (holds state.json) or a run directory (its newest checkpoints/step_N)."""
    root = Path(path).expanduser()
    if (root / "state.json").is_file():
        return root
    steps = sorted(root.glob("checkpoints/step_*/state.json"), key=lambda p: int(p.parent.name.split("_")[1]))
    if not steps:
        raise FileNotFoundError(f"{root}: neither a checkpoint (no state.json) nor a run directory with "
                                "checkpoints/step_N/state.json")
    return steps[-1].parent


def checkpoint_state(path: str) -> tuple[Path, dict]:
    """The checkpoint `path` names (see `find_checkpoint`) and its state.json: version, data_cursor, counts."""
    checkpoint = find_checkpoint(path)
    return checkpoint, json.loads((checkpoint / "state.json").read_text())
