"""Writing an executor: consume approved calls, run a handler per tool, publish results.

An executor is a consumer group of its own on the ``tool.exec.<class>`` topics.
Each batch is consumed (read_committed: only calls the processor committed),
every call in it is handed to the handler registered for its tool, and then
the results on ``tool.results`` (plus any reference-data updates on
``tool.reference``) are produced in one Kafka transaction together with the
batch's input offsets. A crash before the commit therefore loses nothing and
publishes nothing: the batch is consumed again and every result is produced
once.

What the transaction cannot cover is the tool's own effect. A batch delivered
again after a crash or an aborted transaction calls its handlers again, so
**every handler must be idempotent**: it gets the call's ``idempotency_key``
(stable across deliveries and retries of one approved call) and must apply its
effect at most once under that key, answering a repeat with the stored answer.
``processor.support_executor`` shows one way: the effect and the answer are
written in one database transaction, keyed by the idempotency key.

The executor decides only what needs no tool knowledge: a call past its
deadline is not run (``TIMED_OUT``), a tool without a handler and a handler
that raises fail closed (``FAILED``, not retryable, nothing committed: a handler that
has committed a step must return ``Failed`` with ``committed_steps`` rather than raise,
or the call is never compensated). A record that is not an
approved call goes to the executors' dead-letter topic (``tool.calls.dlq``) with
the reason in its headers, in the transaction that commits its offset, so one bad
record never stops the group and none is lost. A record that is an approved call
but cannot be handed to a handler (its arguments are not a JSON object: another
producer wrote it, or a processor of another version) still names its call: it is
dead-lettered, and answered on ``tool.results`` in the same transaction as a failure
that says the call was not run (``approved_call_invalid``, ``UNKNOWN_ERROR``), so its
agent hears of it at once instead of after the call's deadline. A call written with an
approved-call schema this executor does not know (a newer processor's, during an
upgrade) is neither run nor skipped: its partition waits at it, paused, and is read
again every ``HOLD_S`` seconds, until an executor that knows the schema owns it.
Handlers run one after another while their batch is held, and the group moves the
partitions of a consumer that holds a batch past ``max.poll.interval.ms`` (the batch then
runs again elsewhere): a batch starts no more calls once it has run for ``batch_max_s``,
half that interval by default, and the calls it did not start are read again for the
next one. Signals are the caller's business: call ``stop()`` from a signal handler. A stop
starts no more calls: the call in hand finishes, the batch is committed up to it, and
the records after it are left, uncommitted, to the partitions' next owner. Finishing
the batch, as the processor does, would hold the shutdown for the run time of every
call left in it, past an orchestrator's grace period, whose kill could then land in
the middle of a call.

A call delivered again may have run the first time: its handler answered, then
the transaction aborted (or the group moved the partition, or the process
died) before the result was published, and now it is past its deadline. It
must not be reported ``TIMED_OUT`` ("nothing ran"). Within one process the
executor keeps the answers of batches it gave back and publishes those again,
without running the handler. Across a restart only the handlers' own store
knows: pass ``recorded``, which returns the answer stored under a call's
idempotency key (or None), and a late call that ran is answered from it.

A result too large for the broker (``message.max.bytes``, less the room the
processor's observation needs around it) is published as a failure that says
the call ran, instead of being retried for ever. So is a success whose answer
cannot be published at all (data that is not JSON, a reference update that does not
serialise). A failure whose answer cannot be published as given keeps what is known
to be true of it (its committed steps, and whatever of its compensation arguments and
reference updates does serialise): a call that committed a step still asks for
compensation.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import orjson
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from prometheus_client import CollectorRegistry, Counter

from processor.app import consumer_config, producer_config
from processor.codec.avro import known_headers, writer_header
from processor.codec.records import (
    ID_MAX_CHARS,
    decode_approved_call,
    dlq_record,
    encode_result,
    oversized_id,
)
from processor.config import Settings
from processor.kafka.offsets import next_offsets, records_of, rewind, where
from processor.kafka.produce import Headers, send
from processor.model import Decision, Gate, Outcome, SideEffectClass, SourceRecord, TaxonomyClass
from processor.results import CALL_INVALID, RESULT_TOO_LARGE, RESULT_UNPUBLISHABLE
from processor.state.references import BadReference, parse_reference

logger = logging.getLogger(__name__)

SUCCEEDED, FAILED, TIMED_OUT = "SUCCEEDED", "FAILED", "TIMED_OUT"

RESULT_HEADROOM_BYTES = 16_384
"""Room left under ``message.max.bytes`` for what the processor's observation adds
around a result's data."""
HOLD_S = 10.0
"""How long a partition waits, paused, at a call written with a schema this executor does
not know, before it is read again (and the call logged and counted again): the next owner
of the partition, once an upgrade moves it, may know the schema."""
MAX_POLL_INTERVAL_MS = 300_000
"""librdkafka's ``max.poll.interval.ms`` where the settings name none."""
UNREADABLE_TOOL = "(unreadable)"
"""The ``tool`` label of the answers to calls that could not be read (see ``_not_run``)."""
NO_HANDLER_TOOL = "(no handler)"
"""The ``tool`` label of the answers to calls of a tool this executor has no handler for:
whoever writes to an execution topic names the tool, and a label per name it invents
would grow the executor's series without bound."""
GIVEN_BACK_BYTES = 64 * 1024 * 1024
"""Answers of aborted batches kept for their redelivery, at most this many bytes (the
oldest dropped first: a call whose batch moved to another executor is never committed
here)."""


