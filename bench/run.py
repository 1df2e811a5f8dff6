"""The foundation benchmark: everything measured in one run, printed as ratios.

    .venv/bin/python -m bench.run            # starts a private stack on free ports
    .venv/bin/python -m bench.run --bootstrap 127.0.0.1:9092   # use a running broker

(a) passthrough, (b) the foundation gates (parse, resolve, schema, route),
(e) every gate as shipped (identity, references in Redis, rules, policy,
confirmation, budgets, rate limits, idempotency in Redis) and (c) the naive
processor each consume the same
pre-produced proposals from their own topics, in their own process; (d)
times the decision core in this process; the latency runs offer a fixed
rate to a running processor (the passthrough, the foundation's gates, and as
shipped) and measure proposal -> observation, the passthrough's being the
pipe's own latency.
Machines here are noisy: read the ratios, which compare runs made minutes
apart on the same machine, rather than the absolute numbers.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from bench.modes import STACK_PIDS, foundation_decide
from processor.approvals import load_approvers
from processor.client import ToolsentryClient, next_messages, observations_consumer
from processor.config import IdentitySettings, Settings, Topics
from processor.contracts.registry import load_contracts
from processor.gates.parse import Limits
from processor.gates.semantic import RefEntry
from processor.identity import TokenIssuer, Verifier
from processor.kafka.topics import ensure_topics
from processor.keys import init_keys
from processor.metrics import Metrics
from processor.model import Outcome, SourceRecord
from processor.pipeline import Gates, decide
from processor.policy import load_policy
from processor.reference_data import publish_references, wait_until_loaded
from processor.state.connection import connect
from processor.state.references import ReferenceLoader

ROOT = Path(__file__).resolve().parents[1]
MODES = ("passthrough", "foundation", "toolsentry")
"""Timed for throughput and for latency: the passthrough's figures are the pipe's own."""


VALID_SHARE = 0.84
"""Seed 000 measured 83.9% of an agent's tool calls schema-valid before its schema
work (99.6% after): the corpus is the harder of the two."""


AGENTS = 16
"""Principals (one token each) the corpus's runs are spread over."""

STEPS_PER_RUN = 8
"""Consecutive proposals of one agent run: under the shipped step cap (12)."""

POLICY = ROOT / "bench" / "policy.yaml"
"""The shipped policy, with one tenant's rate limits and day cap opened up (see the file)."""


def corpus(n: int, seed: int = 7, tokens: list[str] | None = None) -> list[tuple[bytes, bytes]]:
    """Proposals as agents send them: 84% valid, the rest the usual mistakes. Each run's
    agent signs with its own token (``tokens``, one per agent)."""
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
        run_id = f"bench-run-{i // STEPS_PER_RUN}"
        env = {
            "proposal_id": f"p-{i}",
            "created_at": "2026-11-22T02:08:49.000Z",
            "tenant_id": "acme",
            "run_id": run_id,
            "tool": {"name": tool},
            "arguments": args,
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        }
        if tokens:
            env["principal_token"] = tokens[(i // STEPS_PER_RUN) % len(tokens)]
        out.append((run_id.encode(), orjson.dumps(env)))
    return out


def order_references(n: int) -> list[tuple[str, dict[str, Any] | None]]:
    """The orders the corpus names, as a system of record publishes them."""
    return [
        (f"acme/order/WO-{i:05d}-A", {"state": "processing", "owner": f"CUS-{i:06d}"})
        for i in range(min(n, 100_000))
    ]


def with_identity(settings: Settings, directory: Path) -> tuple[Settings, list[str]]:
    """Settings that verify tokens and know approvers, and one token per agent."""
    bundle = init_keys(directory)
    issuer = TokenIssuer.from_jwk_file(bundle.issuer)
    scopes = ["orders:read", "orders:write", "kb:read"]
    tokens = [
        issuer.mint("acme", f"u-{a}", f"agent-{a}", scopes, "confidential", ttl_s=6 * 3600)
        for a in range(AGENTS)
    ]
    updated = settings.model_copy(
        update={
            "identity": IdentitySettings(
                jwks_file=bundle.jwks, delegation_key_file=bundle.delegation
            ),
            "approvers_file": bundle.approvers,
            "policy_file": POLICY,
        }
    )
    return updated, tokens


def isolated(settings: Settings, name: str) -> Settings:
    s = settings.model_copy(
        update={
            "topics": Topics(prefix=f"{name}."),
            "group_id": f"g-{name}",
            "instance_id": name,
            "metrics_port": 0,
            "redis_namespace": name,
            "reference_group_id": f"g-{name}-reference",
        }
    )
    ensure_topics(s)
    return s


def load_references(settings: Settings, n: int) -> None:
    """Publish the corpus's orders and run a loader until Redis holds them all."""
    publish_references(settings, order_references(n))
    loader = ReferenceLoader(settings, connect(settings.redis_url), Metrics(CollectorRegistry()))
    loader.start()
    try:
        wait_until_loaded(settings, timeout=300)
    finally:
        loader.stop()


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


def throughput(
    settings: Settings,
    mode: str,
    records: list[tuple[bytes, bytes]],
    services: dict[str, int],
) -> dict[str, Any]:
    """One mode's run in its own process. ``services``: the pids of the stack's processes
    (none with ``--bootstrap``), whose CPU time the mode reads with its own clocks."""
    s = isolated(settings, f"bench-{mode}-{int(time.time())}")
    if mode == "toolsentry":
        load_references(s, len(records))
    preload(s, records)
    env = child_env(s)
    env[STACK_PIDS] = ",".join(f"{name}={pid}" for name, pid in services.items())
    out = subprocess.run(
        [sys.executable, "-m", "bench.modes", mode, str(len(records))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if out.returncode != 0:
        raise RuntimeError(f"bench.modes {mode} failed:\n{out.stderr[-3000:]}")
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1]
    result: dict[str, Any] = orjson.loads(line)
    return result


class RawArrivals:
    """When each proposal's copy reaches the observations topic, for the passthrough, whose
    observations are the proposals' own bytes (JSON, which the client does not read). Read
    as ``ToolsentryClient`` reads: read_committed, the same fetch wait, from the end."""

    def __init__(self, settings: Settings) -> None:
        self.arrivals: dict[str, float] = {}
        self._consumer = observations_consumer(settings, "bench-raw")
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read, name="raw-arrivals", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._closed.is_set():
            messages = next_messages(self._consumer)
            now = time.monotonic()
            for m in messages:
                value = m.value()
                if m.error() is not None or not value:
                    continue
                try:
                    pid = orjson.loads(value)["proposal_id"]
                except (ValueError, TypeError, KeyError):
                    continue  # not one of the corpus's proposals: never waited for
                self.arrivals.setdefault(pid, now)

    def wait(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.arrivals) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.arrivals)} of {count} copies arrived")
            time.sleep(0.05)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5)
        self._consumer.close()


