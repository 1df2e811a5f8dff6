"""The broker is stopped in the middle of a run and started again: the processor waits,
loses nothing, doubles nothing, and every admission answer is the one a run without the
outage gives.

A private stack (its own Kafka broker and redis-server, so the session's broker keeps
running for every other test) and a processor decide a paced stream of the agent runs
of ``tests.integration.stories``, whose answers depend on the admission state in Redis.
The broker is stopped cleanly for 15 s in the middle, and started again on the same
ports and data dir: the processor's open transaction cannot commit, its consumer loses
its coordinator, and the agents' producer buffers what they send meanwhile. Batches
whose transaction failed are rewound and decided again; their Redis effects replay
to the same answers without being counted twice.

Afterwards, read with read_committed: every proposal has exactly one observation, each
the answer the story's table gives; every routed call exactly one approved call on its
execution topic, and no other call was routed; every run's counters are what its
proposals spent; replay markers did not pile up; the processor counted the outage in its
dependency-error metric, is still alive, and stops cleanly.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from processor.codec.records import decode_approved_call
from processor.config import Settings
from processor.reference_data import publish_references, wait_until_loaded
from processor.stack import LocalStack, private_stack_settings
from processor.stack.local import free_ports
from processor.state.admission import AdmissionStore
from processor.state.connection import connect
from tests.integration.harness import (
    ProcessorProcess,
    isolated,
    metric,
    policy_with_budgets,
    produce_at_rate,
    read_all,
    token,
)
from tests.integration.stories import (
    BUDGETS,
    EXPECTED,
    OUTAGE_AT_S,
    WINDOW_S,
    answered_once,
    corpus,
    orders,
    wrong_counters,
)

pytestmark = pytest.mark.integration

TENANT = "acme-broker"
RUNS = 60
RATE = RUNS / WINDOW_S
STOPPED_S = 15.0


def test_a_stopped_broker_loses_nothing_doubles_nothing_and_counts_nothing_twice(
    stack_settings: Settings, tmp_path: Path
) -> None:
    started = time.monotonic()
    private = private_stack_settings(tmp_path / "stack", partitions=3)
    stack = LocalStack(private)
    stack.up()
    proc: ProcessorProcess | None = None
    try:
        base = stack_settings.model_copy(
            update={
                "bootstrap_servers": private.bootstrap_servers,
                "redis_url": private.redis_url,
                "stack": private.stack,
                "policy_file": policy_with_budgets(tmp_path / "policy.yaml", BUDGETS),
            }
        )
        settings = isolated(base, f"broker-{time.time_ns()}")
        publish_references(settings, orders(TENANT, RUNS))
        (metrics_port,) = free_ports(1)
        proc = ProcessorProcess(
            settings, "broker-1", tmp_path, TOOLSENTRY_METRICS_PORT=str(metrics_port)
        )
        proc.start().wait_ready()
        wait_until_loaded(settings)
        principal = token(settings, TENANT, ttl_s=3600)
        stories = corpus(principal, TENANT, "broker", RUNS)
        outage: dict[str, float] = {}

        def stop_and_start() -> None:
            time.sleep(OUTAGE_AT_S)
            outage["stop"] = time.time()
            stack.stop("kafka")
            outage["gone"] = time.time()
            time.sleep(max(0.0, STOPPED_S - (time.time() - outage["gone"])))
            stack.start("kafka")
            outage["back"] = time.time()

        chaos = threading.Thread(target=stop_and_start)
        chaos.start()
        produce_at_rate(settings, TENANT, [(k, v) for _, k, v in stories], RATE)
        chaos.join()

        records = read_all(
            settings, settings.topics.observations, timeout=180, idle=3, expect=len(stories)
        )
        execs = [t for t in settings.topics.all() if t.startswith(settings.topics.execution(""))]
        calls = read_all(settings, execs, timeout=60, idle=2)
        kafka_errors = metric(
            metrics_port, "toolsentry_dependency_errors_total", 'dependency="kafka"'
        )
        store = AdmissionStore(connect(settings.redis_url), settings.redis_namespace)
        counters = {run: store.run_counters(TENANT, f"broker-run-{run}") for run in range(RUNS)}
        # One more proposal, in a batch of its own after everything else committed: its
        # admission call drops every earlier batch's replay markers.
        late = corpus(principal, TENANT, "late", 1)[:1]
        produce_at_rate(settings, TENANT, [(k, v) for _, k, v in late], RATE)
        read_all(settings, settings.topics.observations, timeout=60, idle=2,
                 expect=len(stories) + 1)  # fmt: skip
        markers = connect(settings.redis_url).hlen(f"{settings.redis_namespace}:{{{TENANT}}}:done")
        assert proc.alive(), proc.log()[-3000:]
    finally:
        try:
            exit_code = proc.terminate(60) if proc is not None else None
        finally:
            stack.down()  # also when the processor would not stop: no broker left behind
    assert exit_code == 0, proc.log()[-3000:]
    log = proc.log()

    observations = answered_once(records, stories)

    # Exactly the routed proposals have an approved call, each exactly one.
    routed = {o["proposal_id"] for o in observations if o["decision"] == "ROUTED"}
    routed_steps = sum(1 for d, _, _ in EXPECTED.values() if d == "ROUTED")
    assert len(routed) == RUNS * routed_steps
    approved = Counter(decode_approved_call(m.value())["proposal_id"] for m in calls)
    assert set(approved) == routed, (
        f"routed without a call: {sorted(routed - set(approved))[:5]}; "
        f"a call but not routed: {sorted(set(approved) - routed)[:5]}"
    )
    assert max(approved.values()) == 1, "a call was routed twice"

    # Nothing counted twice by the batches that were rewound and decided again.
    wrong_runs = wrong_counters(counters)
    assert not wrong_runs, (
        f"{len(wrong_runs)} runs counted otherwise, e.g. {list(wrong_runs.items())[:2]}"
    )
    # Replay markers are dropped once their batch commits, in the next batch's round trip:
    # only the late proposal's batch's are left, never one per proposal.
    assert markers <= len(late), f"{markers} replay markers left behind"

    assert kafka_errors > 0, "the processor's dependency-error metric missed the outage"
    assert outage["back"] - outage["gone"] >= STOPPED_S - 1
    print(
        f"\nbroker gone {outage['back'] - outage['gone']:.1f} s; {kafka_errors:.0f} kafka "
        f"errors; {log.count('rewinding')} batches rewound; {markers} markers left; "
        f"{time.monotonic() - started:.0f} s"
    )
