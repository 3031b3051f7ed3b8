"""TensorBoard's event file (driver/logs.Scalars): a full disk under it is warned of once and the run goes on."""

import errno

from driver.logs import Scalars


def test_a_refused_write_is_warned_of_once_and_the_run_goes_on(tmp_path, capsys):
    scalars = Scalars(str(tmp_path))
    scalars.add_scalar("rl/reward_mean", 0.5, 0)
    calls = []

    def full(*args):
        calls.append(args)
        raise OSError(errno.ENOSPC, "No space left on device")

    scalars.writer.add_scalar = full
    scalars.writer.close = full
    scalars.add_scalar("rl/reward_mean", 0.6, 1)
    scalars.add_scalar("rl/reward_mean", 0.7, 2)  # not tried again
    scalars.close()  # (raising here skipped summary.json and Ray's shutdown)
    assert len(calls) == 2 and scalars.failed
    err = capsys.readouterr().err
    assert err.count("TensorBoard's event file cannot be written") == 1 and "No space left" in err
