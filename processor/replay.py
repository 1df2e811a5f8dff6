"""Replay: the retained proposals of a time range, or of an offset range of one
partition, decided again, in dry run, and compared with what was decided then.

The decision is a pure function of the record, the gates' configuration and the reference
data (see ``pipeline``), so deciding a retained proposal again against other contracts or
another policy says exactly what they would have decided, with two limits stated in every
report: the reference data is today's, read from Redis, not the data as it was; and what
Redis admits (idempotency, budgets, rate limits, the loop and repair guards), what people
approve later and what executors return are not decided again. Nothing is written: the
topics are read through ``RetainedReader`` (no group, nothing committed), and Redis is
only asked for reference data.

Each proposal is decided at the time the processor decided it (its observation's
timestamp, or its dead letter's; its record's time where nothing recorded says), so a
token that has expired since, or a version sunsetted since, is judged as it stood then,
a backlog's delay included. The recorded answers are read first for that reason. What
was decided is the observation that answered the proposal's own record, found by its id
(a digest of the record's position, see ``codec.records.observation_id``), not by
``proposal_id``: an agent may reuse a proposal id in another run, and a parked call's end
or a routed call's result answers the same proposal id from another record. A proposal
the processor dead-lettered has no observation: its dead letter, which names the
record's position and the gate that decided it in its headers, is what was decided. A
decision is encoded as the processor encodes it (``encode_outputs``), so one whose
outputs the processor could not write is replayed as the same dead letter.

An offset range is read twice: once for its records' earliest and latest times, which
bound when their answers were written (producers stamp their own records, so times need
not follow offsets, and a range's ends alone would miss answers), then to decide it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Message
from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from processor.app import MESSAGE_MAX_BYTES, RECORD_OVERHEAD, max_output_bytes
from processor.approvals import load_approvers, shown_time
from processor.codec.avro import codec
from processor.codec.records import (
    ENCODING_FAILED,
    PLATFORM_FAULTS,
    dlq_headers,
    encode_outputs,
    headers_by_name,
    millis,
    observation_id,
    observation_record,
    position_id,
    printable,
    tool_name,
    unencodable,
)
from processor.config import Settings
from processor.contracts.registry import load_contracts
from processor.gates.parse import Limits
from processor.gates.semantic import RefAnswers, RefKey
from processor.identity import Verifier
from processor.kafka.offsets import source_record
from processor.kafka.retained import BATCH, OffsetRange, RetainedReader
from processor.kafka.topics import topics_partitions
from processor.model import Decision, Gate, Outcome, SourceRecord, TaxonomyClass
from processor.pipeline import Gates, Lookup, decide_batch_at
from processor.policy import load_policy
from processor.results import ADMITTED, is_compensation, refused_compensation
from processor.state.connection import REDIS_ERRORS, connect
from processor.state.references import ReferencesLoading, ReferenceStore

logger = logging.getLogger(__name__)

DEAD_LETTER = "DEAD_LETTER"
"""The decision word of a proposal answered on the DLQ instead of with an observation."""

ADMISSION_GATES = frozenset({Gate.BUDGET.value, Gate.IDEMPOTENCY.value})
APPROVAL_REUSED = "approval_reused"
"""The error code of the one refusal Redis gives under another gate's name (confirmation):
an attached approval some other call has already spent."""

NOT_REPLAYED = (
    "admission in Redis (idempotency, budgets, rate limits, the loop and repair guards)",
    "approvals given by people after a call was parked",
    "executors' results",
)

_ANSWERS_OF_OTHER_RECORDS = frozenset({Gate.APPROVAL.value, Gate.RESULT.value})
"""Gates of observations that answer an approval or an executor's result, whose ids come
from those records' positions: never a proposal's decision, so not held in memory."""

_GATES = frozenset(g.value for g in Gate)
_CLASSES = frozenset(c.value for c in TaxonomyClass)
"""The gates and classes a processor writes: a recorded verdict naming another is garbage,
never compared."""

DEFAULT_SLACK_MS = 300_000
"""How long after ``until`` an answer is still looked for: a proposal near the end of the
range is answered a little later, more so under a backlog."""

DEFAULT_MAX_OUTPUT_BYTES = MESSAGE_MAX_BYTES - RECORD_OVERHEAD
"""The largest output of a processor whose settings leave message.max.bytes alone."""

UNKNOWN_GATE = "unknown"
"""The gate of a dead letter that does not name its own (written before dead letters
did) and whose reason does not imply one: an output that could not be encoded, after
whichever gate decided it."""

_LABEL = 64


class ReplayError(Exception):
    """The replay cannot be carried out as asked (reference data unreachable or loading)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """A decision as an observation words it: what the comparison is made on."""

    decision: str
    taxonomy: str
    gate: str

    def __str__(self) -> str:
        return f"{self.decision} {self.taxonomy} @{self.gate}"

    def as_dict(self) -> dict[str, str]:
        return {"decision": self.decision, "taxonomy_class": self.taxonomy, "gate": self.gate}


