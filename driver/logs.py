"""Where a run's logs go: the console shows the driver's own lines (configuration, progress, summary) and, from every
process, warnings and errors at `logging.engine_level` or above; everything from info up (debug when asked) goes to
`logging.dir/run.log`, the file to grep after a failure. While the training loop runs, the progress line stays at
the bottom of the console and every other line (the driver's, and the workers' that Ray forwards) prints above it.

In the Ray workers (rollout actors, learner ranks) `route_worker_logs` runs before any actor code, as Ray's
`worker_process_setup_hook`: their stdout (vLLM's and DeepSpeed's info chatter, stray prints) goes to the file, the
Python logging tree gets a file handler and a console handler on stderr (which Ray forwards to the driver), and
vLLM is told not to install its own stdout handler.

TensorBoard's event file (`Scalars`) is a log like the others: a write it refuses (a full disk) is warned of once and
the run goes on without it, to its next checkpoint, instead of ending there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

LOG_FILE = "run.log"
_FILE_ENV, _LEVEL_ENV = "SPECACTOR_LOG_FILE", "SPECACTOR_ENGINE_LEVEL"
_FORMAT = "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"


def worker_env(path: str, engine_level: str) -> dict[str, str]:
    """Environment variables the workers need for `route_worker_logs`."""
    return {_FILE_ENV: path, _LEVEL_ENV: engine_level, "VLLM_CONFIGURE_LOGGING": "0",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1"}  # transformers' load/save progress bars: not a run's progress


def route(path: str, engine_level: str) -> list[logging.Handler]:
    """Adds to this process's logging tree: everything from info up to `path`, `engine_level` and up to stderr;
    Python warnings (library deprecation notices) to the file only. Returns the handlers added."""
    level = getattr(logging, engine_level.upper())
    root = logging.getLogger()
    root.setLevel(min(level, logging.INFO))
    to_file = logging.FileHandler(path)
    to_file.setFormatter(logging.Formatter(_FORMAT))
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(level)
    console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(to_file)
    root.addHandler(console)
    logging.captureWarnings(True)
    warnings_logger = logging.getLogger("py.warnings")
    warnings_logger.addHandler(to_file)
    warnings_logger.propagate = False
    return [to_file, console]


def unroute(handlers: list[logging.Handler]) -> None:
    """Undoes `route` in the driver's process (a launch inside a longer-lived process, e.g. a test session)."""
    for handler in handlers:
        logging.getLogger().removeHandler(handler)
        logging.getLogger("py.warnings").removeHandler(handler)
        handler.close()
    logging.getLogger("py.warnings").propagate = True
    logging.captureWarnings(False)


def route_process_logs(path: str, level: str, stderr_too: bool = False) -> None:
    """For a process that runs engines and prints nothing of its own (a Ray worker, a benchmark's engine process):
    its stdout (and stderr if asked: a benchmark's errors come back to its parent as exceptions) to `path`, its
    logging tree routed (call before vLLM is imported)."""
    os.environ.update(worker_env(path, level))
    log = open(path, "a", buffering=1)  # noqa: SIM115 -- stays open for the life of the process
    os.dup2(log.fileno(), 1)  # stdout, at the file-descriptor level (C++ prints too): the file only
    if stderr_too:
        os.dup2(log.fileno(), 2)
    logging.getLogger().handlers = []  # whatever the process had: this routing instead
    route(path, level)


def route_worker_logs() -> None:
    """Ray's `worker_process_setup_hook` (driver/run.py sets the variables `worker_env` names)."""
    if os.environ.get(_FILE_ENV):
        route_process_logs(os.environ[_FILE_ENV], os.environ.get(_LEVEL_ENV, "warning"))


@contextlib.contextmanager
def progress_line(initial: int, total: int) -> Iterator:
    """The training loop's tqdm bar on stderr. Meanwhile whatever this process writes to stdout or stderr (the
    driver's lines, its console logging, the workers' lines Ray forwards, which it writes to `sys.stderr` as it finds
    it) goes above the bar, a line at a time, instead of onto the end of the bar's line."""
    from tqdm import tqdm
    from tqdm.contrib import DummyTqdmFile

    streams = sys.stdout, sys.stderr
    bar = tqdm(initial=initial, total=total, desc="GRPO", file=streams[1])
    above = {stream: DummyTqdmFile(stream) for stream in streams}
    consoles = [h for h in logging.getLogger().handlers if type(h) is logging.StreamHandler and h.stream in above]
    sys.stdout, sys.stderr = above[streams[0]], above[streams[1]]
    previous = [handler.setStream(above[handler.stream]) for handler in consoles]
    try:
        yield bar
    finally:
        for handler, stream in zip(consoles, previous):
            handler.setStream(stream)
        sys.stdout, sys.stderr = streams
        bar.close()


class Scalars:
    """TensorBoard's `SummaryWriter` in `directory`, whose refusal to write is warned of once, not raised."""

    def __init__(self, directory: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer, self.failed = SummaryWriter(directory), False

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if not self.failed:
            self._guarded(self.writer.add_scalar, tag, value, step)

    def close(self) -> None:
        self._guarded(self.writer.close)

    def _guarded(self, write, *args) -> None:
        try:
            write(*args)
        except OSError as e:  # (the writer's thread raises what it met at the next write, and at close)
            if not self.failed:
                print(f"warning: TensorBoard's event file cannot be written ({e}); the run goes on without it",
                      file=sys.stderr)
            self.failed = True
