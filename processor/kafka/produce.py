"""Producing: into an open transaction, or records the caller must know were taken."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from confluent_kafka import KafkaError, Message, Producer

Headers = list[tuple[str, str | bytes | None]]


class DeliveryError(RuntimeError):
    """The broker refused or never acknowledged a record."""


def send(
    producer: Producer,
    topic: str,
    key: bytes | None,
    value: bytes | None,
    headers: Headers | None = None,
    on_delivery: Callable[[KafkaError | None, Message], None] | None = None,
) -> None:
    """Produce one record, waiting while the local queue is full: a transaction's records
    may not be dropped, and the queue drains as deliveries complete."""
    while True:
        try:
            producer.produce(topic, value=value, key=key, headers=headers, on_delivery=on_delivery)
            return
        except BufferError:
            producer.poll(0.05)


def deliver(
    producer: Producer,
    topic: str,
    records: Iterable[tuple[bytes | None, bytes | None]],
    timeout: float,
) -> None:
    """Produce ``(key, value)`` records and wait until the broker has taken every one.
    flush() counts only the records still queued: one the broker refused, or that expired
    unsent, has left the queue and would pass for delivered. It raises DeliveryError here;
    records still unacknowledged after ``timeout`` raise TimeoutError."""
    failed: list[KafkaError] = []

    def delivered(err: KafkaError | None, _: Message) -> None:
        if err is not None:
            failed.append(err)

    for key, value in records:
        send(producer, topic, key, value, on_delivery=delivered)
    remaining = producer.flush(timeout)
    if remaining:
        raise TimeoutError(f"{remaining} record(s) to {topic} not acknowledged in {timeout}s")
    if failed:
        raise DeliveryError(f"{len(failed)} record(s) to {topic} not delivered: {failed[0]}")
