"""When lookups may read reference data: every partition loaded, none being loaded again."""

from __future__ import annotations

from processor.state.references import positions_of, unloaded

T = "tool.reference"


def test_every_partition_with_a_position_and_no_mark_is_loaded() -> None:
    held = {b"tool.reference/0": b"4", b"tool.reference/1": b"0", b"tool.reference/2": b"9"}
    assert unloaded(held, b"3", T) is None


def test_no_partition_count_is_a_database_no_loader_has_written_to() -> None:
    assert (
        unloaded({b"tool.reference/0": b"4"}, None, T) == "no loader has taken tool.reference yet"
    )
    assert unloaded({}, None, T) == "no loader has taken tool.reference yet"


def test_a_partition_without_a_position_is_not_loaded() -> None:
    held = {b"tool.reference/0": b"4", b"tool.reference/2": b"9"}
    assert unloaded(held, b"3", T) == "tool.reference partitions [1] have not been loaded"


def test_a_marked_partition_is_being_loaded() -> None:
    held = {b"tool.reference/0": b"4", b"tool.reference/1": b"3",
            b":loading:tool.reference/1": b"10", b":loading:tool.reference/0": b"7"}  # fmt: skip
    assert unloaded(held, b"2", T) == "tool.reference partitions [0, 1] are being loaded"


def test_another_topics_marks_do_not_count() -> None:
    held = {b"tool.reference/0": b"4", b":loading:other/0": b"10"}
    assert unloaded(held, b"1", T) is None


def test_positions_leave_out_the_marks() -> None:
    held = {b"tool.reference/0": b"4", b":loading:tool.reference/1": b"10",
            b"tool.reference/1": b"3"}  # fmt: skip
    assert positions_of(held) == {(T, 0): 4, (T, 1): 3}