def latency(
    settings: Settings,
    tokens: list[str],
    rate: int,
    seconds: float,
    mode: str = "toolsentry",
    warmup: float = 3.0,
) -> dict[str, Any]:
    """Offer ``rate`` proposals/s; sample proposal -> observation after ``warmup`` s.

    ``mode``: ``toolsentry``, the processor as shipped (``toolsentry run``);
    ``foundation``, the same loop with the foundation's gates only (bench.modes);
    ``passthrough``, the same loop copying each proposal to the observations topic:
    the latency of the pipe itself (the broker's transactions on this machine).
    The first seconds of a fresh processor register partitions with the
    transaction coordinator and fill caches; the target is the steady state.
    """
    s = isolated(settings, f"bench-latency-{mode}-{int(time.time())}")
    total = int(rate * (seconds + warmup))
    if mode == "toolsentry":
        load_references(s, total)
    log_path = Path(tempfile.mkdtemp(prefix="bench-")) / "processor.log"
    log = log_path.open("wb")
    command = (
        ["-m", "processor", "run"]
        if mode == "toolsentry"
        else ["-m", "bench.modes", mode, str(total), "--log"]
    )
    proc = subprocess.Popen(
        [sys.executable, *command],
        cwd=ROOT,
        env=child_env(s),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    raw: RawArrivals | None = None
    try:
        deadline = time.monotonic() + 60
        while b"assigned [" not in log_path.read_bytes():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(log_path.read_text()[-2000:])
            time.sleep(0.1)
        # The passthrough's observations are JSON: a reader of its own; the client only sends.
        raw = RawArrivals(s) if mode == "passthrough" else None
        client = ToolsentryClient(s, "acme", watch=raw is None)
        sent: dict[str, float] = {}
        skip = int(rate * warmup)
        records = corpus(total, seed=11, tokens=tokens)
        # This process is the agent side, and the time an observation arrives is when its
        # reader thread gets the interpreter: a full collection of the harness's own heap
        # (the broker and stack clients, the modules, the corpus) stalled it 55-130 ms,
        # several times a run. Frozen, as the processor freezes its own after start, the
        # collector only walks what the run itself allocates.
        gc.collect()
        gc.freeze()
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
        if raw is not None:
            raw.wait(total, timeout=60)
            arrivals = dict(raw.arrivals)
        else:
            for n in range(total):
                client.wait(f"p-{n}", timeout=60)
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
        gc.unfreeze()
        if raw is not None:
            raw.close()
        proc.terminate()
        proc.wait(30)


def decision_core(n: int = 20_000, repeats: int = 5) -> dict[str, dict[str, Any]]:
    """Both decision cores on one valid cancel_order: the foundation's gates, and every
    gate with a verified (cached) token and its order in the reference answers."""
    contracts = load_contracts(ROOT / "contracts")
    keys = Path(tempfile.mkdtemp(prefix="bench-core-"))
    with_keys, tokens = with_identity(Settings(), keys)
    gates = Gates(
        contracts,
        Limits(),
        Verifier.from_settings(with_keys.identity),
        load_policy(with_keys.policy_file),
        load_approvers(with_keys.approvers_file),
    )
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
    signed = SourceRecord(
        "tool.proposals", 0, 0, b"run-1", orjson.dumps({**env, "principal_token": tokens[0]}), 0
    )
    answers = {("acme", "order", "WO-12345-A"): RefEntry("acme", "processing", "CUS-1", {})}
    now_ms = int(time.time() * 1000)
    assert foundation_decide(record, contracts, Limits()).outcome is Outcome.ROUTED
    assert decide(signed, gates, now_ms, answers).outcome is Outcome.PARKED
    cores: dict[str, Callable[[], object]] = {
        "foundation": lambda: foundation_decide(record, contracts, Limits()),
        "all gates": lambda: decide(signed, gates, now_ms, answers),
    }
    out: dict[str, dict[str, Any]] = {}
    for name, call in cores.items():
        medians, p99s, hosts = [], [], []
        for _ in range(repeats):
            hosts.append(host_reference_ms())
            timings = []
            for _ in range(n):
                t = time.perf_counter()
                call()
                timings.append(time.perf_counter() - t)
            timings.sort()
            medians.append(timings[n // 2] * 1e6)
            p99s.append(timings[int(n * 0.99)] * 1e6)
        out[name] = {
            "median_us": statistics.median(medians),
            "p99_us": statistics.median(p99s),
            "repeats": list(zip(medians, hosts, strict=True)),
        }
    return out


def host_reference_ms(n: int = 200_000) -> float:
    """A fixed pure-Python loop, timed beside each repeat of the decision core: the hosts
    here run it at two speeds (about 8 and 14.5 ms, switching within one process), and the
    core's figures move with it."""
    started = time.perf_counter()
    total = 0
    for i in range(n):
        total += i * i
    return (time.perf_counter() - started) * 1000


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda r: r["per_second"])
    return ordered[len(ordered) // 2]


def print_cpu(runs: dict[str, dict[str, Any]]) -> None:
    """Where each mode's CPU goes, per proposal, and what it bounds. The processor's loop is
    one thread: it cannot commit proposals faster than its own CPU per proposal allows,
    whatever the other threads and the other core do. Every process here shares the
    machine's cores, so a mode's total CPU per proposal bounds it too."""
    cores = os.cpu_count() or 1
    print(
        f"\nCPU per proposal (us; loop: the processor's loop thread; processor: all its threads; "
        f"stack: the broker and redis-server; {cores} cores)"
    )
    a_wall = 1e6 / runs["(a) passthrough"]["per_second"]
    for name, r in runs.items():
        stack = r["stack_cpu_us"]
        total = r["cpu_us"] + sum(stack.values())
        print(
            f"  {name:<16} wall {1e6 / r['per_second']:7.1f}   loop {r['loop_cpu_us']:7.1f}   "
            f"processor {r['cpu_us']:7.1f}   "
            + "   ".join(f"{svc} {us:6.1f}" for svc, us in sorted(stack.items()))
            + f"   total {total:7.1f}"
        )
    for name in ("(b) foundation", "(e) all gates"):
        r = runs[name]
        total = r["cpu_us"] + sum(r["stack_cpu_us"].values())
        print(
            f"  {name[:3]}/(a) at most {a_wall / r['loop_cpu_us']:.2f} with this loop thread's CPU "
            f"per proposal; at most {a_wall * cores / total:.2f} on {cores} cores "
            f"with all the CPU it costs"
        )


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
    services: dict[str, int] = {}
    if args.bootstrap:
        settings = Settings(bootstrap_servers=args.bootstrap, metrics_port=0)
    else:
        from processor.stack import LocalStack, private_stack_settings

        settings = private_stack_settings(Path(tempfile.mkdtemp(prefix="bench-stack-")))
        stack = LocalStack(settings)
        stack.up()
        services = {
            name: status.pid for name, status in stack.status().items() if status.pid is not None
        }
    settings = settings.model_copy(update={"contracts_dir": ROOT / "contracts"})
    settings, tokens = with_identity(settings, Path(tempfile.mkdtemp(prefix="bench-keys-")))
    try:
        records = corpus(args.count, tokens=tokens)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
        for n in range(args.rounds):
            # Interleaved, and every other round in reverse, so that drift and the
            # broker's growing logs hit every mode alike.
            for mode in MODES if n % 2 == 0 else MODES[::-1]:
                print(
                    f"round {n + 1}/{args.rounds}: {mode}, {args.count} proposals ...", flush=True
                )
                runs[mode].append(throughput(settings, mode, records, services))
        print(f"(c) naive, {args.naive_count} proposals ...", flush=True)
        c = throughput(settings, "naive", records[: args.naive_count], services)
        lat: dict[str, dict[str, Any]] = {}
        for mode in MODES:
            print(f"latency at {args.rate}/s for {args.seconds:.0f}s, {mode} ...", flush=True)
            lat[mode] = latency(settings, tokens, args.rate, args.seconds, mode)
    finally:
        if stack is not None:
            stack.down()

    a = _median_run(runs["passthrough"])
    b = _median_run(runs["foundation"])
    e = _median_run(runs["toolsentry"])
    pair_ratios = sorted(
        tb["per_second"] / ta["per_second"]
        for ta, tb in zip(runs["passthrough"], runs["foundation"], strict=True)
    )
    gate_ratios = sorted(
        te["per_second"] / tb["per_second"]
        for tb, te in zip(runs["foundation"], runs["toolsentry"], strict=True)
    )

    def row(name: str, r: dict[str, Any]) -> str:
        return (
            f"  {name:<14} {r['per_second']:>10,.0f} proposals/s   peak RSS {r['rss_mb']:6.1f} MB"
        )

    print(f"\nthroughput (same input: {VALID_SHARE:.0%} valid proposals; own topics and process)")
    print(row("(a) passthrough", a))
    print(row("(b) foundation", b))
    print(row("(e) all gates", e))
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
    ratio_eb = statistics.median(gate_ratios)
    ea_ratios = sorted(
        te["per_second"] / ta["per_second"]
        for ta, te in zip(runs["passthrough"], runs["toolsentry"], strict=True)
    )
    ratio_ea = statistics.median(ea_ratios)
    print(
        f"  (e)/(a) = {ratio_ea:6.2f}   target >= 0.35 (every gate, Redis admission included, "
        f"against the pipe's limit)   {'met' if ratio_ea >= 0.35 else 'NOT met'}"
        f"   rounds: {', '.join(f'{r:.2f}' for r in ea_ratios)}"
    )
    print(
        f"  (e)/(b) = {ratio_eb:6.2f}   target >= 0.70 (the gates on identity, meaning, policy "
        f"and approval cost <= 30%)   {'met' if ratio_eb >= 0.7 else 'NOT met'}"
        f"   rounds: {', '.join(f'{r:.2f}' for r in gate_ratios)}"
    )
    print_cpu({"(a) passthrough": a, "(b) foundation": b, "(e) all gates": e, "(c) naive": c})
    for name, figures in core.items():
        target = (
            f"   target median <= 20 us   {'met' if figures['median_us'] <= 20 else 'NOT met'}"
            if name == "foundation"
            else ""
        )
        print(
            f"\n(d) decision core, cancel_order, {name}: median {figures['median_us']:.1f} us, "
            f"p99 {figures['p99_us']:.1f} us{target}\n"
            "    each repeat's median, with the host reference loop timed beside it: "
            + ", ".join(f"{us:.1f} us @ {ms:.1f} ms" for us, ms in figures["repeats"])
        )
    pipe = lat["passthrough"]
    print(
        f"\nlatency proposal -> observation, (a) passthrough (the pipe's own, no gates), at "
        f"{pipe['offered_per_second']:,.0f}/s offered, {pipe['samples']} samples: "
        f"p50 {pipe['p50_ms']:.1f} ms, p99 {pipe['p99_ms']:.1f} ms, max {pipe['max_ms']:.1f} ms"
    )
    for mode, title in (("foundation", "(b) foundation gates"), ("toolsentry", "every gate")):
        r = lat[mode]
        print(
            f"latency proposal -> observation, {title}, at {r['offered_per_second']:,.0f}/s "
            f"offered, {r['samples']} samples: p50 {r['p50_ms']:.1f} ms, "
            f"p99 {r['p99_ms']:.1f} ms, max {r['max_ms']:.1f} ms   target p99 <= 50 ms   "
            f"{'met' if r['p99_ms'] <= 50 else 'NOT met'}   against the pipe: "
            f"p50 x{r['p50_ms'] / pipe['p50_ms']:.2f}, p99 x{r['p99_ms'] / pipe['p99_ms']:.2f}"
        )
    for name, r in (("(b)", b), ("(e)", e)):
        print(
            f"\nprocessor peak RSS {name}: {r['rss_mb']:.1f} MB   target <= 150 MB   "
            f"{'met' if r['rss_mb'] <= 150 else 'NOT met'}"
        )


if __name__ == "__main__":
    main()
