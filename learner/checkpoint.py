"""Checkpoints of a run, and which one a resume or a restart takes.

A checkpoint is a directory `checkpoints/step_N/` of a run: `deepspeed/` (weights and optimizer), `hf/` (the weights as
a Hugging Face checkpoint, what resumed actors load), with online distillation `draft/` (the newest draft LM version
handed to the actors, which a resumed run publishes first), `state.json` (`version` = step counter, `data_cursor` = one
past the newest prompt trained on, counters) and `manifest.json` (the run's id and every file with its size and
sha256). It is written into an emptied `step_N.partial/`, fsynced, and renamed into place only when whole, so a crash
leaves either the previous checkpoint or the new one; resuming from a run directory takes the newest *complete*
checkpoint *of the run that last wrote the directory* (`run.json`), never a checkpoint an earlier run left there. A
resumed run continues at that step and that cursor (and that run id); prompts in flight but untrained at checkpoint
time are skipped, not repeated.

With learner ranks on several nodes every rank writes its shard into the same directory, so `logging.dir` must be
one that every learner node shares (a network file system): rank 0 checks it sees every rank's files when the ranks
start (`RankCheckpoints.check_shared`) and again before it seals each checkpoint.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import socket
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from configs.load import draft_model
from learner.exchange import gather_full_state
from models.zoo import copy_tokenizer

MANIFEST = "manifest.json"
REQUIRED = {"state.json", "hf", "deepspeed"}  # what every checkpoint's manifest lists (files, or files under them)
STEP_DIR = re.compile(r"step_([0-9]+)(\.old)?")  # checkpoints/step_N (step_N.old: see `seal`)
SHARED_WAIT_S = 60.0  # how long rank 0 waits to see another rank's files before it calls logging.dir unshared
# in a run directory: {"run_id": ..., "data_sha256": ...} of the run that writes its checkpoints (the digest of its
# data.source file; absent for the arithmetic task)
RUN_FILE = "run.json"


def file_sha256(path: Path) -> str:
    stat = path.stat()
    return _sha256_of(str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _sha256_of(path: str, inode: int, size: int, mtime_ns: int) -> str:
    """A file's sha256, read once per process while it stays the same file, size and modification time (a resume
    checks the checkpoint at load, when it names the run id and when the run starts: one read of its bytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _intact(path: Path, entry: dict | int) -> bool:
    if isinstance(entry, int):  # a manifest written before they carried hashes: its sizes are all it can check
        return path.stat().st_size == entry
    return path.stat().st_size == entry["size"] and file_sha256(path) == entry["sha256"]


def manifest(checkpoint: Path) -> dict | None:
    """A checkpoint's manifest when every file it lists is there with its size and sha256 (a file damaged in place,
    same size or not, fails); None for a partial or damaged checkpoint. Reading every byte is the price, once per
    process (`file_sha256`): a resume or a restart reads them anyway."""
    try:
        listed = json.loads((checkpoint / MANIFEST).read_text())
        whole = all(_intact(checkpoint / name, entry) for name, entry in listed["files"].items())
        parts = {name.split("/")[0] for name in listed["files"]}
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None
    return listed if whole and REQUIRED <= parts else None  # (a manifest listing fewer parts is no checkpoint)


class UnreadableRunFile(FileNotFoundError):
    """A run directory's run.json is there but cannot be read (a kill or a full disk while an older version wrote it):
    which run's checkpoints the directory holds is not known."""


def run_of(directory: Path, key: str = "run_id") -> str | None:
    """What the run that last wrote run directory `directory` keeps under `key` in its run.json: its id, or its data
    file's digest (None: no run did, or the key is not there); UnreadableRunFile where the file cannot be read."""
    path = directory / RUN_FILE
    try:
        written = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        written = None
    if not isinstance(written, dict) or "run_id" not in written:
        raise UnreadableRunFile(f"{path} is unreadable, so which run's checkpoints are there is not known: name the "
                                f"checkpoint to resume (trainer.resume_from={directory}/checkpoints/step_N)")
    return written.get(key)


def last_run(directory: Path) -> str | None:
    """The id of the run that last wrote run directory `directory` (None: none did); one whose run.json cannot be
    read is another run's, as far as anyone can tell."""
    try:
        return run_of(directory)
    except UnreadableRunFile:
        return "unreadable"


def mark_run(directory: Path, run_id: str, data_sha256: str | None) -> None:
    """Writes run directory `directory`'s run.json (the run that writes it now, and its data file's digest) whole or
    not at all: a kill or a full disk while writing leaves the previous one."""
    written = directory / (RUN_FILE + ".partial")
    written.write_text(json.dumps({"run_id": run_id, "data_sha256": data_sha256}))
    _fsync(written)
    os.replace(written, directory / RUN_FILE)


