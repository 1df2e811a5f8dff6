"""The agent-side client: propose a tool call, await its observation.

Proposals are keyed by ``run_id`` and partitioned with murmur2 (Kafka's
default, so Java and Python producers agree and a run's proposals stay in
order on one partition). Observations are read with ``read_committed`` from
the end of ``tool.observations`` as it stood when the client started, and
matched to proposals by ``proposal_id``.

The observations topic carries every run of every agent. A client keeps only those
of the runs it proposed under (or was told to follow with ``follow``), as the bytes it
read, decoded when asked for; a proposal with no traffic for ``retain_s`` is forgotten
with its observations, and a run with none left. An agent runtime's memory then follows
its own recent calls, not the fleet's.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from typing import Any

import orjson
from confluent_kafka import (
    OFFSET_END,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from processor.codec.avro import codec
from processor.config import Settings, enforce
from processor.gates.parse import is_id
from processor.kafka.offsets import high_watermark
from processor.kafka.produce import DeliveryError

_ENDS = ("COMPLETED", "FAILED", "REJECTED")
"""The decisions that say what a call finally did."""
_FAILED_KEPT = 16
"""Delivery errors kept between two flush() calls (all are counted)."""
_UNDELIVERED_KEPT = 10_000
"""Proposals kept with their delivery error for whoever waits on them (the oldest go
first)."""
_PRODUCER_FIXED = {"enable.idempotence": True, "acks": "all", "partitioner": "murmur2_random"}
"""What no pass-through setting may change: a proposal is written once, and lands on the
partition a Java producer would pick for its run, behind the run's earlier proposals."""
_CONSUMER_FIXED = {"isolation.level": "read_committed"}
"""An observation of an aborted transaction was never decided: it is not read."""


class ObservationTimeout(TimeoutError):
    pass


class ClientClosed(RuntimeError):
    """The client was closed while a caller waited: nothing more will be read for it."""


class TopicMissing(LookupError):
    """The observations topic does not exist: a client started now would read nothing, and
    every wait would end in ObservationTimeout."""

    def __init__(self, topic: str) -> None:
        super().__init__(
            f"topic {topic} does not exist: create the topics (toolsentry stack topics) "
            "before starting a client"
        )
        self.topic = topic


