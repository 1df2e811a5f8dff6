"""The reference loader against a real broker and Redis: what it has loaded is what is on
``tool.reference``, transaction markers included.

A transactional publisher (the reference executor updates order states in the same
transaction as its results) leaves a marker after its records. The marker takes an
offset but is never handed to a consumer, so a loader that counted only its records
would never look loaded up to the partition's end: ``wait_until_loaded`` (the demo, the
tests, operators) then timed out on every later run of the demo.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import redis as redis_lib
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from prometheus_client import CollectorRegistry

from processor.config import Settings
from processor.gates.semantic import FOREIGN
from processor.kafka.partitioner import partition_for
from processor.metrics import Metrics
from processor.reference_data import publish_references, wait_until_loaded
from processor.state import references
from processor.state.connection import connect, run_scripts
from processor.state.references import (
    ReferenceLoader,
    ReferencesLoading,
    ReferenceStore,
    count_key,
    entity_key,
    index_key,
    load_state,
    position_key,
    write_positions,
)
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
    _load(settings, redis)


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


@contextlib.contextmanager
def _cancelled_order(
    stack_settings: Settings, order: str
) -> Iterator[tuple[Settings, Any, Metrics, str]]:
    """A loader of its own topics and namespace, running, that has loaded order ``order``
    of acme as processing, then cancelled: (settings, Redis, its metrics, the order's key)."""
    settings = isolated(stack_settings, f"refs-{uuid.uuid4().hex[:6]}")
    redis = connect(settings.redis_url)
    metrics = Metrics(CollectorRegistry())
    loader = ReferenceLoader(settings, redis, metrics)
    loader.start()
    try:
        key = f"acme/order/{order}"
        publish_references(settings, [(key, {"state": "processing"})])
        publish_references(settings, [(key, {"state": "cancelled"})])
        wait_until_loaded(settings, timeout=30)
        ek = entity_key(settings.redis_namespace, "acme", "order", order)
        assert redis.get(ek) == b'{"state":"cancelled"}'
        yield settings, redis, metrics, ek
    finally:
        loader.stop()


def test_writes_redis_lost_are_loaded_again(stack_settings: Settings) -> None:
    """Redis goes back in time (a failover to a replica that missed the latest writes, a
    restore): the entity and the loader's positions both older. The loader sees its
    positions behind what it wrote and reads those partitions again, so the entity comes
    back to its latest state without a restart."""
    with _cancelled_order(stack_settings, "WO-00042-A") as (settings, redis, metrics, ek):
        ns = settings.redis_namespace
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


def test_writes_redis_lost_are_loaded_again_though_a_batch_came_first(
    stack_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollback, then a record on the same partition before the loader's periodic
    check: the batch that writes it finds Redis's position behind what the loader wrote,
    leaves it there and reads the partition again (a plain write of the batch's position
    hid the rollback for good, and the entity stayed in its older state)."""
    monkeypatch.setattr(references, "RESYNC_S", 3600.0)  # no periodic check in this test
    with _cancelled_order(stack_settings, "WO-00043-A") as (settings, redis, metrics, ek):
        ns = settings.redis_namespace
        key = "acme/order/WO-00043-A"
        partitions = 6
        home = partition_for(key.encode(), partitions)
        neighbour = next(
            f"acme/order/WO-{i:05d}-B"
            for i in range(1000)
            if partition_for(f"acme/order/WO-{i:05d}-B".encode(), partitions) == home
        )
        redis.set(ek, b'{"state":"processing"}')
        redis.delete(position_key(ns, settings.reference_group_id))
        publish_references(settings, [(neighbour, {"state": "processing"})])
        deadline = time.monotonic() + 30
        while redis.get(ek) != b'{"state":"cancelled"}' and time.monotonic() < deadline:
            time.sleep(0.05)
        assert redis.get(ek) == b'{"state":"cancelled"}'
        assert metrics.reference_rewinds._value.get() >= 1
        wait_until_loaded(settings, timeout=30)


def test_lookups_wait_while_the_loader_loads_again_what_redis_lost(
    stack_settings: Settings,
) -> None:
    """A flushed database (here: the entity back in an older state and the positions
    gone): until the loader has read the partition again up to where it had got, a lookup
    raises ReferencesLoading rather than answer with the older state. (Answered, the
    cancelled order reads as processing, and a cancel or refund goes through again.)"""
    with _cancelled_order(stack_settings, "WO-00044-A") as (settings, redis, metrics, ek):
        store = ReferenceStore(
            redis, settings.redis_namespace, settings.reference_group_id,
            settings.topics.reference,
        )  # fmt: skip
        wanted = ("acme", "order", "WO-00044-A")
        assert store.lookup([wanted])[wanted].state == "cancelled"  # type: ignore[union-attr]
        redis.set(ek, b'{"state":"processing"}')
        redis.delete(
            position_key(settings.redis_namespace, settings.reference_group_id),
            count_key(settings.redis_namespace, settings.reference_group_id),
        )
        answers: list[str] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and answers[-1:] != ["cancelled"]:
            try:
                entry = store.lookup([wanted])[wanted]
                answers.append(entry.state if entry else "none")
            except ReferencesLoading:
                answers.append("loading")
            time.sleep(0.01)
        assert answers[0] == "loading" and answers[-1] == "cancelled", answers
        assert set(answers) == {"loading", "cancelled"}, answers
        assert metrics.reference_rewinds._value.get() >= 1


def test_a_first_load_is_marked_until_it_reaches_the_end_it_started_from(
    stack_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loader that starts behind a partition's end (a first load; a restart after the
    topic moved on) marks the partition before its first batch is written, and the mark
    goes with the batch that reaches that end: lookups meanwhile would read older states."""
    settings = isolated(stack_settings, f"refs-{uuid.uuid4().hex[:6]}")
    redis = connect(settings.redis_url)
    key = position_key(settings.redis_namespace, settings.reference_group_id)
    group, topic = settings.reference_group_id, settings.topics.reference
    publish_references(
        settings,
        [("acme/order/WO-00045-A", {"state": "processing"}),
         ("acme/order/WO-00045-A", {"state": "refunded"})],
    )  # fmt: skip
    seen: list[str | None] = []
    apply = references.apply_records

    def watched(*args: Any, **kw: Any) -> Any:
        seen.append(load_state(redis, group, settings.redis_namespace, topic)[1])
        return apply(*args, **kw)

    monkeypatch.setattr(references, "apply_records", watched)
    _load(settings, redis)
    assert seen and seen[0] is not None and "being loaded" in seen[0], seen
    assert load_state(redis, group, settings.redis_namespace, topic)[1] is None
    held = redis.hgetall(key)
    assert not [k for k in held if k.startswith(b":loading:")]
    # Every partition has a position, the five empty ones included.
    assert len(held) == 6


def _load(settings: Settings, redis: Any) -> None:
    """A loader of its own, until it has loaded the topic; then stopped."""
    loader = ReferenceLoader(settings, redis, Metrics(CollectorRegistry()))
    loader.start()
    try:
        wait_until_loaded(settings, timeout=30)
    finally:
        loader.stop()


def _names(settings: Settings) -> tuple[str, str, str]:
    """(the loaders' group, the Redis namespace, the reference topic)"""
    return settings.reference_group_id, settings.redis_namespace, settings.topics.reference


def _loaded_once(stack_settings: Settings) -> tuple[Settings, Any]:
    """A namespace and topics of their own, one order on them, loaded by a loader that
    has stopped since: (settings, Redis)."""
    settings = isolated(stack_settings, f"refs-{uuid.uuid4().hex[:6]}")
    redis = connect(settings.redis_url)
    publish_references(settings, [("acme/order/WO-00046-A", {"state": "processing"})])
    _load(settings, redis)
    return settings, redis


def test_a_loader_started_behind_the_topic_marks_it_before_it_joins_its_group(
    stack_settings: Settings,
) -> None:
    """The topic moved on while no loader ran: the partitions behind are marked by
    start() itself, before the loader (or the processor) reads anything. Until the
    loader's group join, Redis's older state would otherwise read as loaded."""
    settings, redis = _loaded_once(stack_settings)
    group, ns, topic = (
        settings.reference_group_id,
        settings.redis_namespace,
        settings.topics.reference,
    )
    assert load_state(redis, group, ns, topic)[1] is None
    publish_references(settings, [("acme/order/WO-00046-A", {"state": "refunded"})])
    loader = ReferenceLoader(settings, redis, Metrics(CollectorRegistry()))
    loader.start()
    try:
        why = load_state(redis, group, ns, topic)[1]
        assert why is not None and "being loaded" in why, why
        wait_until_loaded(settings, timeout=30)
        ek = entity_key(ns, "acme", "order", "WO-00046-A")
        assert redis.get(ek) == b'{"state":"refunded"}'
    finally:
        loader.stop()


def test_an_assignment_that_fails_is_placed_again_not_left_to_the_client(
    stack_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker does not answer while the loader places its partitions: it tries again.
    Raised out of the callback, the client assigned the partitions itself, from the
    group's committed offsets (none: from the beginning), and the loader wrote the
    partition's older records again, positions going back, with no mark."""
    settings, redis = _loaded_once(stack_settings)
    calls = {"watermarks": 0}
    real_watermarks = references.watermarks

    def flaky(*args: Any, **kw: Any) -> tuple[int, int]:
        calls["watermarks"] += 1
        if calls["watermarks"] <= 2:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "broker busy"))
        return real_watermarks(*args, **kw)

    applied: list[int] = []
    real_apply = references.apply_records

    def watched(client: Any, records: list[Any], *args: Any, **kw: Any) -> Any:
        applied.extend(r[2] for r in records)
        return real_apply(client, records, *args, **kw)

    monkeypatch.setattr(references, "watermarks", flaky)
    monkeypatch.setattr(references, "apply_records", watched)
    metrics = Metrics(CollectorRegistry())
    loader = ReferenceLoader(settings, redis, metrics)
    loader.start()  # (its own mark_behind takes the first failure)
    try:
        deadline = time.monotonic() + 30
        while not loader._stored and time.monotonic() < deadline:
            time.sleep(0.05)
        assert loader._stored, "the partitions were never placed"
        time.sleep(1.0)  # what a replay from the beginning would have written by now
        assert applied == [], applied
        assert metrics.dependency_errors.labels("kafka")._value.get() >= 1
        wait_until_loaded(settings, timeout=30)
    finally:
        loader.stop()


def test_a_rewind_that_fails_keeps_the_marks_of_the_rewinds_before_it(
    stack_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch finds two partitions behind (a failover lost writes on both); Redis fails
    on the second rewind. The error goes up (the loader starts again) instead of the
    batch being written again, which moved the first partition's position past the range
    it still had to read and took its mark away."""
    settings = isolated(stack_settings, f"refs-{uuid.uuid4().hex[:6]}")
    redis = connect(settings.redis_url)
    ns, group, topic = (
        settings.redis_namespace,
        settings.reference_group_id,
        settings.topics.reference,
    )

    class Consumer_:
        """The loader's consumer, as far as a batch and its rewinds use it."""

        def __init__(self) -> None:
            self.at = {(topic, 0): 12, (topic, 1): 12}

        def position(self, tps: list[TopicPartition]) -> list[TopicPartition]:
            return [TopicPartition(tp.topic, tp.partition, self.at[(tp.topic, tp.partition)])
                    for tp in tps]  # fmt: skip

        def get_watermark_offsets(self, tp: TopicPartition, timeout: float) -> tuple[int, int]:
            return 0, 12

        def seek(self, tp: TopicPartition) -> None:
            self.at[(tp.topic, tp.partition)] = tp.offset

    loader = ReferenceLoader(settings, redis, Metrics(CollectorRegistry()))
    loader._count, loader._stored = 2, {(topic, 0): 10, (topic, 1): 10}
    redis.hset(count_key(ns, group), topic, 2)
    redis.hset(position_key(ns, group), mapping={f"{topic}/0": 4, f"{topic}/1": 4})
    real_mark, marks = ReferenceLoader._mark, []

    def flaky(self: ReferenceLoader, plan: dict[tuple[str, int], tuple[int, int]]) -> None:
        marks.append(plan)
        if len(marks) == 2:
            raise redis_lib.ConnectionError("connection reset by the failover")
        real_mark(self, plan)

    monkeypatch.setattr(ReferenceLoader, "_mark", flaky)
    batch = [(topic, p, o, f"acme/order/P{p}-{o}".encode(), b'{"state":"s"}')
             for p in (0, 1) for o in (10, 11)]  # fmt: skip
    with pytest.raises(redis_lib.ConnectionError):
        loader._apply(Consumer_(), batch)  # type: ignore[arg-type]
    held = redis.hgetall(position_key(ns, group))
    assert held[f":loading:{topic}/0".encode()] == b"12", held
    assert held[f"{topic}/0".encode()] == b"4", held
    assert load_state(redis, group, ns, topic)[1] is not None


def test_a_rewind_whose_end_is_unknown_marks_up_to_where_the_loader_had_got(
    stack_settings: Settings,
) -> None:
    """The broker does not answer when a rewind asks a partition's end: the partition is
    still marked, up to the position this loader had written, which Redis lost."""
    settings = isolated(stack_settings, f"refs-{uuid.uuid4().hex[:6]}")
    redis = connect(settings.redis_url)
    group, ns, topic = _names(settings)

    class Unanswered:
        sought: list[TopicPartition] = []

        def get_watermark_offsets(self, tp: TopicPartition, timeout: float) -> tuple[int, int]:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "no broker"))

        def seek(self, tp: TopicPartition) -> None:
            self.sought.append(tp)

    loader = ReferenceLoader(settings, redis, Metrics(CollectorRegistry()))
    loader._count, loader._stored = 1, {(topic, 0): 500}
    redis.hset(position_key(ns, group), f"{topic}/0", 300)
    loader._rewind(Unanswered(), topic, 0, 300)  # type: ignore[arg-type]
    held = redis.hgetall(position_key(ns, group))
    assert held == {f"{topic}/0".encode(): b"300", f":loading:{topic}/0".encode(): b"500"}
    assert [(tp.partition, tp.offset) for tp in Unanswered.sought] == [(0, 300)]
    assert loader._stored[(topic, 0)] == 300


