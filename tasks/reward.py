"""Exact-final-answer reward, aware of the `#### <number>` answer format."""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from tasks.base import ANSWER_MARK

_NUMBER = re.compile(r"[+-]?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?")


@dataclass(frozen=True)
class Score:
    reward: float
    correct: bool
    well_formed: bool
    reason: str  # "" when correct, else why not


REWARD_BOUND = 1.0  # every reward this module gives (length-penalised or not) lies in [0, REWARD_BOUND]


def normalize_number(text: str) -> Decimal | None:
    """'1,234' -> 1234, '+7' -> 7, '3.50' -> 3.50 (equal to 3.5); None if `text` is not exactly one number. Exact,
    however many digits (normalize() would round to the context's 28: distinct long numbers compared equal)."""
    text = text.strip()
    if not _NUMBER.fullmatch(text):
        return None
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None


def score(response: str, answer: str) -> Score:
    """1.0 for a well-formed response whose final answer equals `answer`, else 0.0 with the reason.

    Well-formed: exactly one line holding `#### <number>`, and nothing but whitespace after that line.
    """
    expected = normalize_number(answer)
    if expected is None:
        raise ValueError(f"reference answer {answer!r} is not a number")
    _, mark, tail = response.partition(ANSWER_MARK)
    if not mark:
        return Score(0.0, False, False, f"no '{ANSWER_MARK}' answer line")
    line, _, after = tail.partition("\n")
    if ANSWER_MARK in tail:
        return Score(0.0, False, False, f"more than one '{ANSWER_MARK}'")
    if after.strip():
        return Score(0.0, False, False, "text after the final answer line")
    got = normalize_number(line)
    if got is None:
        return Score(0.0, False, False, f"final answer {line.strip()!r} is not a number")
    if got != expected:
        return Score(0.0, False, True, f"wrong answer {line.strip()} (expected {answer})")
    return Score(1.0, True, True, "")


def length_penalized(reward: float, tokens: int, max_tokens: int, penalty: float) -> float:
    """A correct answer's reward less `penalty` times the share of the token budget it used (`algorithm.length_penalty`;
    a wrong answer keeps its 0): among a group's correct answers the shorter ones get the larger advantage, so RL
    learns to write them shorter (the length rewards of efficient-reasoning RL), never to answer wrongly."""
    return reward - penalty * min(tokens / max_tokens, 1.0) if reward > 0 else reward
