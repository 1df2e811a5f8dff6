"""Two processor instances share one tenant's limits: together they never exceed them.

A run stays on one partition, so a run's budgets are decided by one instance at a
time; a tenant's limits are not. The tenant's daily cost cap is the sharpest test of
that: it does not refill while the test runs (a rate limit does, with the clock), so
exactly cap / cost calls may pass, whichever instance decides them.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import pytest

from processor.codec.avro import codec
from processor.config import Settings
from tests.conftest import LOAD_POLICY
from tests.integration.harness import ProcessorProcess, isolated, produce_at_rate, read_all, token

pytestmark = pytest.mark.integration

TENANT = "race-t"
COST = 0.01  # summarise's cost_per_call
CAP = 0.5
PROPOSALS = 400


def test_two_instances_never_spend_more_than_the_tenants_day(
    stack_settings: Settings, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(LOAD_POLICY.read_text() + f"  tenants:\n    {TENANT}: {{day_cost: {CAP}}}\n")
    settings = isolated(stack_settings, "race").model_copy(update={"policy_file": policy})
    procs = [ProcessorProcess(settings, f"race-{n}", tmp_path).start() for n in range(2)]
    for p in procs:
        p.wait_ready()
    principal = token(settings, TENANT)
    records = []
    for i in range(PROPOSALS):
        run = f"race-run-{i % 80}"
        args = {"ticket_id": f"TCK-{i:07d}", "max_words": 50, "style": "paragraph"}
        env = {"proposal_id": f"race-{i}", "tenant_id": TENANT, "run_id": run,
               "tool": {"name": "summarise"}, "principal_token": principal,
               "arguments": args}  # fmt: skip
        records.append((run.encode(), orjson.dumps(env)))
    try:
        produce_at_rate(settings, TENANT, records, rate=2000)
        observations = {}
        for m in read_all(
            settings, settings.topics.observations, timeout=120, idle=3, expect=PROPOSALS
        ):
            o = codec("observation").decode(m.value())
            observations[o["proposal_id"]] = o
        logs = [p.life_log() for p in procs]
    finally:
        for p in procs:
            p.terminate()
    assert len(observations) == PROPOSALS
    outcome = Counter((o["decision"], o["status"]["taxonomy_class"]) for o in observations.values())
    allowed = round(CAP / COST)
    assert outcome == {
        ("ROUTED", "SUCCESS"): allowed,
        ("REJECTED", "BUDGET_EXHAUSTED"): PROPOSALS - allowed,
    }, outcome
    refused = [o for o in observations.values() if o["decision"] == "REJECTED"]
    assert {e["code"] for o in refused for e in o["result_payload"]["errors"]} == {
        "tenant_day_cost_cap"
    }
    # Both instances decided part of the stream.
    assert all("assigned [" in log for log in logs)
    calls = read_all(settings, settings.topics.execution("READ_ONLY"), idle=2)
    assert len(calls) == allowed
