"""Admission (idempotency record, rate limit, run budgets, loop guard): one script call
per tenant per batch against one round trip per proposal, on the same calls, in one run.

    .venv/bin/python -m bench.admission                 # starts a private redis-server
    .venv/bin/python -m bench.admission --redis redis://127.0.0.1:6379/0
    .venv/bin/python -m bench.admission --redis redis+cluster://127.0.0.1:7000
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
from processor.state.admission import AdmissionStore, Item, call_item, rate_of
from processor.state.connection import connect


def calls(n: int, tenants: int = 4) -> list[tuple[str, Item]]:
    """Calls as the processor sends them: each with its own idempotency key, spread over
    tenants, runs and tools, under limits none of them reaches."""
    rate = rate_of(60, 1_000_000)
    now = int(time.time() * 1000)  # the store expires its hashes by this clock
    return [
        (
            f"t{i % tenants}",
            call_item(
                pos=f"bench/{i % 6}/{i}",
                run=f"run-{i // 8}",
                tool=("search_kb", "lookup_order", "cancel_order")[i % 3],
                group="read",
                cost=0.01,
                sig=f"sig-{i}",
                now=now,
                rate=rate,
                steps=1_000_000,
                class_budget=1_000_000,
                cost_cap=1e12,
                day_cap=1e12,
                day=time.strftime("%Y%m%d", time.gmtime(now / 1000)),
                repeats=2,
                ikey=f"ik-{uuid.uuid4().hex}",
                hash="sha256:00",
                call=f"c-{i}",
                deadline=now + 8000,
                grace=30_000,
                ttl=3_600_000,
                park=False,
                grant="",
                exempt=False,
            ),
        )
        for i in range(n)
    ]


def timed(store: AdmissionStore, batch: list[tuple[str, Item]], batched: bool, size: int) -> float:
    started = time.perf_counter()
    if batched:
        for i in range(0, len(batch), size):
            store.apply(batch[i : i + size])
    else:
        store.apply_one_by_one(batch)
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
            b = timed(AdmissionStore(client, ns + "a"), calls(args.count), True, args.batch)
            o = timed(AdmissionStore(client, ns + "b"), calls(args.count // 10), False, 1)
            fast.append(b)
            slow.append(o)
            ratios.append(b / o)
        print(f"batched ({args.batch} per batch): {statistics.median(fast):10,.0f} calls/s")
        print(f"one round trip per call:          {statistics.median(slow):10,.0f} calls/s")
        print(
            f"ratio {statistics.median(ratios):.1f}x (rounds: "
            f"{', '.join(f'{r:.1f}' for r in ratios)})   target >= 10x"
        )
    finally:
        if server is not None:
            server.kill()


if __name__ == "__main__":
    main()