def find_checkpoint(path: str) -> Path:
    """`path` is a checkpoint or a run directory (then its newest complete checkpoints/step_N of the run that last
    wrote it)."""
    root = Path(path).expanduser()
    if (root / "state.json").is_file():
        if manifest(root) is None:
            raise FileNotFoundError(f"{root}: an incomplete or damaged checkpoint (its {MANIFEST} is missing or "
                                    "lists files that are not there whole, by size and sha256)")
        return root
    run_id = run_of(root)  # (an unreadable one raises: any run's newest checkpoint would be taken)
    # newest first; at one step, step_N before step_N.old (what a crash between `seal`'s two renames leaves)
    steps = sorted((p for p in root.glob("checkpoints/step_*") if STEP_DIR.fullmatch(p.name)),
                   key=lambda p: (int(STEP_DIR.fullmatch(p.name)[1]), not p.name.endswith(".old")), reverse=True)
    for step in steps:
        listed = manifest(step)
        if listed is not None and (run_id is None or listed.get("run_id") == run_id):
            return step
    raise FileNotFoundError(f"{root}: neither a checkpoint nor a run directory with a complete checkpoint "
                            f"(checkpoints/step_N/{MANIFEST}) of its run")


def passed_over(resume_from: str, checkpoint: Path) -> list[Path]:
    """What a resume from run directory `resume_from` passed over to take `checkpoint` (`find_checkpoint`: the newest
    whole one): the newer step directories beside it, damaged or incomplete. Nothing where `resume_from` names
    `checkpoint` itself (a branch from an older checkpoint passes over nothing)."""
    if Path(resume_from).expanduser() == checkpoint:
        return []
    step = int(STEP_DIR.fullmatch(checkpoint.name)[1])
    newer = [p for p in checkpoint.parent.glob("step_*") if STEP_DIR.fullmatch(p.name)]
    return sorted(p for p in newer if int(STEP_DIR.fullmatch(p.name)[1]) > step)


def is_branch(checkpoint: Path) -> bool:
    """Whether resuming from `checkpoint` leaves a newer whole checkpoint of its run behind (its run directory's)."""
    try:
        return find_checkpoint(str(checkpoint.parent.parent)) != checkpoint
    except UnreadableRunFile:  # (its run unknown: a run of its own, whose id no checkpoint there can share)
        return True
    except FileNotFoundError:
        return False


# what a resumed run must keep: the policy its weights belong to, the data order its cursor counts in, the shape and
# precision of the optimizer state its ranks saved (state.json holds them; driver/preflight.py compares them at load)
RESUME_KEYS = ("model.path", "seed", "data.source", "data.size", "data.max_ops", "data.max_operand",
               "data.tail_exponent", "data.eval_source", "data.eval_size", "learner.num_ranks", "learner.zero_stage",
               "learner.dtype")


DRAFT_MODEL = "speculation.draft_model"  # resume_config's name for the distilled draft LM (configs.load.draft_model)


def resume_config(cfg) -> dict:
    """`cfg`'s values of RESUME_KEYS as state.json keeps them (an enum by its value); the arithmetic task's own keys
    only where it is the data source (a JSONL file's order does not depend on them), the held-out problems' only
    where its stream is endless (it never draws one of them: tasks/dataset.py), and the draft LM where it is distilled
    (the checkpoint's draft/ holds weights of that model)."""
    arithmetic = OmegaConf.select(cfg, "data.source") == "arithmetic"
    endless = arithmetic and not OmegaConf.select(cfg, "data.size")
    keys = [key for key in RESUME_KEYS if (endless or not key.startswith("data.eval")) and (
        arithmetic or key == "data.source" or not key.startswith("data."))]
    kept = {key: getattr(value, "value", value) for key, value in ((k, OmegaConf.select(cfg, k)) for k in keys)}
    if OmegaConf.select(cfg, "speculation.distill.every_versions", default=0):  # its distilled weights are that model's
        kept[DRAFT_MODEL] = draft_model(cfg.speculation)  # (under one name, whichever method runs it)
    return kept


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
    """Where `final` is written until it is whole: a checkpoint by every rank until `seal` makes it visible, the
    final weights by rank 0 until it renames them."""
    return final.with_name(final.name + ".partial")


