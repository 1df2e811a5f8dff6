"""The domain: proposals, contracts, rejections, decisions and the error taxonomy.

Everything here is plain data. Gates take these values and return these
values; Kafka, Redis and Avro live at the edges (``app``, ``state``, ``codec``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class TaxonomyClass(StrEnum):
    """The error taxonomy every observation is classified by (seed 001)."""

    SUCCESS = "SUCCESS"
    PARTIAL_SUCCESS = "PARTIAL_SUCCESS"
    SYNTACTIC_PARSE_FAIL = "SYNTACTIC_PARSE_FAIL"
    STRUCTURAL_VIOLATION = "STRUCTURAL_VIOLATION"
    TYPE_MISMATCH = "TYPE_MISMATCH"
    OUT_OF_BOUNDS = "OUT_OF_BOUNDS"
    SEMANTIC_INVALIDITY = "SEMANTIC_INVALIDITY"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    POLICY_VIOLATION = "POLICY_VIOLATION"
    STALE_STATE = "STALE_STATE"
    CONFIRMATION_MISSING = "CONFIRMATION_MISSING"
    BUDGET_EXHAUSTED = "BUDGET_EXHAUSTED"
    RATE_LIMITED = "RATE_LIMITED"
    TIMEOUT = "TIMEOUT"
    IDEMPOTENCY_CONFLICT = "IDEMPOTENCY_CONFLICT"
    SIGNATURE_MISMATCH = "SIGNATURE_MISMATCH"
    DEPENDENCY_UNAVAILABLE = "DEPENDENCY_UNAVAILABLE"
    OBSERVATION_NORMALIZATION_FAIL = "OBSERVATION_NORMALIZATION_FAIL"
    COMPENSATION_REQUIRED = "COMPENSATION_REQUIRED"
    COMPENSATION_FAILED = "COMPENSATION_FAILED"
    UNKNOWN_ERROR = "UNKNOWN_ERROR"


@dataclass(frozen=True, slots=True)
class ResponseVector:
    """What the orchestrator may do about a class: the taxonomy's contract."""

    code: int
    repairable: bool
    retryable: bool
    requires_approval: bool
    fail_closed: bool
    escalate: bool
    meaning: str


_T = TaxonomyClass
RESPONSE_VECTORS: dict[TaxonomyClass, ResponseVector] = {
    _T.SUCCESS: ResponseVector(200, False, False, False, False, False, "accepted"),
    _T.PARTIAL_SUCCESS: ResponseVector(
        207,
        False,
        True,
        False,
        False,
        False,
        "some steps committed, others did not; the same call with the same idempotency "
        "key finishes the rest",
    ),
    _T.SYNTACTIC_PARSE_FAIL: ResponseVector(
        400, True, False, False, False, False, "the proposal or its arguments are not valid JSON"
    ),
    _T.STRUCTURAL_VIOLATION: ResponseVector(
        422,
        True,
        False,
        False,
        False,
        False,
        "missing, unknown or misplaced fields, or an unknown tool",
    ),
    _T.TYPE_MISMATCH: ResponseVector(
        422, True, False, False, False, False, "a value has the wrong JSON type"
    ),
    _T.OUT_OF_BOUNDS: ResponseVector(
        422,
        True,
        False,
        False,
        False,
        False,
        "a value breaks an enum, pattern, range or size limit",
    ),
    _T.SEMANTIC_INVALIDITY: ResponseVector(
        422, True, False, False, False, False, "well-formed arguments that break a business rule"
    ),
    _T.PERMISSION_DENIED: ResponseVector(
        403, False, False, False, True, False, "the principal may not make this call"
    ),
    _T.POLICY_VIOLATION: ResponseVector(
        403, False, False, False, True, True, "the call breaks a safety or governance policy"
    ),
    _T.STALE_STATE: ResponseVector(
        409, True, False, False, False, False, "the target is not in a state that allows the action"
    ),
    _T.CONFIRMATION_MISSING: ResponseVector(
        428, False, False, True, False, False, "a valid approval is required first"
    ),
    _T.BUDGET_EXHAUSTED: ResponseVector(
        429, False, False, False, True, True, "a run, class or cost budget is spent"
    ),
    _T.RATE_LIMITED: ResponseVector(
        429, False, True, False, False, False, "a rate limit is reached; retry after the delay"
    ),
    _T.TIMEOUT: ResponseVector(
        504, False, True, False, False, False, "the tool did not finish before its deadline"
    ),
    _T.IDEMPOTENCY_CONFLICT: ResponseVector(
        409, False, True, False, False, False, "the same operation is still in flight"
    ),
    _T.SIGNATURE_MISMATCH: ResponseVector(
        409, False, False, False, True, True, "an idempotency key was reused for other arguments"
    ),
    _T.DEPENDENCY_UNAVAILABLE: ResponseVector(
        503, False, True, False, True, False, "a dependency is down"
    ),
    _T.OBSERVATION_NORMALIZATION_FAIL: ResponseVector(
        502, False, False, False, False, True, "the tool's result could not be normalised"
    ),
    _T.COMPENSATION_REQUIRED: ResponseVector(
        500, False, False, False, True, False, "a later step failed after an earlier one committed"
    ),
    _T.COMPENSATION_FAILED: ResponseVector(
        500, False, False, True, True, True, "compensation failed; state needs reconciliation"
    ),
    _T.UNKNOWN_ERROR: ResponseVector(
        500, False, False, False, True, True, "an unclassified failure; nothing was executed"
    ),
}


