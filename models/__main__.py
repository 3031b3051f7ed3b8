"""`python -m models [--evaluate N]`: builds the built-in models if missing and prints where they are and how well
they solve the task."""

from __future__ import annotations

import argparse
import json

from models.zoo import build, builtin_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--evaluate", type=int, default=0, metavar="N",
                        help="also report greedy accuracy of each policy on N easy and N hard problems (vLLM)")
    args = parser.parse_args()
    path = build()
    print(json.dumps(json.loads((builtin_dir() / "build.json").read_text())["models"], indent=2))
    if args.evaluate:
        from models.evaluate import accuracy_by_difficulty

        for name in ("dense", "moe"):
            print(name, json.dumps(accuracy_by_difficulty(path / name, args.evaluate)))


if __name__ == "__main__":
    main()