def seal(final: Path, state: dict) -> None:
    """Writes state.json and the manifest into the fully written `partial(final)` directory, fsyncs every file and
    directory, and renames it to `final`. An older checkpoint of that name is first renamed `final.old`, which
    `find_checkpoint` takes while `final` is missing (a crash between the two renames), and removed after."""
    partial_dir = partial(final)
    (partial_dir / "state.json").write_text(json.dumps(state, indent=2))
    files = {str(p.relative_to(partial_dir)): {"size": p.stat().st_size, "sha256": file_sha256(p)}
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


class UnsharedDirectory(RuntimeError):
    """Rank 0 does not see files another learner rank wrote into the run's directory."""


def files_under(directory: Path) -> list[str]:
    """Every file under `directory`, relative to it: what one rank sees there."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def check_sees_all(directory: Path, seen_by_rank: list[list[str]], wait_s: float = 0.0) -> None:
    """Rank 0, after every rank wrote into `directory` and listed it (`files_under`, rank order): raises
    UnsharedDirectory unless rank 0 sees every file any rank saw there, within `wait_s` (a network file system's
    client may cache a directory's listing for tens of seconds)."""
    deadline = time.monotonic() + wait_s
    here = set(files_under(directory))
    while not set().union(*seen_by_rank) <= here and time.monotonic() < deadline:
        time.sleep(1.0)
        here = set(files_under(directory))
    for rank, names in enumerate(seen_by_rank):
        missing = sorted(set(names) - here)
        if missing:
            raise UnsharedDirectory(
                f"{directory}: learner rank {rank} wrote {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                "there but rank 0 does not see it: learner ranks on several nodes need a logging.dir that every "
                "learner node shares (a network file system mounted at the same path)")


class RankCheckpoints:
    """A learner rank's checkpoint calls, a part of `learner.learner.Learner` (they use its engine, version, rank,
    and on rank 0 its intake and distiller)."""

    def save_pretrained(self, path: str) -> None:
        """Every rank: the weights as a Hugging Face checkpoint that vLLM can serve, at `path` whole or not at all
        (rank 0 writes `path.partial`, then renames it: a rank lost mid-save leaves no half-written one there)."""
        state = gather_full_state(self.engine, self.rank, self.cfg.learner.zero_stage, self.bucket_bytes)
        if state is not None:
            written = partial(Path(path))
            shutil.rmtree(written, ignore_errors=True)
            self.engine.module.save_pretrained(str(written), state_dict=state)
            copy_tokenizer(self.policy_dir, written)
            shutil.rmtree(path, ignore_errors=True)
            written.rename(path)

    def save_checkpoint(self, root: str) -> list[str]:
        """Every rank: `root/step_<version>.partial/` with the DeepSpeed state (weights, optimizer) and the weights
        as a Hugging Face checkpoint (what resumed actors load); returns the files this rank sees there then, for
        `seal_checkpoint`."""
        path = partial(Path(root) / f"step_{self.version}")
        if self.rank == 0:  # what a save that crashed left there is never sealed into this one
            shutil.rmtree(path, ignore_errors=True)
        torch.distributed.barrier()
        self.engine.save_checkpoint(str(path / "deepspeed"), tag="state")
        self.save_pretrained(str(path / "hf"))
        if self.distiller is not None:  # the distilled draft LM the actors run
            self.distiller.save(path / "draft")
        return files_under(path)

    def seal_checkpoint(self, root: str, run_id: str, seen_by_rank: list[list[str]]) -> str:
        """Rank 0, once every rank has saved (`seen_by_rank`: what each saw): when rank 0 sees every rank's files,
        state.json (version, data cursor, counters, run id) and the manifest written, everything fsynced,
        `step_<version>.partial` renamed to `step_<version>` (learner/checkpoint.py)."""
        final = Path(root) / f"step_{self.version}"
        check_sees_all(partial(final), seen_by_rank, SHARED_WAIT_S)
        with self.lock:
            state = {"version": self.version, "run_id": run_id, "skipped_steps": self.skipped_steps,
                     "config": resume_config(self.cfg), **self.intake.state()}
        seal(final, state)
        return str(final)

    def mark_directory(self, directory: str) -> list[str]:
        """Every rank: a file of its own in `directory`, then the files it sees there (rank 0 `check_shared`s them)."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / f"rank_{self.rank}").write_text(socket.gethostname())
        return files_under(Path(directory))

    def check_shared(self, directory: str, seen_by_rank: list[list[str]]) -> None:
        """Rank 0: raises UnsharedDirectory unless it sees each rank's `mark_directory` files; then removes them."""
        check_sees_all(Path(directory), seen_by_rank, SHARED_WAIT_S)
        shutil.rmtree(directory, ignore_errors=True)

    def load_checkpoint(self, path: str) -> None:
        """Every rank: checkpoint `path` as the driver found it (`find_checkpoint`: whole, by size and sha256; a
        rank reads it without hashing it again)."""
        path = Path(path)
        state = json.loads((path / "state.json").read_text())
        # the schedule follows this config (a changed learner.lr applies), fast-forwarded to the checkpoint's step,
        # and so does the weight decay (DeepSpeed brings back the saved optimizer's settings with its state)
        self.engine.load_checkpoint(str(path / "deepspeed"), tag="state", load_lr_scheduler_states=False)
        for group in self.engine.optimizer.param_groups:
            group["weight_decay"] = self.cfg.learner.weight_decay
        self.version, self.skipped_steps = state["version"], state.get("skipped_steps", 0)
        self.engine.lr_scheduler.last_epoch = self.version - 1
        self.engine.lr_scheduler.step()
        if self.rank == 0:
            self.intake.restore(state)
        if self.distiller is not None and (path / "draft").is_dir():
            self.distiller.load(path / "draft")