class SideEffectClass(StrEnum):
    READ_ONLY = "READ_ONLY"
    EPHEMERAL_WRITE = "EPHEMERAL_WRITE"
    LOW_RISK_INTERNAL = "LOW_RISK_INTERNAL"
    MEDIUM_RISK_WRITE = "MEDIUM_RISK_WRITE"
    HIGH_RISK_EXTERNAL = "HIGH_RISK_EXTERNAL"
    CRITICAL_MUTATION = "CRITICAL_MUTATION"


class Gate(StrEnum):
    """The gate that decided a proposal (the first one that failed, or ``route``)."""

    PARSE = "parse"
    RESOLVE = "resolve"
    SCHEMA = "schema"
    IDENTITY = "identity"
    SEMANTIC = "semantic"
    POLICY = "policy"
    STATE = "state"
    CONFIRMATION = "confirmation"
    BUDGET = "budget"
    """Rate limits, run and day budgets, the loop and repair guards."""
    IDEMPOTENCY = "idempotency"
    ROUTE = "route"
    APPROVAL = "approval"
    """A decision on ``tool.approvals`` that released, rejected or expired a parked call."""
    RESULT = "result"
    """An executor's result for a routed call (``tool.results``)."""
    INTERNAL = "internal"


class Outcome(StrEnum):
    ROUTED = "ROUTED"
    REJECTED = "REJECTED"
    PARKED = "PARKED"
    """Waiting for approval: an approval request is published, the call is held in Redis."""
    DEAD_LETTER = "DEAD_LETTER"
    IGNORED = "IGNORED"
    """An input with nothing to answer (a duplicate approval decision, a spent timer)."""
    SETTLED = "SETTLED"
    """A call's final answer: its executor's result, or the cached result of an earlier
    call with the same idempotency key (``Decision.final``)."""


CLEARANCE_LEVELS = ("public", "internal", "confidential", "regulated", "secret")
"""Data classifications, lowest first: a principal may touch data up to its clearance."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is asking, as a verified token says; never taken from unsigned fields."""

    tenant_id: str
    user_id: str
    agent_id: str
    scopes: frozenset[str]
    clearance: str
    verified: bool = True
    key_id: str | None = None
    delegated_for: tuple[str, ...] | None = None
    """Set on a principal the processor vouches for (a compensating call it proposed in
    the original caller's name): the one proposal it may act for, as (idempotency key,
    proposal id, run id)."""

    @property
    def clearance_rank(self) -> int:
        return CLEARANCE_LEVELS.index(self.clearance)

    def as_cel(self) -> dict[str, object]:
        return {
            "tenant_id": self.tenant_id,
            "user_id": self.user_id,
            "agent_id": self.agent_id,
            "scopes": sorted(self.scopes),
            "clearance": self.clearance,
        }


