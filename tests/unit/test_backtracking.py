"""Backtracking in contract patterns: the analysis the registry and the linter share. A
pattern whose loop reads some text in two ways is exponential; one whose loops read a
common text one after the other, or that the search tries at every start, is polynomial
and needs a maxLength. Every pattern the shipped contracts carry is neither."""

from __future__ import annotations

from typing import Any

import pytest
import regress
import yaml

from processor.contracts.backtracking import (
    LONGEST_TEXT,
    STEP_BUDGET,
    Unanalysable,
    explain,
    explain_length,
    exponential_word,
    growth,
    longest_text,
    steps,
)
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
    r"^(?:\d+\d+!|\d)$",
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


POLYNOMIAL = [  # (pattern, degree): the work on n characters that almost match grows as n^degree
    (r"^\d+\d+$", 2),  # 889 ms on 16,000 digits and a "!"
    (r"\s*,\s*$", 2),  # linear from each start, and the search tries each: 1.5 s on 16,000
    (r"[a-z]+$", 2),
    (r"\d+$", 2),
    (r"^\S+@\S+$", 2),  # '@' is in \S: any '@' of a run of them may be the one
    (r"\w+@", 2),  # letters without an @: each start reads them all
    (r"a.*b", 2),  # no $, but a text without a b never matches: every start reads to the end
    (r"[a-z]+\b", 2),  # a \b before a digit fails: the match does not end at the last letter
    (r"(?=[a-z]+!)", 2),  # a lookahead the search runs at each start
    (r"^\d+\d+!", 2),
    (r"^a(?:\d+\d+!)?", 2),  # the search could end after the a, but tries the group first
    (r"(?:\d+\d+!|\d)", 2),  # a digit ends the search, but only after the first branch
    (r"^(a+)\1$", 2),  # a backreference is taken as any text
    (r"\d+\d+!", 3),  # quadratic from each start
    (r"^(.*a){3}$", 3),  # .*a.*a.*a: two pairs of loops, one after the other
    (r"\d+\d+(?=x)", 3),  # a lookahead may fail: reaching it is no match yet
    (r".*a.*a.*b", 4),  # 29 s on 500 letters a
    (r".*a.*a.*$", 4),
    (r"(?:[a-z]+[0-9]*){0,10}x", 11),  # ten copies of a loop, and the search
]

LINEAR = [
    r"^[a-z]+$",
    r"^WO-\d{5}-[A-Z]$",
    r"^(\w+\.)*\w+$",  # the dot separates the runs
    r"^([a-z]+\.)*[a-z]+$",
    r"^[a-z]+(-[a-z]+)*$",
    r"^[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}$",
    r"^(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,}$",
    r"^(?:\w+[.-]){0,9}\w+@(?:\w+\.){1,5}\w{2,}$",
    r"\d+\d+",  # two digits anywhere are a match: the search stops at the first ones
    r"^\d+\d+",  # no $: the first split that leaves a digit for the second loop succeeds
    r"(?m:^\d+\d+)",
    r"[a-z]+",
    r"ab*c",  # only an a starts it: the b loop runs from one start
    r"^\d+(?:\.\d+)?",
    r"^(?=.*\d)[a-z\d]+$",  # the lookahead runs once, at the start
    r"^https?://",
    r"^[A-Za-z0-9][A-Za-z0-9 -]{0,10}[A-Za-z0-9]$",
    r"^\d{1,3}\d{1,3}$",  # two counted runs of digits: at most 3 places to split
    r"^(?:\d{1,3}\.){3}\d{1,3}$",
    r"^[a-z]{1,5000}$",
]

COUNTED = [  # (pattern, longest text): linear at most, but their copies split a text many ways
    (r"^[a-z]{0,90}[a-z]{0,90}[a-z]*\d$", 120),  # 1.6 s on 4,000 letters
    (r"^[a-z]{0,30}[a-z]{0,30}[a-z]*\d$", 1040),
    (r"^(?:\d{1,10}){1,10}$", 3),  # 32 s on 40 digits and a "!"
    (r"^(?:a?){22}$", 1),  # 0.34 s on 11 letters and a "b"
]


