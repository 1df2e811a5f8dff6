"""Reference data: ``tool.reference`` materialised in Redis, read once per batch.

Systems of record publish each entity on the compacted ``tool.reference``
topic: key ``tenant/entity/id``, value ``{"state": ..., "owner": ...,
"attributes": {...}}``, a tombstone when the entity is gone. A loader in
every processor (one consumer group, partitions shared out) writes them to
Redis, where all instances read the same answers:

- ``<ns>:ref:{tenant}:<entity>:<id>``: the entity, as JSON; the ``{tenant}``
  hash tag keeps a tenant's keys in one Redis Cluster slot;
- ``<ns>:refidx:<entity>:<id>``: the set of tenants that have that id, which is
  how an id of *another* tenant is told apart from one that exists nowhere. It is
  one key per id, read with single-key commands, so on a cluster it lives in any slot.

The loader keeps its own position in Redis (``<ns>:refpos:<group>``; ``<ns>`` is the
configured namespace, ``ts`` by default), written
after the values it covers, and resumes from it; re-applying a record is
harmless because the last value of a key wins either way. The position is the
consumer's, past the transaction markers a transactional publisher (the reference
executor) leaves after its records: otherwise a partition ending in a marker would
never look loaded up to its end.

While a partition is read from behind its end, Redis holds older states of its
entities than the topic does: an order refunded since shows as not yet refunded, and
a refund would be let through. So lookups wait for them (``ReferencesLoading``). A hash
beside the positions holds the topic's partition count, and the position hash, for
each partition a loader reads from behind the end it had when the loader took it
(a first load, a restart behind the end) or from a position Redis lost (a rewind),
the position it must reach (``:loading:<topic>/<partition>``). Lookups go ahead only
when every partition has a position and none is marked: a flushed database, which
loses the whole hash, waits too, until the loaders have loaded it again.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    Consumer,
    KafkaException,
    TopicPartition,
)

from processor.config import Settings
from processor.gates.semantic import FOREIGN, RefEntry, RefKey
from processor.kafka.offsets import watermarks
from processor.metrics import Metrics
from processor.state.connection import (
    REDIS_ERRORS,
    LuaScript,
    RedisClient,
    run_scripts,
    tenant_tag,
)

logger = logging.getLogger(__name__)


def entity_key(ns: str, tenant: str, entity: str, entity_id: str) -> str:
    return f"{ns}:ref:{tenant_tag(tenant)}:{entity}:{entity_id}"


def index_key(ns: str, entity: str, entity_id: str) -> str:
    return f"{ns}:refidx:{entity}:{entity_id}"


def position_key(ns: str, group: str) -> str:
    return f"{ns}:refpos:{group}"


def _field(topic: str, partition: int) -> str:
    return f"{topic}/{partition}"


LOADING = ":loading:"
"""The prefix of a partition's field in the position hash while it is loaded again."""


def count_key(ns: str, group: str) -> str:
    """A hash of topic -> partition count, as the loaders of ``group`` last found it (kept
    out of the position hash, whose every field earlier versions read as a position)."""
    return f"{ns}:refparts:{group}"


class ReferencesLoading(Exception):
    """The reference data is being loaded: lookups now could read older states."""


def unloaded(held: dict[bytes, bytes], count: bytes | None, topic: str) -> str | None:
    """None when the position hash ``held`` and the partition ``count`` say every
    partition of ``topic`` is loaded up to where its loader found it; otherwise which
    are not, for a log line."""
    if count is None or int(count) <= 0:
        return f"no loader has taken {topic} yet"
    marked = (LOADING + topic + "/").encode()
    loading = sorted(int(k[len(marked) :]) for k in held if k.startswith(marked))
    if loading:
        return f"{topic} partitions {loading} are being loaded"
    missing = [p for p in range(int(count)) if _field(topic, p).encode() not in held]
    if missing:
        return f"{topic} partitions {missing} have not been loaded"
    return None


