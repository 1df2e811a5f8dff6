"""Rate limits, budgets and the loop guard: one script call per tenant per batch against
one round trip per proposal, on the same checks, in one run.

    .venv/bin/python -m bench.limits                 # starts a private redis-server
    .venv/bin/python -m bench.limits --redis redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
import uuid

from processor.stack.local import free_ports
from processor.stack.redis import ensure_redis_server
from processor.state.connection import connect
from processor.state.limits import Check, LimitStore, rate_of


def checks(n: int, tenants: int = 4) -> list[Check]:
    rate = rate_of(60, 1_000_000)
    return [
        Check(
            tenant=f"t{i % tenants}",
            pos=f"bench/{i % 6}/{i}",
            run=f"run-{i % 512}",
            tool=("search_kb", "lookup_order", "cancel_order")[i % 3],
            cls="READ_ONLY",
            cost=0.0,
            sig=f"sig-{i}",
            now=1_800_000_000_000 + i,
            rate=rate,
            steps=1_000_000,
            class_budget=1_000_000,
            cost_cap=1e12,
        )
        for i in range(n)
    ]


def timed(store: LimitStore, batch: list[Check], batched: bool, size: int) -> float:
    started = time.perf_counter()
    if batched:
        for i in range(0, len(batch), size):
            store.check(batch[i : i + size])
    else:
        store.check_one_by_one(batch)
    return len(batch) / (time.perf_counter() - started)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--redis", help="use this Redis instead of a private redis-server")
    ap.add_argument("--count", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    server = None
    url = args.redis
    if url is None:
        (port,) = free_ports(1)
        server = subprocess.Popen(
            [ensure_redis_server(), "--port", str(port), "--save", "", "--appendonly", "no",
             "--dir", tempfile.mkdtemp()],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        url = f"redis://127.0.0.1:{port}/0"
        time.sleep(0.5)
    try:
        client = connect(url)
        ratios, fast, slow = [], [], []
        for _ in range(args.rounds):
            ns = f"bench-{uuid.uuid4().hex[:8]}"
            b = timed(LimitStore(client, ns + "a"), checks(args.count), True, args.batch)
            o = timed(LimitStore(client, ns + "b"), checks(args.count // 10), False, 1)
            fast.append(b)
            slow.append(o)
            ratios.append(b / o)
        print(f"batched ({args.batch} per batch): {statistics.median(fast):10,.0f} checks/s")
        print(f"one round trip per check:        {statistics.median(slow):10,.0f} checks/s")
        print(
            f"ratio {statistics.median(ratios):.1f}x (rounds: "
            f"{', '.join(f'{r:.1f}' for r in ratios)})   target >= 10x"
        )
    finally:
        if server is not None:
            server.kill()


if __name__ == "__main__":
    main()
