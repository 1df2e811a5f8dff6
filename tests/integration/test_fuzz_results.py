"""Fuzzing the processor's other inputs: executors' results and approval decisions.

Executors and approvers are other programs, written by other teams; what they put on
``tool.results`` and ``tool.approvals`` is input like any other. One ``toolsentry run``
subprocess consumes a reproducible corpus of hostile records on both topics: bytes that
are not Avro or not JSON, truncated and corrupted records, and well-formed records whose
fields are hostile (unknown tools, ids no call has, results whose data or compensation
arguments are garbage, huge, or nested past any parser's depth). Some results settle
real routed calls. The processor must never stop nor trip over a record, and each record
is answered at most once, each result exactly once: a DLQ entry with a typed reason, or
the call's one final observation.
"""

from __future__ import annotations

import random
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Message, Producer

from processor.approval_flow import EXPIRY_CHECK
from processor.client import ToolsentryClient
from processor.codec.avro import codec
from processor.codec.records import (
    decode_approved_call,
    decode_result,
    encode_result,
    oversized_id,
)
from processor.config import Settings
from processor.model import TaxonomyClass
from processor.results import _RESULT_IDS
from tests.integration.harness import ProcessorProcess, isolated, read_all, token

pytestmark = pytest.mark.integration

SEED = 20261122
RESULTS = 3_000
APPROVALS = 1_500
CALLS = 40
TENANT = "acme"

RESULT_REASONS = {"result_invalid", "result_unknown_call"}
APPROVAL_REASONS = {
    "approval_not_json", "approval_not_object", "approval_without_request",
    "approval_unknown_request",
}  # fmt: skip


def _text(rng: random.Random, huge: bool = True) -> str:
    pick = rng.random()
    if pick < 0.2:
        return ""
    if pick < 0.3:
        return "x" * (rng.randint(10_000, 40_000) if huge else 300)
    if pick < 0.5:
        return "".join(chr(rng.choice([0, 7, 0x202E, 0xFEFF, 0x1F600, rng.randint(32, 0x2FFF)]))
                       for _ in range(rng.randint(1, 40)))  # fmt: skip
    return rng.choice(["search_kb", "refund_order", "compensate:k-1", "../../etc", "%s%n"])


def _json_ish(rng: random.Random) -> str | None:
    """What an executor might put where JSON belongs."""
    return rng.choice(
        [
            None,
            '{"results": [], "match_count": 0, "next_action": null}',
            '{"order_id": "WO-1", "amount": 1e309}',
            "{'order_id': WO-5",
            "[" * 5000 + "]" * 5000,
            "[" * 1000 + "]" * 1000,  # (read by orjson, past Python's stack)
            '{"a": NaN}',
            '"just a string"',
            '{"k": 1, "k": 2}',
            orjson.dumps({"blob": "y" * 200_000}).decode(),
            _text(rng),
        ]
    )


def _result(rng: random.Random, call: dict[str, Any] | None) -> dict[str, Any]:
    """A well-formed ToolResult with hostile fields; for ``call`` when given."""
    datum: dict[str, Any] = {
        "result_id": uuid.UUID(int=rng.getrandbits(128)).hex,
        "call_id": _text(rng), "proposal_id": _text(rng), "run_id": _text(rng),
        "tenant_id": rng.choice([TENANT, TENANT, "", "other", _text(rng)]),
        "trace_id": _text(rng), "tool_name": _text(rng), "tool_version": _text(rng),
        "side_effect_class": rng.choice(["READ_ONLY", "CRITICAL_MUTATION", "EPHEMERAL_WRITE"]),
        "idempotency_key": _text(rng), "payload_hash": _text(rng),
        "attempt": rng.choice([0, 1, 2, -1, 2**31 - 1]),
        "outcome": rng.choice(["SUCCEEDED", "FAILED", "TIMED_OUT"]),
        "retryable": rng.random() < 0.5,
        "error_code": rng.choice([None, _text(rng)]),
        "error_message": rng.choice([None, _text(rng)]),
        "taxonomy_class": rng.choice([None, rng.choice(list(TaxonomyClass)).value, _text(rng)]),
        "committed_steps": [_text(rng, huge=False) for _ in range(rng.choice([0, 0, 1, 3, 200]))],
        "data": _json_ish(rng),
        "compensation_arguments": _json_ish(rng),
        "started_at": rng.choice([0, 1_700_000_000_000, 2**62]),
        "finished_at": rng.choice([0, 1_700_000_000_000, 2**62, -(2**40)]),
        "executor_id": _text(rng), "contract_set": _text(rng),
    }  # fmt: skip
    if call is not None:
        for field in (
            "call_id",
            "proposal_id",
            "run_id",
            "tenant_id",
            "tool_name",
            "tool_version",
            "side_effect_class",
            "idempotency_key",
            "payload_hash",
            "attempt",
        ):
            datum[field] = call[field]  # fmt: skip
    return datum


def _result_record(rng: random.Random) -> bytes:
    pick = rng.random()
    if pick < 0.15:
        return rng.randbytes(rng.randint(0, 3000))
    valid = encode_result(_result(rng, None))
    if pick < 0.3:
        return valid[: rng.randint(0, len(valid) - 1)]
    if pick < 0.4:
        spot = rng.randrange(len(valid))
        return valid[:spot] + bytes([valid[spot] ^ 0xFF]) + valid[spot + 1 :]
    return valid


