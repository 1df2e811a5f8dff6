"""The life of one proposal, read back from the retained topics: ``toolsentry trace``.

A proposal leaves records on many topics, each naming whose it is: observations,
approval requests, approved calls and results carry its ``proposal_id``; an approval
names the ``request_id`` of the request it answers; a dead letter keeps the record that
could not be used, which names one or the other where it can be read at all. The range
is read once, keeping what could belong (the proposal's own records, every compensating
proposal's, every approval), and linked afterwards: which compensation and which
approvals belong is known only once the proposal's own records have been read.

A compensation is followed one level deep; its own compensation is not. Reading,
linking and the summary are separate so that only the first touches Kafka.

A run's view starts where an analyst usually does, from a run id: one row per proposal
of the run, each with the answer to its own record (the observation whose id is that
record's position, or the dead letter whose headers name it) and the last observation
under its id. It reads proposals, observations and the proposals' dead letters only.
"""

from __future__ import annotations

import shlex
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import orjson
from confluent_kafka import Message
from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from processor.approval_flow import EXPIRY_CHECK
from processor.approvals import shown_time
from processor.codec.avro import codec, decode_any
from processor.codec.records import (
    decode_approved_call,
    decode_result,
    headers_by_name,
    millis,
    position_id,
    printable,
)
from processor.config import SIDE_EFFECT_TOPIC_SUFFIXES, Settings, Topics
from processor.gates.parse import lenient_loads, unidentified_id
from processor.kafka.partitioner import partition_for
from processor.kafka.retained import RetainedReader
from processor.kafka.topics import topics_partitions
from processor.replay import recorded_dead_letter
from processor.results import compensation_proposal_id

Kind = Literal[
    "proposal", "observation", "approval request", "approval", "call", "result", "dead letter"
]
Role = Literal[
    "proposals",
    "observations",
    "approval_requests",
    "approvals",
    "execution",
    "results",
    "dead_letters",
]

COMPENSATION_ID_PREFIX = "comp_"
"""How ``compensation_proposal_id`` starts every id: records under such ids are kept while
reading, before it is known which compensation, if any, is this proposal's."""

GIST_TEXT = 160
"""Free text in a gist (a next action, result data, a reason) is cut here: the table
is for finding the record, not for reading it whole."""

_COMPENSATION_BYTES = COMPENSATION_ID_PREFIX.encode()

_RANK: dict[str, int] = {
    "proposal": 0,
    "dead letter": 1,
    "observation": 2,
    "approval request": 3,
    "call": 4,
    "approval": 5,
    "result": 6,
}
"""The order of records shown at the same time: a decision's observation before the
approval request or call it wrote with it."""

_WRITTEN_WITH_OBSERVATION = ("approval request", "call")
"""Kinds the processor writes in the transaction of a decision's observation. Its producer
stamps each record as it goes, the call first, so a call can carry an earlier time than
the observation that decided it: they are shown at the observation's time instead."""

_ANSWERED_BY_OTHERS = ("approval", "result")
"""Gates of observations that answer an approval or a result, not the proposal itself."""

_DLQ_REASON = "toolsentry.error.reason"
_DLQ_CUT = "toolsentry.value.truncated_from"
_DLQ_SOURCE = ("toolsentry.source.topic", "toolsentry.source.partition", "toolsentry.source.offset")

Gist = dict[str, str | int | None]


