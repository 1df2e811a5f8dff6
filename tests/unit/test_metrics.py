"""The batch histogram is exposed as prometheus_client's own Histogram would be."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from processor.metrics import BatchHistogram

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