class ReferenceStore:
    """Batched reads of reference data: one pipeline, one round trip, per batch."""

    def __init__(self, client: RedisClient, ns: str, group: str, topic: str) -> None:
        self.client = client
        self.ns = ns
        self.group = group
        """The loaders' consumer group, whose position hash says what is loaded."""
        self.topic = topic

    def lookup(self, keys: Iterable[RefKey]) -> dict[RefKey, RefEntry | None]:
        """One MGET per tenant (a tenant's keys share a slot), all in one pipeline with
        the loaders' positions; ids found nowhere in their tenant are then checked
        against the index, in a second round trip that only batches naming unknown ids
        need. Raises ``ReferencesLoading`` while any partition is being loaded.

        MGET goes through ``execute_command``: redis-py's cluster pipeline refuses its
        ``mget`` method outright, though an MGET of one slot's keys is fine there."""
        by_tenant: dict[str, list[RefKey]] = {}
        for key in keys:
            by_tenant.setdefault(key[0], []).append(key)
        if not by_tenant:
            return {}
        pipe = self.client.pipeline(transaction=False)
        _ask_state(pipe, self.ns, self.group, self.topic)
        for tenant, wanted in by_tenant.items():
            pipe.execute_command("MGET", *[entity_key(self.ns, tenant, e, i) for _, e, i in wanted])
        held, count, *replies = pipe.execute()
        why = unloaded(held, count, self.topic)
        if why is not None:
            raise ReferencesLoading(why)
        out: dict[RefKey, RefEntry | None] = {}
        missing: list[RefKey] = []
        for wanted, values in zip(by_tenant.values(), replies, strict=True):
            for key, raw in zip(wanted, values, strict=True):
                if raw is None:
                    missing.append(key)
                else:
                    out[key] = _entry(key[0], raw)
        if missing:
            pipe = self.client.pipeline(transaction=False)
            for tenant, entity, entity_id in missing:
                index = index_key(self.ns, entity, entity_id)
                pipe.scard(index)
                pipe.sismember(index, tenant)
            replies = pipe.execute()
            for n, key in enumerate(missing):
                # Another tenant's only if another tenant holds it: the index may still
                # name the asking tenant alone (its entity evicted, or a tombstone's
                # delete seen before its index update), and that id is not found.
                holders, own = replies[2 * n], replies[2 * n + 1]
                out[key] = FOREIGN if holders > (1 if own else 0) else None
        return out


def _entry(tenant: str, raw: bytes) -> RefEntry:
    doc = orjson.loads(raw)
    attributes = doc.get("attributes")
    owner = doc.get("owner")
    return RefEntry(
        tenant,
        str(doc["state"]),
        owner if isinstance(owner, str) else None,
        attributes if isinstance(attributes, dict) else {},
    )


@dataclass(frozen=True, slots=True)
class ReferenceRecord:
    tenant: str
    entity: str
    entity_id: str
    value: bytes | None
    """The normalised JSON to store, or None for a tombstone."""


_ENTITY = re.compile(r"[a-z][a-z0-9_]{0,63}\Z")
"""An entity kind, as the contract schema has it (references[].entity)."""


class BadReference(ValueError):
    def __init__(self, why: str, forget: ReferenceRecord | None = None) -> None:
        super().__init__(why)
        self.forget = forget
        """For a record whose key names an entity but whose value cannot be read: that
        entity's tombstone (see apply_records)."""