@dataclass(frozen=True, slots=True)
class Raw:
    """A record as read, before anything is made of its value."""

    topic: str
    partition: int
    offset: int
    time_ms: int
    value: bytes | None
    headers: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Entry:
    """One record of a life: where it is, what it is, and as much of it as a reader needs
    to find it. ``decided_ms`` is the decision time the processor wrote into it, which
    ties an observation to the approval request or call of the same decision.
    ``answers`` is the position id of the record an observation or a dead letter
    answers, which ties a decision to the very proposal record it decided."""

    kind: Kind
    topic: str
    partition: int
    offset: int
    time_ms: int
    decided_ms: int | None
    proposal_id: str | None
    gist: Gist
    request_id: str | None = None
    idempotency_key: str | None = None
    attempt: int | None = None
    compensation: bool = False
    run_id: str | None = None
    answers: str | None = None

    @property
    def position(self) -> str:
        return f"{self.topic}/{self.partition}@{self.offset}"

    @property
    def what(self) -> str:
        return f"compensation {self.kind}" if self.compensation else self.kind

    def gist_text(self, keys: tuple[str, ...] | None = None) -> str:
        """The gist as the table shows it (``keys`` of it only, when given): text from a
        record (a tool name, a reason) is anyone's, so a character that is not printable
        (a terminal's escape, a line break, a lone surrogate that no terminal encoding
        takes) is shown as its code."""
        shown = self.gist if keys is None else {k: self.gist.get(k) for k in keys}
        return " ".join(f"{k}={printable(str(v))}" for k, v in shown.items() if v not in (None, ""))

    def as_json(self) -> dict[str, Any]:
        return {
            "time": shown_time(self.time_ms),
            "time_ms": self.time_ms,
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "kind": self.kind,
            "compensation": self.compensation,
            "proposal_id": self.proposal_id,
            "request_id": self.request_id,
            "gist": self.gist,
        }


@dataclass(frozen=True, slots=True)
class Reading:
    """What was searched, and what of it could not be seen."""

    topics: list[str]
    since_ms: int | None
    until_ms: int | None
    undecodable: dict[str, int] = field(default_factory=dict)
    incomplete: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    errors: int = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "since": None if self.since_ms is None else shown_time(self.since_ms),
            "until": None if self.until_ms is None else shown_time(self.until_ms),
            "topics": self.topics,
            "undecodable": self.undecodable,
        }


@dataclass(frozen=True, slots=True)
class Trace:
    """One proposal's life as found in the range, with its last answer and what is off."""

    proposal_id: str
    entries: list[Entry]
    reading: Reading
    final: Entry | None
    warnings: list[str]

    @property
    def found(self) -> bool:
        return any(not e.compensation for e in self.entries)

    def as_json(self) -> dict[str, Any]:
        return {
            "proposal_id": self.proposal_id,
            "found": self.found,
            **self.reading.as_json(),
            "entries": [e.as_json() for e in self.entries],
            "final": None if self.final is None else self.final.as_json(),
            "warnings": self.warnings,
        }


# -- reading ------------------------------------------------------------------------------


def topic_roles(t: Topics) -> dict[str, Role]:
    roles: dict[str, Role] = {
        t.proposals: "proposals",
        t.observations: "observations",
        t.approval_requests: "approval_requests",
        t.approvals: "approvals",
        t.results: "results",
        t.dlq: "dead_letters",
        t.call_dlq: "dead_letters",
    }
    roles.update({t.execution(s): "execution" for s in SIDE_EFFECT_TOPIC_SUFFIXES})
    return roles


def run_partitions(settings: Settings, run_id: str) -> dict[str, set[int]]:
    """The partitions a run's records are on, for the topics the processor writes keyed
    by ``run_id`` (observations, approval requests, approved calls). Proposals, approvals,
    results and dead letters are keyed by whoever wrote them (an agent, an operator, an
    executor, the original record's key), so they are read whole."""
    t = settings.topics
    written = [
        t.observations,
        t.approval_requests,
        *(t.execution(s) for s in SIDE_EFFECT_TOPIC_SUFFIXES),
    ]
    # A topic left out of the answer does not exist: the reader reports it missing.
    counts = topics_partitions(settings, written)
    return {topic: {partition_for(run_id.encode(), n)} for topic, n in counts.items()}


def raw(m: Message) -> Raw:
    """The record as read, its headers as ``headers_by_name`` keeps them."""
    ts = m.timestamp()
    by_name, _ = headers_by_name(m.headers() or [])
    headers = {k: v for k, v in by_name.items() if isinstance(v, bytes)}
    return Raw(
        m.topic() or "", m.partition() or 0, m.offset() or 0, ts[1] if ts else 0, m.value(), headers
    )


def read_trace(
    settings: Settings,
    proposal_id: str,
    since_ms: int | None,
    until_ms: int | None,
    run_id: str | None = None,
) -> Trace:
    """Read the range once and make the proposal's life of it."""
    roles = topic_roles(settings.topics)
    partitions = run_partitions(settings, run_id) if run_id is not None else None
    reader = RetainedReader(
        settings, list(roles), since_ms=since_ms, until_ms=until_ms, partitions=partitions
    )
    undecodable: Counter[str] = Counter()
    needle = proposal_id.encode()
    # The same test collect() makes, before a Raw is built for every record of the range.
    near = (m for m in reader if may_name(roles[m.topic() or ""], m.value() or b"", needle))
    kept = list(collect(proposal_id, (raw(m) for m in near), roles, undecodable, run_id))
    reading = _reading(reader, undecodable)
    return assemble(proposal_id, kept, reading)


