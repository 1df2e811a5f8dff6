"""The processor: a consumer group on ``tool.proposals`` that decides exactly once.

The loop is the canonical read-process-write transaction: consume a batch,
decide every record, then in one transaction the batch's input offsets and
the observations / approved calls / DLQ entries, and commit. On an
abortable error the transaction is aborted and the consumer rewound to the
batch's first offsets, so the batch is decided again; on a fatal one
(another instance fenced this producer) the clients are rebuilt from the
committed offsets.

Rebalances can only happen inside ``consume()``, which is never called with
a transaction open, so a revoked partition's work is always either
committed or aborted before the partition leaves.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, cast

import orjson
from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from processor.codec.records import (
    dlq_headers,
    dlq_value,
    encode_approved_call,
    encode_observation,
)
from processor.config import Settings
from processor.contracts.registry import ContractSet, load_contracts
from processor.contracts.watch import ContractWatcher
from processor.gates.parse import Limits
from processor.metrics import Metrics
from processor.model import Decision, Outcome, SourceRecord
from processor.pipeline import decide

logger = logging.getLogger(__name__)


class Fenced(Exception):
    """Another instance took over this producer's transactional id."""


def stop_on_signals() -> tuple[threading.Event, threading.Event]:
    """Events set by SIGTERM/SIGINT (stop) and SIGHUP (reload the contracts).

    Installed first thing, so a signal that arrives while the processor is
    still starting is neither lost nor (for SIGHUP) fatal."""
    stop, reload = threading.Event(), threading.Event()

    def on_stop(signum: int, frame: FrameType | None) -> None:
        logger.info("signal %s: finishing the current batch, then stopping", signum)
        stop.set()

    def on_hup(signum: int, frame: FrameType | None) -> None:
        logger.info("SIGHUP: checking the contracts")
        reload.set()

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGHUP, on_hup)
    return stop, reload


class UnsafeSetting(ValueError):
    """A pass-through setting would switch off exactly-once processing."""


def _enforce(conf: dict[str, Any], fixed: dict[str, Any], where: str) -> dict[str, Any]:
    """Pass-through settings may tune clients but never change what exactly-once rests on."""
    for key, value in fixed.items():
        if key in conf and str(conf[key]).lower() != str(value).lower():
            raise UnsafeSetting(f"{where}: {key}={conf[key]!r} is not allowed (must be {value!r})")
        conf[key] = value
    return conf


def consumer_config(settings: Settings) -> dict[str, Any]:
    conf = settings.client_config(
        **{
            "auto.offset.reset": "earliest",
            "session.timeout.ms": 10000,
            "heartbeat.interval.ms": 1000,
            "statistics.interval.ms": 5000,
            "fetch.wait.max.ms": 50,
            # librdkafka prefetches up to 64 MiB per client by default; a batch is
            # at most batch_max_records, so 16 MiB keeps a backlog from bloating RSS.
            "queued.max.messages.kbytes": 16384,
        }
    )
    if settings.static_membership:
        # A restarted instance reclaims its partitions at once, without a rebalance.
        conf["group.instance.id"] = settings.instance_id
    conf.update(settings.consumer)
    fixed = {
        "group.id": settings.group_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "isolation.level": "read_committed",
    }
    return _enforce(conf, fixed, "consumer")


def producer_config(settings: Settings) -> dict[str, Any]:
    conf = settings.client_config(
        **{
            "transaction.timeout.ms": settings.transaction_timeout_ms,
            # commit_transaction flushes anyway; lingering only delays the commit.
            "linger.ms": 0,
            # The next transaction's first request often meets the previous commit's
            # markers still being written (CONCURRENT_TRANSACTIONS); the default 100 ms
            # backoff would then dominate every batch.
            "retry.backoff.ms": 2,
            "retry.backoff.max.ms": 100,
            "partitioner": "murmur2_random",
        }
    )
    conf.update(settings.producer)
    fixed = {
        "transactional.id": settings.transactional_id,
        "enable.idempotence": True,
        "acks": "all",
    }
    return _enforce(conf, fixed, "producer")


