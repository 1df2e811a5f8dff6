"""The times the incident tools take on their command line, and the offset ranges replay
takes instead."""

from __future__ import annotations

import re

import pytest

from processor.kafka.retained import OffsetRange, OutOfRange, parse_time

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


# --- offset ranges ---------------------------------------------------------------------------


def test_an_offset_range_is_read_from_its_first_offset_to_its_last_included() -> None:
    assert OffsetRange("p.proposals", 2, 10, 20).bounds(5, 50) == (10, 21)
    assert OffsetRange("p.proposals", 2, 10).bounds(5, 50) == (10, 50)
    assert OffsetRange("p.proposals", 2).bounds(5, 50) == (5, 50)
    assert OffsetRange("p.proposals", 2, 49, 49).bounds(5, 50) == (49, 50)
    assert OffsetRange("p.proposals", 2, 5, 5).bounds(5, 50) == (5, 6)


@pytest.mark.parametrize(
    ("offsets", "what", "says"),
    [
        (OffsetRange("p.proposals", 2, 4), "first", "offset 4 of p.proposals/2 is no longer "
         "retained: it holds 5..49"),
        (OffsetRange("p.proposals", 2, 50), "first", "offset 50 of p.proposals/2 is not "
         "written yet: it holds 5..49"),
        (OffsetRange("p.proposals", 2, 10, 50), "last", "offset 50 of p.proposals/2 is not "
         "written yet"),
        (OffsetRange("p.proposals", 2, None, 4), "last", "offset 4 of p.proposals/2 is no "
         "longer retained"),
    ],
)  # fmt: skip
def test_offsets_the_partition_does_not_hold_are_refused_saying_what_it_holds(
    offsets: OffsetRange, what: str, says: str
) -> None:
    with pytest.raises(OutOfRange, match=re.escape(says)) as refused:
        offsets.bounds(5, 50)
    assert refused.value.what == what


def test_an_empty_partition_holds_no_offset_to_start_from() -> None:
    with pytest.raises(OutOfRange, match="it holds no record") as refused:
        OffsetRange("p.proposals", 0, 7).bounds(7, 7)
    assert refused.value.what == "first"
    assert OffsetRange("p.proposals", 0).bounds(7, 7) == (7, 7)


def test_a_partition_the_topic_does_not_have_is_refused() -> None:
    OffsetRange("p.proposals", 5).check_partition(6)
    with pytest.raises(OutOfRange, match=r"no partition 6: its partitions are 0\.\.5") as refused:
        OffsetRange("p.proposals", 6).check_partition(6)
    assert refused.value.what == "partition"


@pytest.mark.parametrize(("partition", "first", "last"), [(-1, 0, None), (0, -1, None),
                                                          (0, 5, 4), (0, None, -2)])  # fmt: skip
def test_a_range_that_contradicts_itself_cannot_be_made(
    partition: int, first: int | None, last: int | None
) -> None:
    with pytest.raises(ValueError, match=r"not negative|before the first"):
        OffsetRange("p.proposals", partition, first, last)