@dataclass(frozen=True)
class Call:
    """One approved call, as the processor routed it (arguments already validated)."""

    call_id: str
    proposal_id: str
    run_id: str
    tenant_id: str
    trace_id: str
    tool_name: str
    tool_version: str
    side_effect_class: str
    arguments: dict[str, Any]
    payload_hash: str
    idempotency_key: str
    """Apply the effect at most once under this key: the same call can be delivered twice."""
    deadline_ms: int
    attempt: int
    approval_ids: tuple[str, ...]
    created_at_ms: int
    contract_set: str | None


@dataclass(frozen=True)
class ReferenceUpdate:
    """A change to an entity the gates check, published to ``tool.reference`` with the
    result, so the next proposal is decided against the state this call left behind.

    There is no tenant field: an update always lands under the call's own tenant, so a
    handler cannot write another tenant's reference data."""

    entity: str
    entity_id: str
    state: str | None
    """The entity's new state; None deletes the entity (a tombstone)."""
    owner: str | None = None
    attributes: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.entity or "/" in self.entity or not self.entity_id:
            raise ValueError("a reference needs an entity (without '/') and an id")
        if self.state is not None and not self.state:
            raise ValueError("a reference's state must be non-empty (None deletes it)")

    def key(self, tenant: str) -> bytes:
        return f"{tenant}/{self.entity}/{self.entity_id}".encode()

    def value(self) -> bytes | None:
        """The record value ``tool.reference`` expects (``state``, ``owner``, ``attributes``).
        The topic is compacted and the last value wins, so it carries the whole entity."""
        if self.state is None:
            return None
        doc: dict[str, Any] = {"state": self.state}
        if self.owner is not None:
            doc["owner"] = self.owner
        if self.attributes is not None:
            doc["attributes"] = dict(self.attributes)
        return orjson.dumps(doc)


@dataclass(frozen=True)
class Succeeded:
    data: Any = None
    """The tool's answer; must be JSON-serialisable."""
    references: tuple[ReferenceUpdate, ...] = ()


@dataclass(frozen=True)
class Failed:
    code: str
    message: str
    """Read by people and by the model (the processor bounds it, and withholds it when its
    secret scan flags it): never put secrets in it."""
    retryable: bool = False
    taxonomy_class: str | None = None
    committed_steps: tuple[str, ...] = ()
    """Steps already committed when it failed: non-empty means compensation is needed."""
    compensation_arguments: dict[str, Any] | None = None
    references: tuple[ReferenceUpdate, ...] = ()
    """The entities the committed steps changed, as they are now: a failure after a commit
    (the order cancelled, then a later step failed) left them changed, and the gates must
    not decide the next proposal against the state before it."""


Handler = Callable[[Call], Succeeded | Failed]
Recorded = Callable[[Call], Succeeded | Failed | None]
"""The answer a handler stored under the call's idempotency key, if it ran (no effect)."""


def result_id(call_id: str, attempt: int) -> str:
    """Deterministic, so a call executed again yields the same result id."""
    return hashlib.sha256(f"{call_id}/{attempt}".encode()).hexdigest()[:32]


class ExecutorMetrics:
    """Executor counters. Tool names are bounded: the tools this executor has handlers
    for, and "(unreadable)" and "(no handler)" for the rest (see ``NO_HANDLER_TOOL``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.results = Counter(
            "toolsentry_executor_results_total",
            'Results published, by tool and outcome (tool "(unreadable)": the answers '
            'to calls that could not be read, which are dead-lettered too; "(no handler)": '
            "calls of a tool this executor has no handler for).",
            ["tool", "outcome"],
            registry=registry,
        )
        self.undecodable = Counter(
            "toolsentry_executor_undecodable_total",
            "Records on an execution topic that were not approved calls (sent to the "
            "executors' DLQ).",
            registry=registry,
        )
        self.unknown_schema = Counter(
            "toolsentry_executor_unknown_schema_total",
            "Times a partition was held at a call written with a schema this executor does "
            "not know (a newer processor's): not run, not skipped.",
            registry=registry,
        )
        self.transactions = Counter(
            "toolsentry_executor_transactions_total",
            "Executor Kafka transactions by result (committed, aborted).",
            ["result"],
            registry=registry,
        )
        self.batches_cut = Counter(
            "toolsentry_executor_batches_cut_total",
            "Batches that stopped starting calls after running for batch_max_s (the calls "
            "left are read again): handlers that slow risk the group's max.poll.interval.ms.",
            registry=registry,
        )


@dataclass(frozen=True)
class _Unreadable:
    """Why a record on an execution topic is not an approved call this executor can run."""

    reason: str
    """``toolsentry.error.reason`` of its dead letter."""
    detail: str
    newer: bool = False
    """Framed with a schema this executor does not know: a newer writer's call, held for an
    executor that knows it rather than dead-lettered."""
    call: Call | None = None
    """The call an approved-call record names though it cannot be run (its arguments left
    empty): it is answered on ``tool.results`` as well as dead-lettered. None when the
    record names no call (it does not decode, or lacks the ids a result needs)."""
    why: str = ""
    """What that answer tells the agent: fixed text, never the record's contents."""


DeadLetter = tuple[bytes | None, bytes | None, Headers]
"""Key, value and headers of a record on the executors' DLQ."""


