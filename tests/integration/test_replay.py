"""``toolsentry replay`` against what a real processor decided: the same contracts change
nothing, a tightened contract changes exactly the calls it now refuses, and the replay
writes nothing, to Kafka or to Redis."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from confluent_kafka import Consumer, TopicPartition

from processor.client import ToolsentryClient
from processor.config import Settings
from processor.kafka.offsets import watermarks
from processor.reference_data import publish_references, wait_until_loaded
from processor.replay import Match, Report, reference_lookup, replay, replay_gates
from tests.integration.harness import (
    ROOT,
    ProcessorProcess,
    existing,
    isolated,
    read_all,
    settings_env,
    token,
)

pytestmark = pytest.mark.integration

ORDER = {"order_id": "WO-12345-A"}
CANCEL = {**ORDER, "reason_code": "customer_request", "confirm": True}


@dataclass
class Recorded:
    """A processor's decisions over a range, the processor stopped since."""

    settings: Settings
    since_ms: int
    until_ms: int
    routed_with_limit_50: list[str]
    """search_kb calls with ``limit: 50``: routed, and over a tightened maximum of 20."""
    other: dict[str, dict[str, Any]]
    """The other proposals' observations, by proposal id."""


@pytest.fixture(scope="module")
def recorded(
    stack_settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Recorded]:
    settings = isolated(stack_settings, f"replay-{uuid.uuid4().hex[:6]}")
    publish_references(settings, existing("acme", "cancel_order", CANCEL))
    proc = ProcessorProcess(settings, "replay-1", tmp_path_factory.mktemp("logs")).start()
    wait_until_loaded(settings)
    since_ms = int(time.time() * 1000) - 1000
    client = ToolsentryClient(settings, "acme", principal_token=token(settings, "acme"))
    try:

        def call(tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
            return client.call(tool, arguments, run_id=f"run-{uuid.uuid4().hex[:8]}", timeout=60)

        limit_50 = [call("search_kb", {"query": "return policy", "limit": 50}) for _ in range(3)]
        other = [
            call("search_kb", {"query": "return policy", "limit": 2}),
            call("search_kb", {"query": "return policy", "limit": "10"}),
            call("lookup_order", ORDER),
            call("cancel_order", CANCEL),
            call("cancel_order", {**CANCEL, "order_id": "WO-99999-Z"}),
        ]
        client.send_raw(b"\xff garbage, not a proposal", b"run-garbage")
        client.flush(30)
        assert len(read_all(settings, settings.topics.dlq, expect=1, idle=1)) == 1
        assert [o["decision"] for o in limit_50] == ["ROUTED"] * 3
        assert [(o["decision"], o["gate"]) for o in other] == [
            ("ROUTED", "route"), ("REJECTED", "schema"), ("ROUTED", "route"),
            ("PENDING_APPROVAL", "confirmation"), ("REJECTED", "semantic"),
        ]  # fmt: skip
        until_ms = int(time.time() * 1000)
    finally:
        client.close()
        assert proc.terminate() == 0, proc.log()[-3000:]
    yield Recorded(
        settings, since_ms, until_ms, [o["proposal_id"] for o in limit_50],
        {o["proposal_id"]: o for o in other},
    )  # fmt: skip


def _replay(r: Recorded, contracts: Path, *, open_ended: bool = False) -> Report:
    s = r.settings
    gates = replay_gates(s, contracts, s.policy_file)
    fingerprint = gates.contracts.fingerprint
    until = None if open_ended else r.until_ms
    report = Report(r.since_ms, until, str(contracts), fingerprint, None, True, examples=5)
    return replay(s, gates, reference_lookup(s), report, slack_ms=60_000)


def _tightened(tmp_path: Path) -> Path:
    """The shipped contracts, search_kb's ``limit`` capped at 20 and nothing else changed."""
    contracts = tmp_path / "contracts"
    shutil.copytree(ROOT / "contracts", contracts)
    path = contracts / "search_kb" / "1.0.0.yaml"
    text = path.read_text()
    assert text.count("maximum: 100") == 1
    path.write_text(text.replace("maximum: 100", "maximum: 20"))
    return contracts


def test_the_same_contracts_decide_every_proposal_the_same(recorded: Recorded) -> None:
    report = _replay(recorded, ROOT / "contracts")
    assert report.read == 9
    assert report.counts == {Match.SAME: 9}
    assert report.changes == {}
    assert report.recorded_sets == {report.contract_set: 8}  # the dead letter names none
    assert (report.unreadable, report.incomplete, report.missing) == (0, [], [])


def test_a_range_open_at_its_end_is_closed_when_the_replay_starts(recorded: Recorded) -> None:
    started = int(time.time() * 1000)
    report = _replay(recorded, ROOT / "contracts", open_ended=True)
    assert report.until_ms is not None and started <= report.until_ms <= time.time() * 1000
    assert report.counts == {Match.SAME: 9}


def test_a_tightened_contract_changes_exactly_the_calls_it_now_refuses(
    recorded: Recorded, tmp_path: Path
) -> None:
    report = _replay(recorded, _tightened(tmp_path))
    assert report.counts == {Match.SAME: 6, Match.CHANGED: 3}
    [change] = report.sorted_changes()
    assert change.tool == "search_kb" and change.count == 3
    assert change.recorded.as_dict() == {
        "decision": "ROUTED", "taxonomy_class": "SUCCESS", "gate": "route"}  # fmt: skip
    assert change.replayed.as_dict() == {
        "decision": "REJECTED", "taxonomy_class": "OUT_OF_BOUNDS", "gate": "schema"}  # fmt: skip
    assert sorted(e.proposal_id or "" for e in change.examples) == sorted(
        recorded.routed_with_limit_50
    )
    assert report.contract_set not in report.recorded_sets


def _topics_ends(settings: Settings) -> dict[tuple[str, int], int]:
    consumer = Consumer(settings.client_config(**{"group.id": f"ends-{uuid.uuid4()}"}))
    try:
        ends = {}
        for topic in settings.topics.all():
            meta = consumer.list_topics(topic, timeout=10).topics[topic]
            for p in meta.partitions:
                ends[(topic, p)] = watermarks(consumer, TopicPartition(topic, p))[1]
        return ends
    finally:
        consumer.close()


def _keyspace(settings: Settings) -> dict[bytes, tuple[bytes | None, int]]:
    """Every key of the test's namespace, with its serialized value and absolute expiry."""
    client: redis.Redis[bytes] = redis.Redis.from_url(settings.redis_url)
    keys = sorted(client.scan_iter(match=f"*{settings.redis_namespace}*", count=1000))
    assert keys, "the processor left its reference data and positions in Redis"
    return {k: (client.dump(k), int(client.execute_command("PEXPIRETIME", k))) for k in keys}


def test_replay_writes_nothing_and_the_command_reports_as_json(
    recorded: Recorded, tmp_path: Path
) -> None:
    s = recorded.settings
    ends, keyspace = _topics_ends(s), _keyspace(s)
    _replay(recorded, ROOT / "contracts")
    proc = subprocess.run(
        [sys.executable, "-m", "processor", "replay", "--json", "--fail-on-change",
         "--since", str(recorded.since_ms), "--until", str(recorded.until_ms),
         "--slack-s", "60", "--contracts", str(_tightened(tmp_path)), "--examples", "1"],
        cwd=ROOT, env=settings_env(s, "replay-cli"), capture_output=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr.decode()[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["totals"]["changed"] == 3 and doc["totals"]["same"] == 6
    [change] = doc["changes"]
    assert change["tool"] == "search_kb" and change["count"] == 3
    assert change["replayed"]["taxonomy_class"] == "OUT_OF_BOUNDS"
    [example] = change["examples"]
    assert example["proposal_id"] in recorded.routed_with_limit_50
    assert "limit" in example["next_action"]
    assert doc["range"]["since_ms"] == recorded.since_ms
    assert _topics_ends(s) == ends
    assert _keyspace(s) == keyspace


def test_bad_options_and_unloadable_contracts_exit_2(recorded: Recorded, tmp_path: Path) -> None:
    env = settings_env(recorded.settings, "replay-cli")
    broken = tmp_path / "broken"
    (broken / "search_kb").mkdir(parents=True)
    (broken / "search_kb" / "1.0.0.yaml").write_text("identity: {name: search_kb}\n")
    for args in (["--since", "yesterday-ish"], ["--contracts", str(broken)]):
        proc = subprocess.run([sys.executable, "-m", "processor", "replay", *args],
                              cwd=ROOT, env=env, capture_output=True, timeout=120)  # fmt: skip
        assert proc.returncode == 2, proc.stdout.decode() + proc.stderr.decode()