def parse_reference(key: bytes | None, value: bytes | None) -> ReferenceRecord:
    """One ``tool.reference`` record, checked; ``BadReference`` says why it is unusable."""
    if key is None:
        raise BadReference("no key")
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadReference("key is not UTF-8") from exc
    parts = text.split("/", 2)
    if len(parts) != 3 or not all(parts):
        raise BadReference("key must be tenant/entity/id")
    tenant, entity, entity_id = parts
    if not _ENTITY.match(entity):
        # (as contracts name entities; any other, ':' in it say, could spell another
        # entity's key: "order:x" with id "1" and "order" with id "x:1")
        raise BadReference("entity must be a lower-case name ([a-z][a-z0-9_]{0,63})")
    gone = ReferenceRecord(tenant, entity, entity_id, None)
    if value is None:
        return gone
    try:
        doc = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise BadReference("value is not JSON", gone) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("state"), str) or not doc["state"]:
        raise BadReference("value must be an object with a non-empty state", gone)
    # Dropped rather than refused, an owner or attributes of another type would read as
    # none: a rule such as ``refs.order.owner != 'blocked'`` would then pass.
    owner, attributes = _owner(doc.get("owner")), doc.get("attributes")
    if owner is None and doc.get("owner") is not None:
        raise BadReference("owner must be text, a whole number or null", gone)
    if attributes is not None and not isinstance(attributes, dict):
        raise BadReference("attributes must be an object or null", gone)
    kept: dict[str, Any] = {"state": doc["state"]}
    if owner is not None:
        kept["owner"] = owner
    if attributes is not None:
        kept["attributes"] = attributes
    try:
        kept_json = orjson.dumps(kept)
    except (TypeError, ValueError) as exc:  # orjson reads deeper nesting than it writes
        raise BadReference(f"value cannot be kept: {exc}", gone) from exc
    return ReferenceRecord(tenant, entity, entity_id, kept_json)


def _owner(value: Any) -> str | None:
    """The owner as rules compare it, text: a system of record that numbers its customers
    may send ``"owner": 4211``, which reads as ``"4211"`` (a number with a fraction or an
    exponent, or true, has no one spelling and is not an owner)."""
    if isinstance(value, str):
        return value
    return str(value) if type(value) is int else None


def apply_records(
    client: RedisClient,
    records: list[tuple[str, int, int, bytes | None, bytes | None]],
    group: str,
    ns: str = "ts",
    past: dict[tuple[str, int], int] | None = None,
    stored: dict[tuple[str, int], int] | None = None,
) -> tuple[int, int, dict[tuple[str, int], int]]:
    """Write a batch of (topic, partition, offset, key, value); positions last, in the
    same round trip. ``past``: the consumer's positions after the batch, which may be
    beyond its last record (transaction markers). ``stored``: the positions this loader
    wrote last; a partition whose position in Redis stands behind it lost writes, and
    keeps the position Redis holds (see positions.lua).

    Returns (applied, refused, {partition: the position Redis holds} for those)."""
    pipe = client.pipeline(transaction=False)
    positions: dict[tuple[str, int], int] = {}
    applied = refused = 0
    past = past or {}
    for topic, partition, offset, key, value in records:
        positions[(topic, partition)] = max(offset + 1, past.get((topic, partition), 0))
        try:
            rec = parse_reference(key, value)
        except BadReference as exc:
            refused += 1
            logger.warning("tool.reference %s@%s refused: %s", partition, offset, exc)
            if exc.forget is None:
                continue
            # The entity's system of record replaced the state Redis holds with one that
            # cannot be read: kept, that older state would pass calls the new one may
            # refuse (an order refunded since, refunded again). Forgotten, as by a
            # tombstone: a call naming the entity is refused until a readable record comes.
            rec = exc.forget
        except Exception:  # a defect: this record is refused, the others still load
            refused += 1
            logger.exception("tool.reference %s@%s refused: cannot be read", partition, offset)
            continue
        else:
            applied += 1
        ek = entity_key(ns, rec.tenant, rec.entity, rec.entity_id)
        ik = index_key(ns, rec.entity, rec.entity_id)
        if rec.value is None:
            pipe.delete(ek)
            pipe.srem(ik, rec.tenant)
        else:
            pipe.set(ek, rec.value)
            pipe.sadd(ik, rec.tenant)
    if not positions:
        pipe.execute()
        return applied, refused, {}
    return applied, refused, write_positions(client, group, ns, positions, stored or {}, pipe)