@dataclass
class _Output:
    key: bytes
    value: bytes
    tool: str
    outcome: str
    call: tuple[str, int, str]
    """(call id, attempt, idempotency key)."""
    references: list[tuple[bytes, bytes | None]] = field(default_factory=list)
    ran: bool = True
    """A handler's answer (or the deadline's), kept for the batch's redelivery should its
    transaction abort. False for the answer to a record that could not be run, which is
    built again from the record: kept under the ids the record claims, it could stand in
    for the answer of another record claiming the same ids."""

    def size(self) -> int:
        return len(self.value) + sum(len(k) + len(v or b"") for k, v in self.references)


class Executor:
    """Runs handlers for the approved calls of some side-effect classes, exactly-once
    on the Kafka side (see the module docstring for what handlers must guarantee)."""

    def __init__(
        self,
        settings: Settings,
        handlers: Mapping[str, Handler],
        classes: Iterable[str] | None = None,
        group_id: str = "toolsentry-executor",
        executor_id: str | None = None,
        clock: Callable[[], float] = time.time,
        metrics_registry: CollectorRegistry | None = None,
        batch_max_records: int = 100,
        recorded: Recorded | None = None,
        batch_max_s: float | None = None,
    ) -> None:
        """``group_id``: executors of two deployments on one cluster (their own topic
        prefixes) need groups of their own, or their rebalances wait on each other.

        ``executor_id``: by default the instance id (the host name) and the classes
        served, so that executors for different classes on one host do not share a
        transactional id (and fence each other). Two executors for the same classes on
        one host need ids of their own.

        ``recorded``: see the module docstring (a call that ran, delivered again late).

        ``batch_max_records`` is far below the processor's: handlers run while the batch
        is held, and a batch must finish within the consumer's ``max.poll.interval.ms``,
        or the group moves its partitions away and the whole batch runs again elsewhere
        (and again there, for as long as its handlers are that slow). So a batch also
        starts no call once it has run for ``batch_max_s`` (by default half of
        ``max.poll.interval.ms``): it is committed up to the calls that ran, and the rest
        are read again for the next batch. It always starts one call, so a handler that
        alone outlasts the interval still moves its partition."""
        if batch_max_s is not None and not batch_max_s >= 0:
            raise ValueError(f"batch_max_s must be 0 or more, not {batch_max_s}")
        self.handlers = dict(handlers)
        self.batch_max_records = batch_max_records
        wanted = [c.upper() for c in (classes or [c.value for c in SideEffectClass])]
        unknown = sorted(set(wanted) - {c.value for c in SideEffectClass})
        if unknown:
            raise ValueError(f"unknown side-effect classes: {', '.join(unknown)}")
        self.topics = [settings.topics.execution(c) for c in dict.fromkeys(wanted)]
        served = ",".join(sorted(set(wanted)))
        digest = hashlib.sha256(served.encode()).hexdigest()[:8]
        self.executor_id = executor_id or f"{settings.instance_id}-{digest}"
        self.recorded = recorded
        self.max_result_bytes = (
            int(producer_config(settings).get("message.max.bytes", 1_000_000))
            - RESULT_HEADROOM_BYTES
        )
        # (an unsafe setting stops it here, not in run())
        poll_interval_ms = consumer_config(settings, self.topics).get(
            "max.poll.interval.ms", MAX_POLL_INTERVAL_MS
        )
        self.batch_max_s = int(poll_interval_ms) / 2000 if batch_max_s is None else batch_max_s
        self._given_back: dict[tuple[str, int, str], _Output] = {}
        """Outputs of batches whose transaction aborted, by (call id, attempt, key)."""
        self._given_back_bytes = 0
        self._held: dict[tuple[str, int], float] = {}
        """Partitions paused at a call of an unknown schema, and when to read them again."""
        self._rebalanced = False
        # The processor's client configs, with this executor's group and instance: the
        # same enforced exactly-once settings, and transactional.id
        # "<group_id>-<executor_id>", stable so a restart fences its predecessor.
        self.settings = settings.model_copy(
            update={
                "group_id": group_id,
                "instance_id": self.executor_id,
            }
        )
        self.clock = clock
        self.metrics = ExecutorMetrics(metrics_registry or CollectorRegistry())
        self.undecodable = 0
        self.results_committed = 0
        self._stop = threading.Event()
        self._assigned: set[tuple[str, int]] = set()
        self.ready = threading.Event()
        """Set once the executor's consumer owns partitions."""
        self._consumer: Consumer | None = None
        self._producer: Producer | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def stop(self) -> None:
        """Start no more calls: the one in hand finishes, the records of the batch handled
        so far are committed (their results with their offsets), the rest are left to the
        partitions' next owner, and ``run()`` returns. Signal-safe."""
        self._stop.set()

    def run(self) -> None:
        """Consume and execute until ``stop()``; then close the clients."""
        try:
            while not self._stop.is_set():
                try:
                    self.run_once(self.settings.batch_wait_s)
                except KafkaException as exc:
                    logger.warning("executor: %s; retrying", exc)
                    self._close_clients()
                    self._stop.wait(1.0)
        finally:
            self.close()

    def close(self) -> None:
        self._close_clients()

    def run_once(self, timeout_s: float) -> int:
        """Consume one batch (waiting up to ``timeout_s`` for its first record), execute
        it, commit. Returns how many records the committed batch consumed, dead-lettered
        ones included and held ones not (nor those left by a stop); 0 when nothing came or
        the transaction was aborted."""
        consumer, producer = self._clients()
        self._resume_held(consumer)
        first = consumer.poll(timeout_s)
        if first is None:
            return 0
        messages = [first, *consumer.consume(self.batch_max_records - 1, 0)]
        records = records_of(messages, lambda err: logger.warning("consumer error: %s", err))
        if self._rebalanced:
            # Some of these may belong to a partition revoked inside poll()/consume():
            # run under the new assignment, they would run here and at its new owner.
            self._rebalanced = False
            # (a seek refused here is of a partition just assigned again, which starts from
            # its committed offsets, before these records, anyway)
            rewind(consumer, records, self._assigned)
            return 0
        read = [(m, _read(m.value())) for m in records]
        held = _newer(read)
        if held and not self._hold(consumer, held):
            return 0
        # A held call and whatever follows it on its partition wait: not run, not committed.
        read = [(m, r) for m, r in read if not _behind(m, held)]
        records = [m for m, _ in read]
        outputs: list[_Output] = []
        dead: list[DeadLetter] = []
        started = time.monotonic()
        for done, (m, r) in enumerate(read):
            if self._stop.is_set():
                # A stop starts no more calls (see the module docstring): the batch ends at
                # the first record not handled. A batch keeps each partition's order, so each
                # partition is committed up to its last record handled, and its next owner
                # starts at its first record left (this executor handles no more).
                records = records[:done]
                break
            if done and time.monotonic() - started >= self.batch_max_s:
                # Ends so too, before the group takes its partitions away (see __init__):
                # the records left are read again, here, from their first.
                left, records = records[done:], records[:done]
                self.metrics.batches_cut.inc()
                if rewind(consumer, left, self._assigned):
                    logger.warning("cannot rewind the calls left; rebuilding the clients")
                    self._give_back(outputs)  # (read again from the committed offsets)
                    self._close_clients()
                    return 0
                break
            if isinstance(r, Call):
                outputs.append(self._execute(r))
                continue
            dead.append(self._dead_letter(m, r))
            answer = self._not_run(r)
            if answer is not None:
                outputs.append(answer)
        if not records:
            return 0
        try:
            producer.begin_transaction()
            producer.send_offsets_to_transaction(
                next_offsets(records), consumer.consumer_group_metadata(), 30
            )
            for key, value, headers in dead:
                send(producer, self.settings.topics.call_dlq, key, value, headers)
            for out in outputs:
                for key, value in out.references:
                    send(producer, self.settings.topics.reference, key, value)
                send(producer, self.settings.topics.results, out.key, out.value)
            self._commit(producer)
        except KafkaException as exc:
            self._give_back(outputs)
            self._abort_and_rewind(consumer, producer, records, exc)
            return 0
        for out in outputs:
            if out.ran:
                self._forget(out.call)
        self.metrics.transactions.labels("committed").inc()
        for out in outputs:
            self.metrics.results.labels(out.tool, out.outcome).inc()
        self.results_committed += len(outputs)
        self.undecodable += len(dead)
        self.metrics.undecodable.inc(len(dead))
        return len(records)

    # -- records that are not calls ----------------------------------------------------------

    def _dead_letter(self, m: Message, why: _Unreadable) -> DeadLetter:
        """The record as the executors' DLQ keeps it: its key and value (cut to fit), and
        where it came from and why, in the processor's DLQ headers."""
        topic, partition, offset = where(m)
        logger.warning("%s[%s]@%s is not an approved call (%s): sent to %s",
                       topic, partition, offset, why.detail,
                       self.settings.topics.call_dlq)  # fmt: skip
        source = SourceRecord(topic, partition, offset, m.key(), m.value(), m.timestamp()[1])
        d = Decision(source, Outcome.DEAD_LETTER, Gate.PARSE, None, dlq_reason=why.reason,
                     dlq_detail=why.detail)  # fmt: skip
        return dlq_record(m.key(), d, self.max_result_bytes)

    def _not_run(self, why: _Unreadable) -> _Output | None:
        """The answer to a record that names a call but cannot be run: a failure that says
        nothing ran (no committed steps, no data), under the record's own ids, so the
        processor settles that call, and only that call, at once. The class is
        ``UNKNOWN_ERROR``, not retryable: a fault of the platform (not of the model's
        arguments, which the processor checked) that an operator, who has the dead letter,
        must fix; retried, the call would meet the same fault. None when there is no call
        to answer, or its answer would not fit in a record (ids far larger than any the
        processor writes): the dead letter alone tells of it."""
        call = why.call
        if call is None:
            return None
        failed = Failed(
            CALL_INVALID,
            f"the executor could not read this call ({why.why}); it was not run",
            retryable=False,  # the same call, routed again, meets the same fault
            taxonomy_class=TaxonomyClass.UNKNOWN_ERROR.value,
        )
        now = self._now_ms()
        try:
            out = self._output(call, failed, FAILED, now)
        except Exception as exc:  # ids no result can carry
            logger.warning("call %.64s cannot be answered (%s): dead-lettered only",
                           call.call_id, type(exc).__name__)  # fmt: skip
            return None
        if len(out.key) + len(out.value) > self.max_result_bytes:
            logger.warning("the answer to call %.64s is too large: dead-lettered only",
                           call.call_id)  # fmt: skip
            return None
        out.ran = False
        out.tool = UNREADABLE_TOOL  # the record's tool name is anybody's text: not a label
        logger.error("call %.64s cannot be run (%s): answered as not run", call.call_id,
                     why.why)  # fmt: skip
        return out

    def _hold(self, consumer: Consumer, held: dict[tuple[str, int], int]) -> bool:
        """Pause each partition at its call of an unknown schema for ``HOLD_S``, and seek
        back to that call: skipped, it would be lost to its agent, who would never hear of
        it; dead-lettered, every call of a newer processor would be, for the whole of an
        upgrade. False when the consumer cannot be moved back: the clients are rebuilt
        from the committed offsets, which hold the call just the same."""
        for (topic, partition), offset in held.items():
            logger.error(
                "%s[%s]@%s is an approved call of a schema this executor does not know (a "
                "newer processor wrote it): not run; the partition waits %.0f s and is read "
                "again from there. Upgrade the executors.",
                topic, partition, offset, HOLD_S,
            )  # fmt: skip
            self.metrics.unknown_schema.inc()
            tp = TopicPartition(topic, partition, offset)
            try:
                consumer.pause([tp])
                consumer.seek(tp)
            except KafkaException as exc:
                logger.warning("cannot hold %s[%s] (%s); rebuilding the clients",
                               topic, partition, exc.args[0])  # fmt: skip
                self._close_clients()
                return False
            self._held[(topic, partition)] = time.monotonic() + HOLD_S
        return True

    def _resume_held(self, consumer: Consumer) -> None:
        now = time.monotonic()
        due = [tp for tp, until in self._held.items() if until <= now]
        for tp in due:
            del self._held[tp]
        if due:
            with contextlib.suppress(KafkaException):
                consumer.resume([TopicPartition(topic, partition) for topic, partition in due])

    # -- one call --------------------------------------------------------------------------

    def _execute(self, call: Call) -> _Output:
        given = self._given_back.get((call.call_id, call.attempt, call.idempotency_key))
        if given is not None:
            return given  # answered before, in a batch that was given back: not run again
        started = self._now_ms()
        if call.deadline_ms >= started:
            answer = self._run_handler(call)
        elif (earlier := self._recorded(call)) is not None:
            answer = earlier  # it ran when first delivered; its result never made it out
        else:
            not_run = Failed(
                "deadline_exceeded",
                "the call reached the executor after its deadline and was not run",
                retryable=True,
                taxonomy_class=TaxonomyClass.TIMEOUT.value,
            )
            return self._published(call, not_run, TIMED_OUT, started)
        outcome = SUCCEEDED if isinstance(answer, Succeeded) else FAILED
        return self._published(call, answer, outcome, started)

    def _published(
        self, call: Call, answer: Succeeded | Failed, outcome: str, started: int
    ) -> _Output:
        """The result record of an answer, or of why that answer cannot be published."""
        try:
            out = self._output(call, answer, outcome, started)
        except Exception as exc:
            # What the handler answered cannot be published (data that is not JSON, a
            # field of the wrong type): publish what is known to be true of it instead.
            answer, outcome = _salvaged(call, answer, exc), FAILED
            out = self._output(call, answer, outcome, started)
        limit = self.max_result_bytes
        # A record's key counts against the broker's limit as its value does: a reference
        # whose entity id alone is too large (a tombstone included) would be refused at
        # every delivery of the batch, which would never commit.
        references = [(k, v) for k, v in out.references if len(k) + len(v or b"") <= limit]
        if len(out.value) <= limit and len(references) == len(out.references):
            return out
        logger.error(
            "the result of call %s (%d bytes) or a reference update is over %d bytes: "
            "published as a failure", call.call_id, len(out.value), limit,
        )  # fmt: skip
        # What the call committed stays known (its steps, its compensation, the reference
        # updates that fit); only the answer that does not fit is left out.
        failed = answer if isinstance(answer, Failed) else None
        too_large = Failed(
            RESULT_TOO_LARGE,
            f"the call ran, but its answer ({len(out.value)} bytes), or one of its "
            f"reference updates, is larger than a result may be ({limit})",
            taxonomy_class=TaxonomyClass.OBSERVATION_NORMALIZATION_FAIL.value,
            committed_steps=failed.committed_steps if failed else (),
            compensation_arguments=failed.compensation_arguments if failed else None,
        )
        shrunk = self._output(call, too_large, FAILED, started)
        if len(shrunk.value) > limit:  # the compensation arguments were the large part
            too_large = replace(too_large, compensation_arguments=None)
            shrunk = self._output(call, too_large, FAILED, started)
        if len(shrunk.value) > limit:  # so were the committed steps: as many as fit are named
            bare = self._output(call, replace(too_large, committed_steps=()), FAILED, started)
            steps = _steps_within(_step_names(too_large.committed_steps), limit - len(bare.value))
            shrunk = self._output(call, replace(too_large, committed_steps=steps), FAILED, started)
        shrunk.references = references
        return shrunk

    def _recorded(self, call: Call) -> Succeeded | Failed | None:
        if self.recorded is None:
            return None
        try:
            answer = self.recorded(call)
        except Exception as exc:
            # Not knowing is not "nothing ran": fail closed, as a handler error does.
            return _handler_error(call, exc)
        if answer is not None and not isinstance(answer, Succeeded | Failed):
            # Not an answer (a stored row, as the store keeps it): it ran, but what it
            # answered is unknown. Published as it is, it would stop the loop.
            return _handler_error(call, TypeError(type(answer).__name__))
        return answer

    def _give_back(self, outputs: list[_Output]) -> None:
        for out in outputs:
            if not out.ran:
                continue
            self._forget(out.call)
            self._given_back[out.call] = out
            self._given_back_bytes += out.size()
        while self._given_back_bytes > GIVEN_BACK_BYTES:
            self._forget(next(iter(self._given_back)))

    def _forget(self, call: tuple[str, int, str]) -> None:
        out = self._given_back.pop(call, None)
        if out is not None:
            self._given_back_bytes -= out.size()

    def _output(
        self, call: Call, answer: Succeeded | Failed, outcome: str, started: int
    ) -> _Output:
        data: str | None = None
        compensation: str | None = None
        if isinstance(answer, Succeeded):
            data = None if answer.data is None else orjson.dumps(answer.data).decode()
        elif answer.compensation_arguments is not None:
            compensation = orjson.dumps(answer.compensation_arguments).decode()
        references = [_record_of(call.tenant_id, r) for r in answer.references]
        datum = _result(call, answer, outcome, started, self._now_ms(), self.executor_id)
        datum["data"], datum["compensation_arguments"] = data, compensation
        value = encode_result(datum)
        return _Output(
            call.run_id.encode(),
            value,
            call.tool_name if call.tool_name in self.handlers else NO_HANDLER_TOOL,
            outcome,
            (call.call_id, call.attempt, call.idempotency_key),
            references,
        )

    def _run_handler(self, call: Call) -> Succeeded | Failed:
        handler = self.handlers.get(call.tool_name)
        if handler is None:
            return Failed("no_handler", f"this executor has no handler for {call.tool_name}")
        try:
            answer = handler(call)
        except Exception as exc:
            return _handler_error(call, exc)
        if not isinstance(answer, Succeeded | Failed):
            return _handler_error(call, TypeError(type(answer).__name__))
        return answer

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    # -- Kafka -----------------------------------------------------------------------------

    def _clients(self) -> tuple[Consumer, Producer]:
        if self._consumer is not None and self._producer is not None:
            return self._consumer, self._producer
        producer = Producer(producer_config(self.settings))
        try:
            producer.init_transactions(30)
        except KafkaException:
            producer.flush(0)
            raise
        conf = consumer_config(self.settings, self.topics)
        if "statistics.interval.ms" not in self.settings.consumer:
            conf.pop("statistics.interval.ms", None)  # nothing here reads librdkafka stats
        consumer = Consumer(conf)
        consumer.subscribe(
            self.topics, on_assign=self._on_assign, on_revoke=self._on_revoke,
            on_lost=self._on_revoke,
        )  # fmt: skip
        logger.info("executor %s consuming %s", self.executor_id, ", ".join(self.topics))
        self._consumer, self._producer = consumer, producer
        return consumer, producer

    def _close_clients(self) -> None:
        consumer, producer = self._consumer, self._producer
        self._consumer = self._producer = None
        self._assigned.clear()
        self._held.clear()
        if consumer is not None:
            with contextlib.suppress(KafkaException, RuntimeError):
                consumer.close()
        if producer is not None:
            # A fenced producer holds nothing worth delivering (its transaction is
            # aborted) and raises its fatal error instead.
            with contextlib.suppress(KafkaException):
                producer.flush(5)

    def _commit(self, producer: Producer) -> None:
        """Commit, retrying what librdkafka calls retriable, but not past the transaction's
        own timeout nor once a stop was asked for: the batch is then aborted and rewound."""
        deadline = time.monotonic() + self.settings.transaction_timeout_ms / 1000
        while True:
            try:
                producer.commit_transaction(30)
                return
            except KafkaException as exc:
                retry = exc.args[0].retriable() and not self._stop.is_set()
                if not retry or time.monotonic() >= deadline:
                    raise

    def _abort_and_rewind(
        self, consumer: Consumer, producer: Producer, records: list[Message], exc: KafkaException
    ) -> None:
        """Nothing of the batch is published; it is consumed again (handlers run again).
        A fenced or fatally failed producer cannot abort: the clients are rebuilt from
        the committed offsets instead, which rewinds just the same."""
        err: KafkaError = exc.args[0]
        self.metrics.transactions.labels("aborted").inc()
        if err.fatal() or err.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED):
            logger.warning("executor producer fenced (%s); rebuilding the clients", err)
            self._close_clients()
            return
        logger.warning("transaction failed (%s); aborting and rewinding the batch", err)
        try:
            producer.abort_transaction(30)
        except KafkaException as failed:
            # A commit that timed out is still in progress inside librdkafka, which then
            # refuses the abort and every later transaction: new clients settle it.
            logger.warning("abort failed (%s); rebuilding the clients", failed.args[0])
            self._close_clients()
            return
        if rewind(consumer, records, self._assigned):
            logger.warning("cannot rewind the batch; rebuilding the clients")
            self._close_clients()

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._rebalanced = True
        self._assigned |= {(tp.topic, tp.partition) for tp in partitions}
        if self._assigned:
            self.ready.set()

    def wait_ready(self, timeout: float) -> bool:
        """Until the executor owns partitions: a call routed before then waits for the
        group to form and may miss its deadline."""
        return self.ready.wait(timeout)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._rebalanced = True
        self._assigned -= {(tp.topic, tp.partition) for tp in partitions}
        for tp in partitions:
            self._held.pop((tp.topic, tp.partition), None)


