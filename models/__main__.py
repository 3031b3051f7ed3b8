"""`python -m models`: builds the built-in models if missing and prints where they are (`python -m
bench.model_accuracy` says how well they solve the task)."""

from __future__ import annotations

import argparse
import json

from models.zoo import build, builtin_dir, is_built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quiet", action="store_true",
                        help="print nothing when the models are built already, one line while building (the build's "
                             "progress goes to build.log beside them)")
    args = parser.parse_args()
    if args.quiet:
        if not is_built():
            log_path = builtin_dir().parent / "build.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            print(f"building the built-in models (once per machine, ~5-10 min on 2 cores; progress: {log_path})",
                  flush=True)
            with open(log_path, "a") as log:
                build(log=lambda line: print(line, file=log, flush=True))
        return
    build()
    print(json.dumps(json.loads((builtin_dir() / "build.json").read_text())["models"], indent=2))


if __name__ == "__main__":
    main()