def _reading(reader: RetainedReader, undecodable: Counter[str]) -> Reading:
    """What a finished read searched, and what of it could not be seen."""
    return Reading(
        topics=list(reader.topics),
        since_ms=reader.since_ms,
        until_ms=reader.until_ms,
        undecodable=dict(sorted(undecodable.items())),
        incomplete=[
            f"{r.topic}/{r.partition} (at {r.reached} of {r.end})" for r in reader.incomplete
        ],
        missing=list(reader.missing),
        errors=reader.errors,
    )


def collect(
    proposal_id: str,
    records: Iterable[Raw],
    roles: dict[str, Role],
    undecodable: Counter[str],
    run_id: str | None = None,
) -> Iterator[Entry]:
    """The records that may belong to the proposal's life. Those whose bytes cannot name
    it are not decoded at all (``may_name``); those that may but cannot be read are
    counted by topic in ``undecodable``. Given its run, those that name another run are
    dropped: an agent may reuse a proposal id in another run."""
    needle = proposal_id.encode()
    for r in records:
        role = roles[r.topic]
        if not may_name(role, r.value or b"", needle):
            continue
        try:
            e = sight(role, r)
        except ValueError:
            undecodable[r.topic] += 1
            continue
        if e is None or not _may_belong(e, proposal_id):
            continue
        if run_id is None or e.run_id in (None, run_id):
            yield e


def may_name(role: Role, value: bytes, needle: bytes) -> bool:
    """Whether a record's bytes may name the proposal or a compensation. An id is written
    verbatim both in Avro (a string is its UTF-8 bytes) and in JSON without escapes, so a
    record holding neither the id nor ``comp_`` (nor, in JSON, a backslash) cannot be
    about it: most of a busy range is passed over without being decoded. Approvals and
    dead letters name a request, or keep a record that names one: they are always read."""
    if role in ("approvals", "dead_letters"):
        return True
    if needle in value or _COMPENSATION_BYTES in value:
        return True
    return role == "proposals" and b"\\" in value


def _may_belong(e: Entry, proposal_id: str) -> bool:
    if e.proposal_id is None:
        return e.request_id is not None or e.answers is not None
    return e.proposal_id == proposal_id or e.proposal_id.startswith(COMPENSATION_ID_PREFIX)


def sight(role: Role, r: Raw) -> Entry | None:
    """The entry a record makes; None for a dead letter that names nobody. ValueError for
    a record its topic should not hold (garbage, another schema, cut short)."""
    if role == "dead_letters":
        return _dead_letter(r)
    if not r.value:
        raise ValueError("no value")
    return _READERS[role](r, r.value)


def _entry(
    r: Raw, kind: Kind, decided_ms: int | None, proposal_id: str | None, gist: Gist, **links: Any
) -> Entry:
    """The entry a record makes, at the record's own place and time."""
    return Entry(
        kind, r.topic, r.partition, r.offset, r.time_ms, decided_ms, proposal_id, gist, **links
    )


def _proposal(r: Raw, value: bytes) -> Entry:
    doc = _json_object(value)
    if doc is None:
        raise ValueError("not a proposal")
    pid = doc.get("proposal_id")
    if not isinstance(pid, str):
        # A proposal without an id is still answered, under the id the processor gives it.
        pid = unidentified_id(r.topic, r.partition, r.offset)
    tool = doc.get("tool")
    name, version = (
        (tool.get("name"), tool.get("version")) if isinstance(tool, dict) else (None, None)
    )
    key = _text(doc.get("idempotency_key"))
    gist: Gist = {
        "tool": f"{_text(name)}@{_text(version) or 'newest'}",
        "run": _text(doc.get("run_id")),
        "tenant": _text(doc.get("tenant_id")),
        "key": key,
    }
    run = doc.get("run_id")
    return _entry(
        r,
        "proposal",
        None,
        pid,
        gist,
        idempotency_key=key,
        run_id=run if isinstance(run, str) else None,
    )


