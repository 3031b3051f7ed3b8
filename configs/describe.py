"""The configuration reference (docs/configuration.md), written from configs/schema.py: every key with its default,
range and meaning. `python -m configs --describe` prints it; tests/test_config_docs.py checks the file equals it."""

from __future__ import annotations

import dataclasses
import typing
from enum import Enum
from typing import Any, Iterator

from omegaconf import MISSING

from configs.knobs import either, is_section
from configs.schema import Config

INTRO = """\
# Configuration

<!-- Written by `python -m configs --describe > docs/configuration.md` from configs/schema.py: edit the schema,
then run that command (tests/test_config_docs.py fails while the two disagree). -->

A run reads one config: `python launch.py --config NAME key=value ...`, where NAME is a bundled config
(`configs/NAME.yaml`: grpo_tiny, grpo_moe_tiny, grpo_gpu1, grpo_moe) or the path of a YAML file, and each `a.b=c`
after it overrides one key (`python launch.py --config grpo_tiny trainer.steps=50 rollout.temperature=0.7`). A YAML
names only what differs from the defaults below, section by section:

```yaml
model:
  path: builtin:dense
trainer:
  steps: 300
```

Every value is checked at load, before any process starts: an unknown key, a wrong type, a value out of its range
(below), a number that is not finite, a number for a true/false key, or an unset required value (`???`) stops the
launcher with exit status 2 and a message naming the key and the file. So do the rules between keys of two sections
(`rollout.max_tokens` < `model.max_model_len`, for one; `algorithm.max_staleness` and
`speculation.distill.every_versions` within `trainer.steps`), a key set where nothing reads it (the drafting keys
with `speculation.method` none, the distiller's with `speculation.distill.every_versions` 0), and what a value names
outside the config: a model directory, a drafter and its options, an address to bind, a directory to write (never
one whose checkpoints `logging.overwrite` would delete with the model or the draft LM the run starts from), a
checkpoint, a data file, and the built-in task's held-out set (at most 90% of what its endless stream draws).
"""


def sections(cls: type = Config, prefix: str = "") -> Iterator[tuple[str, type]]:
    """(key prefix, section class) for the schema's root and every section under it, in schema order."""
    yield prefix, cls
    for f in dataclasses.fields(cls):
        if is_section(f):
            yield from sections(f.default_factory, f"{prefix}{f.name}.")


def describe() -> str:
    """The reference as Markdown: the intro, then a table per section."""
    parts = [INTRO]
    for prefix, cls in sections():
        hints = typing.get_type_hints(cls)
        rows = [_row(prefix, f, hints[f.name]) for f in dataclasses.fields(cls) if not is_section(f)]
        if not rows:
            continue
        title = f"`{prefix.rstrip('.')}`" if prefix else "Top level"
        parts.append(f"\n## {title}\n\n{cls.__doc__}\n\n| key | default | range | meaning |\n|---|---|---|---|\n"
                     + "".join(rows))
    return "".join(parts)


def _row(prefix: str, f: dataclasses.Field, hint: Any) -> str:
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    cells = [f"`{prefix}{f.name}`", _default(default), _range(f, hint), f.metadata["help"]]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |\n"


def _default(value: Any) -> str:
    if value == MISSING:
        return "`???` (required)"
    if value is None or isinstance(value, bool):
        return "`null`" if value is None else f"`{str(value).lower()}`"
    return f"`{value.value if isinstance(value, Enum) else value}`"


def _range(f: dataclasses.Field, hint: Any) -> str:
    """What a key accepts: its rule's words, else what its type allows."""
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) is typing.Union and type(None) in args
    if optional:
        hint = next(a for a in args if a is not type(None))
    if f.metadata["rule"] is not None:
        words = f.metadata["rule"].says
    elif isinstance(hint, type) and issubclass(hint, Enum):
        words = either([f"`{m.value}`" for m in hint])
    else:
        words = {bool: "true or false", str: "a string", dict: "a mapping", list: "a list of names"}[
            typing.get_origin(hint) or hint]
    return f"null or {words}" if optional else words
