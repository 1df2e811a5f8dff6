"""Redis stops answering in the middle of a run: nothing is lost, nothing is let through.

A processor decides a stream of proposals that need Redis (reference lookups,
parked calls) mixed with ones that do not. Its redis-server, one of its own,
is frozen with SIGSTOP for eight seconds and then resumed (data intact, as
after a network partition or a long pause). Every proposal must still get
exactly one observation, each the decision the reference data gives, and no
proposal that needs Redis may be decided while it is frozen.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest
import redis

from processor.codec.avro import codec
from processor.config import Settings
from processor.reference_data import publish_references, wait_until_loaded
from processor.stack.local import free_ports
from processor.stack.redis import ensure_redis_server
from tests.integration.harness import ProcessorProcess, isolated, produce_at_rate, read_all, token

pytestmark = pytest.mark.integration

TOTAL = 3_000
RATE = 200  # proposals/s: 15 s of traffic, the freeze in the middle
FROZEN_S = 8.0


def _proposals(principal: str) -> list[tuple[str, bytes, bytes, bool]]:
    out = []
    for i in range(TOTAL):
        run_id = f"outage-run-{i % 37}"
        needs_redis = i % 2 == 0
        if needs_redis:
            tool, args = "cancel_order", {
                "order_id": f"WO-{i % 500:05d}-A", "reason_code": "customer_request",
                "confirm": True,
            }  # fmt: skip
        else:
            tool, args = "search_kb", {"query": f"returns {i}", "limit": 5}
        env = {"proposal_id": f"outage-{i}", "tenant_id": "acme-outage", "run_id": run_id,
               "tool": {"name": tool}, "arguments": args, "principal_token": principal}  # fmt: skip
        out.append((f"outage-{i}", run_id.encode(), orjson.dumps(env), needs_redis))
    return out


def test_a_frozen_redis_delays_decisions_and_lets_nothing_through(
    stack_settings: Settings, tmp_path: Path
) -> None:
    (port,) = free_ports(1)
    server = subprocess.Popen(
        [ensure_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    settings = isolated(stack_settings, f"outage-{time.time_ns()}").model_copy(
        update={"redis_url": url}
    )
    publish_references(
        settings,
        [(f"acme-outage/order/WO-{n:05d}-A", {"state": "processing"}) for n in range(500)],
    )
    proc = ProcessorProcess(settings, "outage-1", tmp_path, TOOLSENTRY_REDIS_URL=url).start()
    try:
        proc.wait_ready()
        wait_until_loaded(settings)
        corpus = _proposals(token(settings, "acme-outage"))
        frozen: list[float] = []

        def freeze() -> None:
            time.sleep(TOTAL / RATE / 2 - FROZEN_S / 2)
            frozen.append(time.time())
            os.kill(server.pid, signal.SIGSTOP)
            time.sleep(FROZEN_S)
            os.kill(server.pid, signal.SIGCONT)
            frozen.append(time.time())

        chaos = threading.Thread(target=freeze)
        chaos.start()
        produce_at_rate(settings, "acme-outage", [(k, v) for _, k, v, _ in corpus], RATE)
        chaos.join()

        records = read_all(
            settings, settings.topics.observations, timeout=180, idle=3, expect=TOTAL
        )
        observations = [codec("observation").decode(m.value()) for m in records]
        written_ms = {
            o["proposal_id"]: m.timestamp()[1] for o, m in zip(observations, records, strict=True)
        }
        assert proc.alive(), proc.log()[-3000:]
        log = proc.log()
    finally:
        code = proc.terminate(60)
        server.kill()
        server.wait(10)
    assert code == 0, proc.log()[-3000:]

    per_proposal = Counter(o["proposal_id"] for o in observations)
    assert set(per_proposal) == {pid for pid, _, _, _ in corpus}, "a proposal was lost"
    assert max(per_proposal.values()) == 1, "a proposal was answered twice"
    needs = {pid for pid, _, _, needed in corpus if needed}
    outcomes = Counter(
        (o["proposal_id"] in needs, o["decision"], o["status"]["taxonomy_class"])
        for o in observations
    )
    # Every call that needed Redis was decided with its reference data: parked for approval,
    # never refused as unknown, never routed without an approval.
    assert outcomes == {
        (True, "PENDING_APPROVAL", "CONFIRMATION_MISSING"): len(needs),
        (False, "ROUTED", "SUCCESS"): TOTAL - len(needs),
    }, outcomes
    # None of them was answered while Redis was frozen: a batch caught mid-call waits out the
    # client's 5 s timeout, is rewound (its transaction, if open, aborted) and decided again
    # after the thaw. The observation's record time is when it was written.
    start_ms, end_ms = frozen[0] * 1000, frozen[1] * 1000
    during = [pid for pid in needs if start_ms + 500 < written_ms[pid] < end_ms]
    assert during == [], f"{len(during)} answered while Redis was frozen"
    assert any(written_ms[pid] >= end_ms for pid in needs), "the freeze missed the traffic"
    assert "batch rewound" in log, log[-3000:]
