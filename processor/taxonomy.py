"""The error taxonomy as a table: which gate raises each class, and what the model does.

The README's taxonomy table is this module's output (``toolsentry taxonomy``),
and a test compares the two, so the documentation cannot drift from the code.
"""

from __future__ import annotations

from processor.model import RESPONSE_VECTORS, TaxonomyClass

_T = TaxonomyClass

RAISED_BY: dict[TaxonomyClass, str] = {
    _T.SUCCESS: "route; approval (a parked call released); result",
    _T.SYNTACTIC_PARSE_FAIL: "parse",
    _T.STRUCTURAL_VIOLATION: "resolve, schema",
    _T.TYPE_MISMATCH: "schema",
    _T.OUT_OF_BOUNDS: "schema; semantic (an integer beyond 64 bits, arguments too large for "
    "a rule)",
    _T.SEMANTIC_INVALIDITY: "semantic (unknown id, CEL rule)",
    _T.PERMISSION_DENIED: "identity (token, tenant, scope, another tenant's id); idempotency "
    "(a borrowed compensation key)",
    _T.POLICY_VIOLATION: "policy (credentials, tenant classes, clearance, egress)",
    _T.STALE_STATE: "state (entity not in an allowed state)",
    _T.CONFIRMATION_MISSING: "confirmation; approval (rejected, expired)",
    _T.BUDGET_EXHAUSTED: "budget (step cap, class budgets, cost caps, loop and repair guards)",
    _T.RATE_LIMITED: "budget (rate limit)",
    _T.SIGNATURE_MISMATCH: "idempotency",
    _T.IDEMPOTENCY_CONFLICT: "idempotency",
    _T.TIMEOUT: "result (not started before its deadline)",
    _T.DEPENDENCY_UNAVAILABLE: "result (retryable failure); idempotency (a replay decided "
    "otherwise)",
    _T.PARTIAL_SUCCESS: "result (failed after committing steps of a resumable tool)",
    _T.COMPENSATION_REQUIRED: "result (failed after committing steps of any other tool)",
    _T.COMPENSATION_FAILED: "result (the compensating call failed); any gate refusing the "
    "compensating call",
    _T.OBSERVATION_NORMALIZATION_FAIL: "result (data not matching the contract's output_schema)",
    _T.UNKNOWN_ERROR: "internal (a bug; fails closed); result (a failure its executor did not "
    "classify, a call its executor could not read)",
}
"""Where each class comes from. The gates raise theirs as a proposal passes through them,
admission (idempotency, then budgets) last; the conformance suite sees each of them raised.
The classes of ``RAISED_BY_RESULTS`` come only from executors' results, which the
conformance run (no executors) never sees. An executor may also report a failure under
a class of its own. Classes not listed are defined, with their response vectors, for
stages that do not exist yet; nothing raises them."""

RAISED_BY_RESULTS: frozenset[TaxonomyClass] = frozenset(
    {
        _T.TIMEOUT,
        _T.DEPENDENCY_UNAVAILABLE,
        _T.PARTIAL_SUCCESS,
        _T.COMPENSATION_REQUIRED,
        _T.COMPENSATION_FAILED,
        _T.OBSERVATION_NORMALIZATION_FAIL,
    }
)
"""Raised only from an executor's result (a compensating call exists only after one):
exercised end to end by
``tests/integration/test_results_e2e.py``, not by the conformance suite."""

NEXT_ACTIONS: dict[TaxonomyClass, str] = {
    _T.SUCCESS: "Wait for the call's result before proposing a dependent step.",
    _T.PARTIAL_SUCCESS: "Retry the same call with its idempotency key; it finishes the rest.",
    _T.SYNTACTIC_PARSE_FAIL: "Emit the arguments again as one complete JSON object.",
    _T.STRUCTURAL_VIOLATION: "Fix the listed fields (or pick an allowed tool) and call again.",
    _T.TYPE_MISMATCH: 'Send the expected JSON type, e.g. emit 10 not "10".',
    _T.OUT_OF_BOUNDS: "Use an allowed value; for ids, call the lookup tool the hint names.",
    _T.SEMANTIC_INVALIDITY: "Call the named lookup tool, or ask the user; never invent ids.",
    _T.PERMISSION_DENIED: "Do not retry; tell the user, or hand off to a human.",
    _T.POLICY_VIOLATION: "Do not retry as is; remove what the policy forbids or hand off.",
    _T.STALE_STATE: "Refresh with the lookup tool, then tell the user the actual state.",
    _T.CONFIRMATION_MISSING: "Tell the user the call waits for approval; do not re-propose.",
    _T.BUDGET_EXHAUSTED: "Stop; ask for a budget increase or hand off.",
    _T.RATE_LIMITED: "Retry the same call after the given delay.",
    _T.TIMEOUT: "Retry with the same idempotency key, or escalate after the retry cap.",
    _T.IDEMPOTENCY_CONFLICT: "The same operation is in flight; retry after the delay.",
    _T.SIGNATURE_MISMATCH: "Do not reuse an idempotency key for other arguments.",
    _T.DEPENDENCY_UNAVAILABLE: "Retry after recovery, or use a fallback.",
    _T.OBSERVATION_NORMALIZATION_FAIL: "Hand off: the tool's result could not be read.",
    _T.COMPENSATION_REQUIRED: "Run the compensation tool, or route to an operator.",
    _T.COMPENSATION_FAILED: "Escalate: state needs reconciliation by an operator.",
    _T.UNKNOWN_ERROR: "Nothing ran; do not retry automatically; hand off to a human.",
}


def _yes(flag: bool) -> str:
    return "yes" if flag else ""


def table_markdown() -> str:
    lines = [
        "| class | code | raised by | repairable | retryable | approval | fail closed "
        "| escalate | the model's next action |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for cls in TaxonomyClass:
        v = RESPONSE_VECTORS[cls]
        lines.append(
            f"| `{cls.value}` | {v.code} | {RAISED_BY.get(cls, '(not raised yet)')} "
            f"| {_yes(v.repairable)} | {_yes(v.retryable)} | {_yes(v.requires_approval)} "
            f"| {_yes(v.fail_closed)} | {_yes(v.escalate)} | {NEXT_ACTIONS[cls]} |"
        )
    return "\n".join(lines) + "\n"


BEGIN = "<!-- taxonomy table: generated by `toolsentry taxonomy`; do not edit -->"
END = "<!-- end of taxonomy table -->"
