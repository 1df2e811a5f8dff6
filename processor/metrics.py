"""Prometheus metrics. Labels stay low-cardinality: tool, class, gate, taxonomy.

Never a tenant, run or proposal id as a label. Unresolved tool names (the
model can invent any string) are counted under ``tool="unresolved"``.
Counters are bumped once per batch from a tally, not once per record.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Gauge, Histogram, start_http_server
from prometheus_client import Counter as PCounter
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from processor.model import Decision, Gate, Outcome, TaxonomyClass


class Metrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.decisions = PCounter(
            "toolsentry_decisions_total",
            "Proposals decided, by tool, gate, taxonomy class and outcome.",
            ["tool", "gate", "taxonomy", "outcome"],
            registry=registry,
        )
        self.dead_letters = PCounter(
            "toolsentry_dead_letters_total",
            "Records sent to the DLQ, by reason: proposals that cannot be tied to a run, "
            "refused approval decisions, unknown or invalid results, and records a defect "
            "kept from being decided (internal_error) or encoded (encoding_failed).",
            ["reason"],
            registry=registry,
        )
        self.decision_seconds = BatchHistogram(
            "toolsentry_decision_seconds",
            "Time the gates spent on one proposal, in process (the batch's Redis round trips "
            "for reference data, admission and approvals are not in it).",
            (2e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 5e-2),
            registry,
        )
        # Up to batch_max_records (2000 by default): a backlog is read in full batches,
        # and a full batch above the last bound would read as that bound's size.
        self.batch_records = Histogram(
            "toolsentry_batch_records",
            "Records per transaction.",
            buckets=(1, 5, 10, 50, 100, 250, 500, 1000, 2000, 5000, 10000),
            registry=registry,
        )
        # Up to the transaction's timeout (15 s by default) and past it: a slow Redis or a
        # broker that keeps a commit waiting is what this histogram is looked at for.
        self.batch_seconds = Histogram(
            "toolsentry_batch_seconds",
            "Wall time of one batch from first record to committed transaction.",
            buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 15, 30),
            registry=registry,
        )
        self.transactions = PCounter(
            "toolsentry_transactions_total",
            "Kafka transactions by result: committed, aborted (the broker or the client failed), "
            "abandoned (opened for a batch that Redis then could not decide, or decided slowly).",
            ["result"],
            registry=registry,
        )
        self.consumer_lag = Gauge(
            "toolsentry_consumer_lag_records",
            "Records not yet consumed on tool.proposals, by partition (from librdkafka stats).",
            ["partition"],
            registry=registry,
        )
        self.reference_lag = Gauge(
            "toolsentry_reference_lag_records",
            "Records on tool.reference this instance's loader has not written to Redis yet "
            "(its partitions' ends less the positions it wrote; checked every 5 s).",
            registry=registry,
        )
        self.internal_errors = PCounter(
            "toolsentry_internal_errors_total",
            "Records a defect stopped from being decided: answered as internal errors "
            "(UNKNOWN_ERROR, nothing routed) or dead-lettered with reason internal_error.",
            registry=registry,
        )
        self.batch_splits = PCounter(
            "toolsentry_batch_splits_total",
            "Batches (and halves of batches) a defect stopped from being decided whole, "
            "then decided again in halves.",
            registry=registry,
        )
        self.dependency_errors = PCounter(
            "toolsentry_dependency_errors_total",
            "Errors talking to a dependency (kafka, redis, reference_data: reference data "
            "still being loaded).",
            ["dependency"],
            registry=registry,
        )
        self.contract_set = Gauge(
            "toolsentry_contract_set_info",
            "The contract set this instance decides with (value 1; fingerprint as label).",
            ["fingerprint", "contracts"],
            registry=registry,
        )
        self.contract_reloads = PCounter(
            "toolsentry_contract_reloads_total",
            "Contract reloads by result (loaded, refused: the old set was kept).",
            ["result"],
            registry=registry,
        )
        self.assigned_partitions = Gauge(
            "toolsentry_assigned_partitions",
            "Partitions of tool.proposals this instance owns (its approvals and results "
            "partitions are not counted).",
            registry=registry,
        )

        self.references = PCounter(
            "toolsentry_reference_records_total",
            "tool.reference records written to Redis (applied) or refused as malformed (one "
            "whose key names an entity forgets it, as a tombstone would).",
            ["result"],
            registry=registry,
        )
        self.reference_restarts = PCounter(
            "toolsentry_reference_loader_restarts_total",
            "Times the reference loader met an unexpected error and started again from the "
            "positions Redis holds.",
            registry=registry,
        )
        self.reference_rewinds = PCounter(
            "toolsentry_reference_rewinds_total",
            "Times the reference loader found Redis's positions behind what it had written "
            "(a failover or a restore lost writes) and read those partitions again.",
            registry=registry,
        )
        self.approvals = PCounter(
            "toolsentry_approvals_total",
            "Approval activity: requested, released, refused_at_release (the recheck at release "
            "refused it), rejected, expired, pending (awaiting a second approver), refused "
            "(invalid decisions), reused, ignored.",
            ["result"],
            registry=registry,
        )
        self.trust_reloads = PCounter(
            "toolsentry_trust_reloads_total",
            "Reloads of identity keys, policy and approvers by result (loaded, refused).",
            ["result"],
            registry=registry,
        )
        self.identity_development = Gauge(
            "toolsentry_identity_development_mode",
            "1 when this instance does NOT verify principal tokens (development mode).",
            registry=registry,
        )

        self.results = PCounter(
            "toolsentry_results_total",
            "Executors' results by the state they settled (COMPLETED, FAILED_RETRYABLE, "
            "FAILED_FINAL, EXPIRED) and what they settled (settled, duplicate, superseded, "
            "held, redelivered: a held failure put back on tool.results, stale, unknown, "
            "mismatch, unrouted, unrouted_attempt, conflict: another result of the same "
            "attempt reported another outcome first).",
            ["state", "status"],
            registry=registry,
        )
        self.compensations = PCounter(
            "toolsentry_compensations_total",
            "Compensating calls proposed by the processor.",
            registry=registry,
        )

    def record_tally(self, t: BatchTally, seconds: float) -> None:
        """A committed batch, from what ``tally`` kept of its decisions."""
        self.decision_seconds.observe_many(t.latencies)
        kinds: Counter[tuple[str, str, str, str]] = Counter()
        for (tool, gate, taxonomy, outcome), count in t.kinds.items():
            taxonomy = taxonomy or TaxonomyClass.SUCCESS
            kinds[(tool or "unresolved", gate.value, taxonomy.value, outcome.value)] += count
        for labels, count in kinds.items():
            self.decisions.labels(*labels).inc(count)
        for reason, count in t.dead.items():
            self.dead_letters.labels(reason).inc(count)
        internal = (
            t.dead.get("internal_error", 0)
            + t.dead.get("encoding_failed", 0)
            + sum(count for (_, gate, _, _), count in t.kinds.items() if gate is Gate.INTERNAL)
        )
        if internal:
            self.internal_errors.inc(internal)
        for event, count in t.events.items():
            counter = getattr(self, event[0])
            (counter.labels(*event[1:]) if len(event) > 1 else counter).inc(count)
        self.batch_records.observe(t.records)
        self.batch_seconds.observe(seconds)


@dataclass
class BatchTally:
    """What the metrics need of a batch's decisions, kept while its transaction commits
    instead of the decisions themselves (a large batch's are megabytes)."""

    latencies: list[float]
    """The gates' time of each proposal (records of other topics take none)."""
    kinds: Counter[tuple[Any, ...]]
    dead: Counter[str]
    records: int = 0
    events: Counter[tuple[str, ...]] = field(default_factory=Counter)
    """What deciding it did besides its decisions: (counter, *labels) -> count, of the
    ``results``, ``approvals``, ``compensations`` and ``batch_splits`` counters. Counted
    only once it commits, so a batch decided again (aborted, or split around a defect)
    counts once."""


def tally(decisions: Iterable[Decision], untimed: Collection[str] = ()) -> BatchTally:
    """Counted by the decisions' own fields; turned into label values once per kind.

    ``untimed``: the topics whose records no gate decides (approval decisions, executors'
    results). Their decisions took no gate time, and observed as 0 s in
    ``toolsentry_decision_seconds`` (which promises the gates' time per proposal) they
    would pull its percentiles down to the lowest bucket, by as many as there are results.
    """
    t = BatchTally([], Counter(), Counter())
    latencies, kinds, dead = t.latencies, t.kinds, t.dead
    for d in decisions:
        t.records += 1
        if d.source.topic not in untimed:
            latencies.append(d.latency_ms / 1000)
        if d.outcome is Outcome.DEAD_LETTER:
            dead[d.dlq_reason or "unknown"] += 1
            continue
        rejection = d.rejection
        kinds[(d.contract_name, d.gate, rejection and rejection.taxonomy, d.outcome)] += 1
    return t


class BatchHistogram(Collector):
    """A histogram without labels that takes a whole batch of observations at once.

    prometheus_client's ``Histogram.observe`` takes a lock and walks the buckets
    once per value; a batch of thousands of decisions is binned here with one
    ``bisect`` per value and added under one lock. It is exposed exactly as a
    ``Histogram`` is (``_bucket``, ``_count``, ``_sum``, ``_created``).
    """

    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry
    ) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = sorted(buckets)
        self._counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe_many(self, values: Sequence[float]) -> None:
        bins = Counter(bisect_left(self.bounds, v) for v in values)
        total = sum(values)
        with self._lock:
            for i, n in bins.items():
                self._counts[i] += n
            self._sum += total

    def observe(self, value: float) -> None:
        self.observe_many((value,))

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, n in zip([*map(floatToGoString, self.bounds), "+Inf"], counts, strict=True):
            running += n
            cumulative.append((bound, running))
        yield HistogramMetricFamily(
            self.name, self.documentation, buckets=cumulative, sum_value=total
        )


def serve(port: int) -> None:
    """Expose /metrics on ``port`` (0: do not)."""
    if port:
        start_http_server(port)
