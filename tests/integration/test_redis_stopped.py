"""Redis is stopped in the middle of a run and started again: nothing is decided while it
is gone, nothing is lost, and every budget and record it held still holds after.

A processor with a redis-server of its own (AOF on, fsync on every write, so a restart
keeps every counter and record) decides a paced stream of agent runs. Each run makes
the 16 proposals of ``tests.integration.stories``, whose answers its admission state
decides. The runs are interleaved, so each run's first steps are decided before Redis
stops and its later ones only after it is back.

Redis is stopped (SIGTERM: it persists and exits) for 20 s, and started again on the
same port and data dir; reference data published meanwhile must still be loaded.
Afterwards, every proposal has exactly one observation, each the answer the table
below says; none was decided, nor written, while Redis was gone; every run's counters
are what its proposals spent, no more; and the processor counted the outage in its
dependency-error metric and is still alive.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from processor.config import Settings
from processor.reference_data import publish_references, wait_until_loaded
from processor.stack.local import free_ports
from processor.state.admission import AdmissionStore
from tests.integration.harness import (
    ProcessorProcess,
    RedisServer,
    isolated,
    metric,
    metric_total,
    policy_with_budgets,
    produce_at_rate,
    read_all,
    token,
)
from tests.integration.stories import (
    BUDGETS,
    OUTAGE_AT_S,
    WINDOW_S,
    answered_once,
    corpus,
    ms,
    orders,
    wrong_counters,
)

pytestmark = pytest.mark.integration

TENANT = "acme-stopped"
RUNS = 80
RATE = RUNS / WINDOW_S
STOPPED_S = 20.0
LAG = "toolsentry_consumer_lag_records"


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
    refs = orders(TENANT, RUNS)
    publish_references(settings, refs)
    (metrics_port,) = free_ports(1)
    proc = ProcessorProcess(
        settings, "stopped-1", tmp_path, TOOLSENTRY_METRICS_PORT=str(metrics_port)
    )  # fmt: skip
    try:
        proc.start().wait_ready()
        wait_until_loaded(settings)
        stories = corpus(token(settings, TENANT, ttl_s=3600), TENANT, "stopped", RUNS)
        outage: dict[str, float] = {}

        def stop_and_start() -> None:
            time.sleep(OUTAGE_AT_S)
            outage["stop"] = time.time()
            server.stop()
            outage["gone"] = time.time()
            # Reference data changes while Redis is gone: the loader must wait, not die.
            publish_references(settings, [(key.replace("-A", "-B"), v) for key, v in refs[:20]])
            time.sleep(STOPPED_S - (time.time() - outage["gone"]))
            # Proposals kept coming: the processor's lag gauge (librdkafka's statistics,
            # every 5 s) shows what waits.
            outage["lag"] = metric_total(metrics_port, LAG)
            server.start()
            outage["back"] = time.time()

        chaos = threading.Thread(target=stop_and_start)
        chaos.start()
        produce_at_rate(settings, TENANT, [(k, v) for _, k, v in stories], RATE)
        chaos.join()
        wait_until_loaded(settings, timeout=30)  # what was published meanwhile, too

        records = read_all(
            settings, settings.topics.observations, timeout=120, idle=2, expect=len(stories)
        )
        redis_errors = metric(
            metrics_port, "toolsentry_dependency_errors_total", 'dependency="redis"'
        )
        settled = time.monotonic() + 20  # a few of librdkafka's 5 s statistics
        while (lag_after := metric_total(metrics_port, LAG)) and time.monotonic() < settled:
            time.sleep(0.5)
        store = AdmissionStore(server.client(), settings.redis_namespace)
        counters = {run: store.run_counters(TENANT, f"stopped-run-{run}") for run in range(RUNS)}
        assert proc.alive(), proc.log()[-3000:]
    finally:
        exit_code = proc.terminate(60)
        server.kill()
    assert exit_code == 0, proc.log()[-3000:]
    log = proc.log()

    observations = answered_once(records, stories)

    # Nothing decided, nothing written, while Redis was gone; what came meanwhile waited.
    gone_ms, back_ms = outage["gone"] * 1000, outage["back"] * 1000
    decided = {o["proposal_id"]: ms(o["execution_metadata"]["timestamp"]) for o in observations}
    written = {
        o["proposal_id"]: m.timestamp()[1] for o, m in zip(observations, records, strict=True)
    }
    while_gone = [pid for pid, t in decided.items() if gone_ms <= t < back_ms]
    assert while_gone == [], f"{len(while_gone)} decided while Redis was gone"
    # The lag showed what waited, and went back to 0 once it was decided.
    assert outage["lag"] > 0, outage
    assert lag_after == 0
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
    wrong_runs = wrong_counters(counters)
    assert not wrong_runs, (
        f"{len(wrong_runs)} runs counted otherwise, e.g. {list(wrong_runs.items())[:2]}"
    )

    assert redis_errors > 0, "the processor's dependency-error metric missed the outage"
    assert "batch rewound" in log and "reference load failed" in log, log[-3000:]
    print(
        f"\nredis gone {outage['back'] - outage['gone']:.1f} s; {redis_errors:.0f} redis errors; "
        f"{waited} decisions waited; {time.monotonic() - started:.0f} s"
    )
