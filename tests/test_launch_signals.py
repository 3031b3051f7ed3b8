"""A SIGTERM (a scheduler stopping the job) stops a run as Ctrl-C does: every process stopped (`Run.close`), the run
marked interrupted, exit 130. Ray's own handler, which `ray.init` installs at every start of the run's processes
(the first and each restart), would exit with 15 mid-step instead."""

import inspect
import os
import signal

import driver.run
import launch


def ray_like(signum, frame):
    raise SystemExit(signum)


class StandIn:
    """What the launcher's loop calls of a `Run`; it starts as `Run._start` does (Ray's handler, then the run's), and
    its first collect is stopped by a SIGTERM."""

    def __init__(self, cfg):
        self.step, self.interrupted, self.closed = 0, False, False
        signal.signal(signal.SIGTERM, ray_like)
        signal.signal(signal.SIGTERM, driver.run.interrupt)
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


def test_every_start_of_the_runs_processes_takes_sigterm_back_from_ray():
    source = inspect.getsource(driver.run.Run._start)
    assert source.index("ray.init(") < source.index("signal.signal(signal.SIGTERM, interrupt)")
