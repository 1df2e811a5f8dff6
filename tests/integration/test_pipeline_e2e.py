"""Each gate's outcome end to end: real broker, a `toolsentry run` subprocess, the client."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from processor.client import ObservationTimeout, ToolsentryClient
from processor.codec.avro import codec
from processor.config import Settings
from processor.contracts.registry import load_contracts
from processor.kafka.partitioner import partition_for
from processor.reference_data import publish_references, wait_until_loaded
from tests.integration.harness import (
    ROOT,
    ProcessorProcess,
    approval,
    existing,
    isolated,
    read_all,
    token,
)
from tests.lifecycle import contracts_with_sunsets_ahead, sunset_ahead

pytestmark = pytest.mark.integration

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
CANCEL = {"order_id": "WO-12345-A", "reason_code": "customer_request", "confirm": True}


class E2E:
    def __init__(
        self,
        settings: Settings,
        client: ToolsentryClient,
        proc: ProcessorProcess,
        contracts_dir: Path,
        sunset: str,
    ):
        self.settings = settings
        self.client = client
        self.proc = proc
        self.contracts_dir = contracts_dir
        """The shipped contracts, deprecated versions sunsetted a year from today."""
        self.sunset = sunset
        """That sunset date, as written when the module's processor started."""

    def processor(self, instance_id: str, log_dir: Path) -> ProcessorProcess:
        """Another instance in this module's group, on the same contracts."""
        return processor(self.settings, instance_id, log_dir, self.contracts_dir)

    def call(self, tool: str, arguments: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        run_id = kw.pop("run_id", f"run-{uuid.uuid4().hex[:8]}")
        return self.client.call(tool, arguments, run_id=run_id, timeout=60, **kw)

    def calls_for(self, proposal_id: str, side_effect: str) -> list[dict[str, Any]]:
        topic = self.settings.topics.execution(side_effect)
        decoded = [
            codec("approved_call").decode(m.value())
            for m in read_all(self.settings, topic, idle=1.5)
        ]
        return [c for c in decoded if c["proposal_id"] == proposal_id]


def processor(
    settings: Settings, instance_id: str, log_dir: Path, contracts_dir: Path
) -> ProcessorProcess:
    return ProcessorProcess(
        settings, instance_id, log_dir, TOOLSENTRY_CONTRACTS_DIR=str(contracts_dir)
    )


@pytest.fixture(scope="module")
def e2e(stack_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
    settings = isolated(stack_settings, "e2e")
    sunset = sunset_ahead()
    contracts_dir = contracts_with_sunsets_ahead(tmp_path_factory.mktemp("contracts"), sunset)
    entities = existing("acme", "cancel_order", CANCEL)
    for version in ("2.0.0", "2.1.0"):
        entities += existing("acme", "charge_customer_card_v2", _charge_arguments(version))
    publish_references(settings, entities)
    proc = processor(settings, "e2e-1", tmp_path_factory.mktemp("logs"), contracts_dir).start()
    wait_until_loaded(settings)
    client = ToolsentryClient(settings, "acme", principal_token=token(settings, "acme"))
    try:
        yield E2E(settings, client, proc, contracts_dir, sunset)
    finally:
        client.close()
        if proc.alive():
            assert proc.terminate() == 0, proc.log()[-3000:]


def test_valid_call_is_routed_with_a_complete_observation(e2e: E2E) -> None:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    parked = e2e.call("cancel_order", CANCEL, run_id=run_id, traceparent=TRACEPARENT)
    assert parked["decision"] == "PENDING_APPROVAL", parked["result_payload"]  # needs approval
    approvals = [approval(e2e.settings, "ops-1", parked, request_id=None)]
    obs = e2e.call(
        "cancel_order", CANCEL, run_id=run_id, traceparent=TRACEPARENT, approvals=approvals
    )
    contracts = load_contracts(e2e.contracts_dir)
    assert obs["decision"] == "ROUTED"
    assert obs["gate"] == "route"
    assert obs["run_id"] == run_id and obs["tenant_id"] == "acme"
    assert obs["status"]["taxonomy_class"] == "SUCCESS"
    assert obs["status"]["code"] == 202 and obs["status"]["is_error"] is False
    assert obs["tool_identity"] == {
        "name": "cancel_order",
        "version": "1.0.0",
        "call_id": obs["proposal_id"],
        "side_effect_class": "HIGH_RISK_EXTERNAL",
    }
    meta = obs["execution_metadata"]
    assert meta["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert meta["idempotency_key"].startswith("ik:") and meta["attempt_number"] == 1
    assert meta["source_partition"] == partition_for(run_id.encode(), 6)
    assert obs["verification"]["post_action_verification_required"] is True
    assert obs["contract_set"] == contracts.fingerprint
    assert obs["result_payload"]["errors"] == []

    [call] = e2e.calls_for(obs["proposal_id"], "HIGH_RISK_EXTERNAL")
    assert call["tool_name"] == "cancel_order" and call["tool_version"] == "1.0.0"
    assert orjson.loads(call["arguments"]) == CANCEL
    assert call["arguments"] == orjson.dumps(CANCEL, option=orjson.OPT_SORT_KEYS).decode()
    assert call["idempotency_key"] == meta["idempotency_key"]
    assert call["payload_hash"].startswith("sha256:")
    assert call["trace_id"] == meta["trace_id"]
    assert call["approval_ids"] == [approvals[0]["approval_id"]]
    deadline_ms = call["deadline"].timestamp() * 1000
    created_ms = call["created_at"].timestamp() * 1000
    assert deadline_ms - created_ms == pytest.approx(6000, abs=1)


def test_hallucinated_order_id_is_stopped_with_the_lookup_hint(e2e: E2E) -> None:
    obs = e2e.call("cancel_order", {**CANCEL, "order_id": "ORD-12345"})
    assert obs["decision"] == "REJECTED" and obs["gate"] == "schema"
    status = obs["status"]
    assert status["taxonomy_class"] == "OUT_OF_BOUNDS"
    assert (status["repairable"], status["retryable"], status["fail_closed"]) == (
        True,
        False,
        False,
    )
    [err] = obs["result_payload"]["errors"]
    assert err["field"] == "order_id" and err["code"] == "pattern_mismatch"
    assert err["actual"] == '"ORD-12345"'
    assert "call lookup_order" in obs["next_action"] and "WO-12345-A" in obs["next_action"]
    assert e2e.calls_for(obs["proposal_id"], "HIGH_RISK_EXTERNAL") == []


def test_string_for_integer_is_a_type_mismatch_that_says_how_to_fix_it(e2e: E2E) -> None:
    obs = e2e.call("search_kb", {"query": "return policy", "limit": "10"})
    assert obs["status"]["taxonomy_class"] == "TYPE_MISMATCH"
    [err] = obs["result_payload"]["errors"]
    assert (err["field"], err["expected"], err["actual"]) == ("limit", "integer", "string")
    assert 'emit 10 not "10"' in obs["next_action"]


def test_every_violation_is_reported_and_structure_decides_the_class(e2e: E2E) -> None:
    obs = e2e.call(
        "create_ticket", {"customer_id": "CUS-4211", "priority": "asap", "notify_customer": True}
    )
    assert obs["status"]["taxonomy_class"] == "STRUCTURAL_VIOLATION"
    codes = {(e["field"], e["code"]) for e in obs["result_payload"]["errors"]}
    assert codes == {
        ("category", "missing_field"),
        ("summary", "missing_field"),
        ("notify_customer", "unknown_field"),
        ("priority", "not_in_enum"),
        ("customer_id", "pattern_mismatch"),
    }


def test_unknown_and_look_alike_tools_list_the_allowed_tools(e2e: E2E) -> None:
    for name in ("search_orders", "c\u0430ncel_order"):
        obs = e2e.call(name, CANCEL)
        assert obs["gate"] == "resolve"
        assert obs["status"]["taxonomy_class"] == "STRUCTURAL_VIOLATION"
        assert obs["result_payload"]["errors"][0]["code"] == "unknown_tool"
        assert obs["allowed_tools"] == sorted(load_contracts(e2e.contracts_dir).names)
        assert obs["tool_identity"]["name"] == name


def test_tool_outside_the_steps_palette_is_refused(e2e: E2E) -> None:
    obs = e2e.call("cancel_order", CANCEL, active_tools=["lookup_order", "search_kb"])
    assert obs["result_payload"]["errors"][0]["code"] == "tool_not_active"
    assert obs["allowed_tools"] == ["lookup_order", "search_kb"]
    assert e2e.calls_for(obs["proposal_id"], "HIGH_RISK_EXTERNAL") == []


def test_truncated_model_json_is_a_parse_failure(e2e: E2E) -> None:
    obs = e2e.call("cancel_order", None, arguments_raw='{"order_id": "WO-12345-A", "reas')
    assert obs["gate"] == "parse"
    assert obs["status"]["taxonomy_class"] == "SYNTACTIC_PARSE_FAIL"
    assert obs["result_payload"]["errors"][0]["code"] == "truncated"
    assert "cut off" in obs["next_action"]


def test_raw_arguments_that_parse_are_validated_like_objects(e2e: E2E) -> None:
    obs = e2e.call("cancel_order", None, arguments_raw=orjson.dumps(CANCEL).decode())
    assert obs["decision"] == "PENDING_APPROVAL"  # through every gate up to confirmation
    assert obs["status"]["taxonomy_class"] == "CONFIRMATION_MISSING"


def test_records_that_cannot_be_tied_to_a_run_go_to_the_dlq(e2e: E2E) -> None:
    marker = uuid.uuid4().hex.encode()
    bad = [
        b"not json " + marker,
        orjson.dumps({"proposal_id": marker.decode()}),
        b'{"run_id": "r", "run_id": "' + marker + b'"}',
    ]
    for value in bad:
        e2e.client.send_raw(value, marker)
    e2e.client.flush()
    dlq = [
        m
        for m in read_all(e2e.settings, e2e.settings.topics.dlq, idle=3, expect=3)
        if m.key() == marker
    ]
    assert sorted(m.value() for m in dlq) == sorted(bad)
    reasons = sorted(dict(m.headers())["toolsentry.error.reason"] for m in dlq)
    assert reasons == [b"duplicate_key", b"invalid_json", b"no_run_id"]
    for m in dlq:
        headers = dict(m.headers())
        assert headers["toolsentry.source.topic"] == e2e.settings.topics.proposals.encode()
        assert int(headers["toolsentry.source.offset"]) >= 0


def test_one_runs_proposals_keep_their_order(e2e: E2E) -> None:
    run_id = f"ordered-{uuid.uuid4().hex[:8]}"
    ids = []
    for i in range(300):
        args = CANCEL if i % 3 else {**CANCEL, "order_id": f"BAD-{i}"}
        ids.append(e2e.client.propose("cancel_order", args, run_id=run_id, step=i))
    e2e.client.wait(ids[-1], timeout=60)
    seen = [
        o
        for o in (
            codec("observation").decode(m.value())
            for m in read_all(e2e.settings, e2e.settings.topics.observations, idle=1.5)
        )
        if o["run_id"] == run_id
    ]
    assert [o["proposal_id"] for o in seen] == ids
    offsets = [o["execution_metadata"]["source_offset"] for o in seen]
    assert offsets == sorted(offsets)
    assert len({o["execution_metadata"]["source_partition"] for o in seen}) == 1


def test_a_client_keeps_its_own_runs_and_the_runs_it_follows(e2e: E2E) -> None:
    """The observations topic carries every agent's runs; a client keeps its own, those it
    was told to follow, and forgets a proposal once it has been idle for ``retain_s`` (its
    run busy or not), and a run once all of it has."""
    partitions = e2e.settings.stack.partitions
    followed = f"followed-{uuid.uuid4().hex[:8]}"
    # Another run on the same partition, so that reading the followed run's observation
    # means the other one's, produced first, was read before it.
    unfollowed = next(
        r
        for r in (f"other-{uuid.uuid4().hex[:8]}" for _ in range(10_000))
        if partition_for(r.encode(), partitions) == partition_for(followed.encode(), partitions)
    )
    watcher = ToolsentryClient(e2e.settings, "acme", retain_s=1.0)
    try:
        watcher.follow(followed)
        unseen = e2e.client.propose("search_kb", {"query": "refunds"}, run_id=unfollowed)
        e2e.client.wait(unseen, 60)
        seen = e2e.client.propose("search_kb", {"query": "returns"}, run_id=followed)
        assert watcher.wait(seen, 60) == e2e.client.wait(seen, 60)
        assert watcher.history(unseen) == []
        assert unseen not in watcher.arrivals
        assert e2e.client.history(unseen)[0]["decision"] == "ROUTED"
        # A caller still waiting on one of the run's proposals (a routed call's result,
        # which no executor here sends) keeps the run past retain_s.
        timed_out: list[bool] = []

        def wait_for_a_result() -> None:
            try:
                watcher.wait_result(seen, 4)
            except ObservationTimeout:
                timed_out.append(True)

        waiter = threading.Thread(target=wait_for_a_result)
        waiter.start()
        time.sleep(3)
        assert watcher.history(seen) != []
        waiter.join()
        assert timed_out
        # The run stays busy (a call every 0.3 s, each followed as an operator's console
        # follows a call it shows), but the proposal idle past retain_s, with nobody
        # waiting, is forgotten: a long-lived run keeps only its recent calls.
        deadline = time.monotonic() + 15
        while True:
            latest = e2e.client.propose("search_kb", {"query": "later"}, run_id=followed)
            watcher.follow(followed, latest)
            watcher.wait(latest, 60)
            if not watcher.history(seen) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert watcher.history(seen) == []
        assert watcher.history(latest) != []
        assert followed.encode() in watcher._runs
        assert e2e.client.history(seen) != []  # the proposer's client keeps it (an hour)
        deadline = time.monotonic() + 15
        while followed.encode() in watcher._runs and time.monotonic() < deadline:
            time.sleep(0.2)
        assert followed.encode() not in watcher._runs  # the whole run idle: forgotten
        assert watcher.history(latest) == []
    finally:
        watcher.close()
    sender = ToolsentryClient(e2e.settings, "acme", watch=False)
    try:
        for _ in range(100):
            sender.propose("search_kb", {"query": "refunds"}, run_id=f"r-{uuid.uuid4().hex}")
        sender.flush()
        assert sender._runs == {}  # a client that does not read observations follows nothing
    finally:
        sender.close()


def test_a_proposal_is_answered_only_under_its_own_run(e2e: E2E) -> None:
    """A proposal id is the caller's to choose: the same one in another run the client
    follows is another proposal, and its observation does not answer this one."""
    pid, one, other = (
        str(uuid.uuid4()),
        f"run-{uuid.uuid4().hex[:8]}",
        f"run-{uuid.uuid4().hex[:8]}",
    )
    first = e2e.call("no_such_tool", {}, run_id=one, proposal_id=pid)
    assert (first["decision"], first["run_id"]) == ("REJECTED", one)
    answer = e2e.call("search_kb", {"query": "refunds"}, run_id=other, proposal_id=pid)
    assert (answer["decision"], answer["run_id"]) == ("ROUTED", other)
    # history keeps every observation read under the id, in both runs
    assert [o["run_id"] for o in e2e.client.history(pid)] == [one, other]


def test_sigterm_finishes_and_exits_cleanly(e2e: E2E, tmp_path: Path) -> None:
    early = e2e.processor("e2e-early", tmp_path).start()
    deadline = time.monotonic() + 60
    while "consuming" not in early.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert early.terminate() == 0, early.log()[-2000:]  # before it has joined the group

    proc = e2e.processor("e2e-2", tmp_path).start().wait_ready()
    obs = e2e.call("lookup_order", {"order_id": "WO-12345-A"})
    assert obs["decision"] == "ROUTED"
    assert proc.terminate() == 0, proc.log()[-2000:]


def _charge_arguments(version: str) -> dict[str, Any]:
    """Valid arguments for one version of charge_customer_card_v2, from its own example."""
    contract = next(
        c
        for c in load_contracts(ROOT / "contracts").versions("charge_customer_card_v2")
        if c.version == version
    )
    examples = contract.raw["affordance"]["examples"]
    args = dict(next(e["arguments"] for e in examples if e.get("valid", True)))
    if "order_id" in args:  # its own order: WO-12345-A is the one the cancel tests use
        args["order_id"] = "WO-24680-B"
    return args


def test_lifecycle_newest_active_deprecated_warns_sunsetted_refused(e2e: E2E) -> None:
    newest = e2e.call("charge_customer_card_v2", _charge_arguments("2.1.0"))
    assert newest["decision"] == "PENDING_APPROVAL", newest  # a critical mutation
    assert newest["tool_identity"]["version"] == "2.1.0"
    assert newest["result_payload"]["warnings"] == []

    old = e2e.call("charge_customer_card_v2", _charge_arguments("2.0.0"), version="2.0.0")
    assert old["decision"] == "PENDING_APPROVAL" and old["tool_identity"]["version"] == "2.0.0"
    [warning] = old["result_payload"]["warnings"]
    assert "deprecated" in warning and e2e.sunset in warning
    assert "charge_customer_card_v2@2.1.0" in warning

    gone = e2e.call("charge_customer_card_v2", _charge_arguments("2.1.0"), version="1.0.0")
    assert gone["decision"] == "REJECTED" and gone["gate"] == "resolve"
    assert gone["result_payload"]["errors"][0]["code"] == "tool_sunsetted"
    assert "charge_customer_card_v2@2.1.0" in gone["next_action"]