def _observation(r: Raw, value: bytes) -> Entry:
    d = codec("observation").decode(value)
    meta, status, payload = d["execution_metadata"], d["status"], d["result_payload"]
    errors = payload["errors"]
    gist: Gist = {
        "decision": d["decision"],
        "class": status["taxonomy_class"],
        "gate": d["gate"],
        "error": _clip(errors[0]["message"]) if errors else None,
    }
    # A completed call's answer is its data; any other observation's, what to do next.
    if d["decision"] == "COMPLETED":
        gist["data"] = _clip(payload["data"])
    else:
        gist["next"] = _clip(d["next_action"])
    return _entry(
        r,
        "observation",
        millis(meta["timestamp"]),
        d["proposal_id"],
        gist,
        request_id=d["approval_request_id"],
        idempotency_key=meta["idempotency_key"],
        attempt=meta["attempt_number"],
        run_id=d["run_id"],
        answers=d["observation_id"],
    )


def _approval_request(r: Raw, value: bytes) -> Entry:
    d = codec("approval_request").decode(value)
    gist: Gist = {
        "tool": f"{d['tool_name']}@{d['tool_version']}",
        "class": d["side_effect_class"],
        "approvals_required": d["approvals_required"],
        "expires": shown_time(millis(d["expires_at"])),
        "request": d["request_id"],
    }
    return _entry(
        r,
        "approval request",
        millis(d["created_at"]),
        d["proposal_id"],
        gist,
        request_id=d["request_id"],
        idempotency_key=d["idempotency_key"],
        run_id=d["run_id"],
    )


def _approval(r: Raw, value: bytes) -> Entry:
    doc = _json_object(value)
    rid = doc.get("request_id") if doc is not None else None
    if doc is None or not isinstance(rid, str):
        raise ValueError("not an approval")
    gist: Gist
    kind = doc.get("type")
    if kind == EXPIRY_CHECK:
        gist = {"check": "expiry", "request": _clip(rid)}
    elif kind is not None:
        # Dead-lettered as approval_unknown_type, never counted: not shown as the
        # decision whose fields it may carry.
        gist = {"type": _text(kind) or repr(kind)[:GIST_TEXT], "request": _clip(rid)}
    else:
        gist = {
            "approver": _text(doc.get("approver_id")),
            "decision": _text(doc.get("decision")),
            "reason": _clip(_text(doc.get("reason"))),
            "request": _clip(rid),
        }
    return _entry(r, "approval", None, None, gist, request_id=rid)


def _call(r: Raw, value: bytes) -> Entry:
    d = decode_approved_call(value)
    gist: Gist = {
        "tool": f"{d['tool_name']}@{d['tool_version']}",
        "class": d["side_effect_class"],
        "attempt": d["attempt"],
        "key": d["idempotency_key"],
    }
    return _entry(
        r,
        "call",
        d["created_at"],
        d["proposal_id"],
        gist,
        idempotency_key=d["idempotency_key"],
        attempt=d["attempt"],
        run_id=d["run_id"],
    )


def _result(r: Raw, value: bytes) -> Entry:
    d = decode_result(value)
    gist: Gist = {
        "outcome": d["outcome"],
        "error": d["error_code"],
        "committed": ",".join(d["committed_steps"]) or None,
        "attempt": d["attempt"],
        "executor": d["executor_id"],
    }
    return _entry(
        r,
        "result",
        None,
        d["proposal_id"],
        gist,
        idempotency_key=d["idempotency_key"],
        attempt=d["attempt"],
        run_id=d["run_id"],
    )


def _dead_letter(r: Raw) -> Entry | None:
    """A dead letter belongs to whoever the record it keeps names, if it can be read: a
    proposal's or an approval's JSON, or an Avro result or call. One that keeps too little
    to be read (a record too big for the DLQ is kept cut short) or names no id still
    answers the record at the position its headers name (``answers``)."""
    pid, rid = _named_ids(r.value or b"")
    try:
        (topic, partition, offset), _ = recorded_dead_letter([*r.headers.items()])
        answers: str | None = position_id(topic, partition, offset)
    except (KeyError, ValueError):
        answers = None
    if pid is None and rid is None and answers is None:
        return None
    h = r.headers
    source = "/".join(h.get(k, b"?").decode("utf-8", "replace") for k in _DLQ_SOURCE)
    gist: Gist = {
        "reason": _text(h.get(_DLQ_REASON, b"").decode("utf-8", "replace")) or "unknown",
        "source": source,
    }
    return _entry(r, "dead letter", None, pid, gist, request_id=rid, answers=answers)