def _approval_record(rng: random.Random) -> tuple[bytes, bool]:
    """An approval record, and whether it is an expiry check (which may change nothing,
    and then has no answer)."""
    pick = rng.random()
    if pick < 0.15:
        return rng.randbytes(rng.randint(0, 2000)), False
    if pick < 0.25:
        return orjson.dumps(rng.choice([[], 5, "approve", None, [{"request_id": "r"}]])), False
    doc: dict[str, Any] = {
        "tenant_id": rng.choice([TENANT, "", 5, None, _text(rng)]),
        "request_id": rng.choice([f"req_{rng.getrandbits(96):024x}", "", None, _text(rng)]),
        "approver_id": _text(rng),
        "decision": rng.choice(["approve", "reject", "maybe", None]),
        "signature": _text(rng),
        "approval_id": _text(rng),
        "expires_at": rng.choice([0, 2**62, "soon", None]),
    }
    expiry = rng.random() < 0.2
    if expiry:
        doc["type"] = EXPIRY_CHECK
    raw = orjson.dumps(doc)
    checks = expiry and all(isinstance(doc[k], str) and doc[k] for k in ("tenant_id", "request_id"))
    return raw, checks


def _position(m: Message) -> tuple[int, int]:
    return m.partition(), m.offset()


def _source(m: Message) -> tuple[str, tuple[int, int]]:
    headers = dict(m.headers() or [])
    topic = headers["toolsentry.source.topic"]
    part = headers["toolsentry.source.partition"]
    off = headers["toolsentry.source.offset"]
    assert topic is not None and part is not None and off is not None
    return topic.decode(), (int(part), int(off))


def test_hostile_results_and_approvals_are_each_answered_once(
    stack_settings: Settings, tmp_path: Path
) -> None:
    settings = isolated(stack_settings, f"fuzz-results-{uuid.uuid4().hex[:6]}")
    proc = ProcessorProcess(settings, "fuzz-results-1", tmp_path).start().wait_ready()
    client = ToolsentryClient(settings, TENANT, principal_token=token(settings, TENANT))
    rng = random.Random(SEED)
    try:
        # Real calls, routed and waiting for their results.
        pids = [
            client.propose("search_kb", {"query": f"q {i}", "limit": 3}, run_id=f"fz-run-{i}")
            for i in range(CALLS)
        ]
        for pid in pids:
            assert client.wait(pid, 60)["decision"] == "ROUTED"
        calls = read_all(settings, settings.topics.execution("READ_ONLY"), idle=1, expect=CALLS)
        routed = [decode_approved_call(m.value()) for m in calls]
        assert sorted(c["proposal_id"] for c in routed) == sorted(pids)

        producer = Producer(settings.client_config(**{"enable.idempotence": True}))
        readable = set()  # the real calls whose result can be read: each gets its answer
        for call in routed:
            datum = _result(rng, call)
            value = encode_result(datum)
            producer.produce(settings.topics.results, value, call["run_id"].encode())
            try:
                decode_result(value)
            except ValueError:
                continue  # e.g. a timestamp past year 9999: dead-lettered as result_invalid
            # An id longer than any call has (its trace id, here) is refused as well.
            if oversized_id(datum, _RESULT_IDS) is None:
                readable.add(call["proposal_id"])
        for _ in range(RESULTS):
            producer.produce(settings.topics.results, _result_record(rng), b"fz")
        expiry_checks = 0
        for _ in range(APPROVALS):
            raw, check = _approval_record(rng)
            expiry_checks += check
            producer.produce(settings.topics.approvals, raw, b"fz")
        assert producer.flush(60) == 0
        sentinel = client.propose("search_kb", {"query": "after", "limit": 3}, run_id="fz-after")
        assert client.wait(sentinel, 180)["decision"] == "ROUTED"

        results = read_all(settings, settings.topics.results, idle=1)
        approvals = read_all(settings, settings.topics.approvals, idle=1)
        assert (len(results), len(approvals)) == (CALLS + RESULTS, APPROVALS)
        dead = read_all(settings, settings.topics.dlq, idle=2)
        sources = Counter(_source(m) for m in dead)
        assert max(sources.values()) == 1, "a record dead-lettered twice"
        reasons = Counter(
            (_source(m)[0], (dict(m.headers() or [])["toolsentry.error.reason"] or b"").decode())
            for m in dead
        )
        assert {r for t, r in reasons if t == settings.topics.results} <= RESULT_REASONS, reasons
        assert {r for t, r in reasons if t == settings.topics.approvals} <= APPROVAL_REASONS, (
            reasons
        )

        # Every result: the DLQ, or its call's one final observation.
        finals: Counter[str] = Counter()
        final_sources = set()
        for m in read_all(settings, settings.topics.observations, idle=2):
            obs = codec("observation").decode(m.value())
            if obs["decision"] in ("COMPLETED", "FAILED"):
                finals[obs["proposal_id"]] += 1
                meta = obs["execution_metadata"]
                final_sources.add((meta["source_partition"], meta["source_offset"]))
        # A real call's result that cannot be read is dead-lettered like any other; the call
        # then stays in flight until its deadline.
        assert finals == Counter(readable)
        assert len(readable) >= CALLS // 3, readable
        result_positions = {_position(m) for m in results}
        dead_results = {pos for t, pos in sources if t == settings.topics.results}
        assert not dead_results & final_sources
        assert dead_results | final_sources == result_positions

        # Every approval: the DLQ, except expiry checks, which may change nothing.
        dead_approvals = {pos for t, pos in sources if t == settings.topics.approvals}
        assert len(dead_approvals) == APPROVALS - expiry_checks

        assert proc.alive()
        log = proc.log()
        assert "could not be decided" not in log and "Traceback" not in log, log[-3000:]
    finally:
        client.close()
        proc.terminate()
