"""What an executor publishes when an answer does not fit in a Kafka record, or cannot be
serialised at all: the call ran, so what it committed stays known and only the part that
cannot be carried is left out."""

from __future__ import annotations

import time
from dataclasses import replace
from decimal import Decimal
from typing import Any

import orjson
import pytest

from processor import executor as executor_module
from processor.codec.records import decode_result
from processor.config import Settings
from processor.contracts.registry import ContractSet
from processor.executor import FAILED, SUCCEEDED, Call, Executor, Failed, ReferenceUpdate, Succeeded
from processor.model import TaxonomyClass
from processor.results import ResultInput, parse_result, wants_compensation
from tests.unit.helpers import record


def _call(tool: str = "refund_order", version: str = "1.0.0") -> Call:
    return Call(
        call_id="c-1", proposal_id="c-1", run_id="r-1", tenant_id="acme", trace_id="t" * 32,
        tool_name=tool, tool_version=version, side_effect_class="CRITICAL_MUTATION",
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


def _charge(contracts: ContractSet) -> Call:
    newest = contracts.versions("charge_customer_card_v2")[0]
    return _call(newest.name, newest.version)


def _settled(contracts: ContractSet, value: bytes) -> ResultInput:
    """The result as the processor reads it from tool.results."""
    got = parse_result(record(value, topic="tool.results"), contracts)
    assert isinstance(got, ResultInput), got
    return got


REFUND = {"order_id": "WO-55501-A", "amount": 12.5, "currency": "USD", "reason_code": "damaged"}


def test_a_failure_whose_compensation_cannot_be_serialised_still_asks_for_one(
    contracts: ContractSet,
) -> None:
    """The card was charged: the result must say so, so that the processor answers
    COMPENSATION_REQUIRED (an operator reverses it), not a plain refusal."""
    ex = Executor(Settings(), {}, executor_id="unit")
    charged = ReferenceUpdate("payment", "PAY-1", "captured")
    failed = Failed(
        "receipt_failed",
        "charged, but the receipt could not be stored",
        taxonomy_class="COMPENSATION_REQUIRED",
        committed_steps=("card_charged",),
        compensation_arguments={**REFUND, "amount": Decimal("12.50")},
        references=(charged,),
    )
    out = ex._published(_charge(contracts), failed, FAILED, 0)
    r = decode_result(out.value)
    assert (r["outcome"], r["error_code"]) == ("FAILED", "receipt_failed")
    assert r["committed_steps"] == ["card_charged"]
    assert r["compensation_arguments"] is None
    assert "compensation arguments could not be published" in r["error_message"]
    assert out.references == [(charged.key("acme"), charged.value())]
    item = _settled(contracts, out.value)
    rej = item.decision.rejection
    assert rej is not None and rej.taxonomy is TaxonomyClass.COMPENSATION_REQUIRED
    assert item.state == "FAILED_FINAL" and "handoff_to_human" in rej.next_action


def test_a_failure_keeps_what_does_serialise(contracts: ContractSet) -> None:
    """Only a reference update is broken: the steps, the compensation arguments and the
    other updates are published, and the compensation is proposed."""
    ex = Executor(Settings(), {}, executor_id="unit")
    good = ReferenceUpdate("payment", "PAY-1", "captured")
    bad = ReferenceUpdate("payment", "PAY-2", "captured", attributes={"tags": {"a", "b"}})
    failed = Failed("receipt_failed", "charged, but the receipt could not be stored",
                    committed_steps=("card_charged",), compensation_arguments=REFUND,
                    references=(good, bad))  # fmt: skip
    out = ex._published(_charge(contracts), failed, FAILED, 0)
    r = decode_result(out.value)
    assert r["committed_steps"] == ["card_charged"]
    assert orjson.loads(r["compensation_arguments"]) == REFUND
    assert "a reference update could not be published" in r["error_message"]
    assert out.references == [(good.key("acme"), good.value())]
    comp = wants_compensation(_settled(contracts, out.value), contracts)
    assert comp is not None and comp.arguments == REFUND


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(ReferenceUpdate("Payment", "PAY-2", "captured"), id="entity-not-lower-case"),
        pytest.param(ReferenceUpdate("payment", "PAY-2", "captured", 1.5), id="owner-a-fraction"),  # type: ignore[arg-type]
        pytest.param(ReferenceUpdate("payment", "PAY-2", 7), id="state-not-text"),  # type: ignore[arg-type]
    ],
)
def test_a_reference_update_the_loader_would_refuse_is_reported_not_published(
    contracts: ContractSet, bad: ReferenceUpdate
) -> None:
    """An update that serialises but that the reference loader refuses (or reads as the
    entity's deletion) is left out and named in the result, as one that does not
    serialise is: published, it would vanish there, or forget the entity, unseen. An
    owner that is a whole number is kept: the loader reads it as its digits."""
    ex = Executor(Settings(), {}, executor_id="unit")
    good = ReferenceUpdate("payment", "PAY-1", "captured", 4211)  # type: ignore[arg-type]
    failed = Failed("receipt_failed", "charged, but the receipt could not be stored",
                    committed_steps=("card_charged",), references=(good, bad))  # fmt: skip
    out = ex._published(_charge(contracts), failed, FAILED, 0)
    r = decode_result(out.value)
    assert "a reference update could not be published: BadReference" in r["error_message"]
    assert out.references == [(good.key("acme"), good.value())]
    ran = ex._published(_charge(contracts), Succeeded({"ok": True}, (bad,)), SUCCEEDED, 0)
    r = decode_result(ran.value)
    assert (r["outcome"], r["error_code"]) == ("FAILED", "result_unpublishable")
    assert ran.references == []