def _read(value: bytes | None) -> Call | _Unreadable:
    """The approved call in a record's value, or why there is none."""
    data = value or b""
    header = writer_header(data)
    if header is not None and header not in known_headers():
        fingerprint = header[2:].hex()
        return _Unreadable("approved_call_schema_unknown", f"writer schema {fingerprint}", True)
    try:
        d = decode_approved_call(data)
    except (ValueError, KeyError, TypeError) as exc:
        return _Unreadable(CALL_INVALID, f"{type(exc).__name__}: {exc}"[:500])
    try:
        return _call(d)
    except (ValueError, KeyError, TypeError) as exc:
        detail = f"{type(exc).__name__}: {exc}"[:500]
        why = (
            "its arguments are not a JSON object"
            if isinstance(exc, _NotAnObject)
            else "its arguments are not valid JSON"
            if isinstance(exc, orjson.JSONDecodeError)
            else f"a field of it is not usable ({type(exc).__name__})"
        )
        return _Unreadable(CALL_INVALID, detail, call=_named(d), why=why)


class _NotAnObject(ValueError):
    pass


def _named(d: dict[str, Any]) -> Call | None:
    """The call a decoded record names, with no arguments (it is never run), or None when
    it lacks what ties a result to a call (call id, idempotency key, run, tenant)."""
    try:
        call = _call({**d, "arguments": "{}"})
    except (ValueError, KeyError, TypeError):
        return None
    if not (call.call_id and call.idempotency_key and call.run_id and call.tenant_id):
        return None
    return call


