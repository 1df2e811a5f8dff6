"""Redis is stopped in the middle of a run and started again: nothing is decided while it
is gone, nothing is lost, and every budget and record it held still holds after.

A processor with a redis-server of its own (AOF on, fsync on every write, so a restart
keeps every counter and record) decides a paced stream of agent runs. Each run makes
the same 16 proposals, whose answers its admission state decides: a call made twice
and then a third time (the loop guard), an explicit idempotency key reused with the
same payload (in flight) and with another (signature mismatch), a class budget, a run
cost cap and the step cap that run out, a repair, and a call parked for approval
(reference data needed). The runs are interleaved, so each run's first steps are
decided before Redis stops and its later ones only after it is back.

Redis is stopped (SIGTERM: it persists and exits) for 20 s, and started again on the
same port and data dir; reference data published meanwhile must still be loaded.
Afterwards, every proposal has exactly one observation, each the answer the table
below says; none was decided, nor written, while Redis was gone; every run's counters
are what its proposals spent, no more; and the processor counted the outage in its
dependency-error metric and is still alive.

Rate limits are scaled out of the way (GCRA answers depend on the wall clock, and here
on how long the outage happened to last), and in-flight keys are kept for an hour:
otherwise a key whose deadline and grace period passed during the outage would rightly
become retryable, and step 5 would be routed.
"""

from __future__ import annotations

import datetime as dt
import re
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from processor.codec.avro import codec
from processor.config import Settings
from processor.reference_data import publish_references, wait_until_loaded
from processor.stack.local import free_ports
from processor.state.admission import AdmissionStore
from tests.integration.harness import (
    ProcessorProcess,
    RedisServer,
    isolated,
    policy_with_budgets,
    produce_at_rate,
    read_all,
    token,
)

pytestmark = pytest.mark.integration

TENANT = "acme-stopped"
RUNS = 80
WINDOW_S = 2.0
"""Every run makes its n-th proposal in the n-th window: the runs are interleaved."""
RATE = RUNS / WINDOW_S
STOP_AT_S = 4 * WINDOW_S - 0.5
"""After steps 0-3 are decided, before step 4 is proposed."""
STOPPED_S = 20.0
BUDGETS: dict[str, Any] = {
    "steps": 12,
    "classes": {"read": 30, "write": 2, "external": 3, "financial": 0, "critical": 0},
    "run_cost": 0.025,
    "day_cost": 1000.0,
    "repeats": 2,
    "repairs": 3,
    "rate_limit_scale": 1_000_000,
    "in_flight_grace_ms": 3_600_000,
}
STORY = (
    "The customer ordered a sofa three weeks ago. It arrived with a torn cover and a "
    "broken leg, the courier left it outside in the rain, and two earlier emails asking "
    "for a replacement went unanswered. They now ask for a refund instead."
)


def _step(run: int, n: int) -> tuple[str, dict[str, Any], dict[str, str]]:
    """The n-th proposal of a run: tool, arguments and envelope extras."""
    query = {"query": f"returns for order {run}", "limit": 5}
    summary = f"Parcel {run} arrived damaged; the customer wants a replacement."
    ticket = {"customer_id": f"CUS-{run:06d}", "category": "delivery", "priority": "normal",
              "summary": summary}  # fmt: skip
    key = {"idempotency_key": f"stopped-{run}-ticket"}
    if n in (0, 1, 4):  # the same call as three operations: the third is one too many
        return "search_kb", query, {"logical_operation_id": f"op-{n}"}
    if n in (2, 5):  # an explicit key, then the same key and payload while it is in flight
        return "create_ticket", ticket, key
    if n == 3:
        order = {"order_id": f"WO-{run:05d}-A", "reason_code": "customer_request", "confirm": True}
        return "cancel_order", order, {}
    if n == 6:
        summary = f"Run {run}: the same delivery failure, again, and nobody has called back."
        return "escalate", {"severity": "high", "reason_code": "repeated_failure",
                            "summary": summary}, {}  # fmt: skip
    if n == 7:  # a third write: over the class budget
        return "create_ticket", {**ticket, "priority": "high"}, {}
    if n in (8, 10, 11):  # 0.01 each; the third goes over the run's cost cap
        return "summarise", {"text": f"{STORY} Case {run}-{n}.", "max_words": 60,
                             "style": "paragraph"}, {}  # fmt: skip
    if n == 9:  # a repair: limit as a string
        return "search_kb", {"query": "return policy", "limit": "10"}, {}
    if n == 12:  # the key again with another payload: refused on the key, before the step cap
        return "create_ticket", {**ticket, "priority": "urgent"}, key
    return "search_kb", {"query": f"status of parcel {run}-{n}", "limit": 5}, {}


