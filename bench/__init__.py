"""Benchmarks: `python -m bench.NAME` runs systems side by side on the same cores in one run and writes JSON
(and a PNG where a plot helps). Speed claims come from here, never from timed tests."""
