"""The console's last line on learning (`driver.run.RewardWindows`): windows of steps, not single steps."""

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
