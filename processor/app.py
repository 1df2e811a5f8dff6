"""The processor: a consumer group on ``tool.proposals`` that decides exactly once.

The loop is the canonical read-process-write transaction: consume a batch,
decide every record, then in one transaction the batch's input offsets and
the observations / approved calls / DLQ entries, and commit. On an
abortable error the transaction is aborted and the consumer rewound to the
batch's first offsets, so the batch is decided again; on a fatal one
(another instance fenced this producer) the clients are rebuilt from the
committed offsets.

The loop is pipelined, two batches deep: while one batch's transaction runs
on the committer thread (most of it is waiting for the broker), the next
batch is consumed and decided. Only one transaction is ever open, and a
batch's transaction starts only after the previous one committed; if that
one failed, both batches are rewound and decided again. Their Redis effects
are replay-safe (``processor.state.admission``), so deciding a batch twice
gives the same answers.

Rebalances can only happen inside ``poll()``/``consume()``, on the loop's
thread, and the revoke callback first waits for the batch in flight: a
revoked partition's work is always either committed or aborted before the
partition leaves.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
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

from processor import faults
from processor.approval_flow import (
    EXPIRY_CHECK,
    ApprovalInput,
    dead_letter,
    ignored,
    outcome_decision,
    parked_entry,
    parse_approval_record,
    position,
    recheck_release,
    refused_release,
    release_keys,
    revoked_votes,
    verify_decision,
)
from processor.approvals import load_approvers
from processor.codec.records import DLQ_HEADERS, dlq_record, encode_outputs, unencodable
from processor.config import Settings, enforce
from processor.config import UnsafeSetting as UnsafeSetting  # raised by run at start
from processor.contracts.registry import ContractSet
from processor.contracts.watch import (
    FIRST_READ_POLLS,
    ContractWatcher,
    Settling,
    Stamp,
    StillChanging,
    file_stamps,
    load_settled,
    quiet_for,
    read_settled,
)
from processor.gates.budget import admission_item, apply_verdict, release_item
from processor.gates.parse import Limits
from processor.identity import Verifier
from processor.kafka.offsets import (
    first_offsets,
    records_of,
    rewind,
    rewind_to,
    source_record,
    span,
)
from processor.kafka.produce import send
from processor.metrics import BatchTally, Metrics, tally
from processor.model import (
    Decision,
    FieldError,
    Gate,
    Outcome,
    TaxonomyClass,
)
from processor.pipeline import Gates, decide_batch, internal_error, parked_internal_error
from processor.policy import load_policy
from processor.results import (
    ADMITTED,
    ResultInput,
    compensation_plan,
    held_rejection,
    is_compensation,
    parse_result,
    propose_compensation,
    refused_compensation,
    settle_item,
    stale_compensation,
)
from processor.state.admission import (
    AdmissionStore,
    Item,
    comp_failed_item,
    lapse_item,
    void_item,
    withdraw_item,
)
from processor.state.approvals import ApprovalStore, OpResult, retain_ms
from processor.state.connection import REDIS_ERRORS, connect, is_script_error, tenant_tag
from processor.state.references import ReferenceLoader, ReferencesLoading, ReferenceStore

logger = logging.getLogger(__name__)


Output = tuple[str, bytes | None, bytes | None, list[tuple[str, str | bytes | None]] | None]
"""A record a batch's transaction writes: topic, key, value, headers."""


CALL_BOUND_S = 45.0
"""The longest a transactional call (given 30 s of its own) may take before its producer
is given up as stuck."""
SETTLE_BOUND_S = 150.0
"""The longest a batch's commit may take on the committer thread: offsets (30 s), commit
retries until the transaction's timeout and one more attempt (30 s), and the abort
(30 s), with room to spare."""


MAX_STUCK_PRODUCERS = 4
"""Producers left stuck inside librdkafka at once before the processor gives up."""


class StuckForGood(RuntimeError):
    """Too many producers are stuck inside librdkafka: the process exits, and its
    supervisor starts a clean one (which resumes from the committed offsets)."""


class Fenced(Exception):
    """Another instance took over this producer's transactional id, the consumer failed
    for good (a static member fenced by its own rejoin after a broker restart), or it
    could not seek back to a batch to be read again: the clients are rebuilt from the
    committed offsets."""


@dataclass(eq=False)
class _Batch:
    """A decided batch, handed to the committer thread for its transaction."""

    size: int
    firsts: list[TopicPartition]
    """Each partition's first record: where its records are read again if it aborts."""
    tally: BatchTally
    """What the metrics count of its decisions, once it committed (the records and
    decisions themselves are not kept: the next batch is decided meanwhile)."""
    admitted: list[tuple[str, Item]]
    """Its admission items: their replay markers are dropped once it committed."""
    group: Any
    """The consumer group metadata its offsets are committed under."""
    offsets: list[TopicPartition]
    """One past each partition's last record: what its transaction commits."""
    offsets_sent: bool
    """Whether its offsets are in the transaction already (else the committer sends them)."""
    producer: Producer
    started: float
    finished: float = 0.0
    outcome: Future[KafkaException | Fenced | None] = field(default_factory=Future)


def stop_on_signals() -> tuple[threading.Event, threading.Event]:
    """Events set by SIGTERM/SIGINT (stop) and SIGHUP (check the contracts, keys, policy
    and approvers at once).

    Installed first thing, so a signal that arrives while the processor is
    still starting is neither lost nor (for SIGHUP) fatal."""
    stop, reload = threading.Event(), threading.Event()

    def on_stop(signum: int, frame: FrameType | None) -> None:
        logger.info("signal %s: finishing the current batch, then stopping", signum)
        stop.set()

    def on_hup(signum: int, frame: FrameType | None) -> None:
        logger.info("SIGHUP: checking the contracts, keys, policy and approvers")
        reload.set()

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGHUP, on_hup)
    return stop, reload


class DependencyDown(Exception):
    """Redis could not answer, or its reference data is being loaded: the batch is rewound
    and retried, nothing is let through."""

    def __init__(self, message: str, dependency: str = "redis") -> None:
        super().__init__(message)
        self.dependency = dependency


def consumer_config(settings: Settings, subscription: Sequence[str] = ()) -> dict[str, Any]:
    """The consumer's settings; ``subscription`` is the topics it will subscribe to."""
    conf = settings.client_config(
        **{
            "auto.offset.reset": "earliest",
            "session.timeout.ms": 10000,
            "heartbeat.interval.ms": 1000,
            "statistics.interval.ms": 5000,
            "fetch.wait.max.ms": 50,
            # librdkafka prefetches up to 64 MiB per client by default; a batch is
            # at most batch_max_records (about 1.5 MiB of proposals), so 4 MiB keeps a
            # backlog from bloating RSS (8 MiB measured 9 MB more peak RSS and no more
            # throughput). Once that queue is full, fetching pauses for
            # fetch.queue.backoff.ms, by default a whole second: the queue then ran dry
            # and throughput halved. 20 ms refills it as batches drain.
            "queued.max.messages.kbytes": 4096,
            "fetch.queue.backoff.ms": 20,
        }
    )
    if settings.static_membership:
        # A restarted instance reclaims its partitions at once, without a rebalance. The
        # broker hands a returning static member its previous assignment, even when it
        # now subscribes to more topics (a new release): the id carries a digest of the
        # subscription, so a changed one joins as a new member and is assigned afresh
        # (the old member's partitions move once its session times out).
        digest = hashlib.sha256(",".join(sorted(subscription)).encode()).hexdigest()[:8]
        conf["group.instance.id"] = f"{settings.instance_id}.{digest}"
    conf.update(settings.consumer)
    fixed = {
        "group.id": settings.group_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "isolation.level": "read_committed",
    }
    return enforce(conf, fixed, "consumer")


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
        }
    )
    conf.update(settings.producer)
    fixed = {
        "transactional.id": settings.transactional_id,
        "enable.idempotence": True,
        "acks": "all",
        # A run's outputs land where a Java producer, and the agent's client, put the
        # run's records: per-run order holds across them.
        "partitioner": "murmur2_random",
    }
    return enforce(conf, fixed, "producer")


MESSAGE_MAX_BYTES = 1_000_000
"""librdkafka's own message.max.bytes, where the settings give none."""
RECORD_OVERHEAD = 4096
"""Room left under message.max.bytes for the headers and record overhead."""


