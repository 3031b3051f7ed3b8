"""Paired statistics: over the repeats of benchmarks that run every system in each, and over adjacent engine steps."""

from __future__ import annotations

import math
import statistics

T_975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # Student t, 95% two-sided


def paired(reference: list[float], system: list[float]) -> dict:
    """Median over repeats of reference/system, and a 95% t-interval of the paired log-ratio (from 2 repeats)."""
    logs = [math.log(r / s) for r, s in zip(reference, system)]
    out = {"speedup": round(math.exp(statistics.median(logs)), 3)}
    if len(logs) >= 2:
        half = T_975[min(len(logs) - 1, 9)] * statistics.stdev(logs) / math.sqrt(len(logs))
        mean = statistics.fmean(logs)
        out["speedup_ci95"] = [round(math.exp(mean - half), 3), round(math.exp(mean + half), 3)]
    return out


def median_ci(values: list[float]) -> list[float]:
    """The median and a distribution-free 95% interval for it (order statistics): for the many pairs of adjacent
    engine steps a step-level benchmark times."""
    ordered, n = sorted(values), len(values)
    half = 1.96 * math.sqrt(n) / 2
    return [statistics.median(ordered), ordered[max(int(n / 2 - half), 0)], ordered[min(int(n / 2 + half), n - 1)]]
