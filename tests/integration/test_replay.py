"""``toolsentry replay`` against what a real processor decided: the same contracts change
nothing, a tightened contract changes exactly the calls it now refuses, and the replay
writes nothing, to Kafka or to Redis. An offset range of one partition is replayed against
the answers to its own records, however its records were stamped; a call whose outputs
the processor could not write is the same dead letter again, named after its gate."""

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

import orjson
import pytest
import redis
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from processor.client import ToolsentryClient
from processor.codec.avro import codec
from processor.config import Settings, Topics
from processor.kafka.offsets import watermarks
from processor.kafka.retained import OffsetRange, OutOfRange
from processor.reference_data import publish_references, wait_until_loaded
from processor.replay import (
    DEAD_LETTER,
    Match,
    Report,
    Verdict,
    read_answers,
    reference_lookup,
    replay,
    replay_gates,
    unknown_references,
)
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


# --- an offset range of one partition -------------------------------------------------------


@dataclass
class Positions:
    """One run's proposals, all on one partition, as a processor writing at most 32 KiB a
    record decided them: [0] before the range; [1] a search with ``limit: 50``, stamped an
    hour before it was written; [2] a summary whose approved call is too large to write;
    [3] garbage; [4] a search stamped half an hour before it was written; [5] after the
    range. The range of interest is [1]..[4]: its ends are stamped long before anything
    answered them."""

    settings: Settings
    partition: int
    offsets: list[int]
    stamps: list[int]
    end: int
    """The partition's end once they were all answered."""


@pytest.fixture(scope="module")
def positions(
    stack_settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Positions]:
    base = isolated(stack_settings, f"replay-offsets-{uuid.uuid4().hex[:6]}")
    settings = base.model_copy(update={"producer": {**base.producer, "message.max.bytes": 32768}})
    proc = ProcessorProcess(settings, "replay-offsets-1", tmp_path_factory.mktemp("logs")).start()
    wait_until_loaded(settings)
    run = f"run-{uuid.uuid4().hex[:8]}"
    principal = token(settings, "acme")
    now = int(time.time() * 1000)
    agent = Producer(settings.client_config(**{"enable.idempotence": True, "acks": "all",
                                               "partitioner": "murmur2_random"}))  # fmt: skip

    def send(value: bytes, at: int | None = None) -> None:
        stamp = {} if at is None else {"timestamp": at}
        agent.produce(settings.topics.proposals, value, key=run.encode(), **stamp)
        assert agent.flush(30) == 0

    def propose(tool: str, arguments: dict[str, Any], at: int | None = None) -> None:
        send(orjson.dumps({"proposal_id": str(uuid.uuid4()), "tenant_id": "acme",
                           "run_id": run, "tool": {"name": tool}, "arguments": arguments,
                           "principal_token": principal}), at)  # fmt: skip

    try:
        propose("search_kb", {"query": "before the range", "limit": 2})
        propose("search_kb", {"query": "return policy", "limit": 50}, at=now - 3_600_000)
        text = "The parcel arrived damaged and the customer asks for a refund. " * 640
        propose("summarise", {"text": text[:40_000], "max_words": 60, "style": "paragraph"})
        send(b"\xff garbage, not a proposal")
        propose("search_kb", {"query": "opening hours", "limit": 3}, at=now - 1_800_000)
        propose("search_kb", {"query": "after the range", "limit": 2})
        topics = settings.topics
        answers = read_all(settings, [topics.observations, topics.dlq], expect=6, idle=1.5)
        decisions = sorted(codec("observation").decode(m.value())["decision"]
                           for m in answers if m.topic() == topics.observations)  # fmt: skip
        assert decisions == ["ROUTED"] * 4, decisions
        reasons = sorted(dict(m.headers() or [])["toolsentry.error.reason"]
                         for m in answers if m.topic() == topics.dlq)  # fmt: skip
        assert len(reasons) == 2 and b"encoding_failed" in reasons, reasons
    finally:
        assert proc.terminate() == 0, proc.log()[-3000:]
    mine = [m for m in read_all(settings, settings.topics.proposals, idle=1)
            if m.key() == run.encode()]  # fmt: skip
    assert len(mine) == 6 and len({m.partition() for m in mine}) == 1
    partition = mine[0].partition() or 0
    consumer = Consumer(
        settings.client_config(
            **{"group.id": f"ends-{uuid.uuid4()}", "isolation.level": "read_committed"}
        )
    )
    try:
        end = watermarks(consumer, TopicPartition(settings.topics.proposals, partition))[1]
    finally:
        consumer.close()
    yield Positions(
        settings, partition, [m.offset() or 0 for m in mine], [m.timestamp()[1] for m in mine],
        end,
    )  # fmt: skip


def _replay_offsets(
    p: Positions, contracts: Path, first: int | None, last: int | None = None, **times: int
) -> Report:
    s = p.settings
    gates = replay_gates(s, contracts, s.policy_file)
    offsets = OffsetRange(s.topics.proposals, p.partition, first, last)
    report = Report(
        times.get("since_ms"), times.get("until_ms"), str(contracts),
        gates.contracts.fingerprint, None, True, examples=5, offsets=offsets,
    )  # fmt: skip
    return replay(s, gates, reference_lookup(s), report, slack_ms=60_000)