def test_marks_are_set_only_where_the_position_still_stands_behind(
    stack_settings: Settings,
) -> None:
    """What a starting processor marks: a partition that has reached the end read a moment
    ago (its loader wrote it meanwhile) is left unmarked, or no write would ever clear it."""
    redis = connect(stack_settings.redis_url)
    ns, group, topic = f"refs-{uuid.uuid4().hex[:6]}", "g", "tool.reference"
    key = position_key(ns, group)
    redis.hset(key, mapping={f"{topic}/0": 40, f"{topic}/1": 90})
    args = [f"{topic}/0", 90, f"{topic}/1", 90, f"{topic}/2", 90]
    assert run_scripts(redis, references._MARKS, [([key], args)]) == [1]
    assert redis.hgetall(key) == {
        f"{topic}/0".encode(): b"40", f"{topic}/1".encode(): b"90",
        f":loading:{topic}/0".encode(): b"90",
    }  # fmt: skip


def test_a_mark_an_earlier_version_left_behind_is_removed_when_its_partition_is_placed(
    stack_settings: Settings,
) -> None:
    """A mark whose position was reached by a loader of an earlier version (whose
    positions.lua did not remove marks): placed again at its end, the partition loses it,
    instead of every lookup waiting for ever."""
    settings, redis = _loaded_once(stack_settings)
    group, ns, topic = (
        settings.reference_group_id,
        settings.redis_namespace,
        settings.topics.reference,
    )
    done, _ = load_state(redis, group, ns, topic)
    (where, at) = next((w, o) for w, o in done.items() if o > 0)
    redis.hset(position_key(ns, group), f":loading:{where[0]}/{where[1]}", at)
    _load(settings, redis)


