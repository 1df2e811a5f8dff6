"""Exactly once under failure: SIGKILLs at random moments, scaling 1 -> 3 -> 1.

20,000 proposals, a third of them invalid, are produced at a steady rate
while processors are killed and restarted and the group grows and shrinks.
Afterwards, read with read_committed: every proposal has exactly one
observation, every valid one exactly one approved call, and nothing else.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest

from processor.codec.avro import codec
from processor.config import SIDE_EFFECT_TOPIC_SUFFIXES, Settings
from tests.integration.harness import ProcessorProcess, isolated, produce_at_rate, read_all, token

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOTAL = 20_000
RATE = 400  # proposals/s: production spans ~50 s, so every chaos event lands mid-stream


def _proposal(rng: random.Random, i: int, principal: str) -> tuple[str, bytes, bytes, bool]:
    run_id = f"eos-run-{i % 257}"
    pid = f"eos-{i}"
    kind = rng.random()
    valid = True
    if kind < 0.5:
        tool, args = "lookup_order", {"order_id": f"WO-{i % 100000:05d}-A"}
    elif kind < 0.66:
        tool, args = "search_kb", {"query": f"return policy {i}", "limit": 10}
    elif kind < 0.77:
        tool, args = (
            "cancel_order",
            {"order_id": f"ORD-{i}", "reason_code": "customer_request", "confirm": True},
        )
        valid = False
    elif kind < 0.88:
        tool, args = "search_kb", {"query": "x", "limit": "10"}
        valid = False
    else:
        tool, args = "no_such_tool", {}
        valid = False
    env = {
        "proposal_id": pid,
        "tenant_id": "acme",
        "run_id": run_id,
        "tool": {"name": tool},
        "arguments": args,
        "principal_token": principal,
    }
    return pid, run_id.encode(), orjson.dumps(env), valid


def test_exactly_once_under_kills_and_scaling(stack_settings: Settings, tmp_path: Path) -> None:
    settings = isolated(stack_settings, "eos")
    rng = random.Random(20261122)
    principal = token(settings, "acme", ttl_s=3600)
    corpus = [_proposal(rng, i, principal) for i in range(TOTAL)]
    valid_ids = {pid for pid, _, _, ok in corpus if ok}

    procs = {name: ProcessorProcess(settings, name, tmp_path) for name in ("a", "b", "c")}
    procs["a"].start()
    done = threading.Event()

    def produce() -> None:
        produce_at_rate(settings, "acme", [(key, value) for _, key, value, _ in corpus], RATE)
        done.set()

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()

    kills = 0
    events: list[str] = []

    def kill_and_restart(name: str) -> None:
        nonlocal kills
        time.sleep(rng.uniform(1.0, 4.0))
        procs[name].kill()
        kills += 1
        events.append(f"kill {name}")
        time.sleep(rng.uniform(0.2, 1.5))
        procs[name].start()
        events.append(f"start {name}")

    for _ in range(3):
        kill_and_restart("a")
    procs["b"].start()
    procs["c"].start()
    events.append("scale to 3")
    kill_and_restart("b")
    kill_and_restart("a")
    kill_and_restart("c")
    time.sleep(2)
    assert procs["b"].terminate() == 0
    assert procs["c"].terminate() == 0
    events.append("scale to 1")
    kill_and_restart("a")

    producer.join(300)
    assert done.is_set(), "the producer did not finish"
    assert kills >= 5

    observations = [
        codec("observation").decode(m.value())
        for m in read_all(settings, settings.topics.observations, timeout=300, idle=8, expect=TOTAL)
    ]
    calls = []
    for suffix in SIDE_EFFECT_TOPIC_SUFFIXES:
        calls += [
            codec("approved_call").decode(m.value())
            for m in read_all(settings, f"{settings.topics.prefix}exec.{suffix}", idle=2)
        ]
    assert procs["a"].terminate() == 0, procs["a"].log()[-3000:]

    per_proposal = Counter(o["proposal_id"] for o in observations)
    missing = {pid for pid, _, _, _ in corpus} - set(per_proposal)
    doubled = {pid: n for pid, n in per_proposal.items() if n > 1}
    assert not missing, f"{len(missing)} proposals without an observation ({events})"
    assert not doubled, f"{len(doubled)} proposals observed twice ({events})"
    assert len(observations) == TOTAL

    per_call = Counter(c["proposal_id"] for c in calls)
    assert set(per_call) == valid_ids, "approved calls must be exactly the valid proposals"
    assert max(per_call.values()) == 1, "an approved call was routed twice"

    routed = {o["proposal_id"] for o in observations if o["decision"] == "ROUTED"}
    assert routed == valid_ids
