"""Running processors as users run them (``toolsentry run`` subprocesses) and reading topics."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
import yaml
from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from processor.approvals import load_private_key, sign_for_request
from processor.client import ToolsentryClient
from processor.codec.avro import codec
from processor.config import Settings, Topics
from processor.contracts.registry import load_contracts
from processor.identity import TokenIssuer
from processor.kafka.topics import ensure_topics
from processor.policy import load_policy
from processor.stack.local import free_ports
from processor.stack.redis import ensure_redis_server, ping
from tests.unit.helpers import existing_references

ROOT = Path(__file__).resolve().parents[2]
ALL_SCOPES = sorted(
    {s for versions in load_contracts(ROOT / "contracts").by_name.values()
     for c in versions for s in c.required_scopes}
)  # fmt: skip


def existing(
    tenant: str, tool: str, arguments: dict[str, Any]
) -> list[tuple[str, dict[str, Any] | None]]:
    """tool.reference records under which every id ``arguments`` names exists for ``tenant``,
    in the first state the contract allows: publish them and the call passes the reference
    checks."""
    env = {"tenant_id": tenant, "tool": {"name": tool}, "arguments": arguments}
    answers = existing_references(env, load_contracts(ROOT / "contracts"))
    return [("/".join(key), {"state": e.state}) for key, e in answers.items() if e is not None]


def produce_at_rate(
    settings: Settings, tenant: str, records: list[tuple[bytes, bytes]], rate: float
) -> None:
    """Send (key, value) records at a steady ``rate`` per second, then wait for every ack."""
    client = ToolsentryClient(settings, tenant, watch=False)
    started = time.monotonic()
    for n, (key, value) in enumerate(records):
        client.send_raw(value, key)
        ahead = n / rate - (time.monotonic() - started)
        if ahead > 0:
            time.sleep(ahead)
    client.flush(60)
    client.close()


def approval(
    settings: Settings, approver: str, observation: dict[str, Any], **overrides: Any
) -> dict[str, Any]:
    """A test approver's signed approval of the call a PENDING_APPROVAL observation names,
    built from its confirmation packet on the approval requests topic."""
    packet = approval_request(settings, observation["approval_request_id"])
    key = load_private_key(Path(str(settings.approvers_file)).parent / f"approver-{approver}.jwk")
    return sign_for_request(key, approver, packet, int(time.time() * 1000), **overrides)


def approval_request(settings: Settings, request_id: str, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        for m in read_all(settings, settings.topics.approval_requests, idle=0.5):
            packet = codec("approval_request").decode(m.value())
            if packet["request_id"] == request_id:
                return dict(packet)
        if time.monotonic() > deadline:
            raise AssertionError(f"no approval request {request_id}")


def issuer(settings: Settings) -> TokenIssuer:
    """The test identity provider: signs with the key whose public half the processors trust."""
    jwks = settings.identity.jwks_file
    assert jwks is not None, "the test settings configure identity keys"
    return TokenIssuer.from_jwk_file(Path(jwks).parent / "issuer.jwk")


def token(
    settings: Settings,
    tenant: str,
    scopes: list[str] | None = None,
    clearance: str = "secret",
    user: str = "u-test",
    agent: str = "agent-test",
    **kw: Any,
) -> str:
    """A principal token for ``tenant`` with every scope of the pack unless told otherwise."""
    return issuer(settings).mint(
        tenant, user, agent, ALL_SCOPES if scopes is None else scopes, clearance, **kw
    )


def isolated(settings: Settings, name: str) -> Settings:
    """The same stack with its own topic prefix and consumer group, topics created."""
    s = settings.model_copy(
        update={
            "topics": Topics(prefix=f"{name}."),
            "group_id": f"ts-{name}",
            "reference_group_id": f"ts-{name}-reference",
            "redis_namespace": f"ts-{name}",
        }
    )
    ensure_topics(s)
    return s


def settings_env(settings: Settings, instance_id: str, **extra: str) -> dict[str, str]:
    """The parent's environment without its TOOLSENTRY_* variables, plus these settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLSENTRY_")}
    consumer = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500, **settings.consumer}
    test_settings = settings.model_copy(
        update={
            "instance_id": instance_id,
            "metrics_port": 0,
            "contracts_dir": ROOT / "contracts",
            "consumer": consumer,
        }
    )
    env.update(test_settings.as_env(**extra))
    return env


class ProcessorProcess:
    """One ``toolsentry run`` subprocess, its log in a file."""

    def __init__(self, settings: Settings, instance_id: str, log_dir: Path, **env: str) -> None:
        self.settings = settings
        self.instance_id = instance_id
        self.log_path = log_dir / f"processor-{instance_id}.log"
        self.env = settings_env(settings, instance_id, **env)
        self.proc: subprocess.Popen[bytes] | None = None
        self._life_starts_at = 0
        """Where in the log the latest start() began: a restarted instance appends to it."""

    def start(self) -> ProcessorProcess:
        self._life_starts_at = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "processor", "run"],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        return self

    def wait_ready(self, timeout: float = 60) -> ProcessorProcess:
        """Until the instance, as (re)started last, has joined the group and owns partitions."""
        deadline = time.monotonic() + timeout
        while "assigned [" not in self.life_log():
            if not self.alive() or time.monotonic() > deadline:
                raise AssertionError(
                    f"processor {self.instance_id} not ready:\n{self.log()[-3000:]}"
                )
            time.sleep(0.1)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no batch finished, no transaction committed or aborted."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM: the batch in hand is finished and committed, then a clean exit."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    @property
    def returncode(self) -> int | None:
        """The exit status of the latest start() (None while it runs; -9 after a SIGKILL)."""
        return None if self.proc is None else self.proc.poll()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def life_log(self) -> str:
        """The log written since the latest start(): one life of a restarted instance."""
        if not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as f:
            f.seek(self._life_starts_at)
            return f.read().decode(errors="replace")


