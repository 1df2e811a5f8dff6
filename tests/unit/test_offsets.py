"""Where a batch's transaction commits to, and where an aborted batch is read again."""

from __future__ import annotations

from confluent_kafka import TopicPartition

from processor.kafka.offsets import earliest_offsets


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