def test_an_offset_range_is_compared_with_the_answers_to_its_own_records(
    positions: Positions,
) -> None:
    """Its records' earliest and latest times bound when their answers were written, not
    its ends' (stamped an hour and half an hour before anything answered them). The
    summary the processor could not write is the same dead letter again, at the gate that
    decided it, and the garbage the same parse dead letter."""
    first, last = positions.offsets[1], positions.offsets[4]
    report = _replay_offsets(positions, ROOT / "contracts", first, last)
    assert report.read == 4
    assert report.counts == {Match.SAME: 4}
    assert report.offsets == OffsetRange(positions.settings.topics.proposals,
                                         positions.partition, first, last)  # fmt: skip
    assert report.since_ms == positions.stamps[1] == min(positions.stamps[1:5])
    assert report.until_ms == max(positions.stamps[1:5])
    assert (report.unreadable, report.incomplete, report.missing) == (0, [], [])


def test_an_offset_range_open_at_its_end_is_closed_when_the_replay_starts(
    positions: Positions,
) -> None:
    report = _replay_offsets(positions, ROOT / "contracts", positions.offsets[1])
    assert report.offsets is not None and report.offsets.last == positions.end - 1
    assert report.read == 5 and report.counts == {Match.SAME: 5}


def test_a_partition_alone_narrows_a_time_range(positions: Positions) -> None:
    since = min(positions.stamps) - 1000
    report = _replay_offsets(positions, ROOT / "contracts", None, since_ms=since)
    assert report.read == 6 and report.counts == {Match.SAME: 6}


def test_a_tightened_contract_changes_the_call_it_now_refuses_in_an_offset_range(
    positions: Positions, tmp_path: Path
) -> None:
    first, last = positions.offsets[1], positions.offsets[4]
    report = _replay_offsets(positions, _tightened(tmp_path), first, last)
    assert report.counts == {Match.SAME: 3, Match.CHANGED: 1}
    [change] = report.sorted_changes()
    assert change.tool == "search_kb" and change.count == 1
    assert str(change.recorded) == "ROUTED SUCCESS @route"
    assert str(change.replayed) == "REJECTED OUT_OF_BOUNDS @schema"


def test_each_dead_letter_names_the_gate_that_decided_it(positions: Positions) -> None:
    s = positions.settings
    report = Report(min(positions.stamps) - 1000, int(time.time() * 1000), "", "", None, True)
    dead = read_answers(s, report, 60_000).dead_letters
    where = (s.topics.proposals, positions.partition)
    assert dead[(*where, positions.offsets[2])].verdict == Verdict(
        DEAD_LETTER, "UNKNOWN_ERROR", "route"
    )
    assert dead[(*where, positions.offsets[3])].verdict == Verdict(
        DEAD_LETTER, "SYNTACTIC_PARSE_FAIL", "parse"
    )
    assert len(dead) == 2
    # Decided again at the time each was written, in the transaction of its decision.
    assert all(r.decided_ms is not None and r.decided_ms > positions.stamps[1]
               for r in dead.values())  # fmt: skip


def test_the_command_replays_an_offset_range_and_refuses_one_the_topic_does_not_hold(
    positions: Positions,
) -> None:
    env = settings_env(positions.settings, "replay-cli")
    first, last = positions.offsets[1], positions.offsets[4]
    where = ["--partition", str(positions.partition)]

    def command(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([sys.executable, "-m", "processor", "replay", *args], cwd=ROOT,
                              env={**env, "COLUMNS": "200"}, capture_output=True,
                              timeout=180)  # fmt: skip

    proc = command(*where, "--from-offset", str(first), "--to-offset", str(last), "--json",
                   "--slack-s", "60", "--fail-on-change")  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["range"]["by_offsets"] is True
    assert (doc["range"]["partition"], doc["range"]["from_offset"], doc["range"]["to_offset"]) == (
        positions.partition, first, last,
    )  # fmt: skip
    assert doc["proposals"] == {"read": 4, "replayed": 4} and doc["totals"]["same"] == 4
    refused = [
        (["--partition", "6", "--from-offset", "0"], "no partition 6"),
        (["--partition", "6"], "no partition 6"),
        ([*where, "--from-offset", str(positions.end)], "is not written yet"),
        ([*where, "--from-offset", str(first), "--to-offset", str(positions.end + 5)],
         "is not written yet"),
    ]  # fmt: skip
    for args, says in refused:
        proc = command(*args)
        out = proc.stdout.decode() + proc.stderr.decode()
        assert proc.returncode == 2 and says in out, out


def test_a_partition_the_topic_does_not_have_is_refused_before_any_answer_is_read(
    stack_settings: Settings,
) -> None:
    """``--partition`` alone narrows a time range: a partition the topic does not have is
    refused as soon as the broker says so, not after a day of answers has been read. Here
    the answers' topics do not exist, and would be reported missing once read."""
    s = stack_settings.model_copy(
        update={"topics": Topics(prefix=f"replay-partition-{uuid.uuid4().hex[:6]}.")}
    )
    admin = AdminClient(s.client_config())
    proposals = s.topics.proposals
    admin.create_topics([NewTopic(proposals, num_partitions=2)])[proposals].result()
    deadline = time.monotonic() + 30
    while proposals not in admin.list_topics(timeout=10).topics:
        assert time.monotonic() < deadline, f"{proposals} never appeared"
        time.sleep(0.1)
    gates = replay_gates(s, ROOT / "contracts", s.policy_file)
    report = Report(
        int(time.time() * 1000) - 3_600_000, None, "contracts", gates.contracts.fingerprint,
        None, False, offsets=OffsetRange(proposals, 2),
    )  # fmt: skip
    with pytest.raises(OutOfRange, match="has no partition 2") as refused:
        replay(s, gates, unknown_references, report)
    assert refused.value.what == "partition"
    assert (report.missing, report.read) == ([], 0)
