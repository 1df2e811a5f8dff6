"""Exponential backtracking in contract patterns: the analysis the registry and the linter
share. A flagged pattern is one whose loop reads some text in two ways; the safe ones
include every pattern the shipped contracts carry."""

from __future__ import annotations

from typing import Any

import pytest
import regress
import yaml

from processor.contracts.backtracking import Unanalysable, explain, exponential_word
from tests.unit.helpers import CONTRACTS_DIR

EXPONENTIAL = [
    r"^(\w+\s?)*$",
    r"^(x+x+)+y$",
    r"^(a|a?)+$",
    r"(a+)+",
    r"^(a|aa)+$",
    r"^(a*)*$",
    r"^(\w|\d)+$",
    r"^(.*a){12}$",  # bounded, but n^12: decided as unbounded
    r"^(.*a){3,}$",
    r"^(?:[A-Z]*)*$",
    r"^WO-([0-9]{2,})+$",
    r"^(?:WO|WOWO)+-$",
    r"^(.|\s)*$",
    r"^([a-z]|[a-f0-9])+$",
    r"^(?:a(?:|)b)*c$",  # the empty group is read two ways in every round
    r"^(?:a?a?b)*$",
    r"^(\w+([.-]?\w+)*)@\w+([.-]?\w+)*(\.\w{2,3})+$",  # a well-known email regex
    r"^(?=(a+)+b)",  # inside a lookahead: the engine runs its body all the same
    r"^(?<word>[a-z]+ ?)+$",
    r"^(\p{L}|[a-z])+$",  # a property may share a character with anything
    r"^(?:\u{1F600}|[\uD83D\uDE00])+$",  # one code point, written two ways
    r"^(?i:[a-z]|[A-Z])+$",  # the same letters, once case is ignored
    "^(?s:.|\n)*$",  # a dot that matches a newline
]

POLYNOMIAL_OR_LESS = [
    r"^[a-z]+(-[a-z]+)*$",
    r"^([a-z]+\.)*[a-z]+$",
    r"^\d{3}-\d{4}$",
    r"^CUS-[0-9]{6}$",
    r"^[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}$",
    r"^([\w.%+-]+)@([\w-]+\.)+([\w]{2,})$",
    r"^(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,}$",
    r"^(\d{1,3}\.){3}\d{1,3}$",
    r"^(?:\d{3}-?){2}\d{4}$",
    r"^(\d{16} ?)+$",
    r"^(WO+)+-[0-9]{5}-[A-Z]$",  # each round starts with a W
    r"^(ab|cd)+$",
    r"^(x{2})+$",
    r"^[(a+)]+$",
    r"^(a|ab)*$",
    r"^(?:WO|WORK)+$",
    r"^([a-z]|[0-9])+$",
    r"^(.*a){3}$",  # n^3: polynomial, like .*a.*a.*a
    r"^\d+\d+$",  # polynomial: n ways, not 2^n
    r".*a.*a.*$",
    r"^(a+)\1$",
    r"^(?<!x)(?=[a-z])[a-z]+\b$",
    r"\p{Lu}\P{Lu}*",
    r"^[^\s\S]*$",
    r"^\B?a$",
    "^(?:.|\n)*$",  # a dot that does not
    r"^(?i:[a-z]+)(?:-[a-z]+)*$",
]


def _shipped_patterns() -> list[str]:
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "pattern" and isinstance(value, str):
                    found.add(value)
                elif key == "patternProperties" and isinstance(value, dict):
                    found.update(value)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    for path in CONTRACTS_DIR.rglob("*.yaml"):
        walk(yaml.safe_load(path.read_text()))
    return sorted(found)


@pytest.mark.parametrize("pattern", EXPONENTIAL)
def test_exponentially_ambiguous_patterns_are_found(pattern: str) -> None:
    regress.Regex(pattern, "u")  # a pattern the engine would run
    word = exponential_word(pattern)
    assert word
    message = explain(pattern)
    assert message is not None and "exponentially many ways" in message


@pytest.mark.parametrize("pattern", POLYNOMIAL_OR_LESS)
def test_patterns_without_exponential_ambiguity_pass(pattern: str) -> None:
    regress.Regex(pattern, "u")
    assert exponential_word(pattern) is None
    assert explain(pattern) is None


def test_every_shipped_pattern_passes() -> None:
    patterns = _shipped_patterns()
    assert len(patterns) > 15
    assert [p for p in patterns if explain(p) is not None] == []


@pytest.mark.parametrize(
    ("pattern", "word"),
    [(r"^(\w+\s?)*$", "aa"), (r"^(a+)+$", "aa"), (r"^(x+x+)+y$", "xxx"), (r"^(\w|\d)+$", "0a")],
)
def test_the_word_is_one_the_loop_reads_in_two_ways(pattern: str, word: str) -> None:
    assert exponential_word(pattern) == word


@pytest.mark.parametrize("pattern", ["(", "[a", "a\\", r"\u{zz}", r"(?x:a)", r"\p"])
def test_syntax_outside_ecma_is_unanalysable_not_a_crash(pattern: str) -> None:
    with pytest.raises(Unanalysable):
        exponential_word(pattern)
    message = explain(pattern)
    assert message is not None and "cannot be checked" in message


def test_a_large_bounded_repetition_is_decided_quickly() -> None:
    """{n,m} past the expansion limit is decided as unbounded, not built copy by copy."""
    assert exponential_word(r"^(?:[a-z]{1,5000}\.){1,9000}$") is None
    assert exponential_word(r"^(?:[a-z]+ ?){1,9000}$") is not None
