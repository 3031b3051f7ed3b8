"""docs/configuration.md is the schema's own account of itself: written by `python -m configs --describe` from
configs/schema.py, it names every key with its default, range and meaning, and cannot drift from the schema."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from configs.describe import describe, sections
from configs.knobs import between, is_section, one_of, zero_or_between
from configs.schema import Config

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "configuration.md"


def leaves(node: dict, prefix: str = ""):
    """(dotted key, default) for every key of the schema as OmegaConf builds it, not by the generator's own walk."""
    for key, value in node.items():
        nested = isinstance(value, dict) and value  # a section; an empty mapping is a key's default
        yield from leaves(value, f"{prefix}{key}.") if nested else [(f"{prefix}{key}", value)]


def test_the_reference_is_what_the_generator_writes():
    assert DOC.read_text() == describe(), "docs/configuration.md is stale: run `python -m configs --describe > " \
                                          "docs/configuration.md`"


def test_the_command_prints_the_reference():
    proc = subprocess.run([sys.executable, "-m", "configs", "--describe"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == describe()


def test_the_reference_names_every_key_of_the_schema_with_its_default_range_and_meaning():
    rows = [line.strip("| ").split(" | ") for line in describe().splitlines() if line.startswith("| `")]
    cells = {key.strip("`"): rest for key, *rest in rows}
    defaults = dict(leaves(OmegaConf.to_container(OmegaConf.structured(Config), enum_to_str=True)))
    assert len(defaults) > 60 and len(rows) == len(cells) and set(defaults) == set(cells)
    for key, default in defaults.items():
        shown = json.dumps(default) if default is None or isinstance(default, bool) else default
        assert cells[key][0] == ("`???` (required)" if default == "???" else f"`{shown}`"), (key, cells[key])
        assert len(cells[key]) == 3 and all(cell.strip() for cell in cells[key]), (key, cells[key])


def test_every_key_has_a_meaning_and_every_section_a_summary():
    for prefix, cls in sections():
        assert (cls.__doc__ or "").strip() and not cls.__doc__.startswith(cls.__name__ + "("), prefix
        for f in dataclasses.fields(cls):
            if not is_section(f):
                assert f.metadata.get("help", "").strip(), f"{prefix}{f.name} has no help"


@pytest.mark.parametrize("rule,good,bad,says", [
    (between(0, 1, "(]"), [1, 0.5], [0, 1.5], "in (0, 1]"),
    (between(0, 1, "[)"), [0, 0.5], [1, -0.1], "in [0, 1)"),
    (zero_or_between(10, 10**7, "never"), [0, 10, 11.5, 1e7], [-5, 1, 9.9, 1e17], "0 (never) or in [10, 10000000]"),
    (one_of(0, 1, 2, 3), [0, 3], [4, -1], "0, 1, 2 or 3"),
])
def test_a_rule_judges_and_words_the_same_range(rule, good, bad, says):
    assert rule.says == says
    assert all(rule.accepts(v) for v in good) and not any(rule.accepts(v) for v in bad)