def _newer(read: list[tuple[Message, Call | _Unreadable]]) -> dict[tuple[str, int], int]:
    """Each partition's first call of a schema this executor does not know, by offset."""
    held: dict[tuple[str, int], int] = {}
    for m, r in read:
        if isinstance(r, _Unreadable) and r.newer:
            topic, partition, offset = where(m)
            held.setdefault((topic, partition), offset)
    return held


def _behind(m: Message, held: dict[tuple[str, int], int]) -> bool:
    """Whether ``m`` is a held call or comes after one on its partition."""
    topic, partition, offset = where(m)
    return offset >= held.get((topic, partition), offset + 1)


_CALL_IDS = ("call_id", "proposal_id", "run_id", "tenant_id", "trace_id", "tool_name",
             "tool_version", "payload_hash", "idempotency_key", "contract_set")  # fmt: skip
"""The ids of a call that its result names (and keys, by the run)."""


def _call(d: dict[str, Any]) -> Call:
    too_long = oversized_id(d, _CALL_IDS)
    if too_long is not None:
        # Longer than any the processor writes: its result could not be published (see
        # ID_MAX_CHARS), so it is not run, nor answered (``_named``), only dead-lettered.
        raise ValueError(f"{too_long} is longer than {ID_MAX_CHARS} characters")
    arguments = orjson.loads(d["arguments"])
    if not isinstance(arguments, dict):
        raise _NotAnObject("arguments are not a JSON object")
    return Call(
        call_id=d["call_id"],
        proposal_id=d["proposal_id"],
        run_id=d["run_id"],
        tenant_id=d["tenant_id"],
        trace_id=d["trace_id"],
        tool_name=d["tool_name"],
        tool_version=d["tool_version"],
        side_effect_class=d["side_effect_class"],
        arguments=arguments,
        payload_hash=d["payload_hash"],
        idempotency_key=d["idempotency_key"],
        deadline_ms=int(d["deadline"]),
        attempt=int(d["attempt"]),
        approval_ids=tuple(d["approval_ids"]),
        created_at_ms=int(d["created_at"]),
        contract_set=d["contract_set"],
    )