class GroupLag:
    """How many records of ``tool.proposals`` the processors' group has yet to commit:
    0 once every proposal produced so far is decided (and its transaction committed)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.admin = AdminClient(settings.client_config())

    def __call__(self) -> int:
        topic = self.settings.topics.proposals
        meta = self.admin.list_topics(topic, timeout=10)
        parts = [TopicPartition(topic, p) for p in meta.topics[topic].partitions]
        request = [ConsumerGroupTopicPartitions(self.settings.group_id, parts)]
        [offsets] = self.admin.list_consumer_group_offsets(request).values()
        committed = {tp.partition: tp.offset for tp in offsets.result(10).topic_partitions}
        probe = Consumer(self.settings.client_config(**{"group.id": "toolsentry-lag-probe"}))
        try:
            ends = {tp.partition: probe.get_watermark_offsets(tp, timeout=10)[1] for tp in parts}
        finally:
            probe.close()
        return sum(end - max(committed.get(p, 0), 0) for p, end in ends.items())


class RedisServer:
    """A redis-server of the test's own on a free port, to stop and start again.

    ``args`` are extra redis-server options (persistence, say); ``dir`` is its data
    dir, kept across restarts."""

    def __init__(self, data_dir: Path, *args: str) -> None:
        (self.port,) = free_ports(1)
        self.data_dir = data_dir
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.args = [ensure_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1",
                     "--dir", str(data_dir), *args]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis[bytes]:
        return redis.Redis.from_url(self.url)

    def start(self, timeout: float = 20) -> RedisServer:
        """Start it and wait until it answers PING (after loading its data, if any)."""
        log = (self.data_dir / "redis.log").open("ab")
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while (why := ping(self.port, 0.5)) is not None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"redis-server on {self.port} did not start: {why}")
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM (what SHUTDOWN does: persist, then exit); returns once the process is gone."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def policy_with_budgets(path: Path, budgets: dict[str, Any]) -> Path:
    """The shipped policy with these ``budgets`` merged over its own, written to ``path``
    (checked by the processor's own loader, so a typo fails here, not in a subprocess)."""
    doc = yaml.safe_load((ROOT / "policy" / "policy.yaml").read_text())
    doc["budgets"] = {**doc["budgets"], **budgets}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    load_policy(path)
    return path


def read_all(
    settings: Settings,
    topic: str | list[str],
    timeout: float = 30.0,
    idle: float = 3.0,
    expect: int | None = None,
) -> list[Any]:
    """Every committed record on ``topic`` (read_committed), from the beginning; ``topic``
    may be a list, read together (one quiet period for all of them, not one each).

    Stops once ``expect`` records are in and the topic has stayed quiet for
    ``idle`` seconds, or when nothing new arrives for ``idle`` seconds and no
    count was expected, or at ``timeout``.
    """
    consumer = Consumer(
        settings.client_config(
            **{
                "group.id": f"reader-{time.monotonic_ns()}",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "auto.offset.reset": "earliest",
            }
        )
    )
    assignment = []
    for name in [topic] if isinstance(topic, str) else topic:
        meta = consumer.list_topics(name, timeout=10)
        assignment += [TopicPartition(name, p, 0) for p in meta.topics[name].partitions]
    consumer.assign(assignment)
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    last_new = time.monotonic()
    try:
        while time.monotonic() < deadline:
            batch = consumer.consume(1000, 0.5)
            got = [m for m in batch if m.error() is None]
            if got:
                out.extend(got)
                last_new = time.monotonic()
            quiet = time.monotonic() - last_new >= idle
            if quiet and (expect is None or len(out) >= expect):
                break
    finally:
        consumer.close()
    return out


def observations(settings: Settings, **kw: Any) -> Iterator[dict[str, Any]]:
    obs = codec("observation")
    for m in read_all(settings, settings.topics.observations, **kw):
        yield obs.decode(m.value())


def _scrape(port: int) -> str:
    """A processor's /metrics on ``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def metric_total(port: int, name: str) -> float:
    """The sum of every sample of ``name`` on a processor's /metrics (0 when absent)."""
    body = _scrape(port)
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", body, re.M))


def metric(port: int, name: str, labels: str) -> float:
    """One sample of a processor's /metrics on ``port`` (0 when absent)."""
    found = re.search(rf"^{name}\{{{labels}\}} (\S+)$", _scrape(port), re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def result_for(call: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A ToolResult for the approved ``call`` as an executor elsewhere reports a success
    (with no data), with ``fields`` in place of what it would say."""
    datum = {
        "result_id": uuid.uuid4().hex, "call_id": call["call_id"],
        "proposal_id": call["proposal_id"], "run_id": call["run_id"],
        "tenant_id": call["tenant_id"], "trace_id": call["trace_id"],
        "tool_name": call["tool_name"], "tool_version": call["tool_version"],
        "side_effect_class": call["side_effect_class"],
        "idempotency_key": call["idempotency_key"], "payload_hash": call["payload_hash"],
        "attempt": call["attempt"], "outcome": "SUCCEEDED", "retryable": False,
        "error_code": None, "error_message": None, "taxonomy_class": None,
        "committed_steps": [], "data": None, "compensation_arguments": None,
        "started_at": 1, "finished_at": 2, "executor_id": "exec-elsewhere",
        "contract_set": None,
    }  # fmt: skip
    return {**datum, **fields}
