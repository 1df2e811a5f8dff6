"""The foundation benchmark: everything measured in one run, printed as ratios.

    .venv/bin/python -m bench.run            # starts a private stack on free ports
    .venv/bin/python -m bench.run --bootstrap 127.0.0.1:9092   # use a running broker

(a) passthrough, (b) toolsentry and (c) the naive processor each consume the
same pre-produced proposals from their own topics, in their own process;
(d) times the decision core in this process; the latency run offers a fixed
rate to a running processor and measures proposal -> observation.
Machines here are noisy: read the ratios, which compare runs made minutes
apart on the same machine, rather than the absolute numbers.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from processor.client import ToolsentryClient
from processor.config import Settings, Topics
from processor.contracts.registry import load_contracts
from processor.gates.parse import Limits
from processor.kafka.topics import ensure_topics
from processor.model import SourceRecord
from processor.pipeline import Gates, decide

ROOT = Path(__file__).resolve().parents[1]


VALID_SHARE = 0.84
"""Seed 000 measured 83.9% of an agent's tool calls schema-valid before its schema
work (99.6% after): the corpus is the harder of the two."""


def corpus(n: int, seed: int = 7) -> list[tuple[bytes, bytes]]:
    """Proposals as agents send them: 84% valid, the rest the usual mistakes."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = rng.random()
        if r < 0.5:
            tool, args = (
                "cancel_order",
                {
                    "order_id": f"WO-{i % 100000:05d}-A",
                    "reason_code": "customer_request",
                    "confirm": True,
                },
            )
        elif r < VALID_SHARE:
            tool, args = "search_kb", {"query": f"return policy {i}", "limit": 10}
        elif r < 0.9:
            tool, args = (
                "cancel_order",
                {"order_id": f"ORD-{i}", "reason_code": "customer_request", "confirm": True},
            )
        elif r < 0.95:
            tool, args = "search_kb", {"query": "refunds", "limit": "10"}
        else:
            tool, args = "lookup_order", {"order_id": f"WO-{i % 100000:05d}-A", "notify": True}
        run_id = f"bench-run-{i % 512}"
        env = {
            "proposal_id": f"p-{i}",
            "created_at": "2026-11-22T02:08:49.000Z",
            "tenant_id": "acme",
            "run_id": run_id,
            "tool": {"name": tool},
            "arguments": args,
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        }
        out.append((run_id.encode(), orjson.dumps(env)))
    return out


def isolated(settings: Settings, name: str) -> Settings:
    s = settings.model_copy(
        update={
            "topics": Topics(prefix=f"{name}."),
            "group_id": f"g-{name}",
            "instance_id": name,
            "metrics_port": 0,
        }
    )
    ensure_topics(s)
    return s


def preload(settings: Settings, records: list[tuple[bytes, bytes]]) -> None:
    client = ToolsentryClient(settings, "acme", watch=False)
    for key, value in records:
        client.send_raw(value, key)
    client.flush(120)
    client.close()


def child_env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLSENTRY_")}
    env.update(settings.as_env())
    return env


