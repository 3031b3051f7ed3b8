"""`logging.rollouts`: every step's trajectories as JSON lines in `logging.dir/rollouts.jsonl`, written by learner rank
0 when it has gathered a step's groups, before training on them (flushed each step, so a run that dies loses none it
trained on). A line is the trajectory's wire message (transport/messages.py: prompt and response token ids, behaviour
logprobs, the policy version of each token, reward, finish reason, speculation counts) plus `step`, the policy
version it trains, and `seed`, the coupled sampler's seed of the sample: with the weights of the versions it names,
(prompt, seed) gives back exactly these tokens. A resumed or restarted run appends (first cutting a line a killed
rank left half-written): the steps after its checkpoint come again, and the later lines are the ones trained."""

from __future__ import annotations

from pathlib import Path

import msgspec

from sampling.coupled import group_seed
from transport.messages import Trajectory

FILE = "rollouts.jsonl"


class RolloutLog:
    def __init__(self, directory: str | Path, run_seed: int):
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.file = (Path(directory) / FILE).open("ab")
        self.file.truncate(last_line_end(Path(directory) / FILE))  # a line a killed rank left half-written goes
        self.run_seed = run_seed

    def write(self, step: int, groups: list[list[Trajectory]]) -> None:
        for t in (t for group in groups for t in group):
            seed = group_seed(self.run_seed, t.group_id, t.group_size) + t.sample_index
            self.file.write(msgspec.json.encode({"step": step, "seed": seed, **msgspec.structs.asdict(t)}) + b"\n")
        self.file.flush()


def last_line_end(path: Path, chunk: int = 1 << 16) -> int:
    """The size of `path` up to and with its last newline (0 if it has none)."""
    with path.open("rb") as f:
        end = f.seek(0, 2)
        while end > 0:
            start = max(0, end - chunk)
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                return start + newline + 1
            end = start
    return 0
