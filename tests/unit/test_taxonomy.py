"""The taxonomy table in the README is the code's, and every class a gate claims it raises
is one the conformance suite sees raised."""

from __future__ import annotations

from pathlib import Path

import yaml_rs

from processor.model import RESPONSE_VECTORS, TaxonomyClass
from processor.taxonomy import BEGIN, END, NEXT_ACTIONS, RAISED_BY, table_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_carries_the_generated_table() -> None:
    text = (ROOT / "README.md").read_text()
    assert BEGIN in text and END in text
    block = text.split(BEGIN + "\n", 1)[1].split(END, 1)[0]
    assert block == table_markdown(), "run: .venv/bin/toolsentry taxonomy --readme README.md"


def test_every_class_has_a_vector_and_a_next_action() -> None:
    assert set(RESPONSE_VECTORS) == set(TaxonomyClass) == set(NEXT_ACTIONS)
    assert all(a.strip().endswith(".") for a in NEXT_ACTIONS.values())


def _labelled() -> set[str]:
    seen: set[str] = set()
    for path in (ROOT / "tests" / "conformance" / "cases").glob("*.yaml"):
        for case in yaml_rs.loads(path.read_text(), parse_datetime=False):
            for step in case.get("steps", [case]):
                seen.add(step["expect"]["taxonomy"])
    return seen


def test_each_raised_class_is_exercised_by_the_conformance_suite() -> None:
    raised = {c.value for c in RAISED_BY} - {TaxonomyClass.UNKNOWN_ERROR.value}
    assert raised <= _labelled(), raised - _labelled()
