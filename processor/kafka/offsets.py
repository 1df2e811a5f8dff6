"""Where a batch of consumed records starts and ends, per partition: what a transactional
consume-produce loop sends with its transaction, and where it rewinds to on abort."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import cast

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from processor.model import SourceRecord


def where(m: Message) -> tuple[str, int, int]:
    """(topic, partition, offset) of a consumed record (never None for one without error)."""
    return cast(str, m.topic()), cast(int, m.partition()), cast(int, m.offset())


def source_record(m: Message) -> SourceRecord:
    """A consumed record as the gates read it: its position, key, value and time."""
    ts = m.timestamp()
    return SourceRecord(*where(m), m.key(), m.value(), ts[1] if ts else 0)


def next_offsets(records: list[Message]) -> list[TopicPartition]:
    """The offsets to commit once ``records`` are done: one past each partition's last."""
    last: dict[tuple[str, int], int] = {}
    for m in records:
        topic, partition, offset = where(m)
        last[(topic, partition)] = offset
    return [TopicPartition(t, p, o + 1) for (t, p), o in last.items()]


def first_offsets(records: list[Message]) -> list[TopicPartition]:
    """Each partition's earliest offset in ``records``: where to rewind to. (A record
    polled before a rebalance may stand ahead of records read after it, from further
    back: a rewind to the first one seen would skip those.)"""
    return span(records)[0]


def span(records: list[Message]) -> tuple[list[TopicPartition], list[TopicPartition]]:
    """``first_offsets`` and ``next_offsets`` of ``records``, in one walk over them."""
    first: dict[tuple[str, int], int] = {}
    last: dict[tuple[str, int], int] = {}
    for m in records:
        topic, partition, offset = where(m)
        seen = first.get((topic, partition))
        if seen is None or offset < seen:
            first[(topic, partition)] = offset
        last[(topic, partition)] = offset
    return (
        [TopicPartition(t, p, o) for (t, p), o in first.items()],
        [TopicPartition(t, p, o + 1) for (t, p), o in last.items()],
    )


def rewind(
    consumer: Consumer, records: list[Message], assigned: Collection[tuple[str, int]]
) -> list[TopicPartition]:
    """Seek back to the batch's first records, on the partitions still assigned (a revoked
    one is read again by its next owner from the committed offsets). Returns the
    partitions whose seek failed (see ``rewind_to``)."""
    return rewind_to(consumer, first_offsets(records), assigned)


def rewind_to(
    consumer: Consumer, firsts: list[TopicPartition], assigned: Collection[tuple[str, int]]
) -> list[TopicPartition]:
    """Seek back to ``firsts`` (from ``first_offsets`` of one or more batches), on the
    partitions still assigned. Returns those whose seek failed: the consumer would read
    on past the records to be read again, so the caller rebuilds its clients, which then
    start from the committed offsets."""
    failed: list[TopicPartition] = []
    for tp in earliest_offsets(firsts):
        if (tp.topic, tp.partition) in assigned:
            try:
                consumer.seek(tp)
            except KafkaException:
                failed.append(tp)
    return failed


def earliest_offsets(firsts: list[TopicPartition]) -> list[TopicPartition]:
    """The earliest offset of each partition among ``firsts``, in first-seen order."""
    earliest: dict[tuple[str, int], TopicPartition] = {}
    for tp in firsts:
        seen = earliest.get((tp.topic, tp.partition))
        if seen is None or tp.offset < seen.offset:
            earliest[(tp.topic, tp.partition)] = tp
    return list(earliest.values())


def records_of(messages: list[Message], on_error: Callable[[KafkaError], None]) -> list[Message]:
    """The records among what ``consume`` returned; every error but end-of-partition goes
    to ``on_error``. A transient error is only reported. A fatal one (a static member
    fenced, say) leaves the consumer unusable for good: after ``on_error`` it is raised as
    ``KafkaException``, for the caller to rebuild its clients from the committed offsets."""
    records: list[Message] = []
    for m in messages:
        err = m.error()
        if err is None:
            records.append(m)
        elif err.code() != KafkaError._PARTITION_EOF:
            on_error(err)
            if err.fatal() or err.code() == KafkaError._FATAL:
                raise KafkaException(err)
    return records


def high_watermark(consumer: Consumer, tp: TopicPartition, timeout: float = 30.0) -> int:
    """A partition's end, asked again while a new topic's leader is being elected (or a
    broker answers with another retriable error), for at most ``timeout`` seconds."""
    return watermarks(consumer, tp, timeout)[1]


def watermarks(consumer: Consumer, tp: TopicPartition, timeout: float = 30.0) -> tuple[int, int]:
    """A partition's first and end offsets, asked as ``high_watermark`` asks."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            low, high = consumer.get_watermark_offsets(tp, timeout=10)
            return int(low), int(high)
        except KafkaException as exc:
            err = exc.args[0]
            transient = err.retriable() or err.code() == KafkaError.NOT_LEADER_FOR_PARTITION
            if not transient or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