EXPECTED: dict[int, tuple[str, str, str | None]] = {
    0: ("ROUTED", "SUCCESS", None),
    1: ("ROUTED", "SUCCESS", None),
    2: ("ROUTED", "SUCCESS", None),
    3: ("PENDING_APPROVAL", "CONFIRMATION_MISSING", None),
    4: ("REJECTED", "BUDGET_EXHAUSTED", "repeated_call"),
    5: ("REJECTED", "IDEMPOTENCY_CONFLICT", "idempotency_in_flight"),
    6: ("ROUTED", "SUCCESS", None),
    7: ("REJECTED", "BUDGET_EXHAUSTED", "class_budget"),
    8: ("ROUTED", "SUCCESS", None),
    9: ("REJECTED", "TYPE_MISMATCH", None),
    10: ("ROUTED", "SUCCESS", None),
    11: ("REJECTED", "BUDGET_EXHAUSTED", "run_cost_cap"),
    12: ("REJECTED", "SIGNATURE_MISMATCH", "idempotency_key_reused"),
    13: ("REJECTED", "BUDGET_EXHAUSTED", "step_cap"),
    14: ("REJECTED", "BUDGET_EXHAUSTED", "step_cap"),
    15: ("REJECTED", "BUDGET_EXHAUSTED", "step_cap"),
}
"""(decision, taxonomy class, the admission's error code) of each step of every run."""


def _corpus(principal: str) -> list[tuple[str, bytes, bytes]]:
    out = []
    for n in EXPECTED:
        for run in range(RUNS):
            tool, args, extra = _step(run, n)
            env = {"proposal_id": f"stopped-{run}-{n}", "tenant_id": TENANT,
                   "run_id": f"stopped-run-{run}", "tool": {"name": tool}, "arguments": args,
                   "principal_token": principal, **extra}  # fmt: skip
            out.append((f"stopped-{run}-{n}", f"stopped-run-{run}".encode(), orjson.dumps(env)))
    return out


def _ms(value: Any) -> float:
    """An Avro timestamp-millis as epoch ms (fastavro reads it as an aware datetime)."""
    if isinstance(value, dt.datetime):
        return value.timestamp() * 1000
    return float(value)


