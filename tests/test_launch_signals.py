"""`launch.py`: a SIGTERM (a scheduler stopping the job) stops a run as Ctrl-C does, with a stand-in for the run's
processes: every process stopped (`Run.close`), the run marked interrupted, exit 130. Ray's own handler, installed
when the run starts Ray, would exit with 15 mid-step instead."""

import os
import signal

import driver.run
import launch


def ray_like(signum, frame):
    raise SystemExit(signum)


class StandIn:
    """What the launcher's loop calls of a `Run`; its first collect is stopped by a SIGTERM."""

    def __init__(self, cfg):
        self.step, self.interrupted, self.closed = 0, False, False
        signal.signal(signal.SIGTERM, ray_like)  # as ray.init installs its own
        StandIn.last = self

    def evaluate_if_due(self, step):
        pass

    def collect(self):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the signal is raised in the main thread before this line")

    def close(self):
        self.closed = True


def test_a_sigterm_stops_the_run_as_ctrl_c_does(monkeypatch):
    monkeypatch.setattr(driver.run, "Run", StandIn)
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert launch.main(["--config", "grpo_tiny"]) == 130
    finally:
        signal.signal(signal.SIGTERM, before)
    assert StandIn.last.interrupted and StandIn.last.closed