def _named_ids(value: bytes) -> tuple[str | None, str | None]:
    """The proposal id or request id the kept record names, as far as it can be read."""
    doc = _json_object(value)
    if doc is not None:
        pid, rid = doc.get("proposal_id"), doc.get("request_id")
        return (pid if isinstance(pid, str) else None, rid if isinstance(rid, str) else None)
    try:
        d = decode_any(value, ("tool_result", "approved_call"))
    except ValueError:
        return None, None
    return d["proposal_id"], None


_READERS = {
    "proposals": _proposal,
    "observations": _observation,
    "approval_requests": _approval_request,
    "approvals": _approval,
    "execution": _call,
    "results": _result,
}


def _json_object(value: bytes) -> dict[str, Any] | None:
    """A JSON object as the processor reads one: strictly, else by the lenient reader it
    falls back to (NaN, say), so a proposal the processor decided is found here too."""
    try:
        doc = orjson.loads(value)
    except orjson.JSONDecodeError:
        try:
            doc = lenient_loads(value)
        except ValueError:
            return None
    return doc if isinstance(doc, dict) else None


def _text(value: Any) -> str | None:
    return _clip(value) if isinstance(value, str) else None


def _clip(text: str | None) -> str | None:
    if text is None or len(text) <= GIST_TEXT:
        return text
    return text[: GIST_TEXT - 1] + "\u2026"


# -- linking and the summary -------------------------------------------------------------


def link(proposal_id: str, kept: Iterable[Entry]) -> list[Entry]:
    """The proposal's records, its compensation's (the one the processor proposes under a
    key its calls ran with), and the approvals and dead letters of either's requests, in
    the order they happened."""
    seen = list(kept)
    own = [e for e in seen if e.proposal_id == proposal_id]
    # Only a call's key: the processor writes calls, and compensates only what one ran.
    # An observation repeats whatever key the agent sent, another call's included.
    keys = {e.idempotency_key for e in own if e.idempotency_key and e.kind == "call"}
    compensations = {compensation_proposal_id(k) for k in keys} - {proposal_id}
    theirs = [replace(e, compensation=True) for e in seen if e.proposal_id in compensations]
    requests = {e.request_id: e.compensation for e in (*own, *theirs) if e.request_id}
    answers = [
        replace(e, compensation=requests[e.request_id])
        for e in seen
        if e.proposal_id is None and e.request_id in requests
    ]
    # Dead letters that keep too little of a proposal record to name it, by its position.
    proposed = {
        position_id(e.topic, e.partition, e.offset): e
        for e in (*own, *theirs)
        if e.kind == "proposal"
    }
    unnamed = [
        replace(e, proposal_id=p.proposal_id, compensation=p.compensation)
        for e in seen
        if e.proposal_id is None and e.request_id is None and (p := proposed.get(e.answers or ""))
    ]
    life = [*own, *theirs, *answers, *unnamed]
    observed = {(e.proposal_id, e.decided_ms): e.time_ms for e in life if e.kind == "observation"}

    def order(e: Entry) -> tuple[int, int, str, int, int]:
        at = e.time_ms
        if e.kind in _WRITTEN_WITH_OBSERVATION:
            at = observed.get((e.proposal_id, e.decided_ms), at)
        return at, _RANK[e.kind], e.topic, e.partition, e.offset

    return sorted(life, key=order)


def assemble(proposal_id: str, kept: Iterable[Entry], reading: Reading) -> Trace:
    entries = link(proposal_id, kept)
    said = [e for e in entries if e.kind == "observation" and not e.compensation]
    if not said:
        # A proposal dead-lettered has no observation: the dead letter of its record is.
        records = {
            position_id(e.topic, e.partition, e.offset)
            for e in entries
            if e.kind == "proposal" and not e.compensation
        }
        said = [e for e in entries if e.kind == "dead letter" and e.answers in records]
    final = None
    for e in said:
        if final is None or _written_after(e, final):
            final = e
    return Trace(proposal_id, entries, reading, final, warnings(entries, reading))


