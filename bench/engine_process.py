"""One fresh process per vLLM engine (vLLM keeps global state between engines in one process), its logs in a file
so that a benchmark's console is the table it measures."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from driver.logs import route_process_logs


def in_fresh_process(log_path: Path, fn, *args):
    """`fn(*args)` in a new spawned process whose output and logs go to `log_path`; an error comes back as the
    exception `fn` raised."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                             initializer=route_process_logs, initargs=(str(log_path.resolve()), "error", True)) as pool:
        return pool.submit(fn, *args).result()
