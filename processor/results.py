"""Executors' results: the final observation of a routed call, and its idempotency record.

An executor reports every call it was handed on ``tool.results``. The processor
consumes those records in the same transactions as proposals: each one settles
its call's idempotency record (COMPLETED, FAILED_RETRYABLE, FAILED_FINAL, EXPIRED)
and yields the call's final observation, with the result's data on success or the
failure mapped onto the taxonomy. A result that reports committed steps before a
failure (a timeout included) means the world is half changed: ``PARTIAL_SUCCESS`` for a
tool a retry finishes, else ``COMPENSATION_REQUIRED``, and where the contract names a
compensation tool the compensating call is proposed on ``tool.proposals``, in the
original caller's name (a token the processor signs with its delegation key, good for
that one call) and under a key derived from the original's, so it passes through every
gate like any other call. When that call completes, the original's record becomes
COMPENSATED; when it fails, or a gate refuses it (the order system says it cannot be
undone, an approver says no, its token expired in a backlog), or it cannot be signed,
``COMPENSATION_FAILED`` and an operator must reconcile. Only the compensation the
processor proposed is admitted under its key: the original's record names that key and
its payload hash, so a proposal that borrows the key is refused.

A result whose data does not match the contract's ``output_schema`` is not shown to the
model at all: ``OBSERVATION_NORMALIZATION_FAIL``, and the call is not run again. A failed
result's data is never shown (nothing describes it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

from processor import b64url
from processor.codec.records import ID_MAX_CHARS, decode_result, oversized_id
from processor.contracts.registry import Contract, ContractSet
from processor.contracts.validation import ArgumentValidator
from processor.gates.budget import (
    HANDOFF_TOOL,
    UNREQUESTED_COMPENSATION,
    is_compensation_key,
    runtime_of,
)
from processor.gates.parse import COMPENSATION_PREFIX, nests_deeper, strict_loads
from processor.gates.policy_scan import find_secrets
from processor.identity import Verifier
from processor.model import (
    RESPONSE_VECTORS,
    Decision,
    FieldError,
    Final,
    Gate,
    Outcome,
    Proposal,
    Rejection,
    SideEffectClass,
    SourceRecord,
    TaxonomyClass,
)
from processor.pipeline import canonical_json, hash_payload
from processor.state.admission import SETTLED_TTL_MS, Item, held_record

RESUMABLE = frozenset({"idempotent_write", "retryable_post_pivot"})
"""Contract semantics whose steps a retry under the same idempotency key finishes without
repeating: a failure after some of them is a PARTIAL_SUCCESS, not a compensation."""
_T = TaxonomyClass
_COMPENSATION_CLASSES = frozenset({_T.COMPENSATION_REQUIRED.value, _T.COMPENSATION_FAILED.value})
"""Classes only the processor concludes, from a result's committed steps (or a compensating
call's outcome): an executor that names one without committed steps is not taken at its
word, since COMPENSATION_REQUIRED would have a compensating call proposed for a call that
committed nothing."""
_FAILURE_VALUES = (
    frozenset(c.value for c in _T)
    - {_T.SUCCESS.value, _T.PARTIAL_SUCCESS.value}
    - _COMPENSATION_CLASSES
)
"""Classes an executor may give its own failure."""
EXECUTOR_MESSAGE_MAX = 512
EXECUTOR_CODE_MAX = 128
"""The most of an executor's error message and code the model is shown (and Redis caches
for retries): an observation must always fit in a record, and an error code is a name,
not a text."""
WITHHELD = "withheld: it looks like it holds a credential"
"""What the model reads in place of an executor's error text that the policy gate's
secret scan flags (a connection string or a token in an exception's message)."""


@dataclass(frozen=True, slots=True)
class ResultInput:
    """One decoded record of ``tool.results`` and what it settles."""

    src: SourceRecord
    result: dict[str, Any]
    state: str
    decision: Decision
    ttl_ms: int = 0
    """Its contract's idempotency TTL (0: its contract is unknown here)."""

    @property
    def tenant_id(self) -> str:
        return str(self.result["tenant_id"])


ADMITTED = "admitted"
"""``Decision.extra`` key: Redis decided this proposal (see ``refused_compensation``)."""


def is_compensation(p: Proposal | None) -> bool:
    return p is not None and is_compensation_key(p.idempotency_key)


def compensation_key(idempotency_key: str) -> str:
    return COMPENSATION_PREFIX + idempotency_key


RESULT_TOO_LARGE = "result_too_large"
RESULT_UNPUBLISHABLE = "result_unpublishable"
"""Executors' error codes (with ``OBSERVATION_NORMALIZATION_FAIL``) for a call that ran
whose answer cannot be carried: too large for a record, or not serialisable at all."""
CALL_INVALID = "approved_call_invalid"
"""Executors' error code (with ``UNKNOWN_ERROR``) for a call record they could not hand to a
handler (its arguments not a JSON object): it was not run. Also the reason of its dead
letter on ``tool.calls.dlq``."""
RESULT_DATA_MAX_BYTES = 262_144
"""The most of a result's data an observation carries to the model (and Redis caches for
retries): a larger answer is not shown, and the model is told why."""
RESULT_MAX_DEPTH = 256
"""How deeply a result's data may nest: far past any contract's output_schema, and within
what the exact parser, which finds repeated keys, reads without running out of stack."""
COMPENSATION_ARGUMENTS_MAX_BYTES = 65_536
COMPENSATION_ARGUMENTS_MAX_DEPTH = 32
"""The arguments of a compensating call, at most (the gates' own default bounds). Nested
deeper, the proposal's envelope is past what the parse gate reads strictly: refused, its
idempotency key is not read, so nothing would know the refusal for the compensation's and
the model would wait for it for ever (see refused_compensation); past 254 levels, which
orjson writes (it reads 1024), they have no payload hash at all."""


def _too_large(text: str, limit: int) -> bool:
    """Over ``limit`` bytes as UTF-8 (counted only when it could be)."""
    return len(text) > limit // 4 and len(text.encode()) > limit


def compensation_arguments(r: dict[str, Any]) -> dict[str, Any] | None:
    """A result's compensation arguments when they are a JSON object of at most
    ``COMPENSATION_ARGUMENTS_MAX_BYTES``, nested at most ``COMPENSATION_ARGUMENTS_MAX_DEPTH``
    levels (anything else an executor sends cannot be proposed: the call is then handed to
    an operator)."""
    raw = r.get("compensation_arguments")
    if not raw or _too_large(raw, COMPENSATION_ARGUMENTS_MAX_BYTES):
        return None
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    deep = COMPENSATION_ARGUMENTS_MAX_DEPTH
    if nests_deeper(value, deep, raw.count("{") + raw.count("[")):
        return None
    return value


def compensation_proposal_id(idempotency_key: str) -> str:
    """The id of the compensating call proposed for the call under this key."""
    key = compensation_key(idempotency_key)
    return "comp_" + hashlib.sha256(key.encode()).hexdigest()[:24]


_RESULT_IDS = ("result_id", "call_id", "proposal_id", "run_id", "tenant_id", "tool_name",
               "tool_version", "idempotency_key", "payload_hash", "trace_id")  # fmt: skip
"""The ids of a result that its call's record is held to or keeps, the run its answer is
keyed by, and the trace its answer carries (copied from the call, whose trace id the
processor wrote from a traceparent of at most 128 characters)."""


def parse_result(src: SourceRecord, contracts: ContractSet) -> ResultInput | str:
    """A result record, or the reason it cannot be one (it then goes to the DLQ)."""
    try:
        r = decode_result(src.value or b"")
    except Exception as exc:
        return f"undecodable result: {type(exc).__name__}"
    too_long = oversized_id(r, _RESULT_IDS)
    if too_long is not None:
        # No call the processor routed has such an id: refused before Redis keeps any of
        # it (a result for a key that moved on is kept by its id, and answered to the run
        # it names, whose observation, keyed by that run, might not fit in a record).
        return f"the result's {too_long} is longer than {ID_MAX_CHARS} characters"
    if r["call_id"] != r["proposal_id"]:
        # The processor routes every call under its proposal's id, and the observation
        # goes to the proposal the result names, while Redis checks only the call id: a
        # result whose two ids differ would answer another proposal than the one it settles.
        return "the result's proposal_id is not its call_id"
    if int(r["attempt"]) < 1:
        # Attempts start at 1; admission reads an attempt below that as "not given" and
        # would let the result settle whatever attempt its key is on now.
        return f"the result's attempt is {r['attempt']}; attempts start at 1"
    # The version the result names picks the output schema and the semantics it is read
    # with; admission holds it to the version its call was routed as (result_mismatch, see
    # admission.lua, settle), so a result that names another reaches no model.
    contract = contracts.get(r["tool_name"], r["tool_version"])
    state, rejection, final = _classify(r, contract)
    p = Proposal(
        proposal_id=r["proposal_id"],
        run_id=r["run_id"],
        tenant_id=r["tenant_id"],
        created_at=None,
        tool_name=r["tool_name"],
        tool_version=r["tool_version"],
        arguments=None,
        idempotency_key=r["idempotency_key"],
        trace_id=r["trace_id"],
    )
    d = Decision(
        src,
        Outcome.SETTLED,
        Gate.RESULT,
        p,
        contract_name=r["tool_name"],
        contract_version=r["tool_version"],
        side_effect_class=SideEffectClass(r["side_effect_class"]),
        rejection=rejection,
        decided_at_ms=int(r["finished_at"]),
        post_action_verification=bool(
            contract
            and contract.post_action_verification_required
            and (final.completed or r.get("committed_steps"))
        ),
        final=final,
    )
    return ResultInput(src, r, state, d, runtime_of(contract).ttl_ms if contract else 0)


def _classify(r: dict[str, Any], contract: Contract | None) -> tuple[str, Rejection | None, Final]:
    """The record's new state, the failure as the taxonomy says it, the final answer."""
    attempt = int(r["attempt"])
    tool = r["tool_name"]
    compensating = is_compensation_key(r["idempotency_key"])
    if r["outcome"] == "SUCCEEDED":
        problem = _unreadable(r.get("data"), contract)
        if problem is None:
            return "COMPLETED", None, Final(True, r.get("data"), attempt=attempt)
        # The call ran (its record is final: it must not run again), but what it returned
        # is not what its contract promises: the model gets no part of it.
        action = (
            f"{tool} ran, but its result does not match the tool's contract, so it is not "
            "shown. Do not call it again; check the outcome with the lookup tool, or call "
            "handoff_to_human."
        )
        rej = _handoff(_T.OBSERVATION_NORMALIZATION_FAIL, action, problem)
        return "FAILED_FINAL", rej, Final(False, None, attempt=attempt)
    # A failure's data goes nowhere. The result schema says it is null when the call fails,
    # and no contract describes it (output_schema is what a success returns), so there is
    # nothing to check it against: shown to the model and cached for its retries, it would
    # be unchecked executor text in the model's context. Dropping it, rather than checking
    # it as JSON, is the safer choice: a failure is told by its code, message and class.
    final = Final(False, None, attempt=attempt)
    detail = FieldError(
        None,
        _executor_text(r.get("error_message"), EXECUTOR_MESSAGE_MAX) or "the call failed",
        _executor_text(r.get("error_code"), EXECUTOR_CODE_MAX) or "failed",
    )
    if compensating:
        # Failed, refused by its tool or never started before its deadline: either way
        # the earlier step stays committed, and nobody proposes the compensation again.
        action = (
            f"The compensating call {tool} did not complete, so an earlier step stays "
            "committed. Do not retry; tell the user an operator will reconcile it and call "
            "handoff_to_human."
        )
        return "FAILED_FINAL", _handoff(_T.COMPENSATION_FAILED, action, detail), final
    steps = list(r.get("committed_steps") or [])
    if r["outcome"] == "TIMED_OUT" and not steps:
        action = (
            f"{tool} was not started before its deadline; nothing ran. Propose it again "
            "with the same idempotency key, or tell the user it could not be done in time."
        )
        err = FieldError(None, "not started before the call's deadline", "deadline_passed")
        return "EXPIRED", Rejection(_T.TIMEOUT, Gate.RESULT, (err,), action), final
    if steps:
        # (a call timed out after committing steps, as an executor that gives its handlers
        # a time limit may report it, ran in part: it is not "nothing ran", and goes as any
        # failure after committed steps goes)
        # The steps' names are the executor's text: listed among the errors, where the
        # model reads them as data, not in the next action it is told to take.
        done = _executor_text(", ".join(steps), EXECUTOR_MESSAGE_MAX)
        err = FieldError(None, f"committed before the failure: {done}", "partially_committed")
        if contract and contract.raw["transactional"]["semantics"] in RESUMABLE:
            # Steps of a tool that a retry finishes without repeating them: they stand,
            # and the call is resumed rather than compensated.
            action = (
                f"{tool} committed some steps (listed in the errors), then failed: those "
                "steps stand and must not be repeated. Retry the same call with the same "
                "idempotency key to finish the rest, then check the outcome with the lookup "
                "tool."
            )
            rej = Rejection(_T.PARTIAL_SUCCESS, Gate.RESULT, (detail, err), action)
            return "FAILED_RETRYABLE", rej, final
        comp = contract.compensation_tool if contract else None
        errors: tuple[FieldError, ...] = (detail, err)
        if comp and compensation_arguments(r) is not None:
            pid = compensation_proposal_id(r["idempotency_key"])
            action = (
                f"{tool} failed after committing some steps. The compensating call {comp} has "
                f"been proposed for you as {pid}; do not retry this call. Wait for its result."
            )
        else:
            if comp and r.get("compensation_arguments"):
                errors += (FieldError("compensation_arguments", "the executor's compensation "
                                      "arguments are not a JSON object of at most "
                                      f"{COMPENSATION_ARGUMENTS_MAX_BYTES} bytes, nested at "
                                      f"most {COMPENSATION_ARGUMENTS_MAX_DEPTH} levels",
                                      "compensation_arguments_invalid"),)  # fmt: skip
            action = (
                f"{tool} failed after committing some steps, and no compensation can be run "
                "automatically. Do not retry; call handoff_to_human so an operator reverses it."
            )
        rej = Rejection(_T.COMPENSATION_REQUIRED, Gate.RESULT, errors, action)
        return "FAILED_FINAL", rej, final
    claimed = r.get("taxonomy_class")
    if claimed in _COMPENSATION_CLASSES:
        # Something must be undone, says the executor, but it names nothing committed:
        # nothing can be proposed to undo it, and a retry might repeat what did commit.
        err = FieldError("committed_steps", f"the executor reported {claimed} without "
                         "naming a committed step", "compensation_without_steps")  # fmt: skip
        action = (
            f"{tool} failed, and its executor says something must be undone without saying "
            "what. Do not retry it; tell the user an operator will check it, and call "
            "handoff_to_human."
        )
        return "FAILED_FINAL", _handoff(_T.UNKNOWN_ERROR, action, detail, err), final
    if claimed == _T.UNKNOWN_ERROR.value and r.get("error_code") == CALL_INVALID:
        # The executor's word for "the call record could not be read; nothing ran": a fault
        # of the platform (another writer on the execution topic, versions that do not
        # match), not of the model's arguments, which were checked. Final, as the class
        # says: the same call routed again meets the same fault, so the model hands off
        # (an operator has the dead letter) rather than retry or "fix" its arguments.
        action = (
            f"{tool} was not run: its executor could not read the call it was sent. This is "
            "a fault of the platform, not of your arguments. Do not retry it; tell the user "
            "it could not be done, and call handoff_to_human."
        )
        return "FAILED_FINAL", _handoff(_T.UNKNOWN_ERROR, action, detail), final
    if claimed == _T.OBSERVATION_NORMALIZATION_FAIL.value and r.get("error_code") in (
        RESULT_TOO_LARGE,
        RESULT_UNPUBLISHABLE,
    ):
        # The executor's word for "it ran, but its answer cannot be carried".
        action = (
            f"{tool} ran, but its result cannot be shown. Do not call it again; check the "
            "outcome with the lookup tool, or call handoff_to_human."
        )
        return "FAILED_FINAL", _handoff(_T.OBSERVATION_NORMALIZATION_FAIL, action, detail), final
    if claimed in _FAILURE_VALUES:
        # The class the executor names is what the model reads (its status says whether a
        # retry helps), so the record follows it: a retry is admitted exactly when the
        # observation says it may be, whatever the executor's own retryable flag says.
        cls = _T(claimed)
        retry = RESPONSE_VECTORS[cls].retryable
    else:
        retry = bool(r.get("retryable"))
        cls = _T.DEPENDENCY_UNAVAILABLE if retry else _T.UNKNOWN_ERROR
    if retry:
        action = (
            f"{tool} failed on a temporary problem and nothing was committed. Retry the same "
            "call with the same idempotency key after a short wait."
        )
    elif cls is _T.UNKNOWN_ERROR:
        # (a failure nobody classified: the taxonomy escalates it, and so must the model)
        action = (
            f"{tool} failed for a reason its executor did not classify. Do not retry it; "
            "tell the user it could not be done, and call handoff_to_human."
        )
    else:
        action = f"{tool} failed and will fail again as it is. Do not retry it unchanged."
    if claimed in _FAILURE_VALUES:
        # The executor's message is the tool's (or its upstream's) text: the model reads it
        # among the errors, as data, never in the instruction it is told to act on.
        action = f"{tool} refused the call ({cls.value}). " + _NEXT.get(cls, action)
    tools = (HANDOFF_TOOL,) if cls is _T.UNKNOWN_ERROR else ()
    return (
        ("FAILED_RETRYABLE" if retry else "FAILED_FINAL"),
        Rejection(cls, Gate.RESULT, (detail,), action, tools),
        final,
    )


def _executor_text(text: str | None, limit: int) -> str | None:
    """An executor's error text as the model may read it: at most ``limit`` characters,
    and withheld whole when the secret scan the policy gate runs on arguments flags it
    (scanned before it is cut, so no half of a credential slips past)."""
    if not text:
        return text
    if find_secrets(text, limit=1):
        return WITHHELD
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _handoff(cls: _T, action: str, *errors: FieldError) -> Rejection:
    """A result only an operator can take further: the model may only hand off."""
    return Rejection(cls, Gate.RESULT, errors, action, (HANDOFF_TOOL,))


def _output_validator(contract: Contract) -> ArgumentValidator | None:
    schema = contract.raw["affordance"].get("output_schema")
    return ArgumentValidator(schema) if isinstance(schema, dict) else None


def _unreadable(data: str | None, contract: Contract | None) -> FieldError | None:
    """Why a successful call's result cannot be shown to the model (None: it can). No data
    at all is checked as JSON null: a contract whose output_schema wants an object does not
    get a success with nothing in it past the check."""
    value: Any = None
    if data is not None:
        if _too_large(data, RESULT_DATA_MAX_BYTES):
            return FieldError(
                "data",
                f"the result is {len(data.encode())} bytes; at most {RESULT_DATA_MAX_BYTES} "
                "are shown",
                RESULT_TOO_LARGE,
            )
        try:
            # Strict: a key an object repeats reads as its last value, which is all the
            # output schema would check, while the model is shown the text, every value.
            value = strict_loads(data, RESULT_MAX_DEPTH)
        except (ValueError, RecursionError):
            return FieldError(
                "data", "the result is not strict JSON (or an object in it repeats a key, or "
                f"it is nested more than {RESULT_MAX_DEPTH} levels deep)", "result_not_json",
            )  # fmt: skip
    if contract is None:
        # The version that routed the call is not in the set that reads its answer (a
        # reload removed it while the call ran): no output schema can be checked, so the
        # answer is not shown, as one that fails its schema is not.
        return FieldError(
            "data", "no contract version in the current set describes this result",
            "result_contract_unknown",
        )  # fmt: skip
    validator = contract.once("results.output_validator", _output_validator)
    if validator is None or validator.is_valid(value):
        return None
    first = next(iter(validator.errors(value)), None)
    where = "/".join(str(p) for p in first.absolute_path) if first is not None else ""
    detail = first.message[:200] if first is not None else "does not match"
    return FieldError(
        "data" + (f"/{where}" if where else ""),
        f"the result does not match the contract's output_schema: {detail}",
        "result_schema_mismatch",
    )


_NEXT = {
    _T.STALE_STATE: "Refresh with the lookup tool, then tell the user the actual state.",
    _T.OUT_OF_BOUNDS: "Use an allowed value (check the current limits first).",
    _T.SEMANTIC_INVALIDITY: "Call the lookup tool for the right id; never invent ids.",
    _T.PERMISSION_DENIED: "Do not retry; tell the user, or hand off to a human.",
}


def cached_blob(d: Decision, rejection: Rejection | None = None) -> str:
    """What a retry with the same key gets back: the final answer, as stored in Redis
    (``rejection``: in place of ``d``'s own)."""
    assert d.final is not None
    rej = rejection or d.rejection
    return orjson.dumps(
        {
            "class": rej.taxonomy.value if rej else _T.SUCCESS.value,
            "data": d.final.data,
            "attempt": d.final.attempt,
            "next_action": rej.next_action if rej else "",
            "errors": [{"field": e.field, "message": e.message, "code": e.code} for e in rej.errors]
            if rej
            else [],
        }
    ).decode()


@dataclass(frozen=True, slots=True)
class Compensation:
    """The compensating call a result asks for, proposed once the result has settled its
    record. The record keeps ``key`` and ``payload_hash``: only this call is admitted
    under that key."""

    tool: str
    arguments: dict[str, Any]
    key: str
    payload_hash: str


def _failed_after_commit(item: ResultInput) -> bool:
    """Whether the result failed after committing steps (a timeout included): resumed
    (``PARTIAL_SUCCESS``) or compensated (``COMPENSATION_REQUIRED``) as ``_classify`` reads
    it. Read from the result itself, not its decision, which may be escalated by now (no
    delegation key: ``COMPENSATION_FAILED``, see ``compensation_plan``)."""
    r = item.result
    return (
        r["outcome"] != "SUCCEEDED"
        and bool(r.get("committed_steps"))
        and not is_compensation_key(r["idempotency_key"])
    )


def _may_meet_held(item: ResultInput) -> bool:
    """Whether this result, as its attempt's own, answers in place of a failure after
    committed steps held for it: it did not complete, and it names no committed step. (A
    success that cannot be shown, OBSERVATION_NORMALIZATION_FAIL, ran: it completed.)"""
    d = item.decision
    return (
        d.rejection is not None
        and item.state != "COMPLETED"
        and d.rejection.taxonomy is not _T.OBSERVATION_NORMALIZATION_FAIL
        and not _failed_after_commit(item)
        and not is_compensation_key(item.result["idempotency_key"])
    )


def held_rejection(d: Decision) -> Rejection:
    """The answer of an attempt that ended without completing and without committing a
    step, where an earlier attempt of the same call failed after committing some (held for
    this attempt, which might have met them: see admission.lua, settle). Those steps stand
    and nothing compensates them: this result names none, and the earlier one was not
    kept. It escalates, with this attempt's own errors."""
    rej = d.rejection
    assert rej is not None
    err = FieldError(None, "an earlier attempt of this call committed some steps before it "
                     "failed, and this attempt did not finish the call",
                     "committed_by_earlier_attempt")  # fmt: skip
    action = (
        f"{d.contract_name or 'The call'} did not finish, and an earlier attempt of it "
        "committed some steps before failing; no compensation can be run automatically. Do "
        "not retry; call handoff_to_human so an operator reverses it."
    )
    return _handoff(_T.COMPENSATION_REQUIRED, action, *rej.errors, err)


def settle_item(
    item: ResultInput,
    position: str,
    compensation: Compensation | None,
    unsigned: str | None = None,
    max_record_bytes: int | None = None,
) -> tuple[str, Item]:
    """The result as admission settles it. ``unsigned``: the answer to keep instead when
    the compensation needs signing and the record has no principal claims to sign with.
    ``max_record_bytes``: the most key and value the processor writes in one record (see
    app.max_output_bytes); a failure's record larger than that is not kept to be delivered
    again (see admission.lua, redeliver_held): an executor may write records the
    processor's producer refuses, and written back, one would fail its batch's
    transaction every time the batch is decided again."""
    r = item.result
    key = r["idempotency_key"]
    compensates = key[len(COMPENSATION_PREFIX) :] if is_compensation_key(key) else None
    committed = _failed_after_commit(item)
    src = item.src
    value = src.value or b""
    writable = max_record_bytes is None or len(src.key or b"") + len(value) <= max_record_bytes
    return item.tenant_id, {
        "kind": "result",
        "pos": position,
        "ikey": key,
        "call": r["call_id"],
        "attempt": int(r["attempt"]),
        # What the result says it is, held to the call's record (see admission.lua, settle):
        # the tool and its version pick the output schema its data was checked against and
        # the compensation asked for, the run where its observation goes.
        "tool": r["tool_name"],
        "version": r["tool_version"],
        "hash": r["payload_hash"],
        "run": r["run_id"],
        "result_id": r["result_id"],
        "state": item.state,
        "cached": cached_blob(item.decision),
        "ttl": max(SETTLED_TTL_MS, item.ttl_ms),
        "compensation_key": compensation.key if compensation else None,
        "compensation_hash": compensation.payload_hash if compensation else None,
        "compensation_tool": compensation.tool if compensation else None,
        "compensates": compensates,
        "cached_unsigned": unsigned or "",
        # A failure after committed steps: of an attempt its key moved on from, it settles
        # the key where no later attempt can meet those steps (see admission.lua, settle).
        "committed": committed,
        # Its record, kept should its failure be held for a later attempt, and delivered
        # again if that attempt is given back without running (see admission.lua,
        # redeliver_held): sent for such failures only, and only for one the processor can
        # write again.
        "record": held_record(src.topic, src.partition, src.offset, src.key, value)
        if committed and writable
        else "",
        # What the record keeps instead should an earlier attempt's failure after committed
        # steps have been held for this attempt, which ended committing none (see
        # admission.lua, settle): sent for such failures only.
        "cached_held": cached_blob(item.decision, held_rejection(item.decision))
        if _may_meet_held(item)
        else "",
        # What it reported, which another result of its attempt is held to (a copy, or a
        # conflict: see outcome_digest).
        "digest": outcome_digest(r),
    }


DIGEST_BYTES = 12
"""The bytes of SHA-256 a result's outcome digest keeps (96 bits, 16 characters as
base64url): written with every settled record, and with a failure held on it, so short;
far past any chance of two outcomes colliding, and past any search for a forged result
that collides with a given one."""


def outcome_digest(r: dict[str, Any]) -> str:
    """What a result reported, as a short digest: the record keeps the settling result's,
    and another result of the same attempt is a copy when its digest is the same (answered
    once, quietly) and a conflict when it is not (see app.py, the ``conflict`` verdict).

    Only what the outcome is counts: for a success, its data; for a failure, whether it
    ran out of time, its code, class and retryability, the steps it committed and the
    compensation it asks for. Not the ids (Redis matched them already), the times, the
    executor, nor the error message (free text, which a call run again may word afresh
    with nothing else changed). JSON is compared by value, not spelling (key order,
    whitespace, 1250 or 1250.0), so an answer read back from a handler's store is the same
    answer. A read-only tool's success counts without its data: run twice, it may read
    the world as it has changed since (a search, a balance), and nothing it did can be
    false; only whether it ran and what a failure says can be."""
    if r["outcome"] == "SUCCEEDED":
        read_only = r.get("side_effect_class") == SideEffectClass.READ_ONLY.value
        fields: list[Any] = [r["outcome"], None if read_only else _content(r.get("data"))]
    else:
        fields = [
            r["outcome"],
            bool(r.get("retryable")),
            r.get("error_code"),
            r.get("taxonomy_class"),
            list(r.get("committed_steps") or []),
            _content(r.get("compensation_arguments")),
        ]
    return b64url.encode(hashlib.sha256(orjson.dumps(fields)).digest()[:DIGEST_BYTES])


def _content(text: str | None) -> str | None:
    """JSON text in its canonical spelling (sorted keys, no whitespace, a whole number
    without a fraction or exponent), so that two spellings of one value are one; text that
    is not JSON, or too large to be read as such, as it is."""
    if text is None or _too_large(text, RESULT_DATA_MAX_BYTES):
        return text
    try:
        return canonical_json(_whole_numbers(orjson.loads(text))).decode()
    except (orjson.JSONDecodeError, orjson.JSONEncodeError, RecursionError):
        # (text nested past the 254 levels orjson writes, or past Python's stack, which
        # orjson reads up to 1024 levels, is kept as it is)
        return text


_WHOLE_MAX = 2**63
"""Below this a whole number is written as an integer (orjson writes no larger one)."""


def _whole_numbers(value: Any) -> Any:
    """``value`` with every float that is a whole number as an int: JSON has one kind of
    number, and 1250, 1250.0 and 1.25e3 are one value (JSON Schema's equality), which a
    store that keeps numbers as doubles (SQLite's json(), a Go or JavaScript handler)
    spells either way when it hands an answer back."""
    if isinstance(value, float):
        return int(value) if value.is_integer() and -_WHOLE_MAX < value < _WHOLE_MAX else value
    if isinstance(value, dict):
        return {k: _whole_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole_numbers(v) for v in value]
    return value


def wants_compensation(item: ResultInput, contracts: ContractSet) -> Compensation | None:
    """The compensating call to propose for this result, if any."""
    d = item.decision
    if d.rejection is None or d.rejection.taxonomy is not _T.COMPENSATION_REQUIRED:
        return None
    r = item.result
    contract = contracts.get(r["tool_name"], r["tool_version"])
    arguments = compensation_arguments(r)
    if contract is None or not contract.compensation_tool or arguments is None:
        return None
    key = compensation_key(r["idempotency_key"])
    digest = hash_payload(canonical_json(arguments))
    return Compensation(contract.compensation_tool, arguments, key, digest)


def compensation_proposal(
    item: ResultInput, comp: Compensation, grant: str, verifier: Verifier
) -> bytes | None:
    """The compensating call, as a proposal envelope on ``tool.proposals``, signed in the
    name ``grant`` (the original principal's claims) describes; None when it cannot be
    signed (no delegation key, or a record kept no readable grant)."""
    r = item.result
    pid = compensation_proposal_id(r["idempotency_key"])
    token = None
    if not verifier.development:
        if verifier.delegator is None:
            return None
        token = verifier.delegator.mint(r["tenant_id"], grant, comp.key, pid, r["run_id"])
        if token is None:
            return None
    env: dict[str, Any] = {
        "proposal_id": pid,
        "created_at": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "tenant_id": r["tenant_id"],
        "run_id": r["run_id"],
        "tool": {"name": comp.tool},
        "arguments": comp.arguments,
        "idempotency_key": comp.key,
        "logical_operation_id": comp.key,
    }
    if token:
        env["principal_token"] = token
    return orjson.dumps(env)


def compensation_plan(
    item: ResultInput, contracts: ContractSet, verifier: Verifier
) -> tuple[Compensation | None, str | None]:
    """The compensation to ask admission for, and the answer Redis keeps instead should
    the record hold no claims to sign it with (see admission.lua, settle). Without a
    delegation key it cannot be signed at all: the result escalates now and asks for
    none."""
    comp = wants_compensation(item, contracts)
    if comp is None or verifier.development:
        return comp, None
    if verifier.delegator is None:
        unsigned_compensation(item.decision, verifier)
        return None, None
    return comp, cached_blob(item.decision, unsigned_rejection(item.decision, verifier))


def propose_compensation(
    item: ResultInput, comp: Compensation, verdict: dict[str, Any], verifier: Verifier
) -> None:
    """Once admission settled the result: the compensating call goes with its decision,
    or, when it cannot be signed, the decision escalates (as Redis recorded)."""
    proposal = None
    if not verdict.get("unsigned"):
        proposal = compensation_proposal(item, comp, verdict.get("grant") or "", verifier)
    if proposal is None:
        unsigned_compensation(item.decision, verifier)
    else:
        item.decision.extra["compensation"] = proposal


def unsigned_compensation(d: Decision, verifier: Verifier) -> Decision:
    """A call that needs compensating whose compensation cannot be proposed: nobody can
    sign it in the caller's name. It escalates now rather than wait for nothing."""
    d.rejection = unsigned_rejection(d, verifier)
    return d


def unsigned_rejection(d: Decision, verifier: Verifier) -> Rejection:
    """``d``'s answer when its compensation cannot be signed (see unsigned_compensation)."""
    rej = d.rejection
    assert rej is not None
    why = (
        "no delegation key is configured (identity.delegation_key_file)"
        if verifier.delegator is None
        else "its record keeps no principal the processor can act for (it was written by "
        "an earlier version, which kept a token, or with identity in development mode)"
    )
    return _not_proposed(
        rej, d, "compensation_unsigned", f"the compensating call cannot be signed: {why}"
    )


def stale_compensation(d: Decision) -> Decision:
    """A result that asks for compensation after its key moved on to another attempt
    (retried once its deadline and grace passed with no result): no record is left to
    propose the compensation under, and what it committed stays committed. It escalates
    rather than say a compensation was proposed."""
    rej = d.rejection
    if rej is not None and rej.taxonomy is _T.COMPENSATION_REQUIRED:
        why = "the call's key has moved on to a later attempt: no compensation is proposed"
        d.rejection = _not_proposed(rej, d, "compensation_not_proposed", why)
    return d


def _not_proposed(rej: Rejection, d: Decision, code: str, why: str) -> Rejection:
    action = (
        f"{d.contract_name or 'The call'} failed after committing a step, and its "
        "compensating call cannot be proposed. Do not retry; tell the user an operator will "
        "reconcile it and call handoff_to_human."
    )
    return Rejection(
        _T.COMPENSATION_FAILED, rej.gate, (*rej.errors, FieldError(None, why, code)), action,
        (HANDOFF_TOOL,),
    )  # fmt: skip


def refused_compensation(d: Decision) -> Decision:
    """A compensating call the processor proposed that a gate refuses is a failed
    compensation: nobody will propose it again, and the earlier step stays committed.
    Its answer says so and escalates, keeping the gate's own errors.

    Only a refusal known to be of that call counts: one Redis checked against the
    original's record (``admitted``: the key, the tool and the payload the processor
    proposed), one of its approvers (it was checked when parked), or the token the
    processor signed for it having expired (a refusal before anything is read from
    Redis; nobody else holds that key). A copy refused
    while the real one is in flight, and a proposal that only borrows the key, keep their
    own answers."""
    p, rej = d.proposal, d.rejection
    if d.outcome is not Outcome.REJECTED or rej is None or p is None:
        return d
    key = p.idempotency_key or ""
    if (
        not is_compensation_key(key)
        or p.proposal_id != compensation_proposal_id(key[len(COMPENSATION_PREFIX) :])
        or rej.taxonomy is _T.IDEMPOTENCY_CONFLICT
    ):
        return d
    codes = {e.code for e in rej.errors}
    if UNREQUESTED_COMPENSATION in codes:
        return d
    known = (
        d.extra.get(ADMITTED) is True
        or d.gate is Gate.APPROVAL
        or "release_refused" in codes  # parked under the original's key, refused at release
        or (d.gate is Gate.IDENTITY and "delegation_expired" in codes)
    )
    if not known:
        return d
    refusal = FieldError(
        None,
        f"the compensating call was refused: {rej.taxonomy.value} at the {rej.gate.value} gate",
        "compensation_refused",
    )
    action = (
        f"The compensating call {d.contract_name or p.tool_name} was refused "
        f"({rej.taxonomy.value}), so an earlier step stays committed. Do not retry; tell "
        "the user an operator will reconcile it and call handoff_to_human."
    )
    d.rejection = Rejection(
        _T.COMPENSATION_FAILED, rej.gate, (*rej.errors, refusal), action, (HANDOFF_TOOL,)
    )
    return d
