"""A held failure delivered again, through the processor's own paths (``Processor._admit``
holds it, ``Processor._redelivered`` writes it back on ``tool.results``) against a real
redis-server and a real Redis Cluster."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from processor.app import REDELIVERY_OF, Processor
from processor.codec.records import encode_result
from processor.config import Settings
from processor.metrics import Metrics
from processor.model import Decision, Outcome, SourceRecord
from processor.results import ResultInput, parse_result
from processor.state.admission import withdraw_item
from tests.integration.test_admission import NOW, TENANT, call
from tests.unit.helpers import CONTRACTS_DIR

pytestmark = pytest.mark.integration

LIMITS = {"sig": "cancel", "group": "write", "class_budget": 5, "tool": "cancel_order"}


@pytest.fixture
def processor(redis_backend: str) -> Iterator[Processor]:
    settings = Settings(contracts_dir=CONTRACTS_DIR, policy_file=None, metrics_port=0,
                        redis_url=redis_backend,
                        redis_namespace=f"again-{uuid.uuid4().hex[:8]}")  # fmt: skip
    yield Processor(settings, metrics=Metrics(CollectorRegistry()))


_offsets = iter(range(10**9))


def _late_failure(
    p: Processor, first: dict[str, Any], message: str
) -> tuple[Decision, SourceRecord]:
    """The first attempt's result, read while a later attempt is in flight: it cancelled the
    order, then failed (its error message as long as ``message``). Its decision, and its
    record."""
    datum = {
        "result_id": uuid.uuid4().hex, "call_id": first["call"], "proposal_id": first["call"],
        "run_id": first["run"], "tenant_id": TENANT, "trace_id": "t-1",
        "tool_name": "cancel_order", "tool_version": "1.0.0",
        "side_effect_class": "HIGH_RISK_EXTERNAL", "idempotency_key": first["ikey"],
        "payload_hash": first["hash"], "attempt": 1, "outcome": "FAILED", "retryable": False,
        "error_code": "notify_failed", "error_message": message,
        "taxonomy_class": None, "committed_steps": ["order_cancelled"], "data": None,
        "compensation_arguments": orjson.dumps({"order_id": "WO-1"}).decode(),
        "started_at": NOW - 20, "finished_at": NOW, "executor_id": "exec-1",
        "contract_set": None,
    }  # fmt: skip
    src = SourceRecord("tool.results", 0, next(_offsets), b"run-1", encode_result(datum), NOW)
    res = parse_result(src, p.contracts)
    assert isinstance(res, ResultInput), res
    [d] = p._admit([res], NOW)
    assert isinstance(d, Decision)
    return d, src


@pytest.mark.parametrize("size", ["fits", "too_large"])
def test_a_held_failure_is_delivered_again_only_as_a_record_the_processor_can_write(
    processor: Processor, size: str
) -> None:
    """The first attempt's failure after a committed step is held for the second, which is
    then given back without running (withdrawn on a replay). Its record goes back on
    tool.results as it came. An executor may write a larger record than the processor's
    producer takes (its own message.max.bytes, the topic's): written back, it would fail
    every transaction that carried it, and the batch would be aborted and decided again
    for ever. Such a failure is held as before, with no record kept to deliver again."""
    p = processor
    first = call(deadline=NOW + 8000, **LIMITS)[1]
    second = call(ikey=first["ikey"], call=first["call"], now=NOW + 9001,
                  deadline=NOW + 600_000, **LIMITS)[1]  # fmt: skip
    assert p.admission.apply([(TENANT, first)]) == [{"ok": True, "attempt": 1}]
    assert p.admission.apply([(TENANT, second)]) == [{"ok": True, "attempt": 2}]
    message = "cancelled, but nobody was told; " * (1 if size == "fits" else 31_200)
    held, src = _late_failure(p, first, message)
    assert (held.outcome, held.dlq_reason) == (Outcome.DEAD_LETTER, "result_held_for_later_attempt")
    withdrawn = withdraw_item(TENANT, second["pos"], second["run"], NOW + 10_000)
    assert p.admission.apply([withdrawn]) == [{"status": "withdrawn"}]
    again = p._redelivered()
    assert all(len(key or b"") + len(v) <= p._max_message_bytes for _, key, v, _ in again)
    if size == "fits":
        of = f"{src.topic}/{src.partition}/{src.offset}".encode()
        assert again == [("tool.results", src.key, src.value, [(REDELIVERY_OF, of)])]
    else:
        assert len(src.value or b"") > p._max_message_bytes
        assert again == []