@dataclass(frozen=True, slots=True)
class Recorded:
    """What was decided then, and when. ``admission``: decided by Redis, after every
    gate. ``decided_ms``: the time the processor decided at, which the replay decides at
    too; for a dead letter, the time it was written, in the transaction of its decision
    (an output that could not be encoded was decided by gates that read the clock)."""

    verdict: Verdict
    admission: bool
    contract_set: str | None = None
    decided_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Replayed:
    """One proposal decided again, reduced to what the report needs."""

    observation_id: str
    position: tuple[str, int, int]
    proposal_id: str | None
    run_id: str | None
    tool: str
    compensation: bool
    verdict: Verdict
    next_action: str


class Match(StrEnum):
    SAME = "same"
    CHANGED = "changed"
    ADMISSION = "admission_not_replayed"
    UNRECORDED = "no_recorded_decision"


def compare(recorded: Recorded | None, replayed: Verdict) -> Match:
    """How a replayed decision stands against the recorded one.

    Admission runs after every gate and sees refused proposals too (they are steps of
    their run; the repair guard counts them), so whatever the gates say now, a proposal
    Redis decided would meet Redis again: only a dead letter, which never reaches it, can
    be compared with it."""
    if recorded is None:
        return Match.UNRECORDED
    if recorded.admission and replayed.decision != DEAD_LETTER:
        return Match.ADMISSION
    then = recorded.verdict
    if then.gate == UNKNOWN_GATE:
        # All the record says; the gate is not held against the replay.
        then = dataclasses.replace(then, gate=replayed.gate)
    return Match.SAME if then == replayed else Match.CHANGED


def recorded_observation(obs: dict[str, Any]) -> Recorded:
    """What a decoded observation says was decided."""
    verdict = Verdict(obs["decision"], obs["status"]["taxonomy_class"], obs["gate"])
    if verdict.gate not in _GATES:
        # The schema leaves the gate free text: a record no processor wrote.
        raise ValueError(f"an observation decided by no gate: {verdict.gate!r}")
    codes = {e["code"] for e in obs["result_payload"]["errors"]}
    admission = verdict.gate in ADMISSION_GATES or APPROVAL_REUSED in codes
    decided_ms = millis(obs["execution_metadata"]["timestamp"])
    return Recorded(verdict, admission, obs.get("contract_set"), decided_ms)


Headers = list[tuple[str, str | bytes | None]] | dict[str, str | bytes | None]


def _header(headers: dict[str, str | bytes], name: str) -> str:
    value = headers[f"toolsentry.{name}"]
    return value.decode() if isinstance(value, bytes) else value


def _number(headers: dict[str, str | bytes], name: str) -> int:
    """A partition or an offset as the processor writes it: ASCII digits only (``int``
    would also take spaces, signs, underscores and other scripts' digits)."""
    text = _header(headers, name)
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"toolsentry.{name} is not a number: {text!r}")
    return int(text)


