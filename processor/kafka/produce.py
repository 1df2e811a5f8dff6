"""Producing into an open transaction."""

from __future__ import annotations

from confluent_kafka import Producer

Headers = list[tuple[str, str | bytes | None]]


def send(
    producer: Producer,
    topic: str,
    key: bytes | None,
    value: bytes | None,
    headers: Headers | None = None,
) -> None:
    """Produce one record, waiting while the local queue is full: a transaction's records
    may not be dropped, and the queue drains as deliveries complete."""
    while True:
        try:
            producer.produce(topic, value=value, key=key, headers=headers)
            return
        except BufferError:
            producer.poll(0.05)
