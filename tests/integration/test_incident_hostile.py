"""``trace`` and ``replay`` over topics that hold garbage, against the real broker: the
records an incident leaves (tombstones, other encodings, schemas this version does not
have, records cut short, nesting, NaN, duplicate keys, dead letters whose headers are
missing, garbled or given twice, times no calendar holds, another run under the same
ids) are counted or shown escaped, and the good records among them are still found and
compared on the right basis.

The good records are made by the processor's own encoders from a real decision at their
real positions; nothing else runs.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import orjson
import pytest
from confluent_kafka import Producer

from processor.codec.avro import MAGIC, codec
from processor.codec.records import encode_observation
from processor.config import Settings
from processor.kafka.partitioner import partition_for
from processor.kafka.topics import topics_partitions
from processor.model import SourceRecord
from processor.pipeline import Gates, decide_batch_at
from processor.replay import Match, Report, replay, replay_gates, unknown_references
from processor.replay import render as render_report
from processor.trace import read_run, read_trace, render, render_run
from tests.integration.harness import ROOT, isolated
from tests.unit.helpers import printed

pytestmark = pytest.mark.integration

DUPLICATED = 5
"""The offset of the proposal with a key given twice, which the processor dead-letters."""


@dataclass
class Hostile:
    settings: Settings
    gates: Gates
    since_ms: int
    pid: str
    run: str
    good: tuple[str, int, int]
    """Where the good proposal is."""


def _put(
    p: Producer,
    topic: str,
    value: bytes | None,
    *,
    partition: int = 0,
    headers: list[tuple[str, bytes]] | None = None,
    ts: int = 0,
) -> int:
    """Write one record and wait for it: its offset."""
    done: list[int] = []
    p.produce(
        topic, value, key=b"k", partition=partition, headers=headers or [],
        timestamp=ts, on_delivery=lambda err, m: done.append(-1 if err else m.offset()),
    )  # fmt: skip
    p.flush(30)
    assert len(done) == 1 and done[0] >= 0
    return done[0]


def _dead_letter(
    pid: str, run: str, topic: str, partition: bytes, offset: bytes, cls: bytes
) -> tuple[bytes, list[tuple[str, bytes]]]:
    """A dead letter that keeps a record naming the proposal, and headers saying where."""
    return orjson.dumps({"proposal_id": pid, "run_id": run}), [
        ("toolsentry.error.class", cls),
        ("toolsentry.error.gate", b"parse"),
        ("toolsentry.error.reason", b"duplicate_key"),
        ("toolsentry.source.topic", topic.encode()),
        ("toolsentry.source.partition", partition),
        ("toolsentry.source.offset", offset),
    ]


@pytest.fixture(scope="module")
def hostile(stack_settings: Settings) -> Hostile:
    s = isolated(stack_settings, f"hostile-{uuid.uuid4().hex[:6]}")
    t = s.topics
    gates = replay_gates(s, ROOT / "contracts", s.policy_file)
    pid, run = f"prop-{uuid.uuid4().hex[:8]}", f"run-{uuid.uuid4().hex[:8]}"
    n = topics_partitions(s, [t.observations])[t.observations]
    obs_partition = partition_for(run.encode(), n)
    since_ms = int(time.time() * 1000) - 1000
    p = Producer(s.client_config())
    named = pid.encode() + b" " + run.encode()
    env = {
        "proposal_id": pid, "run_id": run, "tenant_id": "acme",
        "tool": {"name": "lookup_order"}, "arguments": {"order_id": "WO-55502-A"},
    }  # fmt: skip
    # The proposals topic, the good proposal among garbage that names it.
    for value in (
        None,
        b"",
        b"\xff\xfe\x00 random " + named,
        b'{"proposal_id": "' + pid.encode() + b'", "a": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        orjson.dumps({**env, "tool": {"name": "x\x1b]0;owned\x07\x1b[2J"}}).replace(
            b'"tenant_id"', b'"n": NaN, "tenant_id"'
        ),
        b'{"proposal_id": "%s", "run_id": "%s", "run_id": "%s"}'
        % (pid.encode(), run.encode(), run.encode()),
        codec("observation").header + b"\x00" * 5 + named,
        orjson.dumps({**env, "run_id": "run-other"}),
        b'{"proposal_id": "%s", "run_id": "%s", "tool": {"name": "\xff\xfe"}}'
        % (pid.encode(), run.encode()),
    ):
        _put(p, t.proposals, value)
    value = orjson.dumps(env)
    good = (t.proposals, 0, _put(p, t.proposals, value))
    decided_ms = int(time.time() * 1000)
    [d] = decide_batch_at(
        [SourceRecord(*good, b"k", value, decided_ms)], gates, lambda src: decided_ms,
        unknown_references,
    )  # fmt: skip
    observation = encode_observation(d, gates.contracts.fingerprint)
    # The observations: the good one, garbage that names the proposal, another run's.
    for value in (
        observation[:-9],
        MAGIC + b"\x01" * 8 + named,
        b'{"proposal_id": "%s", "run_id": "%s"}' % (pid.encode(), run.encode()),
        observation.replace(b"identity", b"\x1b[2Jiden", 1),
        observation,
    ):
        _put(p, t.observations, value, partition=obs_partition)
    # Dead letters of the proposal the processor dead-letters (a key given twice, at
    # DUPLICATED), each garbled one way: none may be taken for its answer.
    parse = b"SYNTACTIC_PARSE_FAIL"
    where = str(DUPLICATED).encode()
    for partition, offset, cls in (
        (b"0", where, b"\x1b[31m" + parse),
        (b"0", b" %s\n" % where, parse),
        (b"0", "\u0665".encode(), parse),  # 5 in Arabic-Indic digits
        (b"0", b"\xff\xfe", parse),
        (b"-1", where, parse),
    ):
        value, headers = _dead_letter(pid, run, t.proposals, partition, offset, cls)
        _put(p, t.dlq, value, headers=headers)
    value, headers = _dead_letter(pid, run, t.proposals, b"0", where, parse)
    _put(p, t.dlq, value, headers=[*headers, ("toolsentry.source.offset", b"0")])
    _put(p, t.dlq, value, headers=[(k, b"\xff\xfe") for k, _ in headers])
    _put(p, t.dlq, None)
    # A proposal of the run stamped at the epoch's start, after the rest: still read.
    _put(p, t.proposals, orjson.dumps(env), ts=1)
    return Hostile(s, gates, since_ms, pid, run, good)


def test_a_trace_shows_the_good_records_among_garbage_and_counts_the_rest(
    hostile: Hostile,
) -> None:
    h = hostile
    topics = h.settings.topics
    t = read_trace(h.settings, h.pid, h.since_ms, None, h.run)
    proposals = [e for e in t.entries if e.kind == "proposal"]
    # The one stamped at the epoch's start, the NaN one, the one with a key given twice,
    # its own; not another run's, nor the one that is not UTF-8 (counted).
    assert [e.offset for e in proposals] == [10, 4, DUPLICATED, 9]
    assert {e.gist["run"] for e in proposals} == {h.run}
    observations = [e.offset for e in t.entries if e.kind == "observation"]
    assert observations == [3, 4]  # the one with a gate no processor writes, shown escaped
    assert t.final is not None and t.final.offset == 4
    assert t.reading.undecodable == {topics.observations: 3, topics.proposals: 4}
    text = printed(render(t))
    assert "\x1b" not in text and "\\u001b" in text
    assert "1970-01-01T00:00:00.001Z" in text
    assert orjson.loads(orjson.dumps(t.as_json()))["found"] is True


def test_a_runs_view_takes_no_garbled_dead_letter_for_an_answer(hostile: Hostile) -> None:
    h = hostile
    view = read_run(h.settings, h.run, h.since_ms, None)
    by_offset = {r.proposal.offset: r for r in view.rows}
    assert DUPLICATED in by_offset and by_offset[DUPLICATED].decision is None
    # The first observation of its position is the one whose gate no processor writes:
    # shown as it is, escaped.
    good = by_offset[h.good[2]]
    assert good.decision is not None and good.decision.offset == 3
    assert view.reading.undecodable[h.settings.topics.dlq] == 7
    text = printed(render_run(view))
    assert "\x1b" not in text and "gate=\\u001b[2Jiden" in text


def test_a_replay_compares_the_good_proposal_and_takes_no_garbage_for_an_answer(
    hostile: Hostile,
) -> None:
    h = hostile
    report = Report(h.since_ms, None, "contracts", h.gates.contracts.fingerprint, None, False)
    replay(h.settings, h.gates, unknown_references, report, slack_ms=60_000)
    assert report.read == 11
    assert report.counts[Match.SAME] == 1, report.as_dict()
    assert report.counts[Match.UNRECORDED] == 10, report.as_dict()
    # Four observations (cut short, an unknown schema, JSON, a gate no processor writes),
    # seven garbled dead letters and a tombstone.
    assert report.unreadable == 12
    assert "\x1b" not in printed(render_report(report.as_dict()))
