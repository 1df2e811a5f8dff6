"""Where a batch's transaction commits to, and where an aborted batch is read again."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from processor.kafka.offsets import (
    earliest_offsets,
    first_offsets,
    next_offsets,
    rewind_to,
    span,
)


def test_batches_rewound_together_go_back_to_each_partitions_earliest_record() -> None:
    committing = [TopicPartition("p", 0, 10), TopicPartition("p", 1, 7)]
    decided_meanwhile = [TopicPartition("p", 1, 9), TopicPartition("p", 2, 3)]
    got = earliest_offsets([*committing, *decided_meanwhile])
    assert [(t.topic, t.partition, t.offset) for t in got] == [
        ("p", 0, 10),
        ("p", 1, 7),
        ("p", 2, 3),
    ]


def test_the_earliest_wins_whatever_the_order() -> None:
    got = earliest_offsets([TopicPartition("r", 0, 50), TopicPartition("r", 0, 40)])
    assert [(t.topic, t.partition, t.offset) for t in got] == [("r", 0, 40)]
    assert earliest_offsets([]) == []


def test_a_batchs_span_is_its_first_offsets_and_one_past_its_last() -> None:
    records = [
        Message(topic="p", partition=p, offset=o) for p, o in [(0, 5), (1, 2), (0, 6), (1, 3)]
    ]
    firsts, nexts = span(records)
    assert [(t.topic, t.partition, t.offset) for t in firsts] == [("p", 0, 5), ("p", 1, 2)]
    assert [(t.topic, t.partition, t.offset) for t in nexts] == [("p", 0, 7), ("p", 1, 4)]
    key = [(t.topic, t.partition, t.offset) for t in first_offsets(records)]
    assert key == [(t.topic, t.partition, t.offset) for t in firsts]
    key = [(t.topic, t.partition, t.offset) for t in next_offsets(records)]
    assert key == [(t.topic, t.partition, t.offset) for t in nexts]


def test_a_record_polled_before_a_rebalance_does_not_move_the_rewind_past_earlier_ones() -> None:
    """P@10 polled, then the batch in flight aborted inside the rebalance and P read again
    from 0: the rewind goes to 0, not to the first record seen."""
    records = [Message(topic="p", partition=0, offset=o) for o in (10, 0, 1)]
    assert [(t.partition, t.offset) for t in first_offsets(records)] == [(0, 0)]
    firsts, _ = span(records)
    assert [(t.partition, t.offset) for t in firsts] == [(0, 0)]


class _Consumer:
    """Seeks as librdkafka does, refusing partitions not in an active fetch state."""

    def __init__(self, refused: set[int]) -> None:
        self.refused, self.sought = refused, []  # type: ignore[var-annotated]

    def seek(self, tp: TopicPartition) -> None:
        if tp.partition in self.refused:
            raise KafkaException(KafkaError(KafkaError._STATE, "not fetching"))
        self.sought.append((tp.partition, tp.offset))


def test_a_seek_that_fails_on_an_assigned_partition_is_reported() -> None:
    """Ignored, the consumer would read on past the batch to be read again, and the next
    commit would move past records nobody answered."""
    consumer = _Consumer(refused={1, 2})
    firsts = [TopicPartition("p", 0, 5), TopicPartition("p", 1, 7), TopicPartition("p", 2, 9)]
    assigned = {("p", 0), ("p", 1)}  # p[2] was revoked: its next owner reads it again
    failed = rewind_to(consumer, firsts, assigned)  # type: ignore[arg-type]
    assert [(t.partition, t.offset) for t in failed] == [(1, 7)]
    assert consumer.sought == [(0, 5)]