def _written_after(e: Entry, than: Entry) -> bool:
    """Whether ``e`` was written after ``than``. In one partition (a run's observations
    are all in its own) the log's order says; elsewhere the records' times, which their
    producers stamp, each by its own clock."""
    if (e.topic, e.partition) == (than.topic, than.partition):
        return e.offset > than.offset
    return e.time_ms >= than.time_ms


def warnings(entries: list[Entry], reading: Reading) -> list[str]:
    """What an analyst should not take the table for granted on."""
    own = [e for e in entries if not e.compensation]
    out: list[str] = []
    if own:
        out += _decision_warnings(own)
    out += [_unanswered(c) for c in entries if c.kind == "call" and not _has_result(c, entries)]
    return out + _reading_warnings(reading)


def _decision_warnings(own: list[Entry]) -> list[str]:
    out: list[str] = []
    proposed = sum(e.kind == "proposal" for e in own)
    decisions = [
        e for e in own if e.kind == "observation" and e.gist["gate"] not in _ANSWERED_BY_OTHERS
    ]
    if proposed == 0:
        out.append("its proposal is not in the range: proposed before --since, or unreadable")
    elif proposed > 1:
        out.append(f"proposed {proposed} times under this id")
    if len(decisions) > 1:
        out.append(f"{len(decisions)} decision observations, one expected")
    runs = sorted({e.run_id for e in own if e.run_id is not None})
    if len(runs) > 1:
        # (an id reused by another run: its records are not this proposal's life, and the
        # last answer shown may be the other run's)
        named = ", ".join(printable(r, 40) for r in runs[:3]) + (", ..." if len(runs) > 3 else "")
        out.append(f"the id is used by {len(runs)} runs ({named}): --run-id shows one run's")
    if proposed and not decisions and not any(e.kind == "dead letter" for e in own):
        out.append("no decision observation in range: not decided yet, or after --until")
    return out


def _has_result(call: Entry, entries: list[Entry]) -> bool:
    return any(
        e.kind == "result" and e.proposal_id == call.proposal_id and e.attempt == call.attempt
        for e in entries
    )


def _unanswered(call: Entry) -> str:
    return (
        f"the {call.what} of attempt {call.attempt} ({call.position}, {shown_time(call.time_ms)}) "
        "has no result in range"
    )


def _reading_warnings(
    r: Reading,
    named: str = "it",
    why: str = "they hold its id or a compensation's, or are approvals or dead letters",
) -> list[str]:
    out: list[str] = []
    if r.undecodable:
        counts = ", ".join(f"{t}: {n}" for t, n in r.undecodable.items())
        total = sum(r.undecodable.values())
        out.append(
            f"{total} record(s) that may name {named} could not be decoded ({counts}): {why}"
        )
    if r.incomplete:
        out.append(f"partitions not read to their end: {', '.join(r.incomplete)}")
    if r.missing:
        out.append(f"topics missing: {', '.join(r.missing)}")
    if r.errors:
        out.append(f"{r.errors} error(s) while reading (see the log)")
    return out


# -- for a terminal -----------------------------------------------------------------------


def render(found: Trace) -> Iterator[RenderableType]:
    """The trace as the command prints it: the table of its life and its final answer
    (or what was searched, when nothing was found), then the warnings."""
    r = found.reading
    if not found.found:
        yield _alarm(
            "not found",
            f": no record of {found.proposal_id} in {_span(r)} on {', '.join(r.topics)}",
        )
    else:
        table = Table("time (UTC)", "record", "what", "gist")
        for e in found.entries:
            style = "red" if e.kind == "dead letter" else "magenta" if e.compensation else ""
            table.add_row(
                Text(shown_time(e.time_ms)),
                Text(e.position),
                Text(e.what, style),
                Text(e.gist_text()),
            )
        yield table
        last = found.final
        answer = (
            "none in range" if last is None else f"{last.gist_text()} at {shown_time(last.time_ms)}"
        )
        if last is not None and last.kind == "dead letter":
            answer = f"dead letter: {answer}"
        yield Text.assemble(("final answer: ", "bold"), answer)
    for warning in found.warnings:
        yield _alarm("warning", f": {warning}")