def _handler_error(call: Call, exc: Exception) -> Failed:
    """Fail closed. Only the exception's type is reported: its text may quote arguments."""
    logger.error("handler for %s failed on call %s: %s", call.tool_name, call.call_id,
                 type(exc).__name__)  # fmt: skip
    return Failed(
        "handler_error",
        type(exc).__name__,
        retryable=False,
        taxonomy_class=TaxonomyClass.UNKNOWN_ERROR.value,
    )


def _salvaged(call: Call, answer: Succeeded | Failed, exc: Exception) -> Failed:
    """What is known to be true of an answer that cannot be published as given, in a form
    that always encodes. A success ran: it is reported as a call that ran whose answer
    cannot be published (as one too large is), never as a refusal. A failure keeps its
    committed steps (they decide that the call needs compensating), its own code, message
    and class where they have the right types, and the compensation arguments and
    reference updates that serialise; what is left out is named in its message."""
    why = type(exc).__name__
    references = _publishable_references(call, answer)
    if isinstance(answer, Succeeded):
        logger.error("the answer of call %s cannot be published (%s): published as a "
                     "failure that says the call ran", call.call_id, why)  # fmt: skip
        return Failed(
            RESULT_UNPUBLISHABLE,
            f"the call ran, but its answer, or one of its reference updates, cannot be "
            f"published ({why})",
            taxonomy_class=TaxonomyClass.OBSERVATION_NORMALIZATION_FAIL.value,
            references=references,
        )
    left_out: list[str] = []
    compensation = answer.compensation_arguments
    if compensation is not None and not _serialises(lambda: orjson.dumps(compensation)):
        compensation = None
        left_out.append("its compensation arguments")
    if len(references) != len(_listed(answer.references)):
        left_out.append("a reference update")
    code, message = answer.code, answer.message
    if not isinstance(code, str) or not code or not isinstance(message, str):
        code, message = "handler_error", f"the tool's failure cannot be published ({why})"
    elif left_out:
        message = f"{message} ({' and '.join(left_out)} could not be published: {why})"
    claimed = answer.taxonomy_class
    logger.error("the failure of call %s cannot be published as given (%s): %s left out",
                 call.call_id, why, ", ".join(left_out) or "its fields")  # fmt: skip
    return Failed(
        _text(code),
        _text(message),
        retryable=answer.retryable if isinstance(answer.retryable, bool) else False,
        taxonomy_class=_text(claimed) if isinstance(claimed, str) else None,
        committed_steps=tuple(_text(s) for s in _step_names(answer.committed_steps)),
        compensation_arguments=compensation,
        references=references,
    )