@pytest.mark.parametrize(("pattern", "degree"), POLYNOMIAL)
def test_polynomial_patterns_have_their_degree(pattern: str, degree: int) -> None:
    regress.Regex(pattern, "u")
    assert exponential_word(pattern) is None and explain(pattern) is None
    found = growth(pattern)
    assert found is not None and found.degree == degree
    limit = longest_text(pattern)
    assert limit is not None and limit**degree <= STEP_BUDGET < (limit + 1) ** degree


@pytest.mark.parametrize("pattern", LINEAR)
def test_linear_patterns_have_no_limit(pattern: str) -> None:
    regress.Regex(pattern, "u")
    assert exponential_word(pattern) is None
    assert growth(pattern) is None
    assert longest_text(pattern) is None
    assert steps(pattern, LONGEST_TEXT) <= STEP_BUDGET
    assert explain_length(pattern, None, "maxLength") is None


@pytest.mark.parametrize(("pattern", "longest"), COUNTED)
def test_counted_repetitions_that_share_a_text_need_a_bound(pattern: str, longest: int) -> None:
    """Neither exponential (the copies are few) nor polynomial (their loops stop), yet each
    copy of a run can end in many places, and the places multiply."""
    regress.Regex(pattern, "u")
    assert exponential_word(pattern) is None and growth(pattern) is None
    assert longest_text(pattern) == longest
    assert steps(pattern, longest) <= STEP_BUDGET < steps(pattern, longest + 1)
    message = explain_length(pattern, None, "maxLength")
    assert message is not None and "split a run of it in many ways" in message
    assert f"give it a maxLength of at most {longest} (it has none)" in message


def test_every_shipped_pattern_is_linear() -> None:
    assert [p for p in _shipped_patterns() if growth(p) is not None] == []


def test_the_budget_allows_a_thousand_characters_quadratic_and_a_hundred_cubic() -> None:
    """At these lengths the measured worst cases take a few milliseconds (STEP_BUDGET)."""
    assert longest_text(r"^\d+\d+$") == 1000
    assert longest_text(r"\d+\d+!") == 100
    assert longest_text(r".*a.*a.*b") == 31


@pytest.mark.parametrize(
    ("pattern", "word"), [(r"\s*,\s*$", " "), (r"^\d+\d+$", "00"), (r"^\S+@\S+$", "@aa")]
)
def test_the_word_is_one_two_loops_read_alike(pattern: str, word: str) -> None:
    found = growth(pattern)
    assert found is not None and found.word == word


def test_a_polynomial_pattern_needs_a_bound_small_enough() -> None:
    missing = explain_length(r"^\d+\d+$", None, "maxLength")
    assert missing == (
        "can take 4.3e+09 steps on a text of 65,536 characters that almost matches ('00' "
        "repeated; the work grows as n^2), and a search may take 1,000,000: give it a "
        "maxLength of at most 1000 (it has none)"
    )
    large = explain_length(r"^\d+\d+$", 1001, "maxLength")
    assert large is not None and "of at most 1000 (it has 1001)" in large
    assert explain_length(r"^\d+\d+$", 1000, "maxLength") is None
    cubic = explain_length(r"\d+\d+!", 500, "propertyNames maxLength")
    assert (
        cubic is not None and "n^3" in cubic and "propertyNames maxLength of at most 100" in cubic
    )


def test_exponential_and_unanalysable_patterns_have_no_length_limit() -> None:
    """Neither can be in a contract: explain refuses them before any length is asked."""
    assert growth(r"^(a+)+$") is None and longest_text(r"^(a+)+$") is None
    assert longest_text("(") is None
    with pytest.raises(Unanalysable):
        growth("(")