def _span(r: Reading) -> str:
    since = "the earliest" if r.since_ms is None else shown_time(r.since_ms)
    return f"{since} .. {'now' if r.until_ms is None else shown_time(r.until_ms)}"


def _alarm(head: str, rest: str) -> Text:
    return Text.assemble((head, "red"), rest)


# -- a run's view -------------------------------------------------------------------------

DECISION_KEYS = ("decision", "class", "gate")
"""What a row shows of the answer to a proposal's record."""

ANSWER_KEYS = (*DECISION_KEYS, "next", "data", "reason")
"""What a row shows of its last answer: what the model was told to do next, the data a
completed call returned, or why its record was dead-lettered."""

UNDECIDED = "undecided"
"""The final class of a proposal nothing in range answered."""


@dataclass(frozen=True, slots=True)
class RunRow:
    """One proposal record of a run, the answer to that very record (an observation or a
    dead letter), and the last observation under its id (an approval's end, a result's),
    else that answer."""

    proposal: Entry
    decision: Entry | None
    last: Entry | None

    @property
    def final_class(self) -> str:
        return UNDECIDED if self.last is None else str(self.last.gist["class"])

    def as_json(self) -> dict[str, Any]:
        p = self.proposal
        return {
            "time": shown_time(p.time_ms),
            "time_ms": p.time_ms,
            "topic": p.topic,
            "partition": p.partition,
            "offset": p.offset,
            "proposal_id": p.proposal_id,
            "tool": p.gist["tool"],
            "decision": None if self.decision is None else self.decision.as_json(),
            "last": None if self.last is None else self.last.as_json(),
        }


@dataclass(frozen=True, slots=True)
class RunView:
    """A run's proposals as found in the range, in the order they were written."""

    run_id: str
    rows: list[RunRow]
    reading: Reading
    warnings: list[str]

    @property
    def found(self) -> bool:
        return bool(self.rows)

    def finals(self) -> dict[str, int]:
        """How many proposals ended in each taxonomy class, the commonest first."""
        return dict(Counter(row.final_class for row in self.rows).most_common())

    def as_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "found": self.found,
            **self.reading.as_json(),
            "rows": [row.as_json() for row in self.rows],
            "summary": {"proposals": len(self.rows), "final_classes": self.finals()},
            "warnings": self.warnings,
        }


def run_roles(t: Topics) -> dict[str, Role]:
    """The topics a run's view reads: what was proposed, and what answered it."""
    return {t.proposals: "proposals", t.observations: "observations", t.dlq: "dead_letters"}


def read_run(
    settings: Settings, run_id: str, since_ms: int | None, until_ms: int | None
) -> RunView:
    """Read the range once and make the run's view of it."""
    roles = run_roles(settings.topics)
    reader = RetainedReader(
        settings,
        list(roles),
        since_ms=since_ms,
        until_ms=until_ms,
        partitions=run_partitions(settings, run_id),
    )
    undecodable: Counter[str] = Counter()
    needle = run_id.encode()
    # The test collect_run() makes on the bytes, before a Raw is built for every record
    # of the range; a dead letter's headers are needed to finish it.
    near = (
        m
        for m in reader
        if roles[m.topic() or ""] == "dead_letters"
        or may_name_run(roles[m.topic() or ""], m.value() or b"", needle)
    )
    kept = list(collect_run(run_id, (raw(m) for m in near), roles, undecodable))
    reading = _reading(reader, undecodable)
    return assemble_run(run_id, kept, reading)


def collect_run(
    run_id: str, records: Iterable[Raw], roles: dict[str, Role], undecodable: Counter[str]
) -> Iterator[Entry]:
    """The run's proposals and observations, and the dead letters that may answer its
    proposals. Records whose bytes cannot name the run are not decoded at all
    (``may_name_run``); those that may but cannot be read are counted by topic in
    ``undecodable``; those that are read and name another run are dropped."""
    needle = run_id.encode()
    for r in records:
        role = roles[r.topic]
        cut = role == "dead_letters" and _DLQ_CUT in r.headers
        if not may_name_run(role, r.value or b"", needle, cut):
            continue
        try:
            e = _answering_dead_letter(r) if role == "dead_letters" else sight(role, r)
        except ValueError:
            undecodable[r.topic] += 1
            continue
        if e is not None and (role == "dead_letters" or e.run_id == run_id):
            yield e


