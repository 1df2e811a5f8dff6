"""Where a batch's transaction commits to, and where an aborted batch is read again."""

from __future__ import annotations

from confluent_kafka import Message, TopicPartition

from processor.kafka.offsets import earliest_offsets, first_offsets, next_offsets, span


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
