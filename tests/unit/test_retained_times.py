"""The times the incident tools take on their command line."""

from __future__ import annotations

import pytest

from processor.kafka.retained import parse_time

NOW = 1_795_000_000_000


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90s", NOW - 90_000),
        ("30m", NOW - 1_800_000),
        ("2h", NOW - 7_200_000),
        (" 7d ", NOW - 7 * 86_400_000),
        ("2026-11-27T10:00:00Z", 1_795_773_600_000),
        ("2026-11-27T10:00:00", 1_795_773_600_000),
        ("2026-11-27T11:00:00+01:00", 1_795_773_600_000),
        ("1795773600000", 1_795_773_600_000),
    ],
)
def test_a_time_is_a_duration_before_now_an_iso_time_or_epoch_millis(
    text: str, expected: int
) -> None:
    assert parse_time(text, NOW) == expected


@pytest.mark.parametrize("text", ["", "h", "-2h", "2w", "yesterday", "2026-13-01", "1.5h"])
def test_anything_else_is_refused_saying_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError, match="duration before now"):
        parse_time(text, NOW)


@pytest.mark.parametrize("text", ["99999999999999999999", "99999999999999999d", "2²h", "2\u0663h"])
def test_a_time_beyond_what_a_timestamp_holds_is_refused_not_a_crash(text: str) -> None:
    """A timestamp past the year 9999 does not fit the broker's clients (OverflowError),
    and a digit that is not ASCII is no digit of a time."""
    with pytest.raises(ValueError, match="not a time"):
        parse_time(text, NOW)


def test_a_duration_longer_than_the_epoch_is_a_time_before_it() -> None:
    assert parse_time("30000d", NOW) == NOW - 30000 * 86_400_000 < 0
