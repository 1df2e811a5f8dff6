"""Reading retained topics over a time range (the incident tools' way in), against the
real broker: committed records only, the range's ends, and an end that never comes."""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import Producer

from processor.config import Settings
from processor.kafka.retained import RetainedReader
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
