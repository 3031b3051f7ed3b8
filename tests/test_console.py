"""The console: the last line on learning (`driver.run.RewardWindows`: windows of steps, not single steps), and the
progress line that other lines print above (`driver.logs.progress_line`)."""

import io
import logging
import sys

from driver.logs import progress_line
from driver.run import RewardWindows


def test_the_summary_compares_windows_of_steps_and_the_first_and_last_evaluation():
    rewards = RewardWindows(window=3)
    assert str(rewards) == ""
    for reward in [0.9, 0.3, 0.3, 0.5, 0.6, 0.6, 0.9]:  # a lucky first batch: 0.9 -> 0.9 step to step
        rewards.train(reward)
    rewards.held_out(0, 0.2)
    rewards.held_out(50, 0.25)
    rewards.held_out(100, 0.3)
    assert str(rewards) == (", reward 0.500 -> 0.700 (means over the first and the last 3 steps), "
                            "held-out 0.200 (step 0) -> 0.300 (step 100)")


def test_a_run_cut_short_says_what_it_has():
    rewards = RewardWindows(window=10)
    rewards.train(0.5)
    rewards.train(0.7)
    rewards.held_out(0, 0.1)
    assert str(rewards) == ", reward 0.600 (mean of 2 steps), held-out 0.100 (step 0)"


def test_lines_printed_while_the_progress_line_shows_go_above_it(monkeypatch):
    """What the driver prints, what it logs to the console, and what Ray forwards from a worker (written to
    `sys.stderr` as found at the time) each start a line of their own, never the end of the bar's line."""
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    console = logging.StreamHandler(sys.stderr)  # as driver.logs.route adds it, holding the stream it was given
    console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(console)
    try:
        with progress_line(0, 4) as bar:
            bar.update(1)
            print("rollout actor 0 stopped (engine died); replacement 1 runs weights v1", file=sys.stderr)
            bar.update(1)
            logging.getLogger("learner.distill").warning("draft LM distiller failed")
            sys.stderr.write("(Learner pid=7) WARNING ")  # Ray may write a line in pieces
            sys.stderr.write("from a worker\n")
            print("resuming from step 2")
    finally:
        logging.getLogger().removeHandler(console)
    assert sys.stdout is out and sys.stderr is err and console.stream is err  # all given back
    lines = [line.rsplit("\r", 1)[-1] for line in err.getvalue().split("\n")]  # as a terminal shows them
    for message in ["rollout actor 0 stopped (engine died); replacement 1 runs weights v1",
                    "WARNING learner.distill: draft LM distiller failed", "(Learner pid=7) WARNING from a worker"]:
        assert message in lines
    assert "resuming from step 2\n" in out.getvalue()
    assert lines[-2].startswith("GRPO:") and "2/4" in lines[-2]  # the bar, last, closed where it stood