def recorded_dead_letter(headers: Headers) -> tuple[tuple[str, int, int], Recorded]:
    """The position of the record a dead letter stands for, and the verdict it carries.
    KeyError or ValueError (UnicodeDecodeError among them) for a record whose headers do
    not say, or say what no processor writes: a class or gate it does not have, a position
    not written in ASCII digits, a header given twice. A dead letter after an admission
    gate (an output that could not be encoded once Redis had decided) is admission's, as
    its observation would have been."""
    h, twice = headers_by_name(headers)
    if twice:
        raise ValueError(f"{sorted(twice)} given twice, with different values")
    position = (
        _header(h, "source.topic"),
        _number(h, "source.partition"),
        _number(h, "source.offset"),
    )
    taxonomy, reason = _header(h, "error.class"), _header(h, "error.reason")
    gate = _dead_letter_gate(h, reason, taxonomy)
    if taxonomy not in _CLASSES or gate not in _GATES | {UNKNOWN_GATE}:
        # Compared as written, a garbled class or gate would read as a changed decision.
        raise ValueError(f"a dead letter of no known class and gate: {taxonomy!r} @{gate!r}")
    if reason in PLATFORM_FAULTS and "toolsentry.error.gate" not in h:
        # Written before dead letters named their gate, when the platform's own faults
        # were classed as parse failures: read as today's processor classes them.
        taxonomy = TaxonomyClass.UNKNOWN_ERROR.value
    verdict = Verdict(DEAD_LETTER, taxonomy, gate)
    return position, Recorded(verdict, gate in ADMISSION_GATES)


def _dead_letter_gate(h: dict[str, str | bytes], reason: str, taxonomy: str) -> str:
    """The gate a dead letter names; for one written before dead letters named it, the
    gate its reason and class imply (an unusable approval is a confirmation problem, the
    results' reasons all start ``result_``)."""
    if "toolsentry.error.gate" in h:
        return _header(h, "error.gate")
    if taxonomy == TaxonomyClass.CONFIRMATION_MISSING.value:
        return Gate.APPROVAL.value
    if reason == "internal_error":
        return Gate.INTERNAL.value
    if reason == ENCODING_FAILED:
        return UNKNOWN_GATE
    if reason.startswith("result_"):
        return Gate.RESULT.value
    return Gate.PARSE.value


def replayed(d: Decision, contract_set: str, max_bytes: int = DEFAULT_MAX_OUTPUT_BYTES) -> Replayed:
    """The replayed decision worded as the processor would have answered it: encoded by
    the processor's own function against its output limit (``max_bytes``), so outputs it
    could not write are the same dead letter; then worded through the observation's own
    builder, or the dead letter's headers."""
    src = d.source
    where = (src.topic, src.partition, src.offset)
    if d.outcome is Outcome.REJECTED and is_compensation(d.proposal):
        # As the processor answers a refusal of its own compensating call: admission takes
        # every proposal whose principal verified (Processor._admit marks it), after which
        # the refusal is a failed compensation (what Redis says of it is not replayed).
        if d.principal is not None:
            d.extra[ADMITTED] = True
        refused_compensation(d)
    if d.outcome is not Outcome.DEAD_LETTER:
        try:
            encode_outputs(d, contract_set, max_bytes)
        except Exception as exc:  # as Processor._encode: whatever the encoders raise
            logger.warning("%s/%s@%s: outputs that would not be encoded: %r",
                           src.topic, src.partition, src.offset, exc)  # fmt: skip
            unencodable(d, exc)
    if d.outcome is Outcome.DEAD_LETTER:
        _, as_written = recorded_dead_letter(dlq_headers(d))
        p = d.proposal
        if p is None:
            return Replayed(
                observation_id(d), where, None, None, "(dead letter)", False,
                as_written.verdict, f"dead letter: {d.dlq_reason}",
            )  # fmt: skip
        return Replayed(
            observation_id(d), where, p.proposal_id, p.run_id,
            printable(tool_name(d), _LABEL) or "(no tool)", is_compensation(p),
            as_written.verdict, f"dead letter: {d.dlq_reason}",
        )  # fmt: skip
    datum = observation_record(d, contract_set)
    verdict = Verdict(datum["decision"], datum["status"]["taxonomy_class"], datum["gate"])
    return Replayed(
        datum["observation_id"],
        where,
        datum["proposal_id"],
        datum["run_id"],
        printable(datum["tool_identity"]["name"], _LABEL) or "(no tool)",
        is_compensation(d.proposal),
        verdict,
        datum["next_action"],
    )


