"""How configs/schema.py declares a key: `knob(default, help, rule)`, its meaning and its range beside the field.

A `Rule` both judges a value and says in words what it accepts, so the loader's error (`must be >= 1`) and the
generated reference (docs/configuration.md) read from the one declaration. `ranges` walks a config's sections and
yields the first values out of range; the rules that span sections stay in configs/load.py.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator


@dataclass(frozen=True)
class Rule:
    """A value's range: `accepts(value)` judges it, `says` words it (`>= 1`), `why` explains it in an error."""

    accepts: Callable[[Any], bool]
    says: str
    why: str = ""

    def complaint(self) -> str:
        return f"must be {self.says}" + (f" ({self.why})" if self.why else "")


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def at_least(low: float, why: str = "") -> Rule:
    return Rule(lambda v: v >= low, f">= {_number(low)}", why)


def more_than(low: float, why: str = "") -> Rule:
    return Rule(lambda v: v > low, f"> {_number(low)}", why)


def zero_or_between(low: float, high: float, zero: str, why: str = "") -> Rule:
    """0 (which means `zero`) or in [low, high]."""
    return Rule(lambda v: v == 0 or low <= v <= high, f"0 ({zero}) or in [{_number(low)}, {_number(high)}]", why)


def between(low: float, high: float, ends: str = "[]", why: str = "") -> Rule:
    """In the interval from `low` to `high`, each end closed (`[`, `]`) or open (`(`, `)`)."""
    def accepts(v: float) -> bool:
        return (low <= v if ends[0] == "[" else low < v) and (v <= high if ends[1] == "]" else v < high)
    return Rule(accepts, f"in {ends[0]}{_number(low)}, {_number(high)}{ends[1]}", why)


def named(what: str) -> Rule:
    """A string that names something (`what`): not empty nor only spaces (null, where allowed, means none)."""
    return Rule(lambda v: bool(str(v).strip()), f"{what}, not empty")


def either(words: list[str]) -> str:
    """`a, b or c`."""
    return ", ".join(words[:-1]) + f" or {words[-1]}" if len(words) > 1 else words[0]


def one_of(*values: Any) -> Rule:
    return Rule(lambda v: v in values, either([str(v) for v in values]))


def knob(default: Any, help: str, rule: Rule | None = None) -> Any:
    """A schema field: its default, what it means and, where its type alone does not bound it, its range."""
    metadata = {"help": help, "rule": rule}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def is_section(f: dataclasses.Field) -> bool:
    """A field holding a section: a dataclass of knobs (`field(default_factory=TheSection)`)."""
    return isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory)


def ranges(node: Any, prefix: str = "") -> Iterator[tuple[str, Any, str]]:
    """(full key, value, complaint) for each value of a config (its dataclass instance) out of its range: a
    section's keys in schema order, then the section's own `check` (rules between two of its keys; reached only
    when its keys passed, since the loader stops at the first complaint), then its subsections."""
    subsections = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if is_section(f):
            subsections.append((value, f"{prefix}{f.name}."))
        elif f.metadata["rule"] is not None and value is not None and not f.metadata["rule"].accepts(value):
            yield f"{prefix}{f.name}", value, f.metadata["rule"].complaint()
    for name, why in getattr(node, "check", lambda: ())():
        yield f"{prefix}{name}", getattr(node, name), why
    for value, sub in subsections:
        yield from ranges(value, sub)
