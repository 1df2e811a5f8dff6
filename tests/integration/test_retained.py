"""Reading retained topics over a time range (the incident tools' way in), against the
real broker: committed records only, the range's ends, an end that never comes, and
offset ranges of one partition, refused where the partition does not hold them."""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from processor.config import Settings
from processor.kafka.offsets import watermarks
from processor.kafka.retained import OffsetRange, OutOfRange, RetainedReader
from tests.integration.harness import isolated

pytestmark = pytest.mark.integration


def _producer(settings: Settings) -> Producer:
    p = Producer(settings.client_config(**{"transactional.id": f"retained-{uuid.uuid4().hex}"}))
    p.init_transactions(30)
    return p


def _put(p: Producer, topic: str, values: list[str], *, commit: bool) -> None:
    p.begin_transaction()
    for v in values:
        p.produce(topic, v.encode(), key=b"run-1", partition=0)
    if commit:
        p.commit_transaction(30)
    else:
        p.abort_transaction(30)


def _boundary() -> int:
    """A time between what was written before and what is written after (the broker
    stamps commit markers with its own clock, so a pause on each side)."""
    time.sleep(1.1)
    at = int(time.time() * 1000)
    time.sleep(1.1)
    return at


def _stable(settings: Settings, topic: str, end: int) -> None:
    """Wait for partition 0's last stable offset to reach ``end``: the coordinator writes a
    transaction's markers after its commit returns."""
    consumer = Consumer(
        settings.client_config(
            **{"group.id": f"lso-{uuid.uuid4()}", "isolation.level": "read_committed"}
        )
    )
    try:
        deadline = time.monotonic() + 30
        while watermarks(consumer, TopicPartition(topic, 0))[1] < end:
            assert time.monotonic() < deadline, f"{topic}/0 never became stable at {end}"
            time.sleep(0.1)
    finally:
        consumer.close()


def _values(reader: RetainedReader) -> list[str]:
    return [(m.value() or b"").decode() for m in reader]


def test_only_committed_records_are_read_and_the_read_ends_at_the_commit_markers(
    stack_settings: Settings,
) -> None:
    s = isolated(stack_settings, f"retained-{uuid.uuid4().hex[:6]}")
    p = _producer(s)
    _put(p, s.topics.proposals, ["a", "b", "c"], commit=True)
    _put(p, s.topics.proposals, ["aborted-1", "aborted-2"], commit=False)
    _put(p, s.topics.proposals, ["d", "e"], commit=True)
    reader = RetainedReader(s, [s.topics.proposals, f"{s.topics.prefix}no-such-topic"], idle_s=5)
    assert _values(reader) == ["a", "b", "c", "d", "e"]
    assert reader.incomplete == []
    assert reader.missing == [f"{s.topics.prefix}no-such-topic"]
    assert reader.errors == 0


def test_a_time_range_reads_its_records_and_no_others(stack_settings: Settings) -> None:
    s = isolated(stack_settings, f"retained-{uuid.uuid4().hex[:6]}")
    p = _producer(s)
    _put(p, s.topics.proposals, [f"early-{i}" for i in range(3)], commit=True)
    t1 = _boundary()
    _put(p, s.topics.proposals, [f"mid-{i}" for i in range(3)], commit=True)
    t2 = _boundary()
    _put(p, s.topics.proposals, [f"late-{i}" for i in range(3)], commit=True)
    window = RetainedReader(s, [s.topics.proposals], since_ms=t1, until_ms=t2)
    assert _values(window) == ["mid-0", "mid-1", "mid-2"]
    since = RetainedReader(s, [s.topics.proposals], since_ms=t2)
    assert _values(since) == ["late-0", "late-1", "late-2"]
    until = RetainedReader(s, [s.topics.proposals], until_ms=t1)
    assert _values(until) == ["early-0", "early-1", "early-2"]
    after_all = RetainedReader(s, [s.topics.proposals], since_ms=int(time.time() * 1000) + 60_000)
    assert _values(after_all) == []
    other = RetainedReader(s, [s.topics.proposals], partitions={s.topics.proposals: {1, 2}})
    assert _values(other) == []


def test_a_record_stamped_ahead_of_the_range_does_not_end_it(stack_settings: Settings) -> None:
    """A producer may stamp a record ahead of its write (up to the topic's
    message.timestamp.after.max.ms, an hour on this broker): the first record stamped after
    ``until`` is then not where the range ends, and the records written after it, stamped
    in range, are read; the one stamped ahead is not. Before, the read stopped at it."""
    s = isolated(stack_settings, f"retained-{uuid.uuid4().hex[:6]}")
    p = _producer(s)
    now = int(time.time() * 1000)
    p.begin_transaction()
    for value, at in (("a", now - 2_000), ("ahead", now + 1_800_000), ("c", now), ("d", now)):
        p.produce(s.topics.proposals, value.encode(), key=b"run-1", partition=0, timestamp=at)
    p.commit_transaction(30)
    _stable(s, s.topics.proposals, 5)
    until = RetainedReader(s, [s.topics.proposals], until_ms=now + 1_000)
    assert _values(until) == ["a", "c", "d"]
    assert until.incomplete == []
    window = RetainedReader(s, [s.topics.proposals], since_ms=now - 1_000, until_ms=now + 1_000)
    assert _values(window) == ["c", "d"]
    later = RetainedReader(s, [s.topics.proposals], until_ms=now + 1_900_000)
    assert _values(later) == ["a", "ahead", "c", "d"]


