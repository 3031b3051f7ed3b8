"""`python -m configs --describe`: prints the configuration reference (docs/configuration.md) as Markdown."""

import argparse

from configs.describe import describe

parser = argparse.ArgumentParser(prog="python -m configs", description=__doc__)
parser.add_argument("--describe", action="store_true", required=True,
                    help="print every config key with its default, range and meaning, as Markdown")
parser.parse_args()
print(describe(), end="")