def max_output_bytes(settings: Settings) -> int:
    """The largest key and value the processor produces together: librdkafka's
    message.max.bytes, less room for the headers and record overhead it counts too.
    Replay encodes against it."""
    conf = producer_config(settings)
    return int(conf.get("message.max.bytes", MESSAGE_MAX_BYTES)) - RECORD_OVERHEAD


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
        contracts_stamp = None
        if contracts is None:
            contracts, contracts_stamp = load_settled(
                settings.contracts_dir, settings.contracts_poll_s
            )
        self.contracts = contracts
        self.metrics = metrics or Metrics()
        self.limits = Limits(
            settings.max_record_bytes, settings.max_arguments_bytes, settings.max_arguments_depth
        )
        self._stop = stop_requested or threading.Event()
        self._assigned: set[tuple[str, int]] = set()
        self._committed_at: dict[tuple[str, int], int] = {}
        """Where each assigned partition's committed work ends (the lag's base)."""
        self.batches_committed = 0
        self.records_committed = 0
        self.metrics.contract_set.labels(self.contracts.fingerprint, str(len(self.contracts))).set(
            1
        )
        self.watcher = ContractWatcher(
            settings.contracts_dir, self.contracts, self.metrics, settings.contracts_poll_s,
            reload_requested, contracts_stamp,
        )  # fmt: skip
        trust_files = _trust_files(settings)

        def trust_stamp() -> Stamp:
            return file_stamps((str(f), f) for f in trust_files)

        poll_s = settings.contracts_poll_s
        # Held to what a reload is, as the contracts are: a processor started while a key
        # rotation or a policy change is written does not run with half of it.
        self.gates, trust_taken = read_settled(
            trust_stamp,
            lambda: self._load_trust(self.contracts),
            poll_s,
            lambda stamp: quiet_for(poll_s, stamp, time.time()),
            time.sleep,
            lambda: StillChanging(
                f"the keys, policy or approvers files did not hold still for a poll "
                f"({poll_s:g} s) within {FIRST_READ_POLLS} polls: still being written"
            ),
        )
        self._trust = Settling(trust_stamp, trust_taken)
        self._trust_checked = time.monotonic()
        self._trust_forced = 0
        """The watcher's count of forced checks when the trust files were last forced."""
        self.redis = connect(settings.redis_url, socket_timeout=5, socket_connect_timeout=2)
        self.references = ReferenceStore(
            self.redis, settings.redis_namespace, settings.reference_group_id,
            settings.topics.reference,
        )  # fmt: skip
        self.approval_store = ApprovalStore(self.redis, settings.redis_namespace)
        self.loader = ReferenceLoader(settings, self.redis, self.metrics)
        self.sweeper = ExpirySweeper(settings, self.approval_store, self.metrics, self._stop)
        self._redis_backoff = 0.0
        self._early_limit_s = settings.transaction_timeout_ms / 1000 / 3
        """The longest a batch may take to decide inside the transaction opened for it."""
        self._max_message_bytes = max_output_bytes(settings)
        consumer_config(settings)  # an unsafe pass-through setting stops it here, not in run()
        self._inflight: _Batch | None = None
        """The batch whose transaction the committer thread runs, if any."""
        self._rebalanced = False
        """Set by the rebalance callbacks: the records in hand are read again."""
        self._stuck_producers: list[tuple[Producer, Future[Any]]] = []
        """Producers given up inside a librdkafka call, with that call's outcome."""
        self.admission = AdmissionStore(self.redis, settings.redis_namespace)
        self._admitted: list[tuple[str, Item]] = []
        """Admission items of the batch being decided; their replay markers go once it
        commits."""
        self._events: Counter[tuple[str, ...]] = Counter()
        """What deciding the batch in hand did besides its decisions (see BatchTally)."""
        self._parked: list[tuple[str, str, str]] = []
        """(tenant, request id, position) of the calls the batch in hand parked."""
        self._decided: list[Decision] = []
        """The decisions of the records being decided (admission's answers to releases and
        refused compensations change them in place): what a record that then fails alone
        would have answered (see _parked_answer)."""
        self._to_forget: list[tuple[str, Item]] = []
        """Items of committed batches whose markers the next admission call drops."""
        self._unread: list[TopicPartition] | None = None
        """Partitions assigned whose replay markers are still to be read (see _read_markers)."""

    # -- lifecycle -------------------------------------------------------------------------

    def stop(self, *_: Any) -> None:
        """Finish the batch in hand, commit it, close. Safe from a signal handler."""
        self._stop.set()

    def run(self) -> None:
        # Contracts, validators and clients live as long as the process: keep them out of
        # the collector's way, and collect the young generation less often, since a batch
        # allocates many short-lived objects and almost no cycles (refcounting frees them).
        gc.collect()
        gc.freeze()
        gc.set_threshold(10_000, 20, 20)
        self.watcher.start()
        self.loader.start()
        self.sweeper.start()
        try:
            while not self._stop.is_set():
                try:
                    self._run_clients()
                except Fenced as exc:
                    logger.warning("%s; rebuilding clients from committed offsets", exc)
                    time.sleep(0.5)
        finally:
            self._stop.set()  # also on an unexpected error: the sweeper waits for it
            self.watcher.stop()
            self.loader.stop()
            self.sweeper.join()

    def _load_trust(self, contracts: ContractSet) -> Gates:
        """Keys, policy and approvers, read from their files (raises if one is unusable)."""
        verifier = Verifier.from_settings(self.settings.identity)
        self.metrics.identity_development.set(1 if verifier.development else 0)
        return Gates(
            contracts,
            self.limits,
            verifier,
            load_policy(self.settings.policy_file),
            load_approvers(self.settings.approvers_file),
        )

    def reload_trust(self, force: bool = False) -> bool:
        """Re-read the identity keys, the policy and the approvers when one of their files
        changed (rotated keys, a new approver, a tighter policy), as contracts are: only
        between batches, once the change has settled (see ``Settling``), all or nothing,
        the old ones kept if the new ones are unusable. Checked every ``contracts_poll_s``;
        ``force``, or a SIGHUP since the last check, reads at once. True when a new set was
        taken."""
        forced = self.watcher.forced
        if forced != self._trust_forced:
            self._trust_forced, force = forced, True
        now = time.monotonic()
        if not force and now - self._trust_checked < self.settings.contracts_poll_s:
            return False
        self._trust_checked = now
        stamp = self._trust.due(force)
        if stamp is None:
            return False
        try:
            gates: Gates | Exception = self._load_trust(self.contracts)
        except Exception as exc:
            gates = exc
        if not self._trust.held(stamp):
            if force:
                self.metrics.trust_reloads.labels("refused").inc()
                logger.error("keys/policy/approvers reload refused, keeping the old ones: "
                             "their files changed while being read")  # fmt: skip
            else:
                logger.info("keys/policy/approvers changed while being read; reading again")
            return False
        if isinstance(gates, Exception):
            self.metrics.trust_reloads.labels("refused").inc()
            logger.error("keys/policy/approvers reload refused, keeping the old ones: %s", gates)
            return False
        self.gates = gates
        self.metrics.trust_reloads.labels("loaded").inc()
        logger.info("keys, policy and approvers reloaded (%d keys)", len(gates.verifier.keys))
        return True

    def _swap_contracts(self, consumer: Consumer) -> None:
        """Take newly loaded trust files and contracts; only ever between batches, and a
        new contract set only once the batch in flight (encoded under the old set's
        fingerprint) is done."""
        self.reload_trust()
        if not self.watcher.has_pending():
            return
        self._settle_inflight(consumer)
        loaded = self.watcher.take()
        if loaded is None:
            return
        old = self.contracts
        self.contracts = loaded
        self.gates = self.gates.with_contracts(loaded)
        self.metrics.contract_set.remove(old.fingerprint, str(len(old)))
        self.metrics.contract_set.labels(loaded.fingerprint, str(len(loaded))).set(1)

    # -- the loop --------------------------------------------------------------------------

    def _run_clients(self) -> None:
        s = self.settings
        # New clients own nothing until assigned: a consumer that failed for good may close
        # without its revoke callback, and its partitions would stay counted (and lagging).
        self._assigned.clear()
        self._committed_at.clear()
        self._unread = None
        self._count_assigned()
        self.metrics.consumer_lag.clear()
        with contextlib.ExitStack() as stack:
            producer = Producer({**producer_config(s), "error_cb": self._on_kafka_error})
            stack.callback(_drain, producer)
            self._retry_kafka("init_transactions", lambda: producer.init_transactions(30))
            topics = [s.topics.proposals, s.topics.approvals, s.topics.results]
            consumer = Consumer(
                {
                    **consumer_config(s, topics),
                    "stats_cb": self._on_stats,
                    "error_cb": self._on_kafka_error,
                }
            )
            stack.callback(consumer.close)
            # Runs first on the way out (signal, fencing, error): the batch in flight
            # commits or aborts before the clients close.
            stack.callback(self._settle_inflight, consumer)
            consumer.subscribe(
                topics,
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
                self._swap_contracts(consumer)
                # Block only for the first record, then take whatever else is already
                # fetched: idle batches are small (low latency), busy ones big (the
                # commit is amortised), without a fixed wait for a full batch.
                first = consumer.poll(s.batch_wait_s)
                if first is None:
                    self._settle_inflight(consumer)
                    continue
                messages = [first, *consumer.consume(s.batch_max_records - 1, 0)]
                self._process_batch(consumer, producer, messages)

    def _process_batch(
        self,
        consumer: Consumer,
        producer: Producer,
        messages: list[Message],
    ) -> None:
        """Decide a batch while the previous one commits, then hand it to the committer."""
        started = time.perf_counter()
        try:
            records = records_of(messages, self._on_kafka_error)
        except KafkaException as exc:  # the consumer failed for good
            raise Fenced(f"consumer failed: {exc.args[0].str()}") from exc
        if self._rebalanced:
            # A rebalance ran inside poll()/consume() while these records were in hand:
            # some may belong to a partition just revoked, and the batch in flight may
            # have aborted in the callback (rewinding its partitions to before these).
            # Read them again under the new assignment.
            self._rebalanced = False
            # (a seek refused here is of a partition just assigned again, which starts from
            # its committed offsets, before these records, anyway: nothing to rebuild)
            rewind(consumer, records, self._assigned)
            return
        if not records:
            return
        # A batch smaller than the maximum means the processor keeps up: latency is what
        # counts, and the batch is committed before anything more is read (see below).
        # With no transaction in flight, its transaction opens now and its offsets go to
        # the broker while it is decided (they are known once it is read; all of it
        # commits or none). A full batch means a backlog: this thread's time is the
        # limit, so the committer thread sends the offsets with the commit while this one
        # decides the next batch.
        keeping_up = len(records) < self.settings.batch_max_records
        # Not while Redis is being waited out: every retry would open a transaction only to
        # abort it.
        early = keeping_up and self._inflight is None and not self._redis_backoff
        group = consumer.consumer_group_metadata()
        firsts, offsets = span(records)

        def send_offsets() -> Future[None]:
            return self._start_bounded(
                "send_offsets_to_transaction",
                lambda: producer.send_offsets_to_transaction(offsets, group, 30),
            )

        offsets_sent: Future[None] | None = None
        if early:
            try:
                producer.begin_transaction()
            except KafkaException as exc:
                self._failed_transaction(consumer, producer, records, exc)
                return
            offsets_sent = send_offsets()
        self.admission.take_redeliveries()  # (a batch decided before, then rewound)
        try:
            self._read_markers(consumer)
            decisions = self.decide_batch(records)
            outputs = self.encode_batch(records, decisions)
            outputs += self._redelivered()
        except DependencyDown as exc:
            if offsets_sent is not None:
                self._abandon(producer, offsets_sent)
            if self._settle_inflight(consumer, records):
                self._wait_for_redis(consumer, records, exc)
            return
        except BaseException:
            if offsets_sent is not None:
                self._abandon(producer, offsets_sent)
            raise
        self._redis_backoff = 0.0
        if offsets_sent is not None and time.perf_counter() - started > self._early_limit_s:
            # Deciding took long (a slow Redis, a batch split around a defect): what is left
            # of the transaction's timeout might not see it committed, and the same slow
            # decision would be rewound and repeated. The transaction holds only offsets so
            # far: it is dropped and a fresh one carries the batch.
            self._abandon(producer, offsets_sent)
            offsets_sent = None
        if not self._settle_inflight(consumer, records):
            return  # the previous batch aborted: both were rewound, and are decided again
        try:
            if offsets_sent is None:
                producer.begin_transaction()
                if keeping_up:
                    offsets_sent = send_offsets()
            if offsets_sent is not None:
                self._await_bounded(producer, "send_offsets_to_transaction", offsets_sent)
            for topic, key, value, headers in outputs:
                send(producer, topic, key, value, headers)
        except KafkaException as exc:
            self._failed_transaction(consumer, producer, records, exc)
            return
        topics = self.settings.topics
        counted = tally(decisions, (topics.approvals, topics.results))
        counted.events, self._events = self._events, Counter()
        batch = _Batch(
            len(records),
            firsts,
            counted,
            self._admitted,
            group,
            offsets,
            offsets_sent is not None,
            producer,
            started,
        )
        self._admitted = []
        threading.Thread(
            target=self._transact, args=(producer, batch), name="toolsentry-txn", daemon=True
        ).start()
        self._inflight = batch
        if keeping_up:
            # Deciding early would only form a small batch that then waits behind this
            # commit, while the records arriving meanwhile wait behind both.
            self._settle_inflight(consumer)

    def _failed_transaction(
        self, consumer: Consumer, producer: Producer, records: list[Message], exc: KafkaException
    ) -> None:
        """A batch's transaction failed before its commit: abort, rewind, and stop the
        clients if the producer is fenced."""
        failure = self._abort(producer, exc)
        self._rewind(consumer, records)
        if isinstance(failure, Fenced):
            raise failure from exc

    def _transact(self, producer: Producer, batch: _Batch) -> None:
        """The committer thread: the rest of a batch's transaction, whose records are
        produced, and its outcome set on the batch. It waits on the broker, releasing
        the interpreter to the loop's thread, which decides the next batch meanwhile."""
        failure: KafkaException | Fenced | None = None
        try:
            if not batch.offsets_sent:
                producer.send_offsets_to_transaction(batch.offsets, batch.group, 30)
            faults.point("before_commit")
            self._commit(producer)
            batch.finished = time.perf_counter()
        except KafkaException as exc:
            failure = self._abort(producer, exc)
        except BaseException as exc:  # a defect: re-raised on the loop's thread
            with contextlib.suppress(KafkaException):
                producer.abort_transaction(30)
            batch.outcome.set_exception(exc)
            return
        batch.outcome.set_result(failure)

    def _settle_inflight(self, consumer: Consumer, after: list[Message] | None = None) -> bool:
        """Wait for the batch in flight. False when its transaction aborted: it is rewound,
        and so is ``after`` (a batch decided meanwhile), to be decided again."""
        batch, self._inflight = self._inflight, None
        if batch is None:
            return True
        try:
            failure = batch.outcome.result(SETTLE_BOUND_S)
        except FutureTimeout:
            failure = self._stuck(
                batch.producer, batch.outcome, "the batch's commit", SETTLE_BOUND_S
            )
        if failure is None:
            self._to_forget += batch.admitted
            for tp in batch.offsets:
                self._committed_at[(tp.topic, tp.partition)] = tp.offset
            self.batches_committed += 1
            self.records_committed += batch.size
            self.metrics.transactions.labels("committed").inc()
            self.metrics.record_tally(batch.tally, batch.finished - batch.started)
            return True
        failed = rewind_to(consumer, [*batch.firsts, *first_offsets(after or [])], self._assigned)
        if isinstance(failure, Fenced):
            raise failure
        if failed:
            raise _unrewound(failed)
        return False

    def _on_kafka_error(self, err: KafkaError) -> None:
        """Kafka errors, client-wide (brokers unreachable, all brokers down) or the
        consumer's: counted and logged. The clients recover by themselves, or the calls
        that need the broker fail and are handled where they are made; a consumer that
        failed for good is rebuilt (``records_of`` raises)."""
        self.metrics.dependency_errors.labels("kafka").inc()
        logger.warning("kafka: %s", err)

    def decide_batch(self, records: list[Message]) -> list[Decision]:
        """Decide every record of a batch: proposals through the gates, executors' results
        against their calls, approval decisions against their parked calls. Redis is asked
        once for reference data, once for admission (idempotency, limits, budgets) and
        once for approvals, each a single round trip for the whole batch.

        Each gate answers a record it cannot decide as an internal error by itself; a
        defect in the batch's own steps (admission, results, approvals) would otherwise
        stop the consumer on that batch for good. The batch is then split in halves, each
        decided again, down to the records that fail alone: those are answered as
        internal errors (nothing of theirs routed, fail closed; an approval record that
        ended a parked call's request so answers that call's proposal, see _parked_answer),
        the others as they would have been, in order; Redis gives them the verdicts it
        gave the batch (admission is replay-safe by input position). One such record costs
        about 2·log2(batch) more round trips, not one per record.
        """
        try:
            return self._decide(records)
        except DependencyDown:
            raise
        except Exception as exc:
            if len(records) == 1:
                m = records[0]
                logger.exception("record %s/%s@%s could not be decided",
                                 m.topic(), m.partition(), m.offset())  # fmt: skip
                # Its markers stay in _admitted: they go once the batch commits.
                voided = self._void()
                self._events = Counter()
                answer = self._parked_answer(m, exc)
                d = answer or self._internal_error(m, exc)
                if (voided or answer) and is_compensation(d.proposal):
                    # The processor's own compensation (admission took it under the key
                    # the original's record names, or its request ended): it will not be
                    # proposed again.
                    d.extra[ADMITTED] = True
                    refused_compensation(d)
                    _ending(self.admission.apply, _compensation_failed(d))
                return [d]
            logger.warning("a batch of %d records could not be decided (%s: %s); deciding "
                           "its halves", len(records), type(exc).__name__, exc)  # fmt: skip
        half = len(records) // 2
        first = self.decide_batch(records[:half])
        admitted, events, parked = self._admitted, self._events, self._parked
        second = self.decide_batch(records[half:])
        self._admitted, self._events = admitted + self._admitted, events + self._events
        self._parked = parked + self._parked
        self._count("batch_splits")
        return first + second

    def _void(self, at: str | None = None) -> bool:
        """End what the record that just failed alone (or the one at position ``at``) left
        in Redis waiting for it: the idempotency record its call took (FAILED_RETRYABLE:
        nothing ran) and the approval request it parked (so no expiry answers it a second
        time). Its step stays counted: it was a step of its run. The release an approval
        record admitted is undone so: the call it released was never routed, and what
        parking that call took comes back (its park's step stays). True when a call had
        been admitted, or released (and is now voided).

        The request goes first: should Redis fail between the two, the batch is decided
        again with the call still admitted, and parks it again."""
        now_ms = int(time.time() * 1000)
        ends = [(t, {"op": "void", "rid": rid, "pos": pos, "now": now_ms})
                for t, rid, pos in self._parked if at in (None, pos)]  # fmt: skip
        voids = [
            (t, v)
            for t, item in self._admitted
            if at in (None, item["pos"]) and (v := void_item(item)) is not None
        ]
        _ending(self.approval_store.apply, ends)
        verdicts = _ending(self.admission.apply, voids)
        return any(v.get("status") == "voided" for v in verdicts)

    def _parked_answer(self, m: Message, exc: Exception) -> Decision | None:
        """The answer of an approval record that failed alone after it was decided, when
        its decision answered a parked proposal (released it, declined it, let it expire,
        refused it at release, or told it its key went ahead): that proposal, whose
        request has ended, is told of the internal error instead, else nothing would ever
        answer it. Nothing runs: a release admitted is voided (see _void), and an ended
        request's lapse gave back what parking took. None for any other record, which the
        DLQ keeps as before."""
        if m.topic() != self.settings.topics.approvals or len(self._decided) != 1:
            return None
        answer = self._decided[0]
        if answer.proposal is None or answer.outcome not in (Outcome.ROUTED, Outcome.REJECTED):
            return None
        return parked_internal_error(answer, int(time.time() * 1000), exc)

    def _internal_error(self, m: Message, exc: Exception) -> Decision:
        src = source_record(m)
        topics = self.settings.topics
        if src.topic == topics.results:
            return dead_letter(src, "internal_error", type(exc).__name__, Gate.RESULT)
        if src.topic == topics.approvals:
            return dead_letter(src, "internal_error", type(exc).__name__)
        return internal_error(src, self.limits, int(time.time() * 1000), exc)

    def _decide(self, records: list[Message]) -> list[Decision]:
        now_ms = int(time.time() * 1000)
        self._admitted, self._events, self._parked, self._decided = [], Counter(), [], []
        srcs = [source_record(m) for m in records]
        topics = self.settings.topics
        proposals = [s for s in srcs if s.topic not in (topics.approvals, topics.results)]
        try:
            decided = iter(decide_batch(proposals, self.gates, now_ms, self.references.lookup))
            slots: list[Decision | ApprovalInput | ResultInput] = []
            for src in srcs:
                if src.topic == topics.approvals:
                    item = parse_approval_record(src)
                    slots.append(dead_letter(src, item) if isinstance(item, str) else item)
                elif src.topic == topics.results:
                    res = parse_result(src, self.contracts)
                    slots.append(
                        dead_letter(src, "result_invalid", res, Gate.RESULT)
                        if isinstance(res, str)
                        else res
                    )
                else:
                    slots.append(next(decided))
            decisions = self._settle(self._admit(slots, now_ms), now_ms)
            self._decided = decisions
            self._admit_releases(decisions, now_ms)
            failed: list[tuple[str, Item]] = []
            for d in decisions:
                if d.outcome is Outcome.REJECTED and is_compensation(d.proposal):
                    failed += _compensation_failed(refused_compensation(d))
            # Only batches that refuse a compensation pay this round trip.
            self.admission.apply(failed)
            faults.point("after_redis")
            faults.poison(s.value for s in srcs)
            return decisions
        except REDIS_ERRORS as exc:
            if is_script_error(exc):
                raise  # a defect in a script, met again by waiting: the batch is split
            raise DependencyDown(f"redis: {exc}") from exc
        except ReferencesLoading as exc:
            raise DependencyDown(f"reference data: {exc}", "reference_data") from exc

    def _admit(
        self, slots: list[Decision | ApprovalInput | ResultInput], now_ms: int
    ) -> list[Decision | ApprovalInput]:
        """Idempotency, rate limits, budgets and guards for the batch's proposals, and the
        settling of its results: one script call per tenant, one round trip."""
        items: list[tuple[str, Item]] = []
        owners: list[tuple[int, Any, Any]] = []
        policy, verifier = self.gates.policy, self.gates.verifier
        for i, x in enumerate(slots):
            if isinstance(x, Decision):
                contract = (
                    self.contracts.get(x.contract_name, x.contract_version)
                    if x.contract_name and x.contract_version
                    else None
                )
                budgets = policy.budgets_for(x.principal.tenant_id) if x.principal else None
                item = admission_item(x, contract, budgets, now_ms) if budgets else None
                extra: Any = (contract, budgets)
                if item is None and (
                    waiting := self.admission.call_waiting_at(pos := position(x.source))
                ):
                    # Nothing to admit (its token no longer verifies: it expired, or the
                    # keys were rotated; or it no longer reads as a proposal: the limits
                    # changed); but a call admitted at this position before, in a
                    # transaction that aborted, must give back what it took. (Its tenant
                    # was its token's, which is the proposal's: named by it, where it
                    # still reads, so that the batch's items of that tenant stay one
                    # script call.)
                    p, run = x.proposal, ""
                    tenant: str = waiting
                    if p is not None and p.tenant_id and tenant_tag(p.tenant_id) == waiting:
                        tenant, run = p.tenant_id, p.run_id
                    item = withdraw_item(tenant, pos, run, now_ms)
                    extra = _WITHDRAWN
            elif isinstance(x, ResultInput):
                comp, unsigned = compensation_plan(x, self.contracts, verifier)
                item = settle_item(x, position(x.src), comp, unsigned, self._max_message_bytes)
                extra = comp
            else:
                continue
            if item is not None:
                items.append(item)
                owners.append((i, x, extra))
        verdicts = self.admission.apply(items, forget=self._to_forget)
        self._to_forget = []
        self._admitted = items
        out: list[Decision | ApprovalInput | ResultInput] = list(slots)
        for (i, x, extra), v in zip(owners, verdicts, strict=True):
            if extra is _WITHDRAWN:
                continue
            if isinstance(x, Decision):
                contract, budgets = extra
                out[i] = apply_verdict(x, v, budgets, contract)
                if v.get("why") == "approval_reused":
                    self._count("approvals", "reused")
                if is_compensation(x.proposal):
                    x.extra[ADMITTED] = True
                continue
            status = str(v.get("status"))
            self._count("results", x.state, status)
            if status in ("duplicate", "superseded"):
                # A copy of a result already settled, or the result of an attempt of the
                # same proposal the key has moved on from (the later attempt's result
                # answers it; the handler, idempotent under the key, gives the same
                # answer), a copy of its failure held for the later attempt included, once
                # a result has answered the proposal. Counted, not answered twice. (An
                # earlier attempt that completed after the key moved on from it, or failed
                # after committed steps with no later attempt able to meet them, settles
                # the key: "settled", below.)
                out[i] = ignored(x.src, f"result_{status}")
                continue
            if status == "unknown":
                # No call this processor routed has the key: a result from elsewhere, or a
                # forged one. Nothing it says reaches a model; the DLQ keeps it for an operator.
                detail = "no idempotency record for the result's key"
                out[i] = _result_dead_letter(x, "result_unknown_call", detail)
                continue
            if status == "held":
                # An earlier attempt failed after committing steps while a later attempt
                # of the call is routed and may run it: that attempt, idempotent under the
                # key, meets those steps, and its result answers the proposal (a
                # compensation proposed now could undo what it completes). The record
                # keeps the failure with its attempt, and its record, delivered again if
                # that attempt is given back without running (see _redelivered); the DLQ
                # shows it to an operator, since the later attempt may still end without
                # meeting those steps.
                out[i] = _result_dead_letter(x, *_HELD)
                continue
            if status == "conflict":
                # Its attempt's first result reported another outcome: one of the two is
                # false, and the first stands (see _conflicting_result).
                out[i] = _conflicting_result(x, v)
                continue
            if status in _RESULTS_REFUSED:
                # A result that is not its call's (another tool, version, payload or run
                # than the call's record holds), or one for a call that never ran (parked,
                # or its approval request ended without it going): settling it would show
                # a model an answer, or propose a compensation, for something that did not
                # happen as it says. The record is left as it was; the DLQ keeps it.
                out[i] = _result_dead_letter(x, *_RESULTS_REFUSED[status])
                continue
            if v.get("held"):
                # Its attempt did not finish the call, and an earlier one's failure after
                # committed steps was held for it: those steps stand (as Redis recorded).
                x.decision.rejection = held_rejection(x.decision)
            elif extra and status == "settled":
                propose_compensation(x, extra, v, verifier)
            elif extra and status == "stale":
                stale_compensation(x.decision)
            out[i] = x.decision
        for i, x in enumerate(out):
            if isinstance(x, ResultInput):  # a result nobody asked about: still answered
                out[i] = x.decision
        return cast("list[Decision | ApprovalInput]", out)

    def _admit_releases(self, decisions: list[Decision], now_ms: int) -> None:
        """A parked call released by its approvers takes over its idempotency record,
        unless a resubmission carrying approvals already did (then it is not routed
        twice). Only batches with releases pay this round trip."""
        released = [
            (k, d) for k, d in enumerate(decisions)
            if d.outcome is Outcome.ROUTED and d.gate is Gate.APPROVAL and d.call is not None
        ]  # fmt: skip
        if not released:
            return
        items = [release_item(d) for _, d in released]
        for (k, d), v in zip(released, self.admission.apply(items), strict=True):
            if v.get("why") in _ANSWERED_ALREADY:
                # Given back before its release (its proposal was answered on that replay),
                # or this very proposal, sent again with approvals attached, took the key
                # over and was answered by its own observations: not a second time, and
                # nothing runs (see _end_requests).
                decisions[k] = dead_letter(d.source, *_ANSWERED_ALREADY[v["why"]])
            elif v.get("ok") is not True:
                # Superseded: the key went ahead as another proposal; this one is told so,
                # as a rejection or an expiry of its request would tell it (see
                # _end_requests). Voided: released before, and its approval record then
                # failed alone on a defect (see _void): answered as that failure was.
                # Anything else is a replay of a position first decided as the request's
                # end (see admission.lua): changed, and nothing runs.
                why = v.get("why")
                verdict = _SUPERSEDED if why == "superseded" else _REPLAY_CHANGED
                apply_verdict(d, v if why == "voided" else verdict,
                              self.gates.policy.budgets, None)  # fmt: skip
            elif d.call is not None and v.get("attempt"):
                d.call.attempt = int(v["attempt"])
        self._admitted += items

    def _settle(self, slots: list[Decision | ApprovalInput], now_ms: int) -> list[Decision]:
        """Spend approvals, park calls and apply approval decisions, replay-safely."""
        wanted = [
            (x.tenant_id, x.request_id)
            for x in slots
            if isinstance(x, ApprovalInput) and x.kind != EXPIRY_CHECK
        ]
        entries = self.approval_store.entries(wanted)
        out: list[Decision | None] = [x if isinstance(x, Decision) else None for x in slots]
        ops: list[tuple[str, dict[str, Any]]] = []
        owners: list[int] = []
        for i, x in enumerate(slots):
            if isinstance(x, ApprovalInput):
                op = self._approval_op(x, entries, out, i, now_ms)
            else:
                op = _proposal_op(x, now_ms)
                if op is not None and op[1]["op"] == "park":
                    self._parked.append((op[0], op[1]["rid"], op[1]["pos"]))
            if op is not None:
                ops.append(op)
                owners.append(i)
        ended: list[tuple[int, ApprovalInput, OpResult]] = []
        released: list[tuple[int, ApprovalInput, OpResult]] = []
        for i, result in zip(owners, self.approval_store.apply(ops), strict=True):
            x = slots[i]
            if isinstance(x, ApprovalInput):
                if result.status in ("rejected", "expired") and result.entry is not None:
                    ended.append((i, x, result))
                elif result.status == "released" and result.entry is not None:
                    released.append((i, x, result))
                else:
                    out[i] = self._approval_outcome(x, result, now_ms)
                continue
            if x.outcome is Outcome.PARKED:
                self._count("approvals", "requested")
        refused = self._release(released, out, now_ms) if released else []
        if ended or refused:
            self._end_requests(ended, refused, out, now_ms)
        return [d for d in out if d is not None]

    def _release(
        self,
        released: list[tuple[int, ApprovalInput, OpResult]],
        out: list[Decision | None],
        now_ms: int,
    ) -> list[tuple[int, ApprovalInput, OpResult]]:
        """Calls their approvers released, checked again against the world before they go
        (recheck_release): one reference lookup for all of the batch's releases. A call
        refused now is told why and does not run (returned, for what parking it took to be
        given back with the ended requests'); its record waits out its deadline, as a
        declined call's does."""
        entries = [r.entry for _, _, r in released if r.entry is not None]
        keys = {k for e in entries for k in release_keys(e, self.gates, now_ms)}
        answers = self.references.lookup(keys) if keys else {}
        refused: list[tuple[int, ApprovalInput, OpResult]] = []
        for i, item, result in released:
            assert result.entry is not None
            refusal = recheck_release(result.entry, self.gates, answers, now_ms)
            if refusal is None:
                out[i] = self._approval_outcome(item, result, now_ms)
            else:
                self._count("approvals", "refused_at_release")
                out[i] = refused_release(item.src, result.entry, refusal, now_ms)
                refused.append((i, item, result))
        return refused

    def _end_requests(
        self,
        ended: list[tuple[int, ApprovalInput, OpResult]],
        refused: list[tuple[int, ApprovalInput, OpResult]],
        out: list[Decision | None],
        now_ms: int,
    ) -> None:
        """Rejected or expired requests. The call is told it was declined, or not approved
        in time, and did not run, and what it took when it was parked is given back,
        unless its key moved on meanwhile. When the agent resubmitted this very proposal
        with approvals attached ("moved_on"), that resubmission was admitted (it ran, or
        runs) and its own observations answer the proposal: the approver's rejection lands
        on the DLQ (\"approval_request_superseded\"), and an expiry changes nothing. So it
        does when the parked call was given back already ("given_back": its batch's
        transaction aborted and its position was decided again as something else, which
        answered its proposal): a rejection lands on the DLQ as
        \"approval_request_withdrawn\". When the key went ahead as another proposal
        ("superseded"), this one has had no final answer: it is told that its call went
        ahead without this request (as a release of the request would tell it), once.

        The calls refused at release (``refused``, answered already with the refusal) give
        back what parking them took in the same round trip: one, only for batches that
        end requests. Their refusal stands unless their key moved on or was given back,
        as above: then it lands on the DLQ instead, as a rejection would."""
        both = [*ended, *refused]
        items = []
        for _, x, r in both:
            assert r.entry is not None  # (an ended or released request names its call)
            items.append(lapse_item(r.entry, position(x.src), now_ms))
        verdicts = self.admission.apply(items)
        self._admitted += items
        for n, ((i, item, result), verdict) in enumerate(zip(both, verdicts, strict=True)):
            status = verdict.get("status")
            ended_here = n < len(ended)  # (else refused at release, and counted as that)
            if status not in ("moved_on", "given_back"):
                if ended_here:
                    answer = self._approval_outcome(item, result, now_ms)
                    if status == "superseded":
                        # (one answer for every end of a request whose key went ahead as
                        # another proposal, its release's included: see _admit_releases)
                        answer = apply_verdict(answer, _SUPERSEDED, self.gates.policy.budgets,
                                               None)  # fmt: skip
                    out[i] = answer
            elif item.kind == EXPIRY_CHECK:
                self._count("approvals", "ignored")
                out[i] = ignored(item.src, "superseded" if status == "moved_on" else "withdrawn")
            else:
                if ended_here:
                    self._count("approvals", "refused")
                reason, detail = _ANSWERED_ALREADY[status]
                out[i] = dead_letter(item.src, reason, f"{item.request_id}: {detail}")

    def _redelivered(self) -> list[Output]:
        """Failures after committed steps held for a later attempt that this batch gave
        back without running (see admission.lua, redeliver_held): each goes back on
        ``tool.results`` as it came, in this transaction, and settles its key when it is
        read (the proposal answered, the compensation it asks for proposed). A header
        names the position it was first read at."""
        out: list[Output] = []
        for r in self.admission.take_redeliveries():
            self._count("results", r.state, "redelivered")
            logger.info("delivering again the failure held at %s (its later attempt was "
                        "given back at %s)", r.of, r.at)  # fmt: skip
            out.append((self.settings.topics.results, r.key, r.value,
                        [(REDELIVERY_OF, r.of.encode())]))  # fmt: skip
        return out

    def _count(self, *event: str) -> None:
        """Count an event of the batch being decided, once it commits (see BatchTally)."""
        self._events[event] += 1

    def _approval_op(
        self,
        item: ApprovalInput,
        entries: dict[tuple[str, str], dict[str, Any] | None],
        out: list[Decision | None],
        i: int,
        now_ms: int,
    ) -> tuple[str, dict[str, Any]] | None:
        """The Redis op for one record of tool.approvals. Time is this processor's clock,
        never the record's timestamp, which whoever produced the record chose."""
        pos = position(item.src)
        if item.kind == EXPIRY_CHECK:
            op = {"op": "expire", "rid": item.request_id, "pos": pos, "now": now_ms}
            return item.tenant_id, op
        entry = entries.get((item.tenant_id, item.request_id))
        if entry is None:
            out[i] = dead_letter(item.src, "approval_unknown_request", item.request_id)
            self._count("approvals", "refused")
            return None
        verified = verify_decision(
            item, entry, self.gates.approvers, now_ms, self.gates.policy.approval_max_lifetime_s
        )
        if isinstance(verified, FieldError):
            out[i] = dead_letter(item.src, verified.code, verified.message)
            self._count("approvals", "refused")
            logger.warning("approval for %s refused: %s", item.request_id, verified.message)
            return None
        op = {
            "op": "decide",
            "rid": item.request_id,
            "approval_id": verified.approval_id,
            "approver": verified.approver_id,
            "key": self.gates.approvers[verified.approver_id].key_print,
            "decision": verified.decision,
            "reason": verified.reason or "",
            "pos": pos,
            "now": now_ms,
            "ttl": retain_ms(verified.expires_ms, now_ms),
            # Earlier votes whose approvers may no longer cast them: they stop counting.
            "drop": revoked_votes(entry, self.gates.approvers),
        }
        return item.tenant_id, op

    def _approval_outcome(self, item: ApprovalInput, result: Any, now_ms: int) -> Decision:
        """What a record of tool.approvals yields. A decision that changes nothing (spent,
        a second vote of one approver, for a request already ended) goes to the DLQ with
        the reason, so every approval an operator sent is accounted for."""
        refused = {
            "reused": "approval_reused",
            "duplicate_approver": "approver_already_counted",
            "ended": "approval_request_ended",
            "unknown": "approval_unknown_request",
        }
        if item.kind != EXPIRY_CHECK and result.status in refused:
            self._count("approvals", "refused")
            return dead_letter(item.src, refused[result.status], item.request_id)
        decision = outcome_decision(item, result, now_ms)
        if decision is None:
            label = "pending" if result.status == "pending" else "ignored"
            self._count("approvals", label)
            return ignored(item.src, result.status)
        self._count("approvals", result.status)
        return decision

    def _wait_for_redis(
        self, consumer: Consumer, records: list[Message], exc: DependencyDown
    ) -> None:
        """Redis is down, or its reference data is being loaded: decide nothing, rewind,
        back off. Lag grows; nothing gets through. (A load is waited out in short steps: it
        is this process's own loader, or another instance's, making progress.)"""
        self.metrics.dependency_errors.labels(exc.dependency).inc()
        longest = 1.0 if exc.dependency == "reference_data" else 5.0
        self._redis_backoff = min(max(self._redis_backoff * 2, 0.2), longest)
        logger.warning("%s; batch rewound, retrying in %.1fs", exc, self._redis_backoff)
        self._rewind(consumer, records)
        self._stop.wait(self._redis_backoff)

    def encode_batch(self, records: list[Message], decisions: list[Decision]) -> list[Output]:
        """Every record the batch's transaction writes, in order."""
        out: list[Output] = []
        for m, d in zip(records, decisions, strict=True):
            self._encode(out, m, d)
        return out

    def _encode(self, out: list[Output], m: Message, d: Decision) -> None:
        topics = self.settings.topics
        fp = self.contracts.fingerprint
        if d.outcome is Outcome.IGNORED:
            return
        if d.outcome is Outcome.DEAD_LETTER:
            out.append((topics.dlq, *dlq_record(m.key(), d, self._max_message_bytes)))
            return
        try:
            outputs = encode_outputs(d, fp, self._max_message_bytes)
        except Exception as exc:
            # Not expected; but a record we cannot encode must neither stop the
            # consumer nor be routed: it is parked in the DLQ with the reason (and an
            # output the broker would refuse would abort the batch for ever).
            # What its admission took in Redis is given back, as for a record that fails
            # alone while it is decided (a DependencyDown here decides the batch again).
            logger.exception("cannot encode the outputs of %s@%s", m.partition(), m.offset())
            unencodable(d, exc)
            self._void(position(d.source))
            out.append((topics.dlq, *dlq_record(m.key(), d, self._max_message_bytes)))
            return
        key = outputs.key
        if outputs.call is not None and d.side_effect_class is not None:
            out.append((topics.execution(d.side_effect_class.value), key, outputs.call, None))
        if outputs.request is not None:
            out.append((topics.approval_requests, key, outputs.request, None))
        if outputs.compensation is not None:
            out.append((topics.proposals, key, outputs.compensation, None))
            self._count("compensations")
        out.append((topics.observations, key, outputs.observation, None))

    def _commit(self, producer: Producer) -> None:
        """Commit, retrying what librdkafka calls retriable, but not past the transaction's
        own timeout (the coordinator aborts it then) nor once a stop was asked for: the
        failure then aborts and rewinds as any other, so a broker outage never holds a
        rebalance callback or a SIGTERM for longer."""
        deadline = time.monotonic() + self.settings.transaction_timeout_ms / 1000
        while True:
            try:
                producer.commit_transaction(30)
                return
            except KafkaException as exc:
                err = exc.args[0]
                if err.retriable() and not self._stop.is_set() and time.monotonic() < deadline:
                    continue
                raise

    def _bounded(self, producer: Producer, what: str, call: Callable[[], None]) -> None:
        """Run a transactional call that librdkafka may never return from, on a thread
        of its own, for at most ``CALL_BOUND_S``: its own timeout is not honoured when
        the group coordinator it cached went away with a restarted broker
        (confluentinc/librdkafka#5456, #5511), and the loop would wait forever."""
        self._await_bounded(producer, what, self._start_bounded(what, call))

    @staticmethod
    def _start_bounded(what: str, call: Callable[[], None]) -> Future[None]:
        """``_bounded``'s call, started: ``_await_bounded`` waits for it."""
        done: Future[None] = Future()

        def run() -> None:
            try:
                call()
                done.set_result(None)
            except BaseException as exc:
                done.set_exception(exc)

        threading.Thread(target=run, name=f"toolsentry-{what}", daemon=True).start()
        return done

    def _await_bounded(self, producer: Producer, what: str, done: Future[None]) -> None:
        try:
            done.result(CALL_BOUND_S)
        except FutureTimeout:
            raise self._stuck(producer, done, what, CALL_BOUND_S) from None

    def _abandon(self, producer: Producer, offsets_sent: Future[None]) -> None:
        """Abort the transaction opened for a batch that was then not decided (Redis went
        away, or a defect), or decided too slowly: its offsets, sent or not, go with it.
        Counted apart from the aborts the broker caused."""
        self.metrics.transactions.labels("abandoned").inc()
        try:
            with contextlib.suppress(KafkaException):
                self._await_bounded(producer, "send_offsets_to_transaction", offsets_sent)
            self._bounded(producer, "abort_transaction", lambda: producer.abort_transaction(30))
        except KafkaException as exc:
            raise Fenced(f"the transaction could not be aborted ({exc.args[0]})") from exc

    def _stuck(self, producer: Producer, call: Future[Any], what: str, waited: float) -> Fenced:
        """A producer stuck inside librdkafka: never used again, and not freed while its
        ``call`` may still be inside it. New clients take over from the committed offsets;
        the new producer's ``init_transactions`` fences the old one's open transaction.

        Producers whose stuck call has since returned are let go. Each one still stuck
        holds librdkafka's threads and buffers: past ``MAX_STUCK_PRODUCERS`` the process
        stops, for its supervisor to start a clean one."""
        self.metrics.dependency_errors.labels("kafka").inc()
        self._stuck_producers = [(p, c) for p, c in self._stuck_producers if not c.done()]
        self._stuck_producers.append((producer, call))
        if len(self._stuck_producers) > MAX_STUCK_PRODUCERS:
            raise StuckForGood(
                f"{len(self._stuck_producers)} Kafka producers are stuck inside librdkafka "
                f"(the last in {what}); exiting for a clean restart"
            )
        return Fenced(f"{what} did not return in {waited:.0f} s")

    def _abort(self, producer: Producer, exc: KafkaException) -> KafkaException | Fenced:
        """Abort the open transaction after ``exc``; fencing is returned as ``Fenced``."""
        err: KafkaError = exc.args[0]
        self.metrics.transactions.labels("aborted").inc()
        self.metrics.dependency_errors.labels("kafka").inc()
        if err.fatal() or err.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED):
            return Fenced(str(err))
        logger.warning("transaction failed (%s); aborting and rewinding the batch", err)
        try:
            producer.abort_transaction(30)
        except KafkaException as failed:
            # A commit that timed out is still in progress inside librdkafka, which then
            # refuses the abort (and every later begin_transaction): only new clients get
            # out of that. Their init_transactions settles the open transaction, and they
            # start from the committed offsets, whichever way it ended.
            return Fenced(f"the transaction could not be aborted ({failed.args[0]})")
        return exc

    def _rewind(self, consumer: Consumer, records: list[Message]) -> None:
        failed = rewind(consumer, records, self._assigned)
        if failed:
            raise _unrewound(failed)

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
        self._rebalanced = True
        self._assigned |= {(tp.topic, tp.partition) for tp in partitions}
        self._count_assigned()
        logger.info("assigned %s", sorted(p for _, p in self._assigned))
        self._forget_committed(consumer, partitions)

    def _count_assigned(self) -> None:
        proposals = self.settings.topics.proposals
        owned = sum(1 for topic, _ in self._assigned if topic == proposals)
        self.metrics.assigned_partitions.set(owned)

    def _forget_committed(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Replay markers a crashed predecessor left for batches it had committed, and
        where those it left for batches that did not commit wait (see ``_read_markers``)."""
        self._unread = partitions
        try:
            self._read_markers(consumer)
        except DependencyDown as exc:
            logger.warning("replay markers not read (read before the next batch): %s", exc)

    def _read_markers(self, consumer: Consumer) -> None:
        """Read the replay markers of the partitions last assigned, once: those below
        their committed offsets go, and the positions of the others are noted (see
        ``AdmissionStore.forget_committed``). No batch is decided before: a proposal
        decided again where a predecessor's call was admitted, in a transaction that
        aborted, may have to withdraw it. Raises DependencyDown until Redis and the broker
        answer."""
        partitions = self._unread
        if partitions is None:
            return
        try:
            committed = {
                (tp.topic, tp.partition): tp.offset for tp in consumer.committed(partitions, 10)
            }
            removed = self.admission.forget_committed(committed)
        except REDIS_ERRORS as exc:
            raise DependencyDown(f"redis: {exc}") from exc
        except (KafkaException, BufferError) as exc:
            raise DependencyDown(f"committed offsets: {exc}", "kafka") from exc
        self._unread = None
        self._committed_at.update({tp: offset for tp, offset in committed.items() if offset >= 0})
        if removed:
            logger.info("cleared %d replay markers of committed batches", removed)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._rebalanced = True
        self._assigned -= {(tp.topic, tp.partition) for tp in partitions}
        # The batch in flight may hold records of these partitions: it commits (or
        # aborts) before they leave.
        self._settle_inflight(consumer)
        self._count_assigned()
        for tp in partitions:
            self._committed_at.pop((tp.topic, tp.partition), None)
            if tp.topic != self.settings.topics.proposals:
                continue  # the lag series are the proposals' partitions only
            # A partition revoked before its first statistics has no series: older
            # prometheus-client releases raise KeyError for it, newer ones ignore it.
            with contextlib.suppress(KeyError, ValueError):
                self.metrics.consumer_lag.remove(str(tp.partition))

    def _on_stats(self, stats_json: str) -> None:
        try:
            stats = orjson.loads(stats_json)
            topic = self.settings.topics.proposals
            parts = stats.get("topics", {}).get(topic, {})
            for pid, p in parts.get("partitions", {}).items():
                # What is not yet committed: from where this processor's transactions
                # committed (or, before any, where the group's committed offsets had it
                # start; the log's start in a new group) to the last stable offset.
                # librdkafka's own consumer_lag counts from the consumer's committed
                # offset, which this consumer never commits (the producer does): it is -1
                # in a new group and grows for ever after a restart.
                base = self._committed_at.get((topic, int(pid)), p.get("lo_offset", -1))
                end = p.get("ls_offset", -1)
                lag = end - base if end >= 0 and base >= 0 else -1
                if int(pid) >= 0 and lag >= 0 and (topic, int(pid)) in self._assigned:
                    self.metrics.consumer_lag.labels(pid).set(lag)
        except Exception:
            logger.debug("unreadable librdkafka stats", exc_info=True)


def _unrewound(failed: list[TopicPartition]) -> Fenced:
    """A batch to be read again that the consumer could not seek back to: the clients are
    rebuilt, and read on from the committed offsets, which stand before it."""
    where = ", ".join(f"{tp.topic}[{tp.partition}]@{tp.offset}" for tp in failed)
    return Fenced(f"cannot rewind {where}; rebuilding the clients")


def _drain(producer: Producer) -> None:
    """Deliver what a closing producer still holds. A fenced one holds nothing worth
    delivering (its transaction is aborted) and raises its fatal error instead."""
    with contextlib.suppress(KafkaException):
        producer.flush(5)


def _compensation_failed(d: Decision) -> list[tuple[str, Item]]:
    """The admission item that marks the original's record when ``d``, the processor's
    compensating call, was refused for good (see admission.lua, comp_failed)."""
    p = d.proposal
    if p is None or d.taxonomy is not TaxonomyClass.COMPENSATION_FAILED:
        return []
    # With no principal, the refusal is the processor's own delegation token having
    # expired (results.refused_compensation), which gates.identity counts only when the
    # token, verified earlier, names this very proposal and this tenant: the envelope's
    # tenant is then the one the token signs.
    tenant = d.principal.tenant_id if d.principal else p.tenant_id
    return [(tenant or "", comp_failed_item(p.idempotency_key or "", position(d.source)))]


def _ending(apply: Callable[[list[Any]], list[Any]], ops: list[Any]) -> list[Any]:
    """One of ``Processor._void``'s Redis calls. Redis down decides the batch again later;
    a script error is a defect of its own, logged, and what it was to end stays."""
    try:
        return apply(ops)
    except REDIS_ERRORS as exc:
        if not is_script_error(exc):
            raise DependencyDown(f"redis: {exc}") from exc
        logger.exception("could not end what a failed record left in Redis")
        return []


def _trust_files(settings: Settings) -> list[Path]:
    identity = settings.identity
    files = [identity.jwks_file, *identity.key_files, identity.delegation_key_file]
    files += identity.delegation_trusted_key_files
    files += [settings.policy_file, settings.approvers_file]
    return [Path(f) for f in files if f is not None]


def _proposal_op(d: Decision, now_ms: int) -> tuple[str, dict[str, Any]] | None:
    """The Redis effect a proposal's decision needs, keyed by its input position."""
    p = d.proposal
    if p is None or d.principal is None:
        return None
    tenant = d.principal.tenant_id
    pos = position(d.source)
    if d.outcome is Outcome.PARKED and d.approval_request is not None:
        entry = parked_entry(d)
        op = {
            "op": "park",
            "rid": entry["request_id"],
            "entry": entry,
            "pos": pos,
            "expires_at": entry["expires_at"],
            "needed": entry["needed"],
            "ttl": retain_ms(entry["expires_at"], now_ms),
        }
        return tenant, op
    return None


_ANSWERED_ALREADY = {
    "moved_on": (
        "approval_request_superseded",
        "the call went ahead without this request (with approvals attached, or an earlier "
        "attempt of it completed, or failed after committing steps)",
    ),
    "given_back": (
        "approval_request_withdrawn",
        "the call was decided again as something else before its request ended, and never ran",
    ),
}
"""How an approval request's end (a rejection, a release) whose proposal was answered
already lands on the DLQ, by admission's verdict: (reason, detail)."""

_SUPERSEDED = {"ok": False, "why": "superseded", "retry_after_ms": 0}
"""What a parked call's request ends with when its key went ahead as another proposal
(see Processor._end_requests): the one answer its proposal gets."""
_REPLAY_CHANGED = {"ok": False, "why": "replay_changed", "retry_after_ms": 0}

_RESULTS_REFUSED = {
    "mismatch": (
        "result_mismatch",
        "the result's tool, tool version, payload hash or run is not its call's",
    ),
    "unrouted": ("result_unrouted_call", "the result's call was never routed"),
    "unrouted_attempt": (
        "result_unrouted_attempt",
        "the result's attempt is later than any its call was routed as",
    ),
}
"""Admission's verdicts on results that settle nothing and go to the DLQ: (reason, detail)."""

REDELIVERY_OF = "toolsentry.redelivery.of"
"""The header of a held failure delivered again (see ``Processor._redelivered``): the
position it was first read at."""
_HELD = (
    "result_held_for_later_attempt",
    "an earlier attempt failed after committing steps while a later attempt of its call is "
    "in flight, whose result answers the proposal (should that attempt be given back without "
    "running, this result is delivered again, unless it is too large to write back)",
)
"""How an earlier attempt's failure after committed steps, held while a later attempt is in
flight (see admission.lua, settle), lands on the DLQ: (reason, detail)."""


def _result_dead_letter(x: ResultInput, reason: str, detail: str) -> Decision:
    """A result that settles nothing, on the DLQ with ``reason``, its headers naming the
    call and attempt it reported on (and its own id)."""
    d = dead_letter(x.src, reason, detail, Gate.RESULT)
    r = x.result
    d.extra[DLQ_HEADERS] = [
        ("toolsentry.result.call_id", str(r["call_id"])),
        ("toolsentry.result.attempt", str(r["attempt"])),
        ("toolsentry.result.result_id", str(r["result_id"])),
    ]
    return d


def _conflicting_result(x: ResultInput, v: dict[str, Any]) -> Decision:
    """A second result of one call attempt that reports another outcome than the first (see
    results.outcome_digest): the executor said two things of one attempt, so one of them
    is false, and money may have moved where the model was told it did not (or the other
    way round). It goes to the DLQ (``result_conflict``), headers naming the call, the
    attempt and the first result, for an operator to reconcile against the tool's own
    records.

    The first stands, and the model's answer does not change. It was answered already,
    and may have been acted on: the agent told, a retry answered from the record, a
    compensation proposed in the caller's name. A second final answer would contradict
    the first without being more likely true (arriving later says nothing of which
    executor was right), and a record that flips with whatever comes last would let a
    forged or confused result overwrite a true one. Only an operator, with the tool's own
    records, can tell which it was."""
    r = x.result
    first, state = str(v.get("result") or ""), str(v.get("state") or "")
    detail = (
        f"call {r['call_id']} attempt {r['attempt']}: its first result ({first}) left the "
        f"record {state}; this one reports another outcome ({r['outcome']}), which is not "
        "applied"
    )
    d = _result_dead_letter(x, _CONFLICT, detail)
    d.extra[DLQ_HEADERS] += [
        ("toolsentry.result.first_result_id", first),
        ("toolsentry.result.first_state", state),
    ]
    return d


_CONFLICT = "result_conflict"
"""The DLQ reason of a result that contradicts its attempt's first (see _conflicting_result)."""

_WITHDRAWN = object()
"""Marks a proposal's withdraw item in ``Processor._admit``: its verdict changes nothing."""

_DEPENDENCY_ERRORS: tuple[type[Exception], ...] = (*REDIS_ERRORS, KafkaException, BufferError)


class ExpirySweeper(threading.Thread):
    """Publishes an expiry check for each parked call whose time is up.

    The check goes through ``tool.approvals`` like any decision, so the expiry
    observation is written by the transactional loop, exactly once. A check
    that is lost is simply sent again a little later."""

    def __init__(
        self,
        settings: Settings,
        store: ApprovalStore,
        metrics: Metrics,
        stop: threading.Event,
        every_s: float = 1.0,
    ) -> None:
        super().__init__(name="expiry-sweeper", daemon=True)
        self.settings, self.store, self.metrics, self._halt = settings, store, metrics, stop
        self.every_s = every_s

    def new_producer(self) -> Producer:
        return Producer(self.settings.client_config(**{"enable.idempotence": True}))

    def run(self) -> None:
        producer: Producer | None = None
        while not self._halt.wait(self.every_s):
            try:
                now_ms = int(time.time() * 1000)
                self.store.forget_ended(now_ms)
                due = self.store.due(now_ms)
                if not due:
                    continue
                if producer is None:
                    producer = self.new_producer()
                for tenant, rid in due:
                    body = {"type": EXPIRY_CHECK, "tenant_id": tenant, "request_id": rid}
                    producer.produce(
                        self.settings.topics.approvals, orjson.dumps(body), rid.encode()
                    )
                producer.flush(10)
                self.store.postpone(due, int(time.time() * 1000) + 30_000)
            except _DEPENDENCY_ERRORS as exc:
                which = "redis" if isinstance(exc, REDIS_ERRORS) else "kafka"
                self.metrics.dependency_errors.labels(which).inc()
                logger.warning("expiry sweep failed: %s", exc)
                if isinstance(exc, KafkaException) and _failed_for_good(exc):
                    # An idempotent producer that failed for good (a sequence gap after
                    # the broker lost data) refuses every record from then on.
                    producer = None
            except Exception:
                # Not expected; the thread must not end on it, or no parked call would
                # ever be answered as expired again.
                logger.exception("expiry sweep failed")
        if producer is not None:
            producer.flush(5)


def _failed_for_good(exc: KafkaException) -> bool:
    err = exc.args[0] if exc.args else None
    return isinstance(err, KafkaError) and (err.fatal() or err.code() == KafkaError._FATAL)
