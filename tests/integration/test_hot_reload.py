"""Contracts change under load: the processor swaps sets between batches, never mid-set."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections import defaultdict
from pathlib import Path

import orjson
import pytest
import yaml

from processor.client import ToolsentryClient
from processor.codec.avro import codec
from processor.config import Settings
from processor.contracts.registry import load_contracts
from tests.integration.harness import ROOT, ProcessorProcess, isolated, read_all, token

pytestmark = pytest.mark.integration

RATE = 300  # proposals/s while the contracts change under the processor


def _rewrite(path: Path, doc: object) -> None:
    """Replace a file atomically, as a deploy tool would."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(doc))
    os.replace(tmp, path)


def test_contract_sets_swap_whole_between_batches(stack_settings: Settings, tmp_path: Path) -> None:
    folder = tmp_path / "contracts"
    shutil.copytree(ROOT / "contracts", folder)
    first = load_contracts(folder).fingerprint
    search = folder / "search_kb" / "1.0.0.yaml"
    doc = yaml.safe_load(search.read_text())

    settings = isolated(stack_settings, f"reload-{time.time_ns()}")
    proc = ProcessorProcess(
        settings, "reload-1", tmp_path,
        TOOLSENTRY_CONTRACTS_DIR=str(folder), TOOLSENTRY_CONTRACTS_POLL_S="0.2",
    ).start().wait_ready()  # fmt: skip

    sent: list[str] = []
    stop = threading.Event()
    principal = token(settings, "acme")

    def produce() -> None:
        client = ToolsentryClient(settings, "acme", watch=False)
        n = 0
        while not stop.is_set():
            env = {
                "proposal_id": f"hr-{n}",
                "tenant_id": "acme",
                # One run per proposal, each its own call: budgets, guards and idempotency
                # keys stay out of a test about contract sets.
                "run_id": f"run-{n}",
                "tool": {"name": "search_kb"},
                "arguments": {"query": f"returns {n}", "limit": 60},
                "principal_token": principal,
            }
            client.send_raw(orjson.dumps(env), env["run_id"].encode())  # type: ignore[union-attr]
            sent.append(env["proposal_id"])  # type: ignore[arg-type]
            n += 1
            time.sleep(1 / RATE)
        client.flush(30)
        client.close()

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        time.sleep(2)
        doc["affordance"]["input_schema"]["properties"]["limit"]["maximum"] = 50
        _rewrite(search, doc)  # limit 60 is now out of bounds
        time.sleep(2)
        second = load_contracts(folder).fingerprint
        (folder / "broken.yaml").write_text("identity: [not, a, contract\n")  # refused whole
        time.sleep(1.5)
        proc.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]  # a forced check: still refused
        time.sleep(1.5)
    finally:
        stop.set()
        producer.join(60)

    observations = [
        codec("observation").decode(m.value())  # type: ignore[arg-type]
        for m in read_all(
            settings, settings.topics.observations, timeout=120, idle=3, expect=len(sent)
        )
    ]
    assert proc.alive()
    log = proc.log()
    assert proc.terminate() == 0, log[-3000:]

    assert sorted(o["proposal_id"] for o in observations) == sorted(sent)
    by_set: dict[str, set[str]] = defaultdict(set)
    for o in observations:
        by_set[o["contract_set"]].add(o["status"]["taxonomy_class"])
    # Every decision is the one its own set makes: never a mixture.
    assert by_set == {first: {"SUCCESS"}, second: {"OUT_OF_BOUNDS"}}, dict(by_set)
    # Per partition (so per run), the old set's decisions all come before the new set's.
    per_partition: dict[int, list[str]] = defaultdict(list)
    for o in sorted(observations, key=lambda o: o["execution_metadata"]["source_offset"]):
        per_partition[o["execution_metadata"]["source_partition"]].append(o["contract_set"])
    for sets in per_partition.values():
        switch = sets.index(second) if second in sets else len(sets)
        assert set(sets[:switch]) <= {first} and set(sets[switch:]) <= {second}
    assert log.count("contract reload refused") >= 2, log[-3000:]
    assert "broken.yaml" in log
