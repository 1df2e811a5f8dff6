"""The taxonomy table in the README is the code's, every class a gate claims it raises is
one the conformance suite sees raised, and every class only executors' results raise is
one the results end-to-end test sees raised."""

from __future__ import annotations

import re
from pathlib import Path

import yaml_rs

from processor.model import RESPONSE_VECTORS, TaxonomyClass
from processor.taxonomy import (
    BEGIN,
    END,
    NEXT_ACTIONS,
    RAISED_BY,
    RAISED_BY_RESULTS,
    table_markdown,
)

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


def test_each_class_a_gate_raises_is_exercised_by_the_conformance_suite() -> None:
    raised = {c.value for c in set(RAISED_BY) - RAISED_BY_RESULTS - {TaxonomyClass.UNKNOWN_ERROR}}
    assert raised <= _labelled(), raised - _labelled()


def test_each_class_only_results_raise_is_asserted_by_the_results_end_to_end_test() -> None:
    """The conformance run has no executors, so it cannot see these; the end-to-end test of
    results must assert an observation of each."""
    labelled = _labelled()
    text = (ROOT / "tests" / "integration" / "test_results_e2e.py").read_text()
    for cls in RAISED_BY_RESULTS:
        assert cls in RAISED_BY and RAISED_BY[cls].startswith("result"), cls
        assert cls.value not in labelled, f"{cls.value} is labelled: a gate raises it"
        observed = rf'^\s*assert\b.*\["taxonomy_class"\]\s*==\s*"{cls.value}"'
        assert re.search(observed, text, re.MULTILINE), f"no observation of {cls.value} asserted"
