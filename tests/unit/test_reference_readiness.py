"""When lookups may read reference data: every partition loaded, none being loaded again."""

from __future__ import annotations

from processor.state.references import plan_partition, positions_of, unloaded

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


def test_a_count_of_none_is_not_loaded() -> None:
    assert unloaded({}, b"0", T) == "no loader has taken tool.reference yet"


def test_a_partition_is_read_from_its_position_and_waited_for_up_to_its_end() -> None:
    assert plan_partition(40, 0, 100) == (40, 100)
    assert plan_partition(100, 0, 100) == (100, 100)  # at its end: nothing to wait for


def test_a_partition_with_no_position_is_read_whole() -> None:
    assert plan_partition(None, 0, 100) == (0, 100)
    assert plan_partition(None, 30, 100) == (30, 100)  # from its first record
    assert plan_partition(None, 0, 0) == (0, 0)  # empty


def test_records_deleted_below_the_position_are_not_waited_for() -> None:
    # (a position below the first offset stays there; the consumer starts at the first,
    # and with none left it would never report a position that reaches the mark)
    assert plan_partition(10, 50, 50) == (50, 50)
    assert plan_partition(10, 50, 80) == (50, 80)


def test_a_position_past_the_end_reads_the_partition_again() -> None:
    assert plan_partition(500, 0, 80) == (0, 80)  # a topic recreated