def test_reference_records_are_partitioned_as_the_executors_partition(
    stack_settings: Settings,
) -> None:
    """One entity's records share a partition whoever publishes them: murmur2, as the
    executors' producers and Java clients partition, not librdkafka's default crc32."""
    settings = isolated(stack_settings, f"refs-{uuid.uuid4().hex[:6]}")
    keys = [f"acme/order/WO-{i:05d}-A" for i in range(12)]
    consumer = Consumer(settings.client_config(**{"group.id": f"probe-{uuid.uuid4().hex}"}))
    try:
        for key in keys:
            publish_references(settings, [(key, {"state": "processing"})])
            tp = TopicPartition(settings.topics.reference, partition_for(key.encode(), 6))
            _, high = consumer.get_watermark_offsets(tp, timeout=10)
            consumer.assign([TopicPartition(tp.topic, tp.partition, high - 1)])
            [m] = consumer.consume(1, 10)
            assert m.error() is None and m.key() == key.encode(), key
    finally:
        consumer.close()


def test_an_id_only_the_asking_tenant_indexes_is_not_another_tenants(
    stack_settings: Settings,
) -> None:
    """The index still naming the asking tenant alone (its entity evicted, or a
    tombstone's delete seen before its index update) is an id not found, not another
    tenant's data, which would tell the model never to retry."""
    ns = f"refs-{uuid.uuid4().hex[:6]}"
    redis = connect(stack_settings.redis_url)
    store = ReferenceStore(redis, ns, "loaders", "refs")
    redis.hset(position_key(ns, "loaders"), "refs/0", 0)
    redis.hset(count_key(ns, "loaders"), "refs", 1)
    redis.sadd(index_key(ns, "order", "WO-1"), "acme")
    redis.sadd(index_key(ns, "order", "WO-2"), "acme", "globex")
    got = store.lookup([("acme", "order", "WO-1"), ("acme", "order", "WO-2")])
    assert got == {("acme", "order", "WO-1"): None, ("acme", "order", "WO-2"): FOREIGN}