def _text(s: str) -> str:
    """``s`` as valid UTF-8 (a lone surrogate, which no record can carry, replaced)."""
    return s.encode("utf-8", "replace").decode()


def _serialises(encode: Callable[[], object]) -> bool:
    try:
        encode()
    except Exception:
        return False
    return True


def _listed(references: object) -> tuple[object, ...]:
    """A handler's reference updates as a tuple (one update on its own is one)."""
    if isinstance(references, ReferenceUpdate):
        return (references,)
    try:
        return tuple(references) if isinstance(references, Iterable) else ()
    except Exception:
        return ()


def _publishable_references(call: Call, answer: Succeeded | Failed) -> tuple[ReferenceUpdate, ...]:
    """The answer's reference updates whose records can be built."""
    return tuple(
        r
        for r in _listed(answer.references)
        if isinstance(r, ReferenceUpdate) and _serialises(partial(_record_of, call.tenant_id, r))
    )


def _record_of(tenant: str, r: ReferenceUpdate) -> tuple[bytes, bytes | None]:
    """The ``tool.reference`` record of an update, held to what the reference loader
    keeps: an update it would refuse (an entity not named as contracts name them, an
    owner that is neither text nor a whole number, attributes that are not an object)
    raises ``BadReference``, so that the result says it was not published instead of
    the update vanishing in the loader, or the entity being forgotten there. So does a
    tenant with a '/' in its id, whose key the loader would read as another tenant's."""
    key, value = r.key(tenant), r.value()
    if parse_reference(key, value).tenant != tenant:
        raise BadReference(f"tenant {tenant!r} cannot be named in a tool.reference key")
    return key, value