class Processor:
    """One processor instance. ``run()`` blocks until ``stop()`` or a signal."""

    def __init__(
        self,
        settings: Settings,
        contracts: ContractSet | None = None,
        metrics: Metrics | None = None,
        stop_requested: threading.Event | None = None,
        reload_requested: threading.Event | None = None,
    ) -> None:
        self.settings = settings
        self.contracts = contracts or load_contracts(settings.contracts_dir)
        self.metrics = metrics or Metrics()
        self.limits = Limits(
            settings.max_record_bytes, settings.max_arguments_bytes, settings.max_arguments_depth
        )
        self._stop = stop_requested or threading.Event()
        self._assigned: set[tuple[str, int]] = set()
        self.batches_committed = 0
        self.records_committed = 0
        self.metrics.contract_set.labels(self.contracts.fingerprint, str(len(self.contracts))).set(
            1
        )
        self.watcher = ContractWatcher(
            settings.contracts_dir, self.contracts, self.metrics, settings.contracts_poll_s,
            reload_requested,
        )  # fmt: skip

    # -- lifecycle -------------------------------------------------------------------------

    def stop(self, *_: Any) -> None:
        """Finish the batch in hand, commit it, close. Safe from a signal handler."""
        self._stop.set()

    def run(self) -> None:
        self.watcher.start()
        try:
            while not self._stop.is_set():
                try:
                    self._run_clients()
                except Fenced:
                    logger.warning("producer fenced; rebuilding clients from committed offsets")
                    time.sleep(0.5)
        finally:
            self.watcher.stop()

    def _swap_contracts(self) -> None:
        """Take a newly loaded contract set; only ever between batches."""
        loaded = self.watcher.take()
        if loaded is None:
            return
        old = self.contracts
        self.contracts = loaded
        self.metrics.contract_set.remove(old.fingerprint, str(len(old)))
        self.metrics.contract_set.labels(loaded.fingerprint, str(len(loaded))).set(1)

    # -- the loop --------------------------------------------------------------------------

    def _run_clients(self) -> None:
        s = self.settings
        with contextlib.ExitStack() as stack:
            producer = Producer(producer_config(s))
            stack.callback(producer.flush, 5)
            self._retry_kafka("init_transactions", lambda: producer.init_transactions(30))
            consumer = Consumer({**consumer_config(s), "stats_cb": self._on_stats})
            stack.callback(consumer.close)
            consumer.subscribe(
                [s.topics.proposals],
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_revoke,
            )
            logger.info(
                "processor %s consuming %s (contracts %s, %d versions)",
                s.instance_id,
                s.topics.proposals,
                self.contracts.fingerprint,
                len(self.contracts),
            )
            while not self._stop.is_set():
                self._swap_contracts()
                # Block only for the first record, then take whatever else is already
                # fetched: idle batches are small (low latency), busy ones big (the
                # commit is amortised), without a fixed wait for a full batch.
                first = consumer.poll(s.batch_wait_s)
                if first is None:
                    continue
                messages = [first, *consumer.consume(s.batch_max_records - 1, 0)]
                self._process_batch(consumer, producer, messages)

    def _process_batch(
        self, consumer: Consumer, producer: Producer, messages: list[Message]
    ) -> None:
        started = time.perf_counter()
        records: list[Message] = []
        for m in messages:
            err = m.error()
            if err is None:
                records.append(m)
            elif err.code() != KafkaError._PARTITION_EOF:
                self.metrics.dependency_errors.labels("kafka").inc()
                logger.warning("consumer error: %s", err)
        if not records:
            return
        decisions = self.decide_batch(records)
        try:
            producer.begin_transaction()
            # Offsets first: the broker is often still writing the previous commit's
            # markers, and the offsets request retries on a 2 ms backoff while the first
            # AddPartitionsToTxn of a produce would wait far longer. Where in the
            # transaction they go does not matter: all of it commits or none.
            producer.send_offsets_to_transaction(
                _next_offsets(records), consumer.consumer_group_metadata(), 30
            )
            self.produce_batch(producer, records, decisions)
            self._commit(producer)
        except KafkaException as exc:
            self._abort_and_rewind(consumer, producer, records, exc)
            return
        self.batches_committed += 1
        self.records_committed += len(records)
        self.metrics.transactions.labels("committed").inc()
        self.metrics.record_batch(decisions, time.perf_counter() - started)

    def decide_batch(self, records: list[Message]) -> list[Decision]:
        now_ms = int(time.time() * 1000)
        return [decide(_source(m), self.contracts, self.limits, now_ms) for m in records]

    def produce_batch(
        self, producer: Producer, records: list[Message], decisions: list[Decision]
    ) -> None:
        for m, d in zip(records, decisions, strict=True):
            self._produce(producer, m, d)

    def _produce(self, producer: Producer, m: Message, d: Decision) -> None:
        topics = self.settings.topics
        fp = self.contracts.fingerprint
        if d.outcome is Outcome.DEAD_LETTER:
            self._send(producer, topics.dlq, m.key(), dlq_value(m.value()), dlq_headers(d))
            return
        key = d.proposal.run_id.encode() if d.proposal else m.key()
        try:
            call = None
            if d.outcome is Outcome.ROUTED and d.side_effect_class is not None:
                call = encode_approved_call(d, fp)
            observation = encode_observation(d, fp)
        except Exception as exc:
            # Not expected; but a record we cannot encode must neither stop the
            # consumer nor be routed: it is parked in the DLQ with the reason.
            logger.exception("cannot encode the outputs of %s@%s", m.partition(), m.offset())
            d.dlq_reason, d.dlq_detail = "encoding_failed", f"{type(exc).__name__}: {exc}"[:500]
            self._send(producer, topics.dlq, m.key(), dlq_value(m.value()), dlq_headers(d))
            return
        if call is not None and d.side_effect_class is not None:
            self._send(producer, topics.execution(d.side_effect_class.value), key, call)
        self._send(producer, topics.observations, key, observation)

    @staticmethod
    def _send(
        producer: Producer,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, str | bytes | None]] | None = None,
    ) -> None:
        while True:
            try:
                producer.produce(topic, value=value, key=key, headers=headers)
                return
            except BufferError:
                producer.poll(0.05)  # local queue full: let deliveries drain

    def _commit(self, producer: Producer) -> None:
        while True:
            try:
                producer.commit_transaction(30)
                return
            except KafkaException as exc:
                err = exc.args[0]
                if err.retriable():
                    continue
                raise

    def _abort_and_rewind(
        self, consumer: Consumer, producer: Producer, records: list[Message], exc: KafkaException
    ) -> None:
        err: KafkaError = exc.args[0]
        self.metrics.transactions.labels("aborted").inc()
        self.metrics.dependency_errors.labels("kafka").inc()
        if err.fatal() or err.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED):
            raise Fenced(str(err)) from exc
        logger.warning("transaction failed (%s); aborting and rewinding the batch", err)
        with contextlib.suppress(KafkaException):
            producer.abort_transaction(30)
        for tp in _first_offsets(records):
            if (tp.topic, tp.partition) in self._assigned:
                with contextlib.suppress(KafkaException):
                    consumer.seek(tp)

    def _retry_kafka(self, what: str, call: Callable[[], None]) -> None:
        delay = 0.2
        while not self._stop.is_set():
            try:
                call()
                return
            except KafkaException as exc:
                err = exc.args[0]
                self.metrics.dependency_errors.labels("kafka").inc()
                if err.fatal():
                    raise
                logger.warning("%s failed (%s); retrying in %.1fs", what, err, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    # -- callbacks -------------------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._assigned |= {(tp.topic, tp.partition) for tp in partitions}
        self.metrics.assigned_partitions.set(len(self._assigned))
        logger.info("assigned %s", sorted(p for _, p in self._assigned))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._assigned -= {(tp.topic, tp.partition) for tp in partitions}
        self.metrics.assigned_partitions.set(len(self._assigned))
        for tp in partitions:
            with contextlib.suppress(ValueError):
                self.metrics.consumer_lag.remove(str(tp.partition))

    def _on_stats(self, stats_json: str) -> None:
        try:
            stats = orjson.loads(stats_json)
            parts = stats.get("topics", {}).get(self.settings.topics.proposals, {})
            for pid, p in parts.get("partitions", {}).items():
                lag = p.get("consumer_lag", -1)
                if (
                    int(pid) >= 0
                    and lag >= 0
                    and (self.settings.topics.proposals, int(pid)) in self._assigned
                ):
                    self.metrics.consumer_lag.labels(pid).set(lag)
        except Exception:
            logger.debug("unreadable librdkafka stats", exc_info=True)


def _where(m: Message) -> tuple[str, int, int]:
    """(topic, partition, offset) of a consumed record (never None for one without error)."""
    return cast(str, m.topic()), cast(int, m.partition()), cast(int, m.offset())


def _source(m: Message) -> SourceRecord:
    topic, partition, offset = _where(m)
    ts = m.timestamp()
    return SourceRecord(topic, partition, offset, m.key(), m.value(), ts[1] if ts else 0)


def _next_offsets(records: list[Message]) -> list[TopicPartition]:
    last: dict[tuple[str, int], int] = {}
    for m in records:
        topic, partition, offset = _where(m)
        last[(topic, partition)] = offset
    return [TopicPartition(t, p, o + 1) for (t, p), o in last.items()]


def _first_offsets(records: list[Message]) -> list[TopicPartition]:
    first: dict[tuple[str, int], int] = {}
    for m in records:
        topic, partition, offset = _where(m)
        first.setdefault((topic, partition), offset)
    return [TopicPartition(t, p, o) for (t, p), o in first.items()]
