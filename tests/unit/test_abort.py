"""What the processor does when a failed transaction cannot even be aborted: the decision
alone, with a producer that refuses the abort as librdkafka does while a timed-out commit
is still in progress (its integration is the broker-outage suite)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from prometheus_client import CollectorRegistry

from processor.app import Fenced, Processor
from processor.metrics import Metrics


class _Producer:
    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse
        self.aborts = 0

    def abort_transaction(self, timeout: float) -> None:
        self.aborts += 1
        if self.refuse:
            raise KafkaException(KafkaError(KafkaError._CONFLICT, "commit in progress"))


def _abort(producer: _Producer) -> Any:
    owner = SimpleNamespace(metrics=Metrics(CollectorRegistry()))
    failed = KafkaException(KafkaError(KafkaError._TIMED_OUT, "commit timed out", retriable=True))
    return Processor._abort(owner, producer, failed)  # type: ignore[arg-type]


def test_a_transaction_that_aborts_is_rewound_with_the_same_clients() -> None:
    producer = _Producer(refuse=False)
    assert isinstance(_abort(producer), KafkaException) and producer.aborts == 1


def test_a_transaction_that_cannot_be_aborted_rebuilds_the_clients() -> None:
    """Kept, the producer would refuse every later begin_transaction, and the loop would
    abort and rewind for ever."""
    producer = _Producer(refuse=True)
    outcome = _abort(producer)
    assert isinstance(outcome, Fenced) and "could not be aborted" in str(outcome)