@dataclass(slots=True)
class Example:
    proposal_id: str | None
    run_id: str | None
    next_action: str


@dataclass(slots=True)
class Change:
    """The proposals of one tool that went from one verdict to another."""

    tool: str
    compensation: bool
    recorded: Verdict
    replayed: Verdict
    count: int = 0
    examples: list[Example] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tool": self.tool,
            "compensation": self.compensation,
            "recorded": self.recorded.as_dict(),
            "replayed": self.replayed.as_dict(),
            "count": self.count,
            "examples": [
                {"proposal_id": e.proposal_id, "run_id": e.run_id, "next_action": e.next_action}
                for e in self.examples
            ],
        }


def _iso(ms: int | None) -> str | None:
    """A time as trace and the approvals write it (RFC 3339, UTC, ``Z``); one no calendar
    date holds, in epoch milliseconds."""
    return None if ms is None else shown_time(ms)


@dataclass
class Report:
    """What a replay found, as data: the command prints it, or dumps it as JSON."""

    since_ms: int | None
    until_ms: int | None
    contracts: str
    contract_set: str
    policy: str | None
    references: bool
    examples: int = 3
    read: int = 0
    """Proposals read in the range, before ``--tenant`` and ``--tool`` narrowed them."""
    counts: Counter[Match] = field(default_factory=Counter)
    recorded_sets: Counter[str] = field(default_factory=Counter)
    """The contract sets the matched observations were decided with, and how many each."""
    changes: dict[tuple[str, bool, Verdict, Verdict], Change] = field(default_factory=dict)
    unreadable: int = 0
    """Observations and dead letters that could not be decoded."""
    consume_errors: int = 0
    incomplete: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    offsets: OffsetRange | None = None
    """A partition of tool.proposals to replay alone, within the time range; or, with a
    first offset, an offset range of it instead of a time range, closed at its end when
    the replay starts. ``since_ms`` and ``until_ms`` are then its records' earliest and
    latest times (None while it is not read, or holds no record)."""

    @property
    def by_offsets(self) -> bool:
        """Whether the range is an offset range, not a time range."""
        return self.offsets is not None and self.offsets.first is not None

    @property
    def replayed(self) -> int:
        return sum(self.counts.values())

    @property
    def changed(self) -> int:
        return self.counts[Match.CHANGED]

    def add(self, r: Replayed, recorded: Recorded | None) -> Match:
        match = compare(recorded, r.verdict)
        self.counts[match] += 1
        if recorded is not None and recorded.contract_set is not None:
            self.recorded_sets[recorded.contract_set] += 1
        if match is Match.CHANGED:
            assert recorded is not None
            key = (r.tool, r.compensation, recorded.verdict, r.verdict)
            change = self.changes.get(key)
            if change is None:
                change = self.changes[key] = Change(*key)
            change.count += 1
            if len(change.examples) < self.examples:
                change.examples.append(Example(r.proposal_id, r.run_id, r.next_action))
        return match

    def sorted_changes(self) -> list[Change]:
        return sorted(self.changes.values(), key=lambda c: (c.tool, c.compensation, -c.count))

    def as_dict(self) -> dict[str, Any]:
        o = self.offsets
        return {
            "range": {
                "since": _iso(self.since_ms),
                "until": _iso(self.until_ms),
                "since_ms": self.since_ms,
                "until_ms": self.until_ms,
                "by_offsets": self.by_offsets,
                "topic": None if o is None else o.topic,
                "partition": None if o is None else o.partition,
                "from_offset": None if o is None else o.first,
                "to_offset": None if o is None else o.last,
            },
            "contracts": self.contracts,
            "contract_set": {"replayed": self.contract_set, "recorded": dict(self.recorded_sets)},
            "policy": self.policy,
            "references": self.references_note(),
            "not_replayed": list(NOT_REPLAYED),
            "proposals": {"read": self.read, "replayed": self.replayed},
            "changes": [c.as_dict() for c in self.sorted_changes()],
            "totals": {
                **{m.value: self.counts[m] for m in Match},
                "unreadable_records": self.unreadable,
                "consume_errors": self.consume_errors,
            },
            "partitions_not_read_to_end": self.incomplete,
            "missing_topics": self.missing,
        }

    def references_note(self) -> str:
        if self.references:
            return "today's reference data from Redis, not the data as it was then"
        return "none (--no-references): every referenced entity is unknown"


