"""The demo's table of decisions, as a newcomer's terminal shows it."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.text import Text

from processor.demo import SCRIPT, WIDE, _Board

LONGEST_CLASS = "STRUCTURAL_VIOLATION"


def _render(width: int, said: str) -> str:
    board = _Board(width)
    step = SCRIPT[0].steps[0]
    board.conversation(SCRIPT[0].title, "demo-0123abcd")
    board.row(19, step, Text("PENDING_APPROVAL"), Text(LONGEST_CLASS, "yellow"), said)
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(board.table)
    return out.getvalue()


@pytest.mark.parametrize("width", [80, 100, WIDE, 160])
def test_short_fields_are_never_broken_across_lines(width: int) -> None:
    text = _render(width, "call lookup_order to get it and never construct one; " * 3)
    for whole in ("19", "PENDING_APPROVAL", LONGEST_CLASS, SCRIPT[0].steps[0].tool):
        assert whole in text, (whole, text)
    assert all(len(line) <= width for line in text.splitlines())


def test_a_wide_console_gives_each_field_its_column_and_a_narrow_one_stacks_them() -> None:
    assert "┃ class " in _render(WIDE, "x")
    narrow = _render(WIDE - 1, "x")
    assert "┃ decision (class) " in narrow and "┃ class " not in narrow


def test_a_result_that_looks_like_console_markup_is_shown_as_it_is() -> None:
    said = '{"note":"[/red] and [bold]"}'
    assert said in _render(160, said)
