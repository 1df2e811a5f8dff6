"""Idempotency, rate limits, budgets and the loop guard, decided in Redis a batch at a time.

A batch's items go to Redis as one script call per tenant (``admission.lua``), all
in one pipeline: one round trip per batch, whatever its size, and every key under
the tenant's ``{tenant}`` hash tag, so a Redis Cluster can serve it.

- **Rate limits** are GCRA (the generic cell rate algorithm) per tenant and tool:
  one theoretical-arrival time per key instead of a window of timestamps, so a
  check is O(1) in time and memory, bursts up to the contract's ``max_requests``
  pass at once, and a refusal carries an exact retry-after. A sliding-window log
  would keep one entry per call in the window.
- **Budgets** per run: a step cap (every proposal counts, refused ones included),
  calls per budget group, a cost cap; per tenant and UTC day: a cost cap.
- **The loop guard**: the same signature (tool and canonical arguments) may be
  allowed ``repeats`` times per run. **The repair guard**: a run that proposes the
  same invalid call twice, or needs more than ``repairs`` repairs, is stopped.
- **Idempotency records** ``<ns>:{T}:idem:<key>``: PENDING → COMPLETED,
  FAILED_RETRYABLE, FAILED_FINAL, EXPIRED, COMPENSATED. The same key with another
  payload is a signature mismatch (fail closed); a PENDING key is in flight until
  its deadline plus a grace period, after which it may be retried (the executor
  never starts a call past its deadline, so by then nothing can still be running
  it); a final key answers with its cached result and nothing is routed again.

Replay safety: each verdict is stored under its input record's position, in one
hash per tenant, until the batch's Kafka transaction commits (``forget`` then
removes them, so memory stays flat); a batch applied again after an aborted
transaction gets the same verdicts and nothing moves twice.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson

from processor.state.connection import LuaScript, RedisClient, run_scripts

_SCRIPT = LuaScript((Path(__file__).with_name("admission.lua")).read_text())
RUN_TTL_MS = 24 * 3600 * 1000
"""How long a run's counters outlive its last proposal."""

Item = dict[str, Any]
"""One script input: ``kind`` (call, step, result), ``pos`` and the kind's fields."""
Verdict = dict[str, Any]

# Every optional field is always sent: a missing one would read as nil in Lua, not null.
_CALL_FIELDS = ("pos", "run", "tool", "group", "cost", "sig", "now", "rate", "steps",
                "class_budget", "cost_cap", "day_cap", "day", "repeats", "ikey", "hash",
                "call", "deadline", "grace", "ttl", "park", "tok")  # fmt: skip


def rate_of(window_sec: int, max_requests: int) -> tuple[int, int] | None:
    """A contract's ``max_requests`` per ``window_sec`` as GCRA (interval_ms, burst)."""
    if max_requests <= 0 or window_sec <= 0:
        return None
    return max(1, window_sec * 1000 // max_requests), max_requests


class AdmissionStore:
    def __init__(
        self, client: RedisClient, ns: str = "ts", run_ttl_ms: int = RUN_TTL_MS
    ) -> None:
        self.client = client
        self.ns = ns
        self.run_ttl_ms = run_ttl_ms

    def _base(self, tenant: str) -> str:
        return f"{self.ns}:{{{tenant}}}"

    def apply(
        self, items: list[tuple[str, Item]], forget: list[tuple[str, Item]] | None = None
    ) -> list[Verdict]:
        """Verdicts in input order; one script call per tenant, one round trip in all.

        ``forget``: items of batches that have committed since; their replay markers are
        dropped in the same round trip."""
        if not items:
            if forget:
                self.forget(forget)
            return []
        by_tenant: dict[str, list[int]] = defaultdict(list)
        for i, (tenant, _) in enumerate(items):
            by_tenant[tenant].append(i)
        pipe = self.client.pipeline(transaction=False)
        n_forget = self._queue_forget(pipe, forget or [])
        tenants = list(by_tenant)
        calls = [
            ([self._base(t)], [orjson.dumps([items[i][1] for i in by_tenant[t]]), self.run_ttl_ms])
            for t in tenants
        ]
        out: list[Verdict] = [{} for _ in items]
        replies = run_scripts(self.client, _SCRIPT, calls, pipe)[n_forget:]
        for tenant, reply in zip(tenants, replies, strict=True):
            for i, v in zip(by_tenant[tenant], orjson.loads(reply), strict=True):
                out[i] = v
        return out

    def apply_one_by_one(self, items: list[tuple[str, Item]]) -> list[Verdict]:
        """The same decisions, one round trip per item: the baseline the batched path
        is measured against."""
        verdicts: list[Verdict] = []
        for item in items:
            verdicts.extend(self.apply([item]))
        return verdicts

    def forget(self, items: list[tuple[str, Item]]) -> None:
        """Drop the replay markers of a batch whose transaction committed."""
        if not items:
            return
        pipe = self.client.pipeline(transaction=False)
        self._queue_forget(pipe, items)
        pipe.execute()

    def _queue_forget(self, pipe: Any, items: list[tuple[str, Item]]) -> int:
        by_tenant: dict[str, list[str]] = defaultdict(list)
        for tenant, item in items:
            by_tenant[tenant].append(item["pos"])
        for tenant, positions in by_tenant.items():
            pipe.hdel(f"{self._base(tenant)}:done", *positions)
        return len(by_tenant)

    def run_counters(self, tenant: str, run: str) -> dict[str, float]:
        """steps, class:<group>, cost, sig:<signature>, repairs, bad:<signature> of a run."""
        raw = self.client.hgetall(f"{self._base(tenant)}:run:{run}")
        return {k.decode(): float(v) for k, v in raw.items()}

    def record(self, tenant: str, key: str) -> dict[str, str]:
        """An idempotency record's fields (empty when there is none)."""
        raw = self.client.hgetall(f"{self._base(tenant)}:idem:{key}")
        return {k.decode(): v.decode() for k, v in raw.items()}

    def day_cost(self, tenant: str, day: str) -> float:
        return float(self.client.hget(f"{self._base(tenant)}:day:{day}", "cost") or 0)


def call_item(**fields: Any) -> Item:
    """A ``call`` item; raises if a field is missing, so Lua never sees a nil."""
    missing = [f for f in _CALL_FIELDS if f not in fields]
    if missing:
        raise ValueError(f"call item without {missing}")
    return {"kind": "call", **fields}