@dataclass(frozen=True, slots=True)
class FieldError:
    """One violation, addressed to one field (``None`` for the call as a whole)."""

    field: str | None
    message: str
    code: str
    expected: str | None = None
    actual: str | None = None
    hint: str | None = None


@dataclass(frozen=True, slots=True)
class Rejection:
    """A gate's refusal: a value, never an exception thrown across gates."""

    taxonomy: TaxonomyClass
    gate: Gate
    errors: tuple[FieldError, ...]
    next_action: str
    allowed_tools: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SourceRecord:
    """Where an input record came from; the unit of exactly-once bookkeeping."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int


@dataclass(slots=True)
class Proposal:
    """A parsed proposal envelope. Identity fields here are *claims* until verified."""

    proposal_id: str
    run_id: str
    tenant_id: str | None
    created_at: str | None
    tool_name: str | None
    tool_version: str | None
    arguments: Any
    workflow_id: str | None = None
    step: int | None = None
    principal_token: str | None = None
    idempotency_key: str | None = None
    logical_operation_id: str | None = None
    approvals: tuple[Any, ...] = ()
    active_tools: tuple[str, ...] | None = None
    traceparent: str | None = None
    trace_id: str = ""
    arguments_text: str | None = None
    """The model's ``arguments_raw`` when it did not parse into an object: what a repeat
    of the same broken call is recognised by."""


@dataclass(frozen=True, slots=True)
class Lifecycle:
    status: str
    sunset_date: str | None
    replacement: str | None

    def status_on(self, day: str) -> str:
        """The status on ``day`` (YYYY-MM-DD, UTC): a deprecated version is sunsetted from
        its sunset date on, whether or not its contract was edited to say so."""
        if self.status == "deprecated" and self.sunset_date and str(self.sunset_date) <= day:
            return "sunsetted"
        return self.status


@dataclass(frozen=True, slots=True)
class Final:
    """What a call finally did: the executor's result, or the cached one on a retry."""

    completed: bool
    data: str | None = None
    """The result as JSON text."""
    idempotency_hit: bool = False
    attempt: int = 1


@dataclass(slots=True)
class ApprovedCall:
    """What an executor receives: everything it needs and nothing secret."""

    call_id: str
    tool_name: str
    tool_version: str
    side_effect_class: SideEffectClass
    canonical_arguments: str
    payload_hash: str
    idempotency_key: str
    deadline_ms: int
    attempt: int = 1
    approval_ids: tuple[str, ...] = ()


@dataclass(slots=True)
class Decision:
    """The outcome for one input record. Exactly one per record, always.

    Not frozen: a frozen dataclass pays a ``object.__setattr__`` per field, and
    one of these is built for every record on the hot path."""

    source: SourceRecord
    outcome: Outcome
    gate: Gate
    proposal: Proposal | None
    contract_name: str | None = None
    contract_version: str | None = None
    side_effect_class: SideEffectClass | None = None
    rejection: Rejection | None = None
    call: ApprovedCall | None = None
    warnings: tuple[str, ...] = ()
    dlq_reason: str | None = None
    dlq_detail: str | None = None
    decided_at_ms: int = 0
    latency_ms: float = 0.0
    post_action_verification: bool = False
    principal: Principal | None = None
    approval_request: Any = None
    """The confirmation packet published for a parked call (``Outcome.PARKED``)."""
    extra: dict[str, Any] = field(default_factory=dict)
    retry_after_ms: int | None = None
    """When the same call may be proposed again (RATE_LIMITED, IDEMPOTENCY_CONFLICT)."""
    final: Final | None = None
    """A call's final answer (``Outcome.SETTLED``)."""
    idempotency: tuple[str, str] | None = None
    """(key, payload hash) of a call refused on the world's state: a retry of a call that
    already ran, and changed that state itself, is answered from its record instead."""

    @property
    def taxonomy(self) -> TaxonomyClass:
        if self.rejection is not None:
            return self.rejection.taxonomy
        return TaxonomyClass.SUCCESS