def throughput(settings: Settings, mode: str, records: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    s = isolated(settings, f"bench-{mode}-{int(time.time())}")
    preload(s, records)
    out = subprocess.run(
        [sys.executable, "-m", "bench.modes", mode, str(len(records))],
        cwd=ROOT,
        env=child_env(s),
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1]
    result: dict[str, Any] = orjson.loads(line)
    return result


def latency(settings: Settings, rate: int, seconds: float, warmup: float = 3.0) -> dict[str, Any]:
    """Offer ``rate`` proposals/s; sample proposal -> observation after ``warmup`` s.

    The first seconds of a fresh processor register partitions with the
    transaction coordinator and fill caches; the target is the steady state.
    """
    s = isolated(settings, f"bench-latency-{int(time.time())}")
    log_path = Path(tempfile.mkdtemp(prefix="bench-")) / "processor.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "processor", "run"],
        cwd=ROOT,
        env=child_env(s),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while b"assigned [" not in log_path.read_bytes():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(log_path.read_text()[-2000:])
            time.sleep(0.1)
        client = ToolsentryClient(s, "acme")
        sent: dict[str, float] = {}
        total = int(rate * (seconds + warmup))
        skip = int(rate * warmup)
        records = corpus(total, seed=11)
        start = time.monotonic()
        for n, (key, value) in enumerate(records):
            pid = f"p-{n}"
            target = start + n / rate
            pause = target - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            sent[pid] = time.monotonic()
            client.send_raw(value, key)
        client.flush(30)
        for n in range(total):
            pid = f"p-{n}"
            client.wait(pid, timeout=60)
        arrivals = dict(client.arrivals)
        client.close()
        waited = sorted((arrivals[p] - t) * 1000 for p, t in sent.items() if int(p[2:]) >= skip)
        offered = total / (max(sent.values()) - start)
        return {
            "offered_per_second": offered,
            "p50_ms": statistics.median(waited),
            "p99_ms": waited[int(len(waited) * 0.99) - 1],
            "max_ms": waited[-1],
            "samples": len(waited),
        }
    finally:
        proc.terminate()
        proc.wait(30)


def decision_core(n: int = 20_000, repeats: int = 5) -> dict[str, float]:
    contracts = load_contracts(ROOT / "contracts")
    env = {
        "proposal_id": "p-1",
        "created_at": "2026-11-22T02:08:49.000Z",
        "tenant_id": "acme",
        "run_id": "run-1",
        "tool": {"name": "cancel_order"},
        "arguments": {"order_id": "WO-12345-A", "reason_code": "customer_request", "confirm": True},
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    }
    record = SourceRecord("tool.proposals", 0, 0, b"run-1", orjson.dumps(env), 0)
    gates = Gates.development(contracts, Limits())
    medians, p99s = [], []
    for _ in range(repeats):
        timings = []
        for _ in range(n):
            t = time.perf_counter()
            decide(record, gates, 1)
            timings.append(time.perf_counter() - t)
        timings.sort()
        medians.append(timings[n // 2] * 1e6)
        p99s.append(timings[int(n * 0.99)] * 1e6)
    return {"median_us": statistics.median(medians), "p99_us": statistics.median(p99s)}


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda r: r["per_second"])
    return ordered[len(ordered) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--bootstrap", help="use this running broker instead of a private stack")
    ap.add_argument("--count", type=int, default=150_000, help="proposals for (a) and (b)")
    ap.add_argument("--naive-count", type=int, default=1_500, help="proposals for (c)")
    ap.add_argument("--rate", type=int, default=1000, help="offered proposals/s for latency")
    ap.add_argument("--seconds", type=float, default=15.0, help="length of the latency run")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved (a)/(b) rounds")
    args = ap.parse_args()

    # In process and before any broker starts: the core needs none, and a JVM warming
    # up on the same two cores would be measured along with it.
    print("(d) decision core, cancel_order, in process ...", flush=True)
    core = decision_core()
    stack = None
    if args.bootstrap:
        settings = Settings(bootstrap_servers=args.bootstrap, metrics_port=0)
    else:
        from processor.stack import LocalStack, private_stack_settings

        settings = private_stack_settings(Path(tempfile.mkdtemp(prefix="bench-stack-")))
        stack = LocalStack(settings)
        stack.up()
    settings = settings.model_copy(update={"contracts_dir": ROOT / "contracts"})
    try:
        records = corpus(args.count)
        runs: dict[str, list[dict[str, Any]]] = {"passthrough": [], "toolsentry": []}
        for n in range(args.rounds):
            for mode in ("passthrough", "toolsentry"):  # interleaved: drift hits both alike
                print(
                    f"round {n + 1}/{args.rounds}: {mode}, {args.count} proposals ...", flush=True
                )
                runs[mode].append(throughput(settings, mode, records))
        print(f"(c) naive, {args.naive_count} proposals ...", flush=True)
        c = throughput(settings, "naive", records[: args.naive_count])
        print(f"latency at {args.rate}/s for {args.seconds:.0f}s ...", flush=True)
        lat = latency(settings, args.rate, args.seconds)
    finally:
        if stack is not None:
            stack.down()

    a = _median_run(runs["passthrough"])
    b = _median_run(runs["toolsentry"])
    pair_ratios = sorted(
        tb["per_second"] / ta["per_second"]
        for ta, tb in zip(runs["passthrough"], runs["toolsentry"], strict=True)
    )

    def row(name: str, r: dict[str, Any]) -> str:
        return (
            f"  {name:<14} {r['per_second']:>10,.0f} proposals/s   peak RSS {r['rss_mb']:6.1f} MB"
        )

    print(f"\nthroughput (same input: {VALID_SHARE:.0%} valid proposals; own topics and process)")
    print(row("(a) passthrough", a))
    print(row("(b) toolsentry", b))
    print(row("(c) naive", c))
    ratio_ab = statistics.median(pair_ratios)
    ratio_bc = b["per_second"] / c["per_second"]
    print(
        f"\nratios (median of {args.rounds} interleaved rounds; each round's ratio: "
        f"{', '.join(f'{r:.2f}' for r in pair_ratios)})"
    )
    print(
        f"  (b)/(a) = {ratio_ab:6.2f}   target >= 0.50   {'met' if ratio_ab >= 0.5 else 'NOT met'}"
    )
    print(f"  (b)/(c) = {ratio_bc:6.1f}x  target >= 5x     {'met' if ratio_bc >= 5 else 'NOT met'}")
    print(
        f"\n(d) decision core, cancel_order: median {core['median_us']:.1f} us, "
        f"p99 {core['p99_us']:.1f} us   target median <= 20 us   "
        f"{'met' if core['median_us'] <= 20 else 'NOT met'}"
    )
    print(
        f"\nlatency proposal -> observation at {lat['offered_per_second']:,.0f}/s offered, "
        f"{lat['samples']} samples: p50 {lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms, "
        f"max {lat['max_ms']:.1f} ms   target p99 <= 50 ms   "
        f"{'met' if lat['p99_ms'] <= 50 else 'NOT met'}"
    )
    print(
        f"\nprocessor peak RSS (b): {b['rss_mb']:.1f} MB   target <= 150 MB   "
        f"{'met' if b['rss_mb'] <= 150 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