class ToolsentryClient:
    """Thread-safe. One per agent runtime process is enough."""

    def __init__(
        self,
        settings: Settings,
        tenant_id: str,
        *,
        principal_token: str | None = None,
        watch: bool = True,
        retain_s: float = 3600.0,
    ) -> None:
        self.settings = settings
        self.retain_s = retain_s
        self.tenant_id = tenant_id
        self.principal_token = principal_token
        self._producer = Producer(
            enforce(settings.client_config(**{"linger.ms": 1}), _PRODUCER_FIXED, "client producer")
        )
        self._failed: list[KafkaError] = []
        """Delivery errors since the last flush() (the first few: flush() names one)."""
        self._failed_count = 0
        self._undelivered: OrderedDict[str, KafkaError] = OrderedDict()
        """proposal_id -> why the broker did not take it: every wait on it reports it."""
        self._key_of: dict[str, bytes] = {}
        """proposal_id -> the run (record key) it was proposed or followed under: only an
        observation under that run answers it."""
        self._runs: dict[bytes, _Run] = {}
        """The runs this client follows, by record key (the run id's bytes)."""
        self._observed: dict[str, list[tuple[bytes, bytes]]] = {}
        """Every observation per proposal, as read: a parked call gets one when parked, one
        when it ends."""
        self.arrivals: dict[str, float] = {}
        """proposal_id -> time.monotonic() when its first observation was read."""
        self._waiting: Counter[str] = Counter()
        """Proposals a caller waits on now: their runs are not forgotten meanwhile."""
        self._pruned_at = time.monotonic()
        self._cond = threading.Condition()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if watch:
            self._consumer = observations_consumer(settings, "toolsentry-client")
            self._thread = threading.Thread(target=self._watch, name="observations", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        obs = codec("observation")
        while not self._closed.is_set():
            # Delivery reports are served here too: a proposal's failure reaches whoever
            # waits on it when it comes, not when some caller next flushes.
            self._producer.poll(0)
            messages = next_messages(self._consumer)
            got: list[tuple[_Run, str, bytes, bytes]] = []
            for m in messages:
                key = m.key() or b""
                run = self._runs.get(key)
                value = m.value()
                if run is None or m.error() is not None or not value:
                    continue  # another agent's run: not this client's to keep
                try:
                    _, pid = obs.leading_strings(value, 2)
                except Exception:  # not an observation this client can read: skipped
                    continue
                got.append((run, pid, key, value))
            now = time.monotonic()
            if got:
                with self._cond:
                    for run, pid, key, value in got:
                        run.last = now
                        run.proposals[pid] = now
                        if pid not in self._observed:
                            self._observed[pid] = []
                            self.arrivals[pid] = now
                        self._observed[pid].append((key, value))
                    self._cond.notify_all()
            if now - self._pruned_at > min(self.retain_s, 10.0):
                self._prune(now)

    def _prune(self, now: float) -> None:
        """Forget the proposals with no traffic for ``retain_s``, and their observations,
        unless a caller waits on them; and the runs left with none and no traffic either.
        A run that stays busy for hours keeps only its recent proposals."""
        self._pruned_at = now
        with self._cond:
            for key, run in list(self._runs.items()):
                stale = [
                    pid
                    for pid, seen in run.proposals.items()
                    if now - seen > self.retain_s and pid not in self._waiting
                ]
                for pid in stale:
                    del run.proposals[pid]
                    self._observed.pop(pid, None)
                    self.arrivals.pop(pid, None)
                    self._key_of.pop(pid, None)
                if not run.proposals and now - run.last > self.retain_s:
                    del self._runs[key]

    def follow(self, run_id: str | bytes, proposal_id: str | None = None) -> None:
        """Keep the observations of a run proposed elsewhere (another process's agent, an
        operator's console): a client otherwise keeps only its own runs'. A client that
        does not watch keeps nothing."""
        if self._thread is None:
            return
        key = run_id.encode() if isinstance(run_id, str) else run_id
        with self._cond:
            run = self._runs.setdefault(key, _Run())
            run.last = time.monotonic()
            if proposal_id is not None:
                run.proposals[proposal_id] = run.last
                self._key_of[proposal_id] = key

    # -- proposing -------------------------------------------------------------------------

    def propose(
        self,
        tool: str,
        arguments: dict[str, Any] | None = None,
        *,
        run_id: str,
        arguments_raw: str | None = None,
        version: str | None = None,
        active_tools: list[str] | None = None,
        idempotency_key: str | None = None,
        proposal_id: str | None = None,
        **envelope: Any,
    ) -> str:
        """Publish one proposal; returns its proposal_id."""
        pid = proposal_id or str(uuid.uuid4())
        env: dict[str, Any] = {
            "proposal_id": pid,
            "created_at": datetime.now(UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "tenant_id": self.tenant_id,
            "run_id": run_id,
            "tool": {"name": tool} if version is None else {"name": tool, "version": version},
        }
        if arguments_raw is not None:
            env["arguments_raw"] = arguments_raw
        else:
            env["arguments"] = arguments if arguments is not None else {}
        if self.principal_token:
            env["principal_token"] = self.principal_token
        if active_tools is not None:
            env["active_tools"] = active_tools
        if idempotency_key is not None:
            env["idempotency_key"] = idempotency_key
        env.update(envelope)
        key = run_id.encode()
        self.follow(key, pid)
        self._produce(orjson.dumps(env), key, pid)
        return pid

    def send_raw(self, value: bytes | None, key: bytes | None) -> None:
        """Publish bytes as they are (for tests and replays of what a model emitted). The
        client follows the record's key, and the run its JSON names, if any: the processor
        keys an observation by the proposal's run, or by the record's key when it could
        not read one."""
        pid, run_id = _ids(value)
        if self._thread is not None:
            if key is not None:
                self.follow(key, pid)
            if run_id is not None and run_id.encode() != key:
                self.follow(run_id, pid)
                if pid is not None and key is not None:
                    # Answered under its run or, unreadable there, under the record's key.
                    self._key_of.pop(pid, None)
        self._produce(value, key, pid)

    def _produce(self, value: bytes | None, key: bytes | None, pid: str | None) -> None:
        delivered = partial(self._delivered, pid)
        while True:
            try:
                self._producer.produce(
                    self.settings.topics.proposals, value=value, key=key, on_delivery=delivered
                )
                break
            except BufferError:
                self._producer.poll(0.05)
        self._producer.poll(0)

    def _delivered(self, pid: str | None, err: KafkaError | None, msg: Any) -> None:
        """A delivery report, served by whichever thread polls the producer; a failure
        wakes the callers waiting, so the one waiting on ``pid`` learns of it."""
        if err is None:
            return
        with self._cond:
            self._failed_count += 1
            if len(self._failed) < _FAILED_KEPT:
                self._failed.append(err)
            if pid is not None:
                self._undelivered[pid] = err
                while len(self._undelivered) > _UNDELIVERED_KEPT:
                    self._undelivered.popitem(last=False)
                self._cond.notify_all()

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every proposal is acknowledged; raise if any could not be delivered."""
        remaining = self._producer.flush(timeout)
        if remaining:
            raise TimeoutError(f"{remaining} proposals not delivered")
        with self._cond:
            failed, count = self._failed, self._failed_count
            self._failed, self._failed_count = [], 0
        if count:
            raise DeliveryError(f"{count} proposals were not delivered: {failed[0]}")

    # -- observations ----------------------------------------------------------------------

    def wait(self, proposal_id: str, timeout: float = 10.0) -> dict[str, Any]:
        """Block until the observation for ``proposal_id`` arrives."""
        return self._wait_for(proposal_id, lambda o: True, timeout, "observation")

    def _wait_for(
        self, proposal_id: str, wanted: Callable[[dict[str, Any]], bool], timeout: float, what: str
    ) -> dict[str, Any]:
        """The first observation of ``proposal_id`` that is ``wanted``, under the run it was
        proposed in. A proposal the broker did not take raises DeliveryError, whenever
        its report comes: it will never be answered.

        A watching client serves delivery reports as it reads, so a wait never flushes:
        one proposal stuck in the producer's queue (its partition's leader away) would
        otherwise hold up every caller's wait. A client that does not watch can only learn
        of a failure, and flushes for it."""
        deadline = time.monotonic() + timeout
        if self._thread is None:
            self._producer.flush(max(0.0, deadline - time.monotonic()))
        with self._cond:
            self._waiting[proposal_id] += 1  # its run is not forgotten meanwhile
            obs, read = codec("observation"), 0
            try:
                while True:
                    err = self._undelivered.get(proposal_id)
                    if err is not None:
                        raise DeliveryError(f"proposal {proposal_id} was not delivered: {err}")
                    kept = self._observed.get(proposal_id, [])
                    run = self._key_of.get(proposal_id)
                    for key, value in kept[read:]:
                        read += 1
                        if run is not None and key != run:
                            continue  # another run's proposal of the same id
                        try:
                            o = obs.decode(value)
                        except ValueError:
                            continue
                        if wanted(o):
                            return o
                    if self._closed.is_set():
                        raise ClientClosed(f"closed while waiting for {what} of {proposal_id}")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ObservationTimeout(f"no {what} for {proposal_id} in {timeout}s")
                    self._cond.wait(left)
            finally:
                self._waiting[proposal_id] -= 1
                if not self._waiting[proposal_id]:
                    del self._waiting[proposal_id]

    def wait_final(self, proposal_id: str, timeout: float = 30.0) -> dict[str, Any]:
        """The observation that ends a proposal: for a parked call, the one after approval,
        rejection or expiry, not the PENDING_APPROVAL one."""
        return self._wait_for(
            proposal_id, lambda o: o["decision"] != "PENDING_APPROVAL", timeout, "final observation"
        )

    def wait_result(self, proposal_id: str, timeout: float = 30.0) -> dict[str, Any]:
        """The observation that says what the call finally did: COMPLETED or FAILED (from
        its executor, or cached under its idempotency key), or the refusal that stopped it
        before it ran."""
        return self._wait_for(proposal_id, lambda o: o["decision"] in _ENDS, timeout, "result")

    def history(self, proposal_id: str) -> list[dict[str, Any]]:
        """Every observation of ``proposal_id`` read so far, oldest first (a record that
        does not decode is left out)."""
        obs = codec("observation")
        with self._cond:
            kept = list(self._observed.get(proposal_id, ()))
        out = []
        for _, value in kept:
            with contextlib.suppress(ValueError):
                out.append(obs.decode(value))
        return out

    def call(
        self,
        tool: str,
        arguments: dict[str, Any] | None = None,
        *,
        run_id: str,
        timeout: float = 10.0,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Propose and wait: the synchronous API."""
        return self.wait(self.propose(tool, arguments, run_id=run_id, **kwargs), timeout)

    def close(self) -> None:
        """Stop reading observations; a caller still waiting gets ClientClosed at once
        rather than waiting out its timeout for answers no longer read."""
        self._closed.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(5)
            self._consumer.close()
        self._producer.flush(5)

    def __enter__(self) -> ToolsentryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def observations_consumer(settings: Settings, group_prefix: str) -> Consumer:
    """A read_committed consumer of the observations topic, assigned every partition from
    its end as it stands now (no group membership, nothing committed)."""
    conf = settings.client_config(
        **{
            "group.id": f"{group_prefix}-{uuid.uuid4()}",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 20,
        }
    )
    consumer = Consumer(enforce(conf, _CONSUMER_FIXED, "client consumer"))
    topic = settings.topics.observations
    meta = consumer.list_topics(topic, timeout=10).topics.get(topic)
    if meta is None or not meta.partitions:
        consumer.close()
        raise TopicMissing(topic)
    parts = sorted(meta.partitions)
    assignment = []
    for p in parts:
        high = high_watermark(consumer, TopicPartition(topic, p))
        assignment.append(TopicPartition(topic, p, high if high >= 0 else OFFSET_END))
    consumer.assign(assignment)
    return consumer


def next_messages(consumer: Consumer) -> list[Message]:
    """What ``consumer`` has now, waiting up to 0.1 s for the first record; none (after a
    short pause) when the consumer fails, so a reader loop goes on."""
    try:
        first = consumer.poll(0.1)
        return [first, *consumer.consume(500, 0)] if first is not None else []
    except KafkaException:
        time.sleep(0.1)
        return []


class _Run:
    """A run the client follows: when it last saw traffic, and when each of its proposals
    did (proposed, or an observation read)."""

    __slots__ = ("last", "proposals")

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.proposals: dict[str, float] = {}


def _ids(value: bytes | None) -> tuple[str | None, str | None]:
    """The ``proposal_id`` and ``run_id`` a proposal's JSON names, where it names strings.
    JSON the strict reader refuses (NaN, say) is read as the processor's lenient fallback
    reads it, so the client follows the run the processor will answer under. A tombstone
    (``None``) names neither."""
    if not value:
        return None, None
    try:
        env = orjson.loads(value)
    except orjson.JSONDecodeError:
        try:
            env = json.loads(value)
        except (ValueError, RecursionError):
            return None, None
    if not isinstance(env, dict):
        return None, None
    pid, run_id = env.get("proposal_id"), env.get("run_id")
    # A run_id the processor cannot use (lone surrogates, say: not printable, and no key
    # can be made of it) is none; the record is then answered under its own key.
    return (
        pid if isinstance(pid, str) else None,
        run_id if is_id(run_id) else None,
    )
