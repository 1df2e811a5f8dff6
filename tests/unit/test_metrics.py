"""Metrics: the batch histogram is exposed as prometheus_client's own Histogram would be,
and a batch's decisions are counted by their labels."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from processor.contracts.registry import ContractSet
from processor.metrics import BatchHistogram, Metrics, tally
from processor.model import Outcome
from tests.unit.helpers import decide_arguments, decide_envelope, envelope

BUCKETS = (2e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 5e-2)


def _samples(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    lines = text.splitlines()
    return [ln for ln in lines if ln and not ln.startswith("#") and "_created" not in ln]


def test_a_batch_is_binned_as_one_observe_per_value_would_be() -> None:
    rng = random.Random(3)
    # Values on the bounds themselves too: a bucket counts values less than or equal.
    values = [rng.choice((rng.uniform(0, 0.06), rng.choice(BUCKETS))) for _ in range(2_000)]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    batch = BatchHistogram("d_seconds", "doc", BUCKETS, ours)
    reference = Histogram("d_seconds", "doc", buckets=BUCKETS, registry=theirs)
    for chunk in (values[:7], values[7:1500], [], values[1500:]):
        batch.observe_many(chunk)
    for v in values:
        reference.observe(v)
    mine, expected = _samples(ours), _samples(theirs)
    assert [ln.rsplit(" ", 1)[0] for ln in mine] == [ln.rsplit(" ", 1)[0] for ln in expected]
    for a, b in zip(mine, expected, strict=True):
        assert abs(float(a.rsplit(" ", 1)[1]) - float(b.rsplit(" ", 1)[1])) < 1e-9, (a, b)
    assert 'd_seconds_bucket{le="+Inf"} 2000.0' in mine


def test_a_batch_of_decisions_is_counted_by_tool_gate_class_and_outcome(
    contracts: ContractSet,
) -> None:
    routed = decide_arguments(contracts, "search_kb", {"query": "refunds", "limit": 10})
    bad_pattern = decide_arguments(
        contracts,
        "cancel_order",
        {"order_id": "ORD-1", "reason_code": "customer_request", "confirm": True},
    )
    unknown = decide_envelope(envelope("no_such_tool"), contracts)
    dead = decide_envelope({"not": "a proposal"}, contracts)
    assert routed.outcome is Outcome.ROUTED
    assert bad_pattern.outcome is Outcome.REJECTED
    assert dead.outcome is Outcome.DEAD_LETTER
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    batch = tally([routed, bad_pattern, routed, unknown, dead, bad_pattern, routed])
    metrics.record_tally(batch, 0.01)
    metrics.record_tally(tally([unknown]), 0.02)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    decided = "toolsentry_decisions_total"
    assert value(decided, tool="search_kb", gate="route", taxonomy="SUCCESS",
                 outcome="ROUTED") == 3  # fmt: skip
    assert value(decided, tool="cancel_order", gate="schema", taxonomy="OUT_OF_BOUNDS",
                 outcome="REJECTED") == 2  # fmt: skip
    assert value(decided, tool="unresolved", gate="resolve", taxonomy="STRUCTURAL_VIOLATION",
                 outcome="REJECTED") == 2  # fmt: skip
    assert value("toolsentry_dead_letters_total", reason=dead.dlq_reason or "") == 1
    assert value("toolsentry_decision_seconds_count") == 8
    assert value("toolsentry_batch_records_count") == 2
    assert value("toolsentry_batch_records_sum") == 8


def test_what_deciding_a_batch_did_is_counted_when_it_commits() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    batch = tally([])
    batch.events[("results", "COMPLETED", "settled")] += 2
    batch.events[("approvals", "requested")] += 1
    batch.events[("compensations",)] += 3
    assert registry.get_sample_value("toolsentry_compensations_total") == 0
    metrics.record_tally(batch, 0.01)
    results = {"state": "COMPLETED", "status": "settled"}
    assert registry.get_sample_value("toolsentry_results_total", results) == 2
    assert registry.get_sample_value("toolsentry_approvals_total", {"result": "requested"}) == 1
    assert registry.get_sample_value("toolsentry_compensations_total") == 3
