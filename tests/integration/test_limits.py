"""Rate limits, run budgets and the loop guard against a real redis-server and a real
Redis Cluster: boundaries, replays after an aborted transaction, and two racing
processors."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from redis.exceptions import RedisClusterException

from processor.state.connection import connect, is_cluster_url
from processor.state.limits import Check, LimitStore, Verdict, rate_of

pytestmark = pytest.mark.integration

NOW = 1_800_000_000_000


@pytest.fixture
def redis_url(redis_backend: str, request: pytest.FixtureRequest) -> str:
    """Each backend in turn. On a cluster LimitStore fails today: it calls its script
    through ``Script(client=pipeline)``, which redis-py's cluster pipeline refuses
    (EVALSHA is blocked there). Strict, so the fix (``run_scripts``) shows up as XPASS."""
    if is_cluster_url(redis_backend):
        request.applymarker(
            pytest.mark.xfail(
                raises=RedisClusterException,
                strict=True,
                reason="LimitStore.check pipelines Script calls; needs connection.run_scripts",
            )
        )
    return redis_backend


@pytest.fixture
def store(redis_url: str) -> Iterator[LimitStore]:
    yield LimitStore(connect(redis_url), f"limits-{uuid.uuid4().hex[:8]}")


_pos = iter(range(10**9))


def check(**kw: Any) -> Check:
    fields: dict[str, Any] = {
        "tenant": "acme",
        "pos": f"t/0/{next(_pos)}",
        "run": "run-1",
        "tool": "search_kb",
        "cls": "READ_ONLY",
        "cost": 0.0,
        "sig": uuid.uuid4().hex,
        "now": NOW,
        "rate": None,
        "steps": 1000,
        "class_budget": 1000,
        "cost_cap": 1e9,
    }
    fields.update(kw)
    return Check(**fields)


def whys(verdicts: list[Verdict]) -> list[str | None]:
    return [v.why for v in verdicts]


def test_the_nth_step_is_allowed_and_the_next_refused(store: LimitStore) -> None:
    verdicts = store.check([check(steps=12) for _ in range(13)])
    assert whys(verdicts) == [None] * 12 + ["step_cap"]
    assert store.run_counters("acme", "run-1")["steps"] == 13  # refused proposals count too


def test_class_budgets_and_a_zero_budget(store: LimitStore) -> None:
    writes = store.check([check(cls="MEDIUM_RISK_WRITE", class_budget=5) for _ in range(6)])
    assert whys(writes) == [None] * 5 + ["class_budget"]
    [critical] = store.check([check(cls="CRITICAL_MUTATION", class_budget=0)])
    assert critical.why == "class_budget"
    reads = store.check([check(cls="READ_ONLY", class_budget=30) for _ in range(3)])
    assert all(v.ok for v in reads)  # another class's budget is its own


def test_the_cost_cap_counts_what_was_allowed(store: LimitStore) -> None:
    verdicts = store.check([check(cost=4.0, cost_cap=10.0) for _ in range(3)])
    assert whys(verdicts) == [None, None, "cost_cap"]
    assert store.run_counters("acme", "run-1")["cost"] == 8.0


def test_the_third_identical_call_of_a_run_is_a_loop(store: LimitStore) -> None:
    same = [check(sig="cancel_order:abc") for _ in range(3)]
    assert whys(store.check(same)) == [None, None, "loop"]
    assert store.check([check(sig="cancel_order:other")])[0].ok
    assert store.check([check(sig="cancel_order:abc", run="run-2")])[0].ok  # another run


def test_gcra_allows_a_burst_then_one_per_interval(store: LimitStore) -> None:
    rate = rate_of(window_sec=60, max_requests=30)
    assert rate == (2000, 30)
    burst = store.check([check(rate=rate, tool="send_email") for _ in range(31)])
    assert whys(burst) == [None] * 30 + ["rate_limited"]
    assert burst[-1].retry_after_ms == 2000
    later = store.check([check(rate=rate, tool="send_email", now=NOW + 1999)])
    assert later[0].why == "rate_limited" and later[0].retry_after_ms == 1
    assert store.check([check(rate=rate, tool="send_email", now=NOW + 2000)])[0].ok
    assert store.check([check(rate=rate, tool="search_kb")])[0].ok  # per tool


def test_a_replayed_batch_gets_the_same_verdicts_and_counts_nothing_twice(
    store: LimitStore,
) -> None:
    batch = [check(steps=3, sig="same") for _ in range(4)]
    first = store.check(batch)
    counters = store.run_counters("acme", "run-1")
    assert store.check(batch) == first  # the transaction aborted; the batch comes again
    assert store.check(list(reversed(batch))) == list(reversed(first))
    assert store.run_counters("acme", "run-1") == counters
    done = f"{store.ns}:{{acme}}:done"
    assert store.client.hlen(done) == len(batch)
    store.forget(batch)  # committed: the markers go, memory stays flat
    assert store.client.hlen(done) == 0


def test_a_batch_longer_than_a_lua_stack_is_checked_whole(store: LimitStore) -> None:
    verdicts = store.check([check(steps=2500, class_budget=5000) for _ in range(2600)])
    assert whys(verdicts) == [None] * 2500 + ["step_cap"] * 100


def test_batched_and_one_by_one_decide_alike(store: LimitStore) -> None:
    rate = rate_of(60, 10)
    batch = [check(run=f"r{i % 3}", rate=rate, steps=5, sig=f"s{i % 4}") for i in range(40)]
    other = LimitStore(store.client, store.ns + "-b")
    assert store.check(batch) == other.check_one_by_one(batch)


def test_two_processors_racing_never_exceed_a_limit(redis_url: str) -> None:
    ns = f"limits-race-{uuid.uuid4().hex[:8]}"
    rate = rate_of(60, 50)

    def racer(name: str) -> int:
        store = LimitStore(connect(redis_url), ns)
        ok = 0
        for n in range(20):
            batch = [check(pos=f"{name}/{n}/{i}", rate=rate, tool="send_email", run=f"{name}-{i}")
                     for i in range(10)]  # fmt: skip
            ok += sum(v.ok for v in store.check(batch))
        return ok

    with ThreadPoolExecutor(2) as pool:  # a racer's exception is raised here, not lost
        allowed = list(pool.map(racer, ["p0", "p1"]))
    assert sum(allowed) == 50, allowed  # 400 attempts at one instant: exactly the burst
