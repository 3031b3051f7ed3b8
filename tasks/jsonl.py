"""GSM8K-style JSONL data: one object per line with `question` and `answer` ("... #### <final>")."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tasks.base import ANSWER_MARK, Problem, epoch_index
from tasks.reward import normalize_number


class DataFormatError(ValueError):
    """A data file is malformed; the message names the file and the line."""


def load_jsonl(path: str | Path, fits: Callable[[str], str | None] | None = None) -> list[Problem]:
    """Every record of `path`, in order. Whitespace-only lines hold no record and are passed over; any
    other line that is not a valid record raises `DataFormatError` naming the file and line number. `fits`, if
    given, says what is wrong with a record's prompt (None: nothing), e.g. that the model cannot hold it."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataFormatError(f"{path}: {'a directory, not a data file' if path.is_dir() else 'no such data file'}")
    problems = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # (a byte-order mark starts some files)
            except UnicodeDecodeError as e:
                raise DataFormatError(f"{path}:{lineno}: not UTF-8 ({e.reason} at byte {e.start})") from None
            if line.strip():
                problems.append(_parse(line, f"{path}:{lineno}", f"{path.stem}-{lineno}"))
                if fits is not None and (wrong := fits(problems[-1].prompt)):
                    raise DataFormatError(f"{path}:{lineno}: {wrong}")
    if not problems:
        raise DataFormatError(f"{path}: holds no records")
    return problems


def _parse(line: str, where: str, problem_id: str) -> Problem:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataFormatError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise DataFormatError(f"{where}: nested too deeply to be a record") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise DataFormatError(f"{where}: {e}") from None
    if not isinstance(record, dict):
        raise DataFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in ("question", "answer"):
        if key not in record:
            raise DataFormatError(f"{where}: missing key '{key}'")
        if not isinstance(record[key], str) or not record[key].strip():
            raise DataFormatError(f"{where}: '{key}' must be a non-empty string")
        try:
            record[key].encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate escape ("\\ud800"): no tokenizer or message can carry it
            raise DataFormatError(f"{where}: '{key}' holds a lone surrogate, which is not text") from None
    solution = record["answer"].strip()
    if solution.count(ANSWER_MARK) != 1:  # (the reward refuses a response with two: its own reference would score 0)
        raise DataFormatError(f"{where}: 'answer' must hold '{ANSWER_MARK} <final answer>' once, "
                              f"not {solution.count(ANSWER_MARK)} times")
    if ANSWER_MARK + "#" in solution:  # (read as '#' and '####': a response written like it would score 0)
        raise DataFormatError(f"{where}: 'answer' must mark its final answer with '{ANSWER_MARK}' exactly, not "
                              f"'{ANSWER_MARK}#'")
    final = solution.rsplit(ANSWER_MARK, 1)[1].strip()
    if normalize_number(final) is None:
        raise DataFormatError(f"{where}: final answer {final!r} after '{ANSWER_MARK}' is not a number")
    solution = solution.rsplit(ANSWER_MARK, 1)[0].rstrip() + f"\n{ANSWER_MARK} {final}"
    return Problem(str(record.get("id", problem_id)), record["question"].strip(), final, solution.lstrip())


@dataclass
class JsonlDataset:
    """Cycles through a JSONL file in epochs, each epoch in a seeded random order."""

    path: str
    seed: int = 0
    problems: list[Problem] = field(init=False)

    def __post_init__(self) -> None:
        self.problems = load_jsonl(self.path)

    def __getitem__(self, cursor: int) -> Problem:
        if cursor < 0:
            raise IndexError(f"cursor must be >= 0, got {cursor}")
        return self.problems[epoch_index(cursor, len(self.problems), f"jsonl:{self.seed}")]
