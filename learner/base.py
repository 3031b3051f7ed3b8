"""Contract of `learner/`: what the learner consumes and its bounded-asynchrony rule.

The learner trains on `transport.messages.Trajectory` groups. A trajectory sampled (in part) under policy
version `v` may be trained on at learner version `V` only while `V - v <= max_staleness`, where `v` is the
oldest version among its tokens; older ones are dropped and counted, never trained on and never lost silently.

The learner is `learner.num_ranks` DeepSpeed ranks (`learner.Learner`, placed by `driver/`): rank 0 owns the
trajectory inbox, its bookkeeping (`intake.Intake`) and the weight publisher, collects each step's groups and
broadcasts them; every rank trains on its share and DeepSpeed all-reduces the gradients, so a step over R ranks is
the step one rank would take. With `algorithm.kl_coef > 0` every rank also holds a frozen reference policy (the
run's starting weights, sharded like the policy under ZeRO-3) and the loss adds a k3 KL penalty to it. Without one,
a row whose advantage is exactly 0 (its group's rewards all equal) has no gradient, so it gets no backward pass (and
a forward, once the step's weights went out, only when the distiller learns from the step); the step's loss and
gradient stay those of the whole step, whose normalisers count it (`rl/zero_advantage_fraction` says how many rows
that was).

A checkpoint is a directory `checkpoints/step_N/` of a run: `deepspeed/` (weights and optimizer), `hf/` (the
weights as a Hugging Face checkpoint, what resumed actors load), with online distillation `draft/` (the running
draft LM and its version, which a resumed run publishes first), `state.json` (`version` = step counter,
`data_cursor` = one past the newest prompt trained on, counters) and `manifest.json` (the run's id and every file
with its size and sha256). It is written as `step_N.partial/`, fsynced, and renamed into place only when whole, so a crash
leaves either the previous checkpoint or the new one; resuming from a run directory takes the newest *complete*
checkpoint *of the run that last wrote the directory* (`run.json`), never a checkpoint an earlier run left there.
A resumed run continues at that step and that cursor (and that run id); prompts in flight but untrained at
checkpoint time are skipped, not repeated.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

MANIFEST = "manifest.json"
RUN_FILE = "run.json"  # in a run directory: {"run_id": ...} of the run that writes its checkpoints


def staleness(policy_versions: list[int], learner_version: int) -> int:
    """How many versions behind the learner the oldest token of a trajectory is."""
    return learner_version - min(policy_versions, default=learner_version)


def admissible(policy_versions: list[int], learner_version: int, max_staleness: int) -> bool:
    return staleness(policy_versions, learner_version) <= max_staleness


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _intact(path: Path, entry: dict | int) -> bool:
    if isinstance(entry, int):  # a manifest written before they carried hashes: its sizes are all it can check
        return path.stat().st_size == entry
    return path.stat().st_size == entry["size"] and _sha256(path) == entry["sha256"]


def manifest(checkpoint: Path) -> dict | None:
    """A checkpoint's manifest when every file it lists is there with its size and sha256 (a file damaged in place,
    same size or not, fails); None for a partial or damaged checkpoint. Reading every byte is the price: a resume or a
    restart reads them anyway."""
    try:
        listed = json.loads((checkpoint / MANIFEST).read_text())
        whole = all(_intact(checkpoint / name, entry) for name, entry in listed["files"].items())
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None
    return listed if whole else None


def run_of(directory: Path) -> str | None:
    """The id of the run that last wrote run directory `directory` (None: none did, or its run.json is unreadable)."""
    try:
        return json.loads((directory / RUN_FILE).read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find_checkpoint(path: str) -> Path:
    """`path` is a checkpoint or a run directory (then its newest complete checkpoints/step_N of the run that last
    wrote it)."""
    root = Path(path).expanduser()
    if (root / "state.json").is_file():
        if manifest(root) is None:
            raise FileNotFoundError(f"{root}: an incomplete or damaged checkpoint (its {MANIFEST} is missing or "
                                    "lists files that are not there whole, by size and sha256)")
        return root
    run_id = run_of(root)
    steps = sorted((p for p in root.glob("checkpoints/step_*") if p.name.split("_")[1].isdigit()),
                   key=lambda p: int(p.name.split("_")[1]), reverse=True)
    for step in steps:
        listed = manifest(step)
        if listed is not None and (run_id is None or listed.get("run_id") == run_id):
            return step
    raise FileNotFoundError(f"{root}: neither a checkpoint nor a run directory with a complete checkpoint "
                            f"(checkpoints/step_N/{MANIFEST}) of its run")


def is_branch(checkpoint: Path) -> bool:
    """Whether resuming from `checkpoint` leaves a newer whole checkpoint of its run behind (its run directory's)."""
    try:
        return find_checkpoint(str(checkpoint.parent.parent)) != checkpoint
    except FileNotFoundError:
        return False


def checkpoint_state(path: str) -> tuple[Path, dict]:
    """The checkpoint `path` names (see `find_checkpoint`) and its state.json: version, data_cursor, counts, run_id."""
    checkpoint = find_checkpoint(path)
    return checkpoint, json.loads((checkpoint / "state.json").read_text())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def partial(final: Path) -> Path:
    """Where every rank writes checkpoint `final` until `seal_checkpoint` makes it visible."""
    return final.with_name(final.name + ".partial")


def seal_checkpoint(final: Path, state: dict) -> None:
    """Writes state.json and the manifest into the fully written `partial(final)` directory, fsyncs every file and
    directory, and renames it to `final` (replacing an older checkpoint of that name) in one step."""
    partial_dir = partial(final)
    (partial_dir / "state.json").write_text(json.dumps(state, indent=2))
    files = {str(p.relative_to(partial_dir)): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(partial_dir.rglob("*")) if p.is_file()}
    (partial_dir / MANIFEST).write_text(json.dumps({"run_id": state["run_id"], "files": files}, indent=1))
    for p in [*partial_dir.rglob("*"), partial_dir]:
        _fsync(p)
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    partial_dir.rename(final)
    _fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)