def write_positions(
    client: RedisClient,
    group: str,
    ns: str,
    new: dict[tuple[str, int], int],
    stored: dict[tuple[str, int], int],
    pipe: Any | None = None,
) -> dict[tuple[str, int], int]:
    """Move a loader's positions to ``new`` where Redis still holds what it wrote last
    (``stored``), after whatever ``pipe`` holds, in one round trip (see positions.lua).
    Returns {partition: the position Redis holds} where it stands behind: lost writes."""
    args: list[str | int] = []
    for (topic, partition), offset in new.items():
        args += [_field(topic, partition), stored.get((topic, partition), -1), offset]
    reply = run_scripts(client, _POSITIONS, [([position_key(ns, group)], args)], pipe)[-1]
    behind: dict[tuple[str, int], int] = {}
    for field, there in zip(reply[::2], reply[1::2], strict=True):
        behind[_partition_of(field)] = int(there)
    return behind


_POSITIONS = LuaScript((Path(__file__).with_name("positions.lua")).read_text())
_MARKS = LuaScript((Path(__file__).with_name("marks.lua")).read_text())


def positions(client: RedisClient, group: str, ns: str = "ts") -> dict[tuple[str, int], int]:
    return positions_of(client.hgetall(position_key(ns, group)))


def load_state(
    client: RedisClient, group: str, ns: str, topic: str
) -> tuple[dict[tuple[str, int], int], str | None]:
    """The loaders' positions, and ``unloaded``'s answer: one round trip."""
    pipe = client.pipeline(transaction=False)
    _ask_state(pipe, ns, group, topic)
    held, count = pipe.execute()
    return positions_of(held), unloaded(held, count, topic)


def _ask_state(pipe: Any, ns: str, group: str, topic: str) -> None:
    """Queue the reads ``unloaded`` answers from: the position hash, the partition count."""
    pipe.hgetall(position_key(ns, group))
    pipe.hget(count_key(ns, group), topic)


def positions_of(held: dict[bytes, bytes]) -> dict[tuple[str, int], int]:
    out: dict[tuple[str, int], int] = {}
    for k, v in held.items():
        if not k.startswith(LOADING.encode()):
            out[_partition_of(k)] = int(v)
    return out


def _partition_of(field: bytes) -> tuple[str, int]:
    """(topic, partition) of a position hash field, "<topic>/<partition>"."""
    topic, _, partition = field.decode().rpartition("/")
    return topic, int(partition)


def plan_partition(here: int | None, low: int, high: int) -> tuple[int, int]:
    """Where a partition is read from, given the position Redis holds (``here``) and its
    first and end offsets; and the end it must reach before lookups read it. Where Redis
    holds none, or one past the end (a topic recreated), the whole partition; records
    deleted below ``here`` are not waited for."""
    start = low if here is None or here > high else max(here, low)
    return start, high


def partition_count(consumer: Consumer, topic: str) -> int:
    meta = consumer.list_topics(topic, timeout=10).topics[topic]
    if meta.error is not None:
        raise KafkaException(meta.error)
    return len(meta.partitions)


def mark_behind(settings: Settings, client: RedisClient) -> None:
    """Mark every partition whose position in Redis stands behind the topic's end: lookups
    wait until whichever loader holds it gets there (positions.lua removes the mark). A
    partition with no position needs none: it counts as not loaded until a loader has
    placed it."""
    s = settings
    topic = s.topics.reference
    consumer = Consumer(
        s.client_config(
            **{"group.id": f"{s.reference_group_id}-probe", "isolation.level": "read_committed"}
        )
    )
    try:
        count = partition_count(consumer, topic)
        ends = {p: watermarks(consumer, TopicPartition(topic, p), 10)[1] for p in range(count)}
    finally:
        consumer.close()
    args: list[str | int] = []
    for p, end in ends.items():
        args += [_field(topic, p), end]
    key = position_key(s.redis_namespace, s.reference_group_id)
    run_scripts(client, _MARKS, [([key], args)])


