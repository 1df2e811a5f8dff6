"""Metrics: the batch histogram is exposed as prometheus_client's own Histogram would be,
and a batch's decisions are counted by their labels."""

from __future__ import annotations

import random
from dataclasses import replace

import orjson
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from processor.config import Settings
from processor.contracts.registry import ContractSet
from processor.metrics import BatchHistogram, Metrics, tally
from processor.model import Outcome
from processor.pipeline import decide
from tests.unit.helpers import (
    NOW_MS,
    decide_arguments,
    decide_envelope,
    envelope,
    gates,
    record,
)

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


def test_decision_seconds_times_proposals_only_and_batch_records_counts_every_record(
    contracts: ContractSet,
) -> None:
    """Approval decisions and executors' results pass no gate: their decisions take no gate
    time. Observed as 0 s, one per result, they would drag the proposals' p50 and p99 to
    the lowest bucket; they still count as records of the batch."""
    routed = decide_arguments(contracts, "search_kb", {"query": "refunds", "limit": 10})
    routed.latency_ms = 3.0  # in the 2.5 ms to 10 ms bucket
    untimed = ("tool.approvals", "tool.results")
    others = []
    for topic in untimed:
        d = decide_arguments(contracts, "search_kb", {"query": "refunds", "limit": 10})
        d.source = replace(d.source, topic=topic)
        d.latency_ms = 0.0  # (never timed: no gate decided it)
        others += [d, d]
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.record_tally(tally([routed, *others], untimed), 0.01)
    assert registry.get_sample_value("toolsentry_decision_seconds_count") == 1
    assert registry.get_sample_value("toolsentry_decision_seconds_bucket", {"le": "0.0025"}) == 0
    assert registry.get_sample_value("toolsentry_batch_records_sum") == 5
    assert registry.get_sample_value("toolsentry_decisions_total", {
        "tool": "search_kb", "gate": "route", "taxonomy": "SUCCESS", "outcome": "ROUTED",
    }) == 5  # fmt: skip


def test_a_full_batch_and_a_commit_as_slow_as_the_transaction_timeout_have_buckets() -> None:
    """A backlog is read in batches of ``batch_max_records``, and a batch can take up to
    the transaction's timeout to commit: above a histogram's last bound, histogram_quantile
    reports that bound, and the dashboard would show 1000-record batches taking 5 s while
    they hold 2000 and take 12."""
    settings = Settings()
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.batch_records.observe(settings.batch_max_records)
    metrics.batch_seconds.observe(settings.transaction_timeout_ms / 1000)

    def finite_bounds(name: str) -> list[float]:
        [family] = [m for m in registry.collect() if m.name == name]
        return [
            float(s.labels["le"])
            for s in family.samples
            if s.name.endswith("_bucket") and s.labels["le"] != "+Inf" and s.value > 0
        ]

    assert settings.batch_max_records in finite_bounds("toolsentry_batch_records")
    assert settings.transaction_timeout_ms / 1000 in finite_bounds("toolsentry_batch_seconds")


def test_a_stream_of_hostile_proposals_adds_no_series_per_value(contracts: ContractSet) -> None:
    """Invented tool names and versions, tenants, run ids and garbage records: none of it is
    a label value. Each label takes its value from a contract or a fixed vocabulary, so the
    series a stream of such records leaves behind do not grow with the stream."""
    rng = random.Random(7)

    def hostile(i: int) -> bytes:
        word = "".join(rng.choice("abcxyz_-.") for _ in range(12)) + str(i)
        return rng.choice([
            orjson.dumps(envelope(word, tenant_id=word, run_id=word)),
            orjson.dumps({**envelope("search_kb"), "tool": {"name": "search_kb", "version": word}}),
            orjson.dumps({"run_id": word, "tool": word}),
            word.encode(),
            b'{"run_id": "' + word.encode() + b'", "tool": {"name": "',
        ])  # fmt: skip

    def series(n: int) -> int:
        registry = CollectorRegistry()
        metrics = Metrics(registry)
        decisions = [
            decide(record(hostile(i), offset=i), gates(contracts), NOW_MS) for i in range(n)
        ]
        metrics.record_tally(tally(decisions), 0.01)
        return sum(
            1
            for family in registry.collect()
            if family.name in ("toolsentry_decisions", "toolsentry_dead_letters")
            for s in family.samples
            if s.name.endswith("_total")
        )

    assert 3 <= series(400) == series(100) <= 12