def test_a_reference_update_of_a_tenant_whose_id_holds_a_slash_is_not_published() -> None:
    """Tenant ``acme/payment``'s order WO-1 has the key ``acme/payment/order/WO-1``, which
    the loader reads as tenant acme's entity ``payment`` with the id ``order/WO-1``: it was
    published, writing another tenant's reference data."""
    ex = Executor(Settings(), {}, executor_id="unit")
    call = replace(_call(), tenant_id="acme/payment")
    ran = ex._published(
        call, Succeeded({"ok": True}, (ReferenceUpdate("order", "WO-1", "cancelled"),)),
        SUCCEEDED, 0,
    )  # fmt: skip
    r = decode_result(ran.value)
    assert (r["outcome"], r["error_code"]) == ("FAILED", "result_unpublishable")
    assert ran.references == []


STEPS = "card_charged"
BAD_TEXT = "\ud800"
"""A lone surrogate: a Python string no Avro record can carry."""


@pytest.mark.parametrize(
    ("fields", "steps"),
    [
        pytest.param({"committed_steps": (STEPS, 2)}, [STEPS, "2"], id="a-step-not-a-string"),
        pytest.param({"committed_steps": STEPS}, [STEPS], id="one-step-on-its-own"),
        pytest.param({"committed_steps": (STEPS,), "taxonomy_class": 7}, [STEPS], id="wrong-type"),
        pytest.param({"committed_steps": (STEPS,), "code": 5}, [STEPS], id="no-usable-code"),
        pytest.param(
            {"committed_steps": (STEPS + BAD_TEXT,), "message": BAD_TEXT},
            [STEPS + "?"],
            id="text-no-record-can-carry",
        ),
    ],
)
def test_committed_steps_survive_a_failure_that_cannot_be_published_as_given(
    contracts: ContractSet, fields: dict[str, Any], steps: list[str]
) -> None:
    ex = Executor(Settings(), {}, executor_id="unit")
    given: dict[str, Any] = {"code": "receipt_failed", "message": "charged", **fields}
    out = ex._published(_charge(contracts), Failed(**given), FAILED, 0)
    r = decode_result(out.value)
    assert r["outcome"] == "FAILED" and r["committed_steps"] == steps
    rej = _settled(contracts, out.value).decision.rejection
    assert rej is not None and rej.taxonomy is TaxonomyClass.COMPENSATION_REQUIRED


