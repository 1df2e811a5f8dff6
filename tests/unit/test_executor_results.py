"""What an executor publishes when an answer does not fit in a Kafka record: the call
ran, so what it committed stays known and only the part that does not fit is left out."""

from __future__ import annotations

import time

from processor.codec.records import decode_result
from processor.config import Settings
from processor.executor import FAILED, SUCCEEDED, Call, Executor, Failed, ReferenceUpdate, Succeeded


def _call() -> Call:
    return Call(
        call_id="c-1", proposal_id="p-1", run_id="r-1", tenant_id="acme", trace_id="t" * 32,
        tool_name="refund_order", tool_version="1.0.0", side_effect_class="CRITICAL_MUTATION",
        arguments={}, payload_hash="sha256:00", idempotency_key="k-1",
        deadline_ms=int(time.time() * 1000) + 60_000, attempt=1, approval_ids=(),
        created_at_ms=0, contract_set=None,
    )  # fmt: skip


def test_a_too_large_failure_keeps_its_committed_steps_and_compensation() -> None:
    ex = Executor(Settings(), {}, executor_id="unit")
    failed = Failed(
        "ledger_failed",
        "m" * 2_000_000,
        committed_steps=("refund_issued",),
        compensation_arguments={"refund_id": "RF-1"},
    )
    out = ex._published(_call(), failed, FAILED, 0)
    assert len(out.value) <= ex.max_result_bytes
    r = decode_result(out.value)
    assert (r["error_code"], r["taxonomy_class"]) == (
        "result_too_large",
        "OBSERVATION_NORMALIZATION_FAIL",
    )
    assert r["committed_steps"] == ["refund_issued"]
    assert r["compensation_arguments"] == '{"refund_id":"RF-1"}'


def test_a_too_large_success_keeps_the_reference_updates_that_fit() -> None:
    ex = Executor(Settings(), {}, executor_id="unit")
    small = ReferenceUpdate("order", "WO-1", "refunded")
    big = ReferenceUpdate("order", "WO-2", "refunded", attributes={"log": "x" * 2_000_000})
    answer = Succeeded({"report": "y" * 2_000_000}, (small, big))
    out = ex._published(_call(), answer, SUCCEEDED, 0)
    r = decode_result(out.value)
    assert (r["outcome"], r["error_code"]) == ("FAILED", "result_too_large")
    assert "the call ran" in r["error_message"] and r["data"] is None
    assert out.references == [(small.key("acme"), small.value())]


def test_an_answer_that_fits_is_published_as_given() -> None:
    ex = Executor(Settings(), {}, executor_id="unit")
    answer = Succeeded({"ok": True}, (ReferenceUpdate("order", "WO-1", "refunded"),))
    out = ex._published(_call(), answer, SUCCEEDED, 0)
    assert decode_result(out.value)["outcome"] == "SUCCEEDED"
    assert len(out.references) == 1


def test_a_failure_publishes_the_reference_updates_of_the_steps_it_committed() -> None:
    ex = Executor(Settings(), {}, executor_id="unit")
    cancelled = ReferenceUpdate("order", "WO-1", "cancelled", "CUS-1")
    failed = Failed(
        "notify_failed",
        "the order was cancelled, then the customer could not be notified",
        committed_steps=("order_cancelled",),
        references=(cancelled,),
    )
    out = ex._published(_call(), failed, FAILED, 0)
    assert decode_result(out.value)["committed_steps"] == ["order_cancelled"]
    assert out.references == [(b"acme/order/WO-1", cancelled.value())]