_LOADER_ERRORS: tuple[type[Exception], ...] = (KafkaException, *REDIS_ERRORS)

RESYNC_S = 5.0
"""How often the loader compares Redis's positions with the ones it wrote."""


class ReferenceLoader:
    """Background thread: ``tool.reference`` into Redis, from Redis's own position."""

    def __init__(self, settings: Settings, client: RedisClient, metrics: Metrics) -> None:
        self.settings = settings
        self.client = client
        self.metrics = metrics
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reference-loader", daemon=True)
        self._stored: dict[tuple[str, int], int] = {}
        """The positions last written to Redis, per assigned partition."""
        self._count = 0
        """The topic's partition count, as the last assignment found it."""
        self._lost = False
        """A rewind found Redis behind: compare every partition's position now."""

    def start(self) -> None:
        """Mark the partitions whose positions in Redis stand behind the topic's end, then
        load in the background. Marked before the processor reads anything: until this
        loader (or another instance's) has taken them, which takes a group join, Redis's
        older states would read as loaded."""
        try:
            mark_behind(self.settings, self.client)
        except _LOADER_ERRORS as exc:
            # (the loader that takes them marks them then; until then, older states read)
            logger.warning("cannot compare reference positions with the topic: %s", exc)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Each partition from the position Redis holds, waited for (replaying from the
        beginning instead would show the entities' older states); from the beginning
        where Redis holds none. A partition that starts behind its end now is marked as
        loading up to that end, so lookups wait until it is there.

        Never returns without assigning: were this callback to raise, the client would
        assign the partitions itself, from the group's committed offsets (there are none:
        from the beginning), with no mark and positions that go back."""
        s = self.settings
        delay = 0.2
        while True:
            try:
                self._count = partition_count(consumer, s.topics.reference)
                bounds = {
                    (tp.topic, tp.partition): watermarks(consumer, tp, 10) for tp in partitions
                }
                known = positions(self.client, s.reference_group_id, s.redis_namespace)
                plan = {
                    where: plan_partition(known.get(where), *lh) for where, lh in bounds.items()
                }
                self._mark(plan)
                break
            except _LOADER_ERRORS as exc:
                if self._stop.is_set():
                    for tp in partitions:  # nothing more is read
                        tp.offset = OFFSET_END
                    self._stored = {}
                    consumer.assign(partitions)
                    return
                which = "kafka" if isinstance(exc, KafkaException) else "redis"
                self.metrics.dependency_errors.labels(which).inc()
                logger.warning("cannot place the reference partitions (%s); retrying", exc)
                self._stop.wait(delay)
                delay = min(delay * 2, 5.0)
        for tp in partitions:
            start = plan[(tp.topic, tp.partition)][0]
            tp.offset = start if start > 0 else OFFSET_BEGINNING
        self._stored = {where: start for where, (start, _) in plan.items()}
        consumer.assign(partitions)

    def _mark(self, plan: dict[tuple[str, int], tuple[int, int]]) -> None:
        """Write each partition's position (where it starts) with its loading mark (the
        end it must reach) in one HSET, so that neither is seen without the other; a
        partition that starts at its end loses any mark (one an earlier version left)."""
        s = self.settings
        key = position_key(s.redis_namespace, s.reference_group_id)
        fields: dict[str, int] = {}
        done: list[str] = []
        for (topic, partition), (start, end) in plan.items():
            fields[_field(topic, partition)] = start
            if end > start:
                fields[LOADING + _field(topic, partition)] = end
            else:
                done.append(LOADING + _field(topic, partition))
        pipe = self.client.pipeline(transaction=False)
        if self._count > 0:  # (lost too, if the position hash was)
            counts = count_key(s.redis_namespace, s.reference_group_id)
            pipe.hset(counts, s.topics.reference, self._count)
        if fields:
            pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
        if done:
            pipe.hdel(key, *done)
        pipe.execute()

    def _run(self) -> None:
        """Load until stopped. An unexpected error does not end the thread (the decisions
        would go on against reference data that no longer moves, with nothing to show
        for it): it is logged and counted, and a new consumer starts again from the
        positions Redis holds."""
        while not self._stop.is_set():
            try:
                self._load()
            except Exception:
                logger.exception("reference loader failed; starting again from Redis")
                self.metrics.reference_restarts.inc()
                self._stop.wait(1.0)

    def _load(self) -> None:
        s = self.settings
        consumer = Consumer(
            s.client_config(
                **{
                    "group.id": s.reference_group_id,
                    "enable.auto.commit": False,
                    "enable.auto.offset.store": False,
                    "auto.offset.reset": "earliest",
                    "isolation.level": "read_committed",
                    # A loader batch is at most 1,000 records: keep the prefetch small.
                    "queued.max.messages.kbytes": 4096,
                    "fetch.queue.backoff.ms": 20,  # see consumer_config
                    **s.consumer,
                }
            )
        )
        consumer.subscribe([s.topics.reference], on_assign=self._on_assign)
        next_check = time.monotonic() + RESYNC_S
        try:
            while not self._stop.is_set():
                try:
                    batch = consumer.consume(1000, 0.2)
                except KafkaException as exc:
                    logger.warning("reference consumer: %s", exc)
                    continue
                records = [
                    (m.topic(), m.partition(), m.offset(), m.key(), m.value())
                    for m in batch
                    if m.error() is None
                ]
                if records:
                    self._apply(consumer, records)
                # Also after a batch: a partition may have moved past a transaction's
                # marker alone, with none of its records in the batch; on a topic that
                # is never idle, its mark would otherwise wait for its next record.
                self._advance(consumer)
                if time.monotonic() >= next_check or self._lost:
                    # (at once after a rewind: what Redis lost there, it may have lost on
                    # the other partitions too)
                    self._lost = False
                    self._resync(consumer)
                    self._measure_lag(consumer)
                    next_check = time.monotonic() + RESYNC_S
        finally:
            consumer.close()

    def _positions(
        self, consumer: Consumer, partitions: Iterable[tuple[str, int]]
    ) -> dict[tuple[str, int], int]:
        wanted = [TopicPartition(t, p) for t, p in partitions]
        return {(tp.topic, tp.partition): tp.offset for tp in consumer.position(wanted)}

    def _measure_lag(self, consumer: Consumer) -> None:
        """How far behind its partitions' ends the loader is, from the ends librdkafka
        learned with its last fetches (no request): decisions meanwhile read older data."""
        lag = 0
        for (topic, partition), stored in self._stored.items():
            try:
                _, end = consumer.get_watermark_offsets(
                    TopicPartition(topic, partition), cached=True
                )
            except KafkaException:
                continue
            if end >= 0:
                lag += max(end - stored, 0)
        self.metrics.reference_lag.set(lag)

    def _resync(self, consumer: Consumer) -> None:
        """Load again what Redis lost. Redis's positions behind the ones this loader wrote
        (a failover to a replica that missed the latest writes, a restore from an older
        snapshot, a flushed database) mean the entities written since may be gone too:
        those partitions are read again from where Redis says."""
        s = self.settings
        counts = count_key(s.redis_namespace, s.reference_group_id)
        try:
            held = self.client.hgetall(position_key(s.redis_namespace, s.reference_group_id))
            if self._count > 0 and not self.client.hexists(counts, s.topics.reference):
                self.client.hset(counts, s.topics.reference, self._count)  # a flushed database
        except REDIS_ERRORS:
            return  # Redis down: the next batch waits it out; checked again later
        there_all = positions_of(held)
        for (topic, partition), mine in list(self._stored.items()):
            there = there_all.get((topic, partition))
            if there is None or there < mine:  # none at all: a flushed database
                self._rewind(consumer, topic, partition, there or 0)

    def _rewind(self, consumer: Consumer, topic: str, partition: int, there: int) -> None:
        """Read a partition again from ``there``, marked as loading up to its end: until
        then, Redis holds older states. A Redis error goes up: the loader starts again
        from what Redis holds, and marks what stands behind the end then."""
        tp = (topic, partition)
        logger.warning(
            "reference positions in Redis went back (%s/%s: %s, loaded up to %s); "
            "reading it again from there",
            topic, partition, there, self._stored.get(tp),
        )  # fmt: skip
        try:
            start, end = plan_partition(
                there, *watermarks(consumer, TopicPartition(topic, partition), 10)
            )
        except KafkaException as exc:
            # Its end unknown: loading up to where this loader had got, at least.
            logger.warning("cannot read the end of %s/%s: %s", topic, partition, exc)
            start, end = there, max(self._stored.get(tp, 0), there)
        self._mark({tp: (start, end)})
        try:
            consumer.seek(TopicPartition(topic, partition, start or OFFSET_BEGINNING))
        except KafkaException as exc:
            # Read on from here; the next write finds Redis behind and rewinds again.
            logger.warning("cannot rewind %s/%s: %s", topic, partition, exc)
            return
        self._stored[tp] = start
        self._lost = True
        self.metrics.reference_rewinds.inc()

    def _advance(self, consumer: Consumer) -> None:
        """Move the stored positions past what the consumer skipped since (the markers of
        transactions whose records were applied earlier); a write only where one moved."""
        try:
            now = self._positions(consumer, self._stored)
        except KafkaException:
            return
        ahead = {tp: o for tp, o in now.items() if o > self._stored.get(tp, o)}
        if not ahead:
            return
        s = self.settings
        try:
            behind = write_positions(
                self.client, s.reference_group_id, s.redis_namespace, ahead, self._stored
            )
        except REDIS_ERRORS:
            return  # tried again when next idle
        self._stored.update(ahead)
        for (topic, partition), there in behind.items():
            self._rewind(consumer, topic, partition, there)

    def _apply(
        self, consumer: Consumer, records: list[tuple[Any, Any, Any, bytes | None, bytes | None]]
    ) -> None:
        # Only partitions this loader has placed: a record of another (an assignment that
        # failed) would be written with nothing to compare its position with.
        records = [r for r in records if (r[0], r[1]) in self._stored]
        if not records:
            return
        delay = 0.2
        try:
            past = self._positions(consumer, {(r[0], r[1]) for r in records})
        except KafkaException:
            past = {}  # the records' own positions, then; _advance catches up
        while True:
            if self._stop.is_set():
                return
            try:
                applied, refused, behind = apply_records(
                    self.client,
                    records,
                    self.settings.reference_group_id,
                    self.settings.redis_namespace,
                    past,
                    self._stored,
                )
                break
            except REDIS_ERRORS as exc:
                self.metrics.dependency_errors.labels("redis").inc()
                logger.warning("reference load failed (%s); retrying in %.1fs", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        for topic, partition, offset, _, _ in records:
            tp = (topic, partition)
            self._stored[tp] = max(offset + 1, past.get(tp, 0))
        self.metrics.references.labels("applied").inc(applied)
        self.metrics.references.labels("refused").inc(refused)
        # Redis lost writes since this loader's last batch (a failover while it was being
        # retried, say): read those partitions again from there. Not inside the retry
        # above: the batch written again after one rewind would move that partition's
        # position past the range it has still to read, and take its mark away.
        for (topic, partition), there in behind.items():
            self._rewind(consumer, topic, partition, there)