def test_a_success_whose_answer_cannot_be_serialised_says_the_call_ran(
    contracts: ContractSet,
) -> None:
    """Never a refusal: the call ran, and must not be run again."""
    ex = Executor(Settings(), {}, executor_id="unit")
    ref = ReferenceUpdate("payment", "PAY-1", "captured")
    answer = Succeeded({"amount": Decimal("12.50")}, (ref,))
    out = ex._published(_charge(contracts), answer, SUCCEEDED, 0)
    r = decode_result(out.value)
    assert (r["outcome"], r["error_code"], r["taxonomy_class"]) == (
        "FAILED",
        "result_unpublishable",
        "OBSERVATION_NORMALIZATION_FAIL",
    )
    assert "the call ran" in r["error_message"] and r["data"] is None
    assert out.references == [(ref.key("acme"), ref.value())]
    item = _settled(contracts, out.value)
    rej = item.decision.rejection
    assert rej is not None and rej.taxonomy is TaxonomyClass.OBSERVATION_NORMALIZATION_FAIL
    assert item.state == "FAILED_FINAL"
    assert "ran" in rej.next_action and "Do not call it again" in rej.next_action
    assert rej.allowed_tools == ("handoff_to_human",)


def test_a_reference_whose_key_alone_is_too_large_is_left_out() -> None:
    """The broker counts a record's key as it counts its value: a tombstone of an entity
    whose id is over the limit, published with the result, would fail every delivery of
    its batch, so the batch would never commit and its partition would stop."""
    ex = Executor(Settings(), {}, executor_id="unit")
    small = ReferenceUpdate("order", "WO-1", "cancelled")
    huge = ReferenceUpdate("order", "W" * 2_000_000, None)
    out = ex._published(_call(), Succeeded({"ok": True}, (small, huge)), SUCCEEDED, 0)
    assert decode_result(out.value)["error_code"] == "result_too_large"
    assert out.references == [(small.key("acme"), small.value())]
    assert all(len(k) + len(v or b"") <= ex.max_result_bytes for k, v in out.references)


@pytest.mark.parametrize(
    "steps",
    [
        pytest.param(tuple(f"item-{i}-refunded" for i in range(200_000)), id="many-steps"),
        pytest.param(("s" * 2_000_000,), id="one-huge-step"),
    ],
)
def test_committed_steps_too_large_for_a_record_are_cut_not_dropped(
    contracts: ContractSet, steps: tuple[str, ...]
) -> None:
    """Published whole, the result could never be delivered: its batch would abort and come
    back for ever. Left out, the call would pass for one that committed nothing. As many as
    fit are named, and the rest counted."""
    ex = Executor(Settings(), {}, executor_id="unit")
    failed = Failed("ledger_failed", "stopped half way", committed_steps=steps,
                    compensation_arguments={"batch": "B-1"})  # fmt: skip
    out = ex._published(_charge(contracts), failed, FAILED, 0)
    assert len(out.key) + len(out.value) <= ex.max_result_bytes
    r = decode_result(out.value)
    assert (r["outcome"], r["error_code"]) == ("FAILED", "result_too_large")
    kept = r["committed_steps"]
    assert kept[0] == steps[0][: executor_module.STEP_MAX_CHARS]
    if len(steps) > 1:
        assert kept[:-1] == list(steps[: len(kept) - 1])
        assert kept[-1].startswith(f"({len(steps) - len(kept) + 1} more steps not listed")
    rej = _settled(contracts, out.value).decision.rejection
    assert rej is not None and rej.taxonomy is TaxonomyClass.COMPENSATION_REQUIRED
