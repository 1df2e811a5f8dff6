"""One agent story whose every answer depends on admission state in Redis. The outage
tests replay it across a stopped Redis and a stopped broker and check that each step is
answered as if nothing had happened.

Each run makes the same 16 proposals: a call made twice and then a third time (the loop
guard), an explicit idempotency key reused with the same payload (in flight) and with
another (signature mismatch), a class budget, a run cost cap and the step cap that run
out, a repair, and a call parked for approval (reference data needed). Runs are
interleaved when produced (every run's n-th step in the n-th window), so an outage in
the middle splits each run: its first steps decided before, its later ones after.

Rate limits are scaled out of the way (GCRA answers depend on the wall clock, and here
on how long an outage happened to last), and in-flight keys are kept for an hour:
otherwise a key whose deadline and grace period passed during an outage would rightly
become retryable, and step 5 would be routed.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from typing import Any

import orjson

from processor.codec.avro import codec

WINDOW_S = 2.0
"""Every run makes its n-th proposal in the n-th window: the runs are interleaved."""
OUTAGE_AT_S = 4 * WINDOW_S - 0.5
"""When an outage test takes its dependency away: after steps 0-3 are decided, before
step 4 is proposed."""

BUDGETS: dict[str, Any] = {
    "steps": 12,
    "classes": {"read": 30, "write": 2, "external": 3, "financial": 0, "critical": 0},
    "run_cost": 0.025,
    "day_cost": 1000.0,
    "repeats": 2,
    "repairs": 3,
    "rate_limit_scale": 1_000_000,
    "in_flight_grace_ms": 3_600_000,
}
STORY = (
    "The customer ordered a sofa three weeks ago. It arrived with a torn cover and a "
    "broken leg, the courier left it outside in the rain, and two earlier emails asking "
    "for a replacement went unanswered. They now ask for a refund instead."
)


def step(prefix: str, run: int, n: int) -> tuple[str, dict[str, Any], dict[str, str]]:
    """The n-th proposal of a run: tool, arguments and envelope extras."""
    query = {"query": f"returns for order {run}", "limit": 5}
    summary = f"Parcel {run} arrived damaged; the customer wants a replacement."
    ticket = {"customer_id": f"CUS-{run:06d}", "category": "delivery", "priority": "normal",
              "summary": summary}  # fmt: skip
    key = {"idempotency_key": f"{prefix}-{run}-ticket"}
    if n in (0, 1, 4):  # the same call as three operations: the third is one too many
        return "search_kb", query, {"logical_operation_id": f"op-{n}"}
    if n in (2, 5):  # an explicit key, then the same key and payload while it is in flight
        return "create_ticket", ticket, key
    if n == 3:
        order = {"order_id": f"WO-{run:05d}-A", "reason_code": "customer_request", "confirm": True}
        return "cancel_order", order, {}
    if n == 6:
        summary = f"Run {run}: the same delivery failure, again, and nobody has called back."
        return "escalate", {"severity": "high", "reason_code": "repeated_failure",
                            "summary": summary}, {}  # fmt: skip
    if n == 7:  # a third write: over the class budget
        return "create_ticket", {**ticket, "priority": "high"}, {}
    if n in (8, 10, 11):  # 0.01 each; the third goes over the run's cost cap
        return "summarise", {"text": f"{STORY} Case {run}-{n}.", "max_words": 60,
                             "style": "paragraph"}, {}  # fmt: skip
    if n == 9:  # a repair: limit as a string
        return "search_kb", {"query": "return policy", "limit": "10"}, {}
    if n == 12:  # the key again with another payload: refused on the key, before the step cap
        return "create_ticket", {**ticket, "priority": "urgent"}, key
    return "search_kb", {"query": f"status of parcel {run}-{n}", "limit": 5}, {}


EXPECTED: dict[int, tuple[str, str, str | None]] = {
    0: ("ROUTED", "SUCCESS", None),
    1: ("ROUTED", "SUCCESS", None),
    2: ("ROUTED", "SUCCESS", None),
    3: ("PENDING_APPROVAL", "CONFIRMATION_MISSING", None),
    4: ("REJECTED", "BUDGET_EXHAUSTED", "repeated_call"),
    5: ("REJECTED", "IDEMPOTENCY_CONFLICT", "idempotency_in_flight"),
    6: ("ROUTED", "SUCCESS", None),
    7: ("REJECTED", "BUDGET_EXHAUSTED", "class_budget"),
    8: ("ROUTED", "SUCCESS", None),
    9: ("REJECTED", "TYPE_MISMATCH", None),
    10: ("ROUTED", "SUCCESS", None),
    11: ("REJECTED", "BUDGET_EXHAUSTED", "run_cost_cap"),
    12: ("REJECTED", "SIGNATURE_MISMATCH", "idempotency_key_reused"),
    13: ("REJECTED", "BUDGET_EXHAUSTED", "step_cap"),
    14: ("REJECTED", "BUDGET_EXHAUSTED", "step_cap"),
    15: ("REJECTED", "BUDGET_EXHAUSTED", "step_cap"),
}
"""(decision, taxonomy class, the admission's error code) of each step of every run."""


def corpus(principal: str, tenant: str, prefix: str, runs: int) -> list[tuple[str, bytes, bytes]]:
    """(proposal id, key, value) of every step of ``runs`` runs, interleaved: step n of
    every run before step n + 1 of any."""
    out = []
    for n in EXPECTED:
        for run in range(runs):
            tool, args, extra = step(prefix, run, n)
            run_id = f"{prefix}-run-{run}"
            env = {"proposal_id": f"{prefix}-{run}-{n}", "tenant_id": tenant, "run_id": run_id,
                   "tool": {"name": tool}, "arguments": args, "principal_token": principal,
                   **extra}  # fmt: skip
            out.append((f"{prefix}-{run}-{n}", run_id.encode(), orjson.dumps(env)))
    return out


def orders(tenant: str, runs: int) -> list[tuple[str, dict[str, Any] | None]]:
    """The reference records step 3 (cancel_order) needs: each run's order exists."""
    return [(f"{tenant}/order/WO-{r:05d}-A", {"state": "processing"}) for r in range(runs)]


def answered_once(
    records: list[Any], stories: list[tuple[str, bytes, bytes]]
) -> list[dict[str, Any]]:
    """The observations in ``records``; asserts that every proposal of ``stories`` has
    exactly one, with the answer its step should get."""
    observations = [codec("observation").decode(m.value()) for m in records]
    per_proposal = Counter(o["proposal_id"] for o in observations)
    lost = {pid for pid, _, _ in stories} - set(per_proposal)
    assert not lost, f"{len(lost)} proposals lost, e.g. {sorted(lost)[:5]}"
    twice = [pid for pid, n in per_proposal.items() if n > 1]
    assert not twice, f"{len(twice)} proposals answered twice, e.g. {twice[:5]}"
    wrong = wrong_answers(observations)
    assert not wrong, f"{len(wrong)} answered otherwise, e.g. {list(wrong.items())[:4]}"
    return observations


def wrong_answers(observations: list[dict[str, Any]]) -> dict[str, Any]:
    """The observations whose answer is not the one ``EXPECTED`` gives for their step."""
    wrong = {}
    for o in observations:
        decision, taxonomy, code = EXPECTED[int(o["proposal_id"].rpartition("-")[2])]
        codes = [e["code"] for e in o["result_payload"]["errors"]]
        seen = (o["decision"], o["status"]["taxonomy_class"])
        if seen != (decision, taxonomy) or (code is not None and code not in codes):
            wrong[o["proposal_id"]] = (*seen, codes)
    return wrong


WANT_COUNTERS = {"steps": 16, "class:read": 4, "class:write": 2, "class:external": 1}
"""Every run's admission counters once all its steps are decided (and its cost, 0.022,
and its one repair)."""
WANT_COST = 0.022


def wrong_counters(counters: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The runs whose admission counters are not what their 16 steps spent."""
    return {
        run: c
        for run, c in counters.items()
        if {k: c.get(k) for k in WANT_COUNTERS} != WANT_COUNTERS
        or abs(float(c.get("cost", 0)) - WANT_COST) > 1e-9
        or c.get("repairs") != 1
    }


def ms(value: Any) -> float:
    """An Avro timestamp-millis as epoch ms (fastavro reads it as an aware datetime)."""
    if isinstance(value, dt.datetime):
        return value.timestamp() * 1000
    return float(value)