def test_a_transaction_open_when_reading_begins_is_not_waited_for(
    stack_settings: Settings,
) -> None:
    s = isolated(stack_settings, f"retained-{uuid.uuid4().hex[:6]}")
    p = _producer(s)
    _put(p, s.topics.proposals, ["before"], commit=True)
    p.begin_transaction()
    p.produce(s.topics.proposals, b"open", partition=0)
    p.flush(10)
    try:
        # Waiting for the open transaction would give up after a minute and report the
        # partition incomplete.
        reader = RetainedReader(s, [s.topics.proposals], idle_s=60)
        assert _values(reader) == ["before"]
        assert reader.incomplete == []
    finally:
        p.abort_transaction(30)


def test_a_since_before_the_epoch_reads_from_the_start(stack_settings: Settings) -> None:
    """``--since 30000d`` is before 1970: every record is after it. The broker reads a
    negative time as a sentinel (-1: the end, -2: the start), never as a time."""
    s = isolated(stack_settings, f"retained-{uuid.uuid4().hex[:6]}")
    p = _producer(s)
    _put(p, s.topics.proposals, ["a", "b"], commit=True)
    for since in (-1, -3, -86_400_000):
        assert _values(RetainedReader(s, [s.topics.proposals], since_ms=since)) == ["a", "b"]
    before = RetainedReader(s, [s.topics.proposals], since_ms=-5, until_ms=-2)
    assert _values(before) == []


def test_an_offset_range_reads_its_committed_records_and_no_others(
    stack_settings: Settings,
) -> None:
    """Offsets 0-2 committed (3: its marker), 4-5 aborted (6: its marker), 7-8 committed
    (9: its marker): a range counts offsets, markers and aborted records among them."""
    s = isolated(stack_settings, f"retained-{uuid.uuid4().hex[:6]}")
    topic = s.topics.proposals
    p = _producer(s)
    _put(p, topic, ["a", "b", "c"], commit=True)
    p.begin_transaction()
    for v in ("aborted-1", "aborted-2"):
        p.produce(topic, v.encode(), partition=0)
    p.flush(10)  # on the log before the abort, not dropped by the client
    p.abort_transaction(30)
    _put(p, topic, ["d", "e"], commit=True)
    _stable(s, topic, 10)

    def read(offsets: OffsetRange, **times: int) -> list[str]:
        reader = RetainedReader(s, [topic, s.topics.observations], offsets=offsets, **times)
        values = _values(reader)
        assert reader.incomplete == [] and reader.missing == []
        return values

    assert read(OffsetRange(topic, 0, 1, 7)) == ["b", "c", "d"]
    assert read(OffsetRange(topic, 0, 0, 0)) == ["a"]
    assert read(OffsetRange(topic, 0, 3, 6)) == []
    open_ended = RetainedReader(s, [topic], offsets=OffsetRange(topic, 0, 7))
    assert _values(open_ended) == ["d", "e"]
    assert [(r.partition, r.start, r.end) for r in open_ended.planned] == [(0, 7, 10)]
    assert read(OffsetRange(topic, 0)) == ["a", "b", "c", "d", "e"]
    # Within a time range as well, a range reads what both hold.
    assert read(OffsetRange(topic, 0, 1, 8), since_ms=int(time.time() * 1000) + 60_000) == []


def test_offsets_a_partition_does_not_hold_are_refused_before_anything_is_read(
    stack_settings: Settings,
) -> None:
    s = isolated(stack_settings, f"retained-{uuid.uuid4().hex[:6]}")
    topic = s.topics.proposals
    _put(_producer(s), topic, ["a", "b"], commit=True)  # offsets 0-1, its marker 2
    _stable(s, topic, 3)
    refused = [
        (OffsetRange(topic, 0, 3), "first", "offset 3 of " + topic + "/0 is not written yet: "
         "it holds 0..2"),
        (OffsetRange(topic, 0, 1, 3), "last", "offset 3 of " + topic + "/0 is not written"),
        (OffsetRange(topic, 1, 0), "first", "it holds no record"),
        (OffsetRange(topic, 6), "partition", f"{topic} has no partition 6: its partitions "
         "are 0..5"),
    ]  # fmt: skip
    for offsets, what, says in refused:
        with pytest.raises(OutOfRange) as exc:
            list(RetainedReader(s, [topic], offsets=offsets))
        assert exc.value.what == what and says in str(exc.value), exc.value