def replay_gates(settings: Settings, contracts_dir: Path, policy_file: Path | None) -> Gates:
    """The gates to decide with: these contracts and this policy, and the settings' keys
    and approvers. Raises ContractError, PolicyError, ApproverError, KeyError_ or OSError
    for one that does not load, as ``toolsentry run`` would refuse to start."""
    return Gates(
        load_contracts(contracts_dir),
        Limits(
            settings.max_record_bytes, settings.max_arguments_bytes, settings.max_arguments_depth
        ),
        Verifier.from_settings(settings.identity),
        load_policy(policy_file),
        load_approvers(settings.approvers_file),
    )


def reference_lookup(settings: Settings) -> Lookup:
    """Today's reference data, as the processors read it (reads only)."""
    store = ReferenceStore(
        connect(settings.redis_url, socket_timeout=10, socket_connect_timeout=5),
        settings.redis_namespace, settings.reference_group_id, settings.topics.reference,
    )  # fmt: skip

    def lookup(keys: set[RefKey]) -> RefAnswers:
        try:
            return store.lookup(keys)
        except ReferencesLoading as exc:
            raise ReplayError(f"reference data is being loaded ({exc}); try again") from exc
        except REDIS_ERRORS as exc:
            raise ReplayError(f"redis: {exc}") from exc

    return lookup


def unknown_references(keys: set[RefKey]) -> RefAnswers:
    """``--no-references``: no Redis at all, so every referenced id reads as unknown, as
    the semantic gate reads an id the systems of record never published."""
    return {}


def at_record_time(src: SourceRecord) -> int:
    return src.timestamp_ms


def _batches(messages: Iterable[Message]) -> Iterator[list[SourceRecord]]:
    batch: list[SourceRecord] = []
    for m in messages:
        batch.append(source_record(m))
        if len(batch) >= BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


Select = Callable[[Decision], bool]


def selection(tenant: str | None, tool: str | None) -> Select:
    """``--tenant`` and ``--tool``, on what the proposal claims (a record that could not
    be parsed claims nothing, so either option leaves it out)."""

    def wanted(d: Decision) -> bool:
        p = d.proposal
        if tenant is None and tool is None:
            return True
        if p is None:
            return False
        return tenant in (None, p.tenant_id) and tool in (None, p.tool_name, d.contract_name)

    return wanted


def _read_reach(report: Report, reader: RetainedReader) -> None:
    report.consume_errors += reader.errors
    report.missing += reader.missing
    report.incomplete += [f"{r.topic}/{r.partition} at {r.reached} of {r.end}"
                          for r in reader.incomplete]  # fmt: skip


def decide_range(
    settings: Settings,
    gates: Gates,
    lookup: Lookup,
    report: Report,
    wanted: Select,
    answers: Answers,
) -> None:
    """Every proposal of the range decided again, at the time it was decided then (its
    record's time when nothing recorded says), encoded against the processor's output
    limit, and those ``wanted`` compared."""
    timed = not report.by_offsets
    reader = RetainedReader(
        settings,
        [settings.topics.proposals],
        since_ms=report.since_ms if timed else None,
        until_ms=report.until_ms if timed else None,
        offsets=report.offsets,
    )
    fingerprint = gates.contracts.fingerprint
    limit = max_output_bytes(settings)
    for batch in _batches(reader):
        report.read += len(batch)
        for d in decide_batch_at(batch, gates, answers.decided_at, lookup):
            if wanted(d):
                again = replayed(d, fingerprint, limit)
                report.add(again, answers.of(again))
    _read_reach(report, reader)


