"""Rate limits, run budgets and the loop guard, decided in Redis a batch at a time.

The checks of one batch go to Redis as one script call per tenant (``limits.lua``),
all in one pipeline: one round trip per batch, whatever its size, and every key
under the tenant's ``{tenant}`` hash tag, so Redis Cluster can serve it.

- **Rate limits** are GCRA (the generic cell rate algorithm) per tenant and tool:
  one theoretical-arrival time per key instead of a window of timestamps, so a
  check is O(1) in time and memory, bursts up to the contract's
  ``max_requests`` pass at once, and the refusal carries an exact retry-after.
  A sliding-window log would need one entry per call in the window.
- **Budgets** per run: a step cap (every proposal that reaches the gate counts,
  allowed or not), calls per side-effect class, and a cost cap.
- **The loop guard**: the same signature (tool and canonical arguments) may be
  allowed a fixed number of times per run.

Replay safety: each verdict is stored under its input record's position, in one
hash per tenant, until the batch's Kafka transaction commits (``forget`` then
removes them, so memory stays flat), so
a batch checked again after an aborted transaction gets the same verdicts and
no counter moves twice.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson
import redis

_SCRIPT = (Path(__file__).with_name("limits.lua")).read_text()
RUN_TTL_MS = 24 * 3600 * 1000
"""How long a run's counters outlive its last proposal."""


@dataclass(frozen=True, slots=True)
class Check:
    """One proposal at the gate: who, what, and the limits that apply to it."""

    tenant: str
    pos: str
    run: str
    tool: str
    cls: str
    cost: float
    sig: str
    now: int
    rate: tuple[int, int] | None
    """(interval_ms, burst): the contract's max_requests per window_sec, as GCRA."""
    steps: int
    class_budget: int
    cost_cap: float
    repeats: int = 2


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    why: str | None = None
    """step_cap, loop, class_budget, cost_cap or rate_limited."""
    retry_after_ms: int = 0


def rate_of(window_sec: int, max_requests: int) -> tuple[int, int] | None:
    """A contract's ``max_requests`` per ``window_sec`` as GCRA (interval, burst)."""
    if max_requests <= 0 or window_sec <= 0:
        return None
    return max(1, window_sec * 1000 // max_requests), max_requests


def _wire(c: Check) -> dict[str, object]:
    d = asdict(c)
    d["class"] = d.pop("cls")
    del d["tenant"]
    return d


class LimitStore:
    def __init__(
        self, client: redis.Redis[bytes], ns: str = "ts", run_ttl_ms: int = RUN_TTL_MS
    ) -> None:
        self.client = client
        self.ns = ns
        self.run_ttl_ms = run_ttl_ms
        self._script = client.register_script(_SCRIPT)

    def _base(self, tenant: str) -> str:
        return f"{self.ns}:{{{tenant}}}"

    def check(self, checks: list[Check]) -> list[Verdict]:
        """Verdicts in input order; one script call per tenant, one round trip in all."""
        if not checks:
            return []
        by_tenant: dict[str, list[int]] = defaultdict(list)
        for i, c in enumerate(checks):
            by_tenant[c.tenant].append(i)
        pipe = self.client.pipeline(transaction=False)
        tenants = list(by_tenant)
        for tenant in tenants:
            body = orjson.dumps([_wire(checks[i]) for i in by_tenant[tenant]])
            self._script(keys=[self._base(tenant)], args=[body, self.run_ttl_ms], client=pipe)
        out: list[Verdict | None] = [None] * len(checks)
        for tenant, reply in zip(tenants, pipe.execute(), strict=True):
            for i, v in zip(by_tenant[tenant], orjson.loads(reply), strict=True):
                out[i] = Verdict(bool(v["ok"]), v.get("why"), int(v.get("retry_after_ms", 0)))
        return [v if v is not None else Verdict(False, "missing") for v in out]

    def check_one_by_one(self, checks: list[Check]) -> list[Verdict]:
        """The same decisions, one round trip per check: the baseline the batched path
        is measured against."""
        verdicts: list[Verdict] = []
        for c in checks:
            verdicts.extend(self.check([c]))
        return verdicts

    def forget(self, checks: list[Check]) -> None:
        """Drop the replay markers of a batch whose transaction committed."""
        if not checks:
            return
        pipe = self.client.pipeline(transaction=False)
        by_tenant: dict[str, list[str]] = defaultdict(list)
        for c in checks:
            by_tenant[c.tenant].append(c.pos)
        for tenant, positions in by_tenant.items():
            pipe.hdel(f"{self._base(tenant)}:done", *positions)
        pipe.execute()

    def run_counters(self, tenant: str, run: str) -> dict[str, float]:
        """steps, class:<C>, cost and sig:<signature> of one run."""
        raw = self.client.hgetall(f"{self._base(tenant)}:run:{run}")
        return {k.decode(): float(v) for k, v in raw.items()}