def _metric(port: int, name: str, labels: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.search(rf"^{name}\{{{labels}\}} (\S+)$", body, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_stopped_redis_decides_nothing_until_it_is_back_and_forgets_nothing(
    stack_settings: Settings, tmp_path: Path
) -> None:
    started = time.monotonic()
    server = RedisServer(
        tmp_path / "redis", "--appendonly", "yes", "--appendfsync", "always", "--save", ""
    ).start()
    settings = isolated(stack_settings, f"stopped-{time.time_ns()}").model_copy(
        update={
            "redis_url": server.url,
            "policy_file": policy_with_budgets(tmp_path / "policy.yaml", BUDGETS),
        }
    )
    orders: list[tuple[str, dict[str, Any] | None]] = [
        (f"{TENANT}/order/WO-{r:05d}-A", {"state": "processing"}) for r in range(RUNS)
    ]
    publish_references(settings, orders)
    (metrics_port,) = free_ports(1)
    proc = ProcessorProcess(
        settings, "stopped-1", tmp_path, TOOLSENTRY_METRICS_PORT=str(metrics_port)
    )  # fmt: skip
    try:
        proc.start().wait_ready()
        wait_until_loaded(settings)
        corpus = _corpus(token(settings, TENANT, ttl_s=3600))
        outage: dict[str, float] = {}

        def stop_and_start() -> None:
            time.sleep(STOP_AT_S)
            outage["stop"] = time.time()
            server.stop()
            outage["gone"] = time.time()
            # Reference data changes while Redis is gone: the loader must wait, not die.
            publish_references(settings, [(key.replace("-A", "-B"), v) for key, v in orders[:20]])
            time.sleep(STOPPED_S - (time.time() - outage["gone"]))
            server.start()
            outage["back"] = time.time()

        chaos = threading.Thread(target=stop_and_start)
        chaos.start()
        produce_at_rate(settings, TENANT, [(k, v) for _, k, v in corpus], RATE)
        chaos.join()
        wait_until_loaded(settings, timeout=30)  # what was published meanwhile, too

        records = read_all(
            settings, settings.topics.observations, timeout=120, idle=2, expect=len(corpus)
        )
        redis_errors = _metric(
            metrics_port, "toolsentry_dependency_errors_total", 'dependency="redis"'
        )
        store = AdmissionStore(server.client(), settings.redis_namespace)
        counters = {run: store.run_counters(TENANT, f"stopped-run-{run}") for run in range(RUNS)}
        assert proc.alive(), proc.log()[-3000:]
    finally:
        exit_code = proc.terminate(60)
        server.kill()
    assert exit_code == 0, proc.log()[-3000:]
    log = proc.log()

    observations = [codec("observation").decode(m.value()) for m in records]
    per_proposal = Counter(o["proposal_id"] for o in observations)
    assert set(per_proposal) == {pid for pid, _, _ in corpus}, "a proposal was lost"
    assert max(per_proposal.values()) == 1, "a proposal was answered twice"

    # Each step of each run answered as its run's state says, across the restart.
    wrong = {}
    for o in observations:
        decision, taxonomy, code = EXPECTED[int(o["proposal_id"].rpartition("-")[2])]
        codes = [e["code"] for e in o["result_payload"]["errors"]]
        seen = (o["decision"], o["status"]["taxonomy_class"])
        if seen != (decision, taxonomy) or (code is not None and code not in codes):
            wrong[o["proposal_id"]] = (*seen, codes)
    assert not wrong, f"{len(wrong)} answered otherwise, e.g. {list(wrong.items())[:4]}"

    # Nothing decided, nothing written, while Redis was gone; what came meanwhile waited.
    gone_ms, back_ms = outage["gone"] * 1000, outage["back"] * 1000
    decided = {o["proposal_id"]: _ms(o["execution_metadata"]["timestamp"]) for o in observations}
    written = {
        o["proposal_id"]: m.timestamp()[1] for o, m in zip(observations, records, strict=True)
    }
    while_gone = [pid for pid, t in decided.items() if gone_ms <= t < back_ms]
    assert while_gone == [], f"{len(while_gone)} decided while Redis was gone"
    written_while_gone = [pid for pid, t in written.items() if gone_ms + 500 < t < back_ms]
    assert written_while_gone == [], f"{len(written_while_gone)} written while Redis was gone"
    # Every run's first two calls were decided before the stop, its third identical one
    # (refused, by the counters Redis kept over its restart) only after.
    for run in range(RUNS):
        assert decided[f"stopped-{run}-1"] < outage["stop"] * 1000, run
        assert decided[f"stopped-{run}-4"] >= back_ms, run
    waited = sum(t >= back_ms for t in decided.values())
    assert waited >= RUNS * 8, f"only {waited} decisions waited for Redis: the stop missed"

    # Nothing counted twice by the batches rewound while Redis was gone.
    want_counters = {"steps": 16, "class:read": 4, "class:write": 2, "class:external": 1}
    for run, c in counters.items():
        assert {k: c.get(k) for k in want_counters} == want_counters, (run, c)
        assert c["cost"] == pytest.approx(0.022), (run, c)
        assert c["repairs"] == 1, (run, c)

    assert redis_errors > 0, "the processor's dependency-error metric missed the outage"
    assert "batch rewound" in log and "reference load failed" in log, log[-3000:]
    print(
        f"\nredis gone {outage['back'] - outage['gone']:.1f} s; {redis_errors:.0f} redis errors; "
        f"{waited} decisions waited; {time.monotonic() - started:.0f} s"
    )
