"""Reading what topics retain over a time range: the way in for ``trace`` and ``replay``.

The reader is assigned its partitions: it joins no group, commits nothing and writes
nothing, so it can run beside a live processor. It reads committed records only
(``read_committed``): what a processor's aborted transaction wrote never happened. Each
partition is read from the first record at or after ``since`` up to its end when reading
began, the last stable offset (a transaction still open then is not waited for), or,
given ``until``, to where no record at or before ``until`` can follow, so a busy topic
cannot keep it reading for ever. That is not the first record stamped after ``until``: a
producer may stamp a record ahead of its time, up to the topic's
``message.timestamp.after.max.ms`` (an hour by default since Kafka 4.0), and records
after it may still be in range. The read goes on to the first record stamped that much
after ``until`` (to the end, where the topic bounds nothing or its settings cannot be
read) and yields only those stamped at or before ``until``.

An ``OffsetRange`` narrows one topic to one partition, and that partition to offsets an
incident names (a consumer-lag alert, a dead letter's headers), within the time range if
one is given too. A partition the topic does not have, or offsets the partition does not
hold (no longer retained, or not written yet), are refused with ``OutOfRange`` before
anything is read, rather than read as an empty range.

Times are the records' own (``CreateTime``), looked up with the broker's time index. The
broker stamps a transaction's commit marker with its own clock, so a record produced
with a time far older than its write can fall outside a range that names that time.

A partition that stops moving before its end (its leader gone) is given up after
``idle_s`` and reported in ``incomplete``, so a report can say what it did not see.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition
from confluent_kafka.admin import AdminClient

# confluent_kafka.admin re-exports ConfigResource without marking it public for type checkers.
from confluent_kafka.admin._config import ConfigResource

from processor.config import Settings
from processor.kafka.offsets import watermarks

logger = logging.getLogger(__name__)

BATCH = 500
"""Records asked of librdkafka per call: enough to keep the Python side busy."""

UNBOUNDED_AHEAD_MS = 10 * 365 * 86_400_000
"""A topic that lets records be stamped further ahead than this bounds nothing (the
broker's default before Kafka 4.0 was Long.MAX_VALUE): its partitions are read to their
end."""


def stamped_ahead_ms(settings: Settings, topics: list[str]) -> dict[str, int | None]:
    """How far ahead of the broker's clock each topic lets a record be stamped: 0 where
    the broker stamps records itself (LogAppendTime), None where nothing bounds it or its
    settings cannot be read."""
    admin = AdminClient(settings.client_config())
    resources = {t: ConfigResource(ConfigResource.Type.TOPIC, t) for t in topics}
    futures = admin.describe_configs(list(resources.values())) if topics else {}
    out: dict[str, int | None] = dict.fromkeys(topics)
    for topic, resource in resources.items():
        try:
            entries = futures[resource].result(timeout=10)
        except Exception as exc:  # refused (ACLs), gone, timed out: read to the end
            logger.warning("%s: cannot read its timestamp settings (%s); reading to its end",
                           topic, exc)  # fmt: skip
            continue
        kind = entries.get("message.timestamp.type")
        if kind is not None and kind.value == "LogAppendTime":
            out[topic] = 0
            continue
        entry = entries.get("message.timestamp.after.max.ms") or entries.get(
            "message.timestamp.difference.max.ms"
        )
        try:
            ahead = int(entry.value) if entry is not None else None
        except (TypeError, ValueError):
            ahead = None
        out[topic] = ahead if ahead is not None and 0 <= ahead < UNBOUNDED_AHEAD_MS else None
    return out


@dataclass
class Reach:
    """Where one partition's read starts and ends (end exclusive), and how far it got."""

    topic: str
    partition: int
    start: int
    end: int
    reached: int


class OutOfRange(ValueError):
    """An ``OffsetRange`` the topic does not hold. ``what`` names the bound at fault:
    ``partition``, ``first`` or ``last``."""

    def __init__(self, what: str, message: str) -> None:
        super().__init__(message)
        self.what = what


@dataclass(frozen=True, slots=True)
class OffsetRange:
    """One partition of a topic, from offset ``first`` to ``last``, both included; None
    for the first retained offset and the end as reading begins."""

    topic: str
    partition: int
    first: int | None = None
    last: int | None = None

    def __post_init__(self) -> None:
        if self.partition < 0 or min(self.first or 0, self.last or 0) < 0:
            raise ValueError(f"{self}: partitions and offsets are not negative")
        if self.first is not None and self.last is not None and self.last < self.first:
            raise ValueError(f"{self}: the last offset is before the first")

    def __str__(self) -> str:
        first = "" if self.first is None else self.first
        last = "" if self.last is None else self.last
        return f"{self.topic}/{self.partition} offsets {first}..{last}"

    def bounds(self, low: int, high: int) -> tuple[int, int]:
        """Where to start and end (exclusive) in a partition that holds offsets ``low`` to
        ``high - 1`` to be read. OutOfRange for an offset it does not hold: one no
        longer retained, or one not written (or not yet stable) when reading begins."""
        for what, offset in (("first", self.first), ("last", self.last)):
            if offset is not None and not low <= offset < high:
                gone = "is no longer retained" if offset < low else "is not written yet"
                holds = f"it holds {low}..{high - 1}" if high > low else "it holds no record"
                raise OutOfRange(
                    what, f"offset {offset} of {self.topic}/{self.partition} {gone}: {holds}"
                )
        first = low if self.first is None else self.first
        return first, high if self.last is None else self.last + 1

    def check_partition(self, count: int) -> None:
        """OutOfRange unless a topic of ``count`` partitions has this one."""
        if self.partition >= count:
            raise OutOfRange(
                "partition",
                f"{self.topic} has no partition {self.partition}: its partitions are "
                f"0..{count - 1}",
            )


@dataclass
class RetainedReader:
    """Iterate over the committed records of ``topics`` between ``since_ms`` and
    ``until_ms`` (epoch milliseconds, each None for the earliest retained record and the
    end as reading begins), partition by partition in offset order, partitions
    interleaved. ``partitions`` narrows a topic to some of its partitions (a run's
    records are all in the partition its key maps to); ``offsets`` narrows its topic to
    one partition and an offset range of it (OutOfRange, raised as the iteration begins,
    for one the topic does not hold).

    After the iteration: ``planned`` holds each partition's read as planned when it
    began, ``incomplete`` names the partitions not read to their end, ``missing`` the
    topics that do not exist, ``errors`` counts the consume errors seen (each logged)."""

    settings: Settings
    topics: Iterable[str]
    since_ms: int | None = None
    until_ms: int | None = None
    partitions: dict[str, set[int]] | None = None
    offsets: OffsetRange | None = None
    idle_s: float = 10.0
    planned: list[Reach] = field(default_factory=list)
    incomplete: list[Reach] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    errors: int = 0

    def __iter__(self) -> Iterator[Message]:
        consumer = Consumer(
            self.settings.client_config(
                **{
                    "group.id": f"toolsentry-read-{uuid.uuid4()}",
                    "enable.auto.commit": False,
                    "enable.auto.offset.store": False,
                    "isolation.level": "read_committed",
                    "enable.partition.eof": True,
                    "auto.offset.reset": "earliest",
                }
            )
        )
        try:
            reaches = self._plan(consumer)
            yield from self._read(consumer, reaches)
        finally:
            consumer.close()

    def _plan(self, consumer: Consumer) -> dict[tuple[str, int], Reach]:
        reaches: dict[tuple[str, int], Reach] = {}
        found = []
        for topic in dict.fromkeys(self.topics):
            meta = consumer.list_topics(topic, timeout=10).topics.get(topic)
            if meta is None or meta.error is not None or not meta.partitions:
                self.missing.append(topic)
                continue
            found.append((topic, meta))
        ahead = (
            stamped_ahead_ms(self.settings, [t for t, _ in found])
            if self.until_ms is not None
            else {}
        )
        for topic, meta in found:
            narrowed = self.offsets if self.offsets and self.offsets.topic == topic else None
            if narrowed is not None:
                narrowed.check_partition(len(meta.partitions))
            wanted = self.partitions.get(topic) if self.partitions else None
            for p in sorted(meta.partitions):
                if wanted is not None and p not in wanted:
                    continue
                if narrowed is not None and p != narrowed.partition:
                    continue
                reach = self._reach(consumer, topic, p, narrowed, ahead.get(topic))
                if reach.start < reach.end:
                    reaches[(topic, p)] = reach
        self.planned = list(reaches.values())
        consumer.assign([TopicPartition(r.topic, r.partition, r.start) for r in reaches.values()])
        return reaches

    def _reach(
        self,
        consumer: Consumer,
        topic: str,
        partition: int,
        narrowed: OffsetRange | None,
        ahead_ms: int | None = None,
    ) -> Reach:
        """One partition's read: its time range, within its offset range if it has one.
        ``ahead_ms``: how far ahead of its write a record of the topic may be stamped (None:
        unbounded), which is how far past ``until`` a record still in range may follow."""
        low, high = watermarks(consumer, TopicPartition(topic, partition))
        start = self._offset_at(consumer, topic, partition, self.since_ms, low, high)
        end = high
        if self.until_ms is not None and ahead_ms is not None:
            beyond = min(self.until_ms + 1 + ahead_ms, _LATEST_MS)
            end = self._offset_at(consumer, topic, partition, beyond, low, high)
        if narrowed is not None:
            first, after = narrowed.bounds(low, high)
            start, end = max(start, first), min(end, after)
        return Reach(topic, partition, start, end, start)

    @staticmethod
    def _offset_at(
        consumer: Consumer, topic: str, partition: int, at_ms: int | None, low: int, high: int
    ) -> int:
        """The first offset whose record is at or after ``at_ms``: ``low`` for None,
        ``high`` when every record is older."""
        if at_ms is None or at_ms <= 0:
            # Every record is at or after such a time; and the broker reads a negative
            # time as a sentinel (-1: the end, -2: the start), not as a time.
            return low
        found = consumer.offsets_for_times([TopicPartition(topic, partition, at_ms)], timeout=10)
        offset = int(found[0].offset)
        return high if offset < 0 else max(offset, low)

    def _read(self, consumer: Consumer, reaches: dict[tuple[str, int], Reach]) -> Iterator[Message]:
        open_ = dict(reaches)
        moved = time.monotonic()
        while open_:
            batch = consumer.consume(BATCH, timeout=0.5)
            for m in batch:
                key = (m.topic() or "", m.partition() or 0)
                reach = open_.get(key)
                err = m.error()
                if err is not None and err.code() != KafkaError._PARTITION_EOF:
                    self.errors += 1
                    logger.warning("reading %s/%s: %s", m.topic(), m.partition(), err)
                    continue
                if reach is None:
                    continue
                offset = m.offset() or 0
                if err is None and offset < reach.end:
                    reach.reached = offset + 1
                    if self.until_ms is None or _stamped(m) <= self.until_ms:
                        yield m
                if reach.reached >= reach.end or offset >= reach.end:
                    reach.reached = reach.end
                    del open_[key]
                moved = time.monotonic()
            if not batch and open_ and self._closed_by_position(consumer, open_):
                moved = time.monotonic()
            if open_ and time.monotonic() - moved > self.idle_s:
                self.incomplete = sorted(open_.values(), key=lambda r: (r.topic, r.partition))
                for r in self.incomplete:
                    logger.warning("gave up on %s/%d at %d of %d: no progress for %.0f s",
                                   r.topic, r.partition, r.reached, r.end, self.idle_s)  # fmt: skip
                return

    @staticmethod
    def _closed_by_position(consumer: Consumer, open_: dict[tuple[str, int], Reach]) -> bool:
        """Close the partitions whose position passed their end: the last offsets of a
        transactional topic are commit markers, which are never delivered."""
        closed = False
        for tp in consumer.position([TopicPartition(t, p) for t, p in open_]):
            reach = open_.get((tp.topic, tp.partition))
            if reach is not None and tp.offset >= reach.end:
                reach.reached = reach.end
                del open_[(tp.topic, tp.partition)]
                closed = True
        return closed


def _stamped(m: Message) -> int:
    kind, ms = m.timestamp()
    return ms if kind != 0 else 0  # (TIMESTAMP_NOT_AVAILABLE: a record of no time)


_AGO = {"s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_LATEST_MS = 253_402_300_799_999
"""9999-12-31T23:59:59.999Z, the last time ISO 8601 can name: beyond it an epoch or a
duration is not a time (and would not fit the broker's 64-bit timestamps)."""


def parse_time(text: str, now_ms: int) -> int:
    """A time as a command line gives it, in epoch milliseconds: a duration before now
    (``90s``, ``30m``, ``2h``, ``7d``), an ISO 8601 time (``2026-11-27T10:00:00Z``; one
    without a zone is UTC) or epoch milliseconds. ValueError, saying what is accepted,
    for anything else."""
    t = text.strip()
    if len(t) > 1 and t[-1] in _AGO and t[:-1].isascii() and t[:-1].isdigit():
        return _bounded(text, now_ms - int(t[:-1]) * _AGO[t[-1]])
    if t.isascii() and t.isdigit():
        return _bounded(text, int(t))
    try:
        when = datetime.fromisoformat(t)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a time: give a duration before now (90s, 30m, 2h, 7d), "
            "an ISO 8601 time (2026-11-27T10:00:00Z) or epoch milliseconds"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def _bounded(text: str, ms: int) -> int:
    """``ms``, unless it is later than any time ISO 8601 names, or earlier than the
    negative of that (a duration longer than the epoch is an earlier time: all of it)."""
    if abs(ms) > _LATEST_MS:
        raise ValueError(f"{text!r} is not a time: it is beyond the year 9999")
    return ms
