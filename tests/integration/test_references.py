"""The reference loader against a real broker and Redis: what it has loaded is what is on
``tool.reference``, transaction markers included.

A transactional publisher (the reference executor updates order states in the same
transaction as its results) leaves a marker after its records. The marker takes an
offset but is never handed to a consumer, so a loader that counted only its records
would never look loaded up to the partition's end: ``wait_until_loaded`` (the demo, the
tests, operators) then timed out on every later run of the demo.
"""

from __future__ import annotations

import time
import uuid

import orjson
import pytest
from confluent_kafka import Producer
from prometheus_client import CollectorRegistry

from processor.config import Settings
from processor.metrics import Metrics
from processor.reference_data import publish_references, wait_until_loaded
from processor.state.connection import connect
from processor.state.references import ReferenceLoader, entity_key, position_key
from tests.integration.harness import isolated

pytestmark = pytest.mark.integration


def _publish_in_a_transaction(settings: Settings, entities: dict[str, dict[str, str]]) -> None:
    producer = Producer(
        settings.client_config(**{"transactional.id": f"ref-publisher-{uuid.uuid4().hex}"})
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    for key, value in entities.items():
        producer.produce(settings.topics.reference, orjson.dumps(value), key.encode())
    producer.commit_transaction(30)


def test_records_published_in_transactions_count_as_loaded(stack_settings: Settings) -> None:
    settings = isolated(stack_settings, f"refs-{uuid.uuid4().hex[:6]}")
    redis = connect(settings.redis_url)
    ns = settings.redis_namespace
    # Every partition gets records and then a marker.
    orders = {f"acme/order/WO-{i:05d}-A": {"state": "processing"} for i in range(24)}
    _publish_in_a_transaction(settings, orders)
    loader = ReferenceLoader(settings, redis, Metrics(CollectorRegistry()))
    loader.start()
    try:
        wait_until_loaded(settings, timeout=30)
        assert redis.get(entity_key(ns, "acme", "order", "WO-00007-A")) == b'{"state":"processing"}'

        # Ordinary records after the markers, then more transactions: still in step.
        publish_references(settings, [("acme/order/WO-00007-A", {"state": "shipped"})])
        wait_until_loaded(settings, timeout=30)
        _publish_in_a_transaction(settings, {"acme/order/WO-00008-A": {"state": "cancelled"}})
        wait_until_loaded(settings, timeout=30)
        assert redis.get(entity_key(ns, "acme", "order", "WO-00007-A")) == b'{"state":"shipped"}'
        assert redis.get(entity_key(ns, "acme", "order", "WO-00008-A")) == (
            b'{"state":"cancelled"}'
        )
    finally:
        loader.stop()

    # A loader started again resumes from its position, which is at the end.
    again = ReferenceLoader(settings, redis, Metrics(CollectorRegistry()))
    again.start()
    try:
        wait_until_loaded(settings, timeout=30)
    finally:
        again.stop()


def test_a_record_the_loader_cannot_keep_is_refused_and_the_rest_still_load(
    stack_settings: Settings,
) -> None:
    """Attributes nested 300 deep: read (orjson reads 1,024 levels) but not written back
    (254). Refused and counted; the records around it load, and the loader goes on."""
    settings = isolated(stack_settings, f"refs-{uuid.uuid4().hex[:6]}")
    redis = connect(settings.redis_url)
    poison = b'{"state":"open","attributes":' + b'{"x":' * 300 + b"{}" + b"}" * 300 + b"}"
    producer = Producer(settings.client_config())
    for key, value in (
        (b"acme/order/WO-00001-A", b'{"state":"processing"}'),
        (b"t9/order/WO-00009-A", poison),
        (b"acme/order/WO-00001-A", b'{"state":"cancelled"}'),
    ):
        producer.produce(settings.topics.reference, value, key, partition=0)
    assert producer.flush(15) == 0
    metrics = Metrics(CollectorRegistry())
    loader = ReferenceLoader(settings, redis, metrics)
    loader.start()
    try:
        wait_until_loaded(settings, timeout=30)
        ek = entity_key(settings.redis_namespace, "acme", "order", "WO-00001-A")
        assert redis.get(ek) == b'{"state":"cancelled"}'
        assert redis.get(entity_key(settings.redis_namespace, "t9", "order", "WO-00009-A")) is None
        # (the loader counts a batch just after writing its positions, which the wait reads)
        refused = metrics.references.labels("refused")
        deadline = time.monotonic() + 10
        while refused._value.get() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert refused._value.get() == 1
        assert loader._thread.is_alive()
    finally:
        loader.stop()


def test_writes_redis_lost_are_loaded_again(stack_settings: Settings) -> None:
    """Redis goes back in time (a failover to a replica that missed the latest writes, a
    restore): the entity and the loader's positions both older. The loader sees its
    positions behind what it wrote and reads those partitions again, so the entity comes
    back to its latest state without a restart."""
    settings = isolated(stack_settings, f"refs-{uuid.uuid4().hex[:6]}")
    redis = connect(settings.redis_url)
    ns = settings.redis_namespace
    metrics = Metrics(CollectorRegistry())
    loader = ReferenceLoader(settings, redis, metrics)
    loader.start()
    try:
        key = "acme/order/WO-00042-A"
        publish_references(settings, [(key, {"state": "processing"})])
        publish_references(settings, [(key, {"state": "cancelled"})])
        wait_until_loaded(settings, timeout=30)
        ek = entity_key(ns, "acme", "order", "WO-00042-A")
        assert redis.get(ek) == b'{"state":"cancelled"}'
        lag = metrics.reference_lag._value
        deadline = time.monotonic() + 30
        while lag.get() != 0 and time.monotonic() < deadline:  # measured at least once
            time.sleep(0.1)
        lag.set(-1)
        # The rollback: the entity as it was after the first record, no positions at all.
        redis.set(ek, b'{"state":"processing"}')
        redis.delete(position_key(ns, settings.reference_group_id))
        seen: set[float] = set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
            redis.get(ek) == b'{"state":"cancelled"}' and 2 in seen and lag.get() == 0
        ):
            seen.add(lag.get())
            time.sleep(0.05)
        assert redis.get(ek) == b'{"state":"cancelled"}'
        assert metrics.reference_rewinds._value.get() >= 1
        # The lag read just after the rewind: both records to load again; then none.
        assert 2 in seen and lag.get() == 0, seen
        wait_until_loaded(settings, timeout=30)
    finally:
        loader.stop()