def span_offsets(settings: Settings, report: Report) -> None:
    """Read an offset range once before it is replayed: close it at its end as it stands
    now (a proposal written later would find no answer read), and take its records'
    earliest and latest times as the report's range, over which their answers are read.
    Every record's time counts, not the range's ends: producers stamp their own records.
    OutOfRange for a range the partition does not hold."""
    assert report.offsets is not None
    reader = RetainedReader(settings, [report.offsets.topic], offsets=report.offsets)
    earliest = latest = None
    for m in reader:
        kind, t = m.timestamp()
        if kind != TIMESTAMP_NOT_AVAILABLE:
            earliest = t if earliest is None else min(earliest, t)
            latest = t if latest is None else max(latest, t)
    for reach in reader.planned:  # the range's one partition, unless its topic is missing
        report.offsets = dataclasses.replace(report.offsets, last=reach.end - 1)
    report.since_ms, report.until_ms = earliest, latest
    # A first read cut short bounds the answers by some of the records' times only: the
    # report says so, as it does of the second read (a missing topic it reports itself).
    report.consume_errors += reader.errors
    report.incomplete += [
        f"{r.topic}/{r.partition} at {r.reached} of {r.end} while reading the records' "
        "times (answers written after the latest one read may be missed)"
        for r in reader.incomplete
    ]


def _check_partition(settings: Settings, offsets: OffsetRange) -> None:
    """OutOfRange for a partition its topic does not have, asked of the broker before the
    answers are read (a day of them, say), not once they have been. A topic that does not
    exist is left to the reader, which reports it missing."""
    count = topics_partitions(settings, [offsets.topic]).get(offsets.topic)
    if count is not None:
        offsets.check_partition(count)


@dataclass
class Answers:
    """The recorded decisions of the range: observations by id, dead letters by the
    position of the record they stand for."""

    observations: dict[str, Recorded] = field(default_factory=dict)
    dead_letters: dict[tuple[str, int, int], Recorded] = field(default_factory=dict)

    def of(self, r: Replayed) -> Recorded | None:
        return self.observations.get(r.observation_id) or self.dead_letters.get(r.position)

    def decided_at(self, src: SourceRecord) -> int:
        """When the record was decided then: its observation's or its dead letter's time,
        else its own."""
        recorded = self.observations.get(
            position_id(src.topic, src.partition, src.offset)
        ) or self.dead_letters.get((src.topic, src.partition, src.offset))
        if recorded is None or recorded.decided_ms is None:
            return src.timestamp_ms
        return recorded.decided_ms


def read_answers(settings: Settings, report: Report, slack_ms: int) -> Answers:
    """The observations and dead letters written over the range (and ``slack_ms`` after
    it); the first of each id, as a record decided again after an aborted transaction is
    never read (``read_committed``)."""
    topics = settings.topics
    until = None if report.until_ms is None else report.until_ms + slack_ms
    reader = RetainedReader(
        settings, [topics.observations, topics.dlq], since_ms=report.since_ms, until_ms=until
    )
    answers = Answers()
    decoder = codec("observation")
    # Every answer of the range is held at once; the few verdicts and contract sets that
    # they repeat are held once each (about half of what each answer takes).
    shared: dict[Any, Any] = {}
    for m in reader:
        value = m.value()
        try:
            if m.topic() == topics.dlq:
                position, recorded = recorded_dead_letter(m.headers() or [])
                kind, written_ms = m.timestamp()
                if kind != TIMESTAMP_NOT_AVAILABLE:
                    recorded = dataclasses.replace(recorded, decided_ms=written_ms)
                answers.dead_letters.setdefault(position, recorded)
                continue
            if value is None:
                raise ValueError("no value")
            obs = decoder.decode(value)
            if obs["gate"] in _ANSWERS_OF_OTHER_RECORDS:
                continue
            recorded = recorded_observation(obs)
        except (KeyError, ValueError) as exc:
            report.unreadable += 1
            logger.warning("%s/%s@%s unreadable: %s", m.topic(), m.partition(), m.offset(), exc)
            continue
        recorded = dataclasses.replace(
            recorded,
            verdict=shared.setdefault(recorded.verdict, recorded.verdict),
            contract_set=shared.setdefault(recorded.contract_set, recorded.contract_set),
        )
        answers.observations.setdefault(obs["observation_id"], recorded)
    _read_reach(report, reader)
    return answers