def may_name_run(role: Role, value: bytes, needle: bytes, cut: bool = False) -> bool:
    """Whether a record's bytes may name the run. A run id is written verbatim in Avro, so
    an observation without it is another run's. A proposal is JSON, which may spell it
    with escapes (a backslash); a dead letter keeps the proposal's bytes, escapes and
    all, or only their start when they were too big (``cut``)."""
    if needle in value:
        return True
    if role == "observations":
        return False
    return b"\\" in value or cut


def _answering_dead_letter(r: Raw) -> Entry:
    """A dead letter as the answer to the record whose position its headers name, worded
    as replay words it. ValueError for headers that do not say."""
    pairs: list[tuple[str, str | bytes | None]] = [*r.headers.items()]
    try:
        (topic, partition, offset), recorded = recorded_dead_letter(pairs)
    except KeyError:
        raise ValueError("a dead letter without its source") from None
    v = recorded.verdict
    gist: Gist = {
        "decision": v.decision,
        "class": v.taxonomy,
        "gate": v.gate,
        "reason": _text(r.headers.get(_DLQ_REASON, b"").decode("utf-8", "replace")),
    }
    return _entry(r, "dead letter", None, None, gist, answers=position_id(topic, partition, offset))


def assemble_run(run_id: str, kept: Iterable[Entry], reading: Reading) -> RunView:
    """One row per proposal record of the run, in the order written; its decision is the
    first answer to that very record, so a proposal sent twice under one id gets each
    record's own."""
    seen = sorted(kept, key=lambda e: (e.time_ms, e.topic, e.partition, e.offset))
    first: dict[str, Entry] = {}
    last: dict[str | None, Entry] = {}
    for e in seen:
        if e.answers is not None:
            first.setdefault(e.answers, e)
        if e.kind == "observation":
            before = last.get(e.proposal_id)
            if before is None or _written_after(e, before):
                last[e.proposal_id] = e
    rows = []
    for p in seen:
        if p.kind == "proposal":
            decision = first.get(position_id(p.topic, p.partition, p.offset))
            rows.append(RunRow(p, decision, last.get(p.proposal_id, decision)))
    return RunView(run_id, rows, reading, run_warnings(rows, reading))


def run_warnings(rows: list[RunRow], reading: Reading) -> list[str]:
    """What an analyst should not take the run's table for granted on."""
    out: list[str] = []
    undecided = sum(row.decision is None for row in rows)
    if undecided:
        out.append(
            f"{undecided} proposal(s) with no decision in range: not decided yet, or after --until"
        )
    why = "they hold its id or JSON escapes, or are dead letters cut short"
    return out + _reading_warnings(reading, "the run", why)


def render_run(view: RunView) -> Iterator[RenderableType]:
    """The run's view as the command prints it: its table and a summary (or what was
    searched, when nothing was found), the warnings, and how to see one row whole."""
    r = view.reading
    run = printable(view.run_id)
    if not view.found:
        yield _alarm(
            "not found", f": no proposal of run {run} in {_span(r)} on {', '.join(r.topics)}"
        )
    else:
        table = Table("time (UTC)", "proposal", "tool", "decision", "last answer")
        for row in view.rows:
            p = row.proposal
            table.add_row(
                Text(shown_time(p.time_ms)),
                Text(printable(p.proposal_id or "")),
                Text(printable(str(p.gist["tool"]))),
                _answer_text(row.decision, DECISION_KEYS),
                _answer_text(row.last, ANSWER_KEYS),
            )
        yield table
        finals = ", ".join(f"{c} {n}" for c, n in view.finals().items())
        yield Text.assemble(
            ("summary: ", "bold"), f"{len(view.rows)} proposal(s), by final class: {finals}"
        )
    for warning in view.warnings:
        yield _alarm("warning", f": {warning}")
    if view.found:
        again = shlex.quote(view.run_id) if view.run_id.isprintable() else run
        yield Text(f"the whole life of one: toolsentry trace PROPOSAL_ID --run-id {again}")


def _answer_text(e: Entry | None, keys: tuple[str, ...]) -> Text:
    if e is None:
        return Text("none in range", "red")
    return Text(e.gist_text(keys), "red" if e.kind == "dead letter" else "")
