"""Calibration of drafters' confidences (drafters/calibration.py): every verify step labels a proposal exactly, token
by token, and a confidence is worth the acceptance rate its bucket has seen."""

import numpy as np

from drafters.calibration import EDGES, Calibration


def bucket(confidence: float) -> int:
    return int(np.searchsorted(EDGES, confidence, side="right"))


def test_labels_run_to_the_first_rejection_and_the_bonus_token_labels_one_past_the_verified_drafts():
    table = Calibration(decay=1.0)
    table.observe([0.95, 0.95, 0.95], [1, 2, 3], [1, 9])  # 1 accepted, 2 rejected (the target sampled 9), 3 unknown
    assert table.labelled[bucket(0.95)] == 2 and table.agreed[bucket(0.95)] == 1
    table.observe([0.2, 0.2, 0.2], [4, 5, 6], [4, 5])  # 4 verified and accepted; the bonus token 5 agrees with draft 5
    assert table.labelled[bucket(0.2)] == 2 and table.agreed[bucket(0.2)] == 2
    table.observe([0.6, 0.6], [7, 8], [3])  # not verified at all: the plain-decoded token labels the first draft
    assert table.labelled[bucket(0.6)] == 1 and table.agreed[bucket(0.6)] == 0


def test_rates_follow_what_was_committed_not_what_the_drafter_claimed():
    table = Calibration()
    assert table.rates([0.999])[0] > 0.9 and table.rates([0.1])[0] < 0.2  # no labels: the drafter's own number
    for _ in range(300):  # a drafter sure of tokens the target never samples, unsure of ones it always does
        table.observe([0.999], [1], [2])
        table.observe([0.1, 0.1], [3, 4], [3, 4])
    sure, unsure = table.rates([0.999, 0.1])
    assert sure < 0.05 and unsure > 0.95
    assert table.gains([0.1, 0.1, 0.999]) == [unsure, unsure * unsure, unsure * unsure * sure]