def _step_names(steps: object) -> tuple[str, ...]:
    """Committed steps as strings, whatever a handler gave: one name on its own is one
    step (not a step per letter), and steps that cannot even be listed are still
    reported as a step, so that the call is compensated or escalated, never taken for
    one that committed nothing."""
    if not steps:
        return ()
    if isinstance(steps, str):
        return (steps,)
    try:
        return tuple(str(s) for s in steps) if isinstance(steps, Iterable) else (str(steps),)
    except Exception:
        return ("unnamed_step",)


STEP_MAX_CHARS = 256
"""The longest step name a result too large to publish keeps (see ``_steps_within``)."""


def _steps_within(steps: tuple[str, ...], room: int) -> tuple[str, ...]:
    """As many of ``steps`` as fit in ``room`` bytes of a result, each cut at
    ``STEP_MAX_CHARS``, and then one that counts those left out. Never none of a call that
    committed steps: a result without them says nothing needs compensating. Published
    whole, steps larger than a record would fail every delivery of the batch, which would
    then never commit."""
    left = room - 64  # the last step, that counts those left out, and the array's framing
    kept: list[str] = []
    for step in steps:
        name = step[:STEP_MAX_CHARS]
        size = len(name.encode()) + 8  # and its length, as Avro writes it
        if size > left:
            break
        kept.append(name)
        left -= size
    if len(kept) < len(steps):
        kept.append(f"({len(steps) - len(kept)} more steps not listed: the result was too large)")
    return tuple(kept)


def _result(
    call: Call,
    answer: Succeeded | Failed,
    outcome: str,
    started_ms: int,
    finished_ms: int,
    executor_id: str,
) -> dict[str, Any]:
    """The ToolResult datum; ``data`` and ``compensation_arguments`` are filled in by the
    caller, which serialises them where a failure can still be turned into a result."""
    failed = answer if isinstance(answer, Failed) else None
    return {
        "result_id": result_id(call.call_id, call.attempt),
        "call_id": call.call_id,
        "proposal_id": call.proposal_id,
        "run_id": call.run_id,
        "tenant_id": call.tenant_id,
        "trace_id": call.trace_id,
        "tool_name": call.tool_name,
        "tool_version": call.tool_version,
        "side_effect_class": call.side_effect_class,
        "idempotency_key": call.idempotency_key,
        "payload_hash": call.payload_hash,
        "attempt": call.attempt,
        "outcome": outcome,
        "retryable": failed.retryable if failed else False,
        "error_code": failed.code if failed else None,
        "error_message": failed.message if failed else None,
        "taxonomy_class": failed.taxonomy_class if failed else None,
        "committed_steps": list(_step_names(failed.committed_steps)) if failed else [],
        "data": None,
        "compensation_arguments": None,
        "started_at": started_ms,
        "finished_at": finished_ms,
        "executor_id": executor_id,
        "contract_set": call.contract_set,
    }