def test_positions_move_forward_only_where_redis_kept_what_the_loader_wrote(
    stack_settings: Settings,
) -> None:
    """The compare-and-set both a loader batch and an idle advance (past transaction
    markers) write their positions with: a partition whose position Redis holds behind
    what the loader wrote last keeps it, and is reported, to be read again from there."""
    redis = connect(stack_settings.redis_url)
    ns, group = f"refs-{uuid.uuid4().hex[:6]}", "g"
    p0, p1, p2 = ("tool.reference", 0), ("tool.reference", 1), ("tool.reference", 2)
    assert write_positions(redis, group, ns, {p0: 10, p1: 5}, {}) == {}
    assert write_positions(redis, group, ns, {p0: 12, p1: 7}, {p0: 10, p1: 5}) == {}
    redis.hset(position_key(ns, group), "tool.reference/0", 4)  # a replica that missed 2
    redis.hdel(position_key(ns, group), "tool.reference/1")  # or a flushed database
    moved = write_positions(redis, group, ns, {p0: 13, p1: 8, p2: 3}, {p0: 12, p1: 7})
    assert moved == {p0: 4, p1: 0}
    held = redis.hgetall(position_key(ns, group))
    assert held == {b"tool.reference/0": b"4", b"tool.reference/2": b"3"}


def test_a_loading_mark_goes_with_the_position_that_reaches_it(stack_settings: Settings) -> None:
    redis = connect(stack_settings.redis_url)
    ns, group = f"refs-{uuid.uuid4().hex[:6]}", "g"
    key = position_key(ns, group)
    p0, p1 = ("tool.reference", 0), ("tool.reference", 1)
    redis.hset(count_key(ns, group), "tool.reference", 2)
    redis.hset(key, mapping={":loading:tool.reference/0": 10, ":loading:tool.reference/1": 5})
    assert write_positions(redis, group, ns, {p0: 9, p1: 5}, {}) == {}
    held = redis.hgetall(key)
    assert b":loading:tool.reference/1" not in held
    assert held[b":loading:tool.reference/0"] == b"10"
    assert load_state(redis, group, ns, "tool.reference") == (
        {p0: 9, p1: 5},
        "tool.reference partitions [0] are being loaded",
    )
    assert write_positions(redis, group, ns, {p0: 11}, {p0: 9, p1: 5}) == {}
    assert load_state(redis, group, ns, "tool.reference") == ({p0: 11, p1: 5}, None)
