"""Publishing reference data: what a system of record does, for the demo, tests and ops."""

from __future__ import annotations

import time
from typing import Any

import orjson
from confluent_kafka import Consumer, Producer, TopicPartition

from processor.config import Settings
from processor.kafka.offsets import high_watermark
from processor.kafka.produce import deliver
from processor.state.connection import connect
from processor.state.references import load_state, parse_reference


def publish_references(
    settings: Settings, entities: list[tuple[str, dict[str, Any] | None]]
) -> None:
    """Publish ``(tenant/entity/id, value or None)`` pairs to ``tool.reference``. A record
    the loader would refuse raises ``BadReference`` before any is sent: published, it
    would vanish there, or forget the entity its key names."""
    # murmur2, as the executors' producers and Java systems of record partition: one
    # entity's records must share a partition (librdkafka's default, crc32, put them in
    # another, and a replay could end on the older state, or bring a deleted one back).
    producer = Producer(
        settings.client_config(**{"enable.idempotence": True, "partitioner": "murmur2_random"})
    )
    records = [(k.encode(), None if v is None else orjson.dumps(v)) for k, v in entities]
    for key, value in records:
        parse_reference(key, value)
    deliver(producer, settings.topics.reference, records, 30)


def wait_until_loaded(settings: Settings, timeout: float = 60.0) -> None:
    """Block until the processors' loader has written everything now on tool.reference."""
    deadline = time.monotonic() + timeout
    consumer = Consumer(settings.client_config(**{"group.id": "toolsentry-reference-probe"}))
    try:
        topic = settings.topics.reference
        meta = consumer.list_topics(topic, timeout=10)
        ends = {
            p: high_watermark(consumer, TopicPartition(topic, p), deadline - time.monotonic())
            for p in meta.topics[topic].partitions
        }
    finally:
        consumer.close()
    client = connect(settings.redis_url)
    while True:
        done, why = load_state(client, settings.reference_group_id, settings.redis_namespace, topic)
        if why is None and all(
            end <= 0 or done.get((topic, p), 0) >= end for p, end in ends.items()
        ):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"tool.reference not loaded into Redis within {timeout}s")
        time.sleep(0.1)
