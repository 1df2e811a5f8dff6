"""The agent-side client: propose a tool call, await its observation.

Proposals are keyed by ``run_id`` and partitioned with murmur2 (Kafka's
default, so Java and Python producers agree and a run's proposals stay in
order on one partition). Observations are read with ``read_committed`` from
the end of ``tool.observations`` as it stood when the client started, and
matched to proposals by ``proposal_id``.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import orjson
from confluent_kafka import (
    OFFSET_END,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)

from processor.codec.avro import codec
from processor.config import Settings
from processor.kafka.offsets import high_watermark


class ObservationTimeout(TimeoutError):
    pass


class DeliveryError(RuntimeError):
    """The broker refused or never acknowledged a proposal."""


class ToolsentryClient:
    """Thread-safe. One per agent runtime process is enough."""

    def __init__(
        self,
        settings: Settings,
        tenant_id: str,
        *,
        principal_token: str | None = None,
        watch: bool = True,
    ) -> None:
        self.settings = settings
        self.tenant_id = tenant_id
        self.principal_token = principal_token
        self._producer = Producer(
            settings.client_config(
                **{
                    "enable.idempotence": True,
                    "acks": "all",
                    "linger.ms": 1,
                    "partitioner": "murmur2_random",
                }
            )
        )
        self._failed: list[KafkaError] = []
        self._seen: dict[str, dict[str, Any]] = {}
        self._history: dict[str, list[dict[str, Any]]] = {}
        """Every observation per proposal: a parked call gets one when parked, one when it ends."""
        self.arrivals: dict[str, float] = {}
        """proposal_id -> time.monotonic() when its observation was read."""
        self._cond = threading.Condition()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if watch:
            self._consumer = Consumer(
                settings.client_config(
                    **{
                        "group.id": f"toolsentry-client-{uuid.uuid4()}",
                        "enable.auto.commit": False,
                        "isolation.level": "read_committed",
                        "fetch.wait.max.ms": 20,
                    }
                )
            )
            self._assign_from_end()
            self._thread = threading.Thread(target=self._watch, name="observations", daemon=True)
            self._thread.start()

    def _assign_from_end(self) -> None:
        topic = self.settings.topics.observations
        meta = self._consumer.list_topics(topic, timeout=10)
        parts = sorted(meta.topics[topic].partitions)
        assignment = []
        for p in parts:
            high = high_watermark(self._consumer, TopicPartition(topic, p))
            assignment.append(TopicPartition(topic, p, high if high >= 0 else OFFSET_END))
        self._consumer.assign(assignment)

    def _watch(self) -> None:
        obs = codec("observation")
        while not self._closed.is_set():
            try:
                first = self._consumer.poll(0.1)
                messages = [first, *self._consumer.consume(500, 0)] if first is not None else []
            except KafkaException:
                time.sleep(0.1)
                continue
            got = []
            for m in messages:
                value = m.value()
                if m.error() is None and value:
                    try:
                        got.append(obs.decode(value))
                    except ValueError:
                        continue
            if got:
                now = time.monotonic()
                with self._cond:
                    for o in got:
                        self._seen.setdefault(o["proposal_id"], o)
                        self._history.setdefault(o["proposal_id"], []).append(o)
                        self.arrivals.setdefault(o["proposal_id"], now)
                    self._cond.notify_all()

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
        self.send_raw(orjson.dumps(env), run_id.encode())
        return pid

    def send_raw(self, value: bytes, key: bytes | None) -> None:
        """Publish bytes as they are (for tests and replays of what a model emitted)."""
        while True:
            try:
                self._producer.produce(
                    self.settings.topics.proposals,
                    value=value,
                    key=key,
                    on_delivery=self._delivered,
                )
                break
            except BufferError:
                self._producer.poll(0.05)
        self._producer.poll(0)

    def _delivered(self, err: KafkaError | None, msg: Any) -> None:
        if err is not None:
            self._failed.append(err)

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every proposal is acknowledged; raise if any could not be delivered."""
        remaining = self._producer.flush(timeout)
        if remaining:
            raise TimeoutError(f"{remaining} proposals not delivered")
        if self._failed:
            failed, self._failed = self._failed, []
            raise DeliveryError(f"{len(failed)} proposals were not delivered: {failed[0]}")

    # -- observations ----------------------------------------------------------------------

    def wait(self, proposal_id: str, timeout: float = 10.0) -> dict[str, Any]:
        """Block until the observation for ``proposal_id`` arrives."""
        self._producer.flush(timeout)
        deadline = time.monotonic() + timeout
        with self._cond:
            while proposal_id not in self._seen:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ObservationTimeout(f"no observation for {proposal_id} in {timeout}s")
                self._cond.wait(left)
            return self._seen[proposal_id]

    def wait_final(self, proposal_id: str, timeout: float = 30.0) -> dict[str, Any]:
        """The observation that ends a proposal: for a parked call, the one after approval,
        rejection or expiry, not the PENDING_APPROVAL one."""
        self._producer.flush(timeout)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for o in self._history.get(proposal_id, ()):
                    if o["decision"] != "PENDING_APPROVAL":
                        return o
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ObservationTimeout(f"no final observation for {proposal_id}")
                self._cond.wait(left)

    def wait_result(self, proposal_id: str, timeout: float = 30.0) -> dict[str, Any]:
        """The observation that says what the call finally did: COMPLETED or FAILED (from
        its executor, or cached under its idempotency key), or the refusal that stopped it
        before it ran."""
        self._producer.flush(timeout)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for o in self._history.get(proposal_id, ()):
                    if o["decision"] in ("COMPLETED", "FAILED", "REJECTED"):
                        return o
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ObservationTimeout(f"no result for {proposal_id} in {timeout}s")
                self._cond.wait(left)

    def history(self, proposal_id: str) -> list[dict[str, Any]]:
        with self._cond:
            return list(self._history.get(proposal_id, ()))

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
        self._closed.set()
        if self._thread is not None:
            self._thread.join(5)
            self._consumer.close()
        self._producer.flush(5)

    def __enter__(self) -> ToolsentryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