def replay(
    settings: Settings,
    gates: Gates,
    lookup: Lookup,
    report: Report,
    *,
    wanted: Select | None = None,
    slack_ms: int = DEFAULT_SLACK_MS,
) -> Report:
    """Read what was decided, decide the range again and compare: the whole of
    ``toolsentry replay``. A range open at its end is closed now, before anything is read:
    proposals made while the replay reads would find no answer written yet. OutOfRange
    for an offset range the partition does not hold, or a partition the topic does not
    have, before anything is read."""
    if report.by_offsets:
        span_offsets(settings, report)
    else:
        if report.offsets is not None:
            _check_partition(settings, report.offsets)
        if report.until_ms is None:
            report.until_ms = int(time.time() * 1000)
    if report.by_offsets and report.since_ms is None:
        answers = Answers()  # no record in the range: nothing can have answered it
    else:
        answers = read_answers(settings, report, slack_ms)
    decide_range(settings, gates, lookup, report, wanted or selection(None, None), answers)
    return report


def render(doc: dict[str, Any]) -> Iterator[RenderableType]:
    """A report (``Report.as_dict``) as the command prints it: what was replayed against
    what, the changes by tool, then the totals."""
    span, sets, t = doc["range"], doc["contract_set"], doc["totals"]
    yield Text(
        f"replay {_range(span)}: {doc['proposals']['read']} proposals read, "
        f"{doc['proposals']['replayed']} replayed"
    )
    # An observation's contract set is free text, written by whatever wrote the record.
    recorded = ", ".join(f"{printable(fp, _LABEL)} ({n})" for fp, n in sets["recorded"].items())
    recorded = recorded or "none"
    yield Text(f"contracts {doc['contracts']} ({sets['replayed']}); recorded with {recorded}")
    yield Text(f"policy {doc['policy'] or '(none)'}; reference data: {doc['references']}")
    yield Text(f"not replayed: {'; '.join(doc['not_replayed'])}")
    if doc["changes"]:
        table = Table("tool", "recorded", "replayed", "count", "examples: replayed next action")
        for c in doc["changes"]:
            tool = c["tool"] + (" (compensation)" if c["compensation"] else "")
            shown = "\n".join(
                printable(f"{e['proposal_id']}: {e['next_action']}", 160) for e in c["examples"]
            )
            table.add_row(
                Text(tool), Text(_verdict(c["recorded"])),
                Text(_verdict(c["replayed"]), style="yellow"), Text(str(c["count"])), Text(shown),
            )  # fmt: skip
        yield table
    for partition in doc["partitions_not_read_to_end"]:
        yield Text.assemble(("not read to its end", "red"), f": {partition}")
    for topic in doc["missing_topics"]:
        yield Text.assemble(("no such topic", "red"), f": {topic}")
    if t["consume_errors"]:
        yield Text.assemble(
            ("errors while reading", "red"), f": {t['consume_errors']} (see the log)"
        )
    yield Text(
        f"same {t['same']}, changed {t['changed']}, admission not replayed "
        f"{t['admission_not_replayed']}, no recorded decision {t['no_recorded_decision']}, "
        f"unreadable records {t['unreadable_records']}, partitions not read to their end "
        f"{len(doc['partitions_not_read_to_end'])}"
    )


def _range(span: dict[str, Any]) -> str:
    times = f"{span['since']} .. {span['until'] or 'now'}"
    if span["partition"] is None:
        return times
    where = f"{span['topic']}/{span['partition']}"
    if not span["by_offsets"]:
        return f"{times}, {where}"
    records = f"records {times}" if span["since"] is not None else "no record"
    return f"{where} offsets {span['from_offset']}..{span['to_offset']} ({records})"


def _verdict(v: dict[str, str]) -> str:
    return f"{v['decision']} {v['taxonomy_class']} @{v['gate']}"
