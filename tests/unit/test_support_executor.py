"""The reference support executor's tools against a real SQLite file: lookups, business
refusals with their taxonomy classes, idempotent replay by key, failure after a commit."""

from __future__ import annotations

import contextlib
import hashlib
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from processor.executor import Call, Failed, ReferenceUpdate, Succeeded
from processor.support_executor import SupportStore, demo_orders, seed

TENANT = "acme"
ORDERS: list[tuple[str, dict[str, Any] | None]] = [
    ("acme/order/WO-12345-A", {"state": "processing", "owner": "CUS-004211"}),
    (
        "acme/order/WO-24680-B",
        {
            "state": "delivered",
            "owner": "CUS-004211",
            "attributes": {"amount": 59.90, "currency": "USD", "placed_on": "2026-11-18"},
        },
    ),
    ("acme/order/WO-55555-B", {"state": "shipped", "owner": "CUS-004211"}),
    ("other/order/WO-77777-C", {"state": "processing", "owner": "CUS-000001"}),
    ("acme/customer/CUS-004211", {"state": "active"}),
    ("acme/order/WO-00000-Z", None),
]


def make_call(tool: str, arguments: dict[str, Any], key: str | None = None, **kw: Any) -> Call:
    canonical = orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS)
    fields: dict[str, Any] = {
        "call_id": uuid.uuid4().hex,
        "proposal_id": uuid.uuid4().hex,
        "run_id": "run-1",
        "tenant_id": TENANT,
        "trace_id": "trace-1",
        "tool_name": tool,
        "tool_version": "1.0.0",
        "side_effect_class": "HIGH_RISK_EXTERNAL",
        "arguments": arguments,
        "payload_hash": "sha256:" + hashlib.sha256(canonical).hexdigest(),
        "idempotency_key": key or uuid.uuid4().hex,
        "deadline_ms": 2**62,
        "attempt": 1,
        "approval_ids": (),
        "created_at_ms": 0,
        "contract_set": None,
    }
    fields.update(kw)
    return Call(**fields)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "support.db"


@pytest.fixture
def store(db_path: Path) -> Iterator[SupportStore]:
    s = SupportStore(db_path)
    s.seed(ORDERS)
    yield s
    s.close()


def cancel(order_id: str, key: str | None = None) -> Call:
    args = {"order_id": order_id, "reason_code": "customer_request", "confirm": True}
    return make_call("cancel_order", args, key)


def refund(order_id: str, amount: float, key: str | None = None, currency: str = "USD") -> Call:
    args = {"order_id": order_id, "amount": amount, "currency": currency, "reason_code": "damaged"}
    return make_call("refund_order", args, key, side_effect_class="CRITICAL_MUTATION")


def row(store: SupportStore, order_id: str, tenant: str = TENANT) -> dict[str, Any]:
    order = store.order(tenant, order_id)
    assert order is not None, order_id
    return order


def failed(answer: Succeeded | Failed) -> Failed:
    assert isinstance(answer, Failed), answer
    return answer


def succeeded(answer: Succeeded | Failed) -> Succeeded:
    assert isinstance(answer, Succeeded), answer
    return answer


def test_seed_takes_the_reference_records_and_keeps_newer_store_state(store: SupportStore) -> None:
    order = row(store, "WO-24680-B")
    assert (order["status"], order["amount_cents"], order["placed_on"]) == (
        "delivered",
        5990,
        "2026-11-18",
    )
    default = row(store, "WO-12345-A")
    assert (default["amount_cents"], default["currency"]) == (10000, "USD")
    assert store.order(TENANT, "CUS-004211") is None  # not an order
    succeeded(store.cancel_order(cancel("WO-12345-A")))
    assert store.seed(ORDERS) == 0  # seeding again does not revive the cancelled order
    assert row(store, "WO-12345-A")["status"] == "cancelled"


def test_demo_orders_are_what_the_demo_publishes(db_path: Path) -> None:
    SupportStore(db_path).close()
    with contextlib.closing(sqlite3.connect(db_path, isolation_level=None)) as db:
        assert seed(db, demo_orders("acme")) == 4
        rows = db.execute("SELECT tenant, order_id, status FROM orders ORDER BY 1, 2").fetchall()
    assert rows == [
        ("acme", "WO-12345-A", "processing"),
        ("acme", "WO-24680-B", "delivered"),
        ("acme", "WO-55555-B", "shipped"),
        ("other-acme", "WO-77777-C", "processing"),
    ]


def test_lookup_by_id_customer_and_dates(store: SupportStore) -> None:
    by_id = succeeded(store.lookup_order(make_call("lookup_order", {"order_id": "WO-12345-A"})))
    assert by_id.data["match_count"] == 1
    assert by_id.data["orders"][0]["status"] == "processing"
    assert by_id.data["next_action"] is None
    mine = succeeded(
        store.lookup_order(make_call("lookup_order", {"customer_id": "CUS-004211", "limit": 2}))
    )
    assert mine.data["match_count"] == 3 and len(mine.data["orders"]) == 2
    week = {"customer_id": "CUS-004211", "date_from": "2026-11-16", "date_to": "2026-11-22"}
    dated = succeeded(store.lookup_order(make_call("lookup_order", week)))
    assert [o["order_id"] for o in dated.data["orders"]] == ["WO-24680-B"]
    other = succeeded(store.lookup_order(make_call("lookup_order", {"order_id": "WO-77777-C"})))
    assert other.data["match_count"] == 0  # another tenant's order is invisible
    assert "never construct" in other.data["next_action"].lower()


CANCELLED = ReferenceUpdate(
    "order",
    "WO-12345-A",
    "cancelled",
    "CUS-004211",
    {"amount": 100.0, "currency": "USD", "refunded_amount": 0.0},
)
"""WO-12345-A as tool.reference shows it once cancelled."""


def test_cancel_then_refusals(store: SupportStore) -> None:
    done = succeeded(store.cancel_order(cancel("WO-12345-A")))
    assert done.data == {"order_id": "WO-12345-A", "status": "cancelled"}
    assert done.references == (CANCELLED,)
    assert done.references[0].key(TENANT) == b"acme/order/WO-12345-A"
    shipped = failed(store.cancel_order(cancel("WO-55555-B")))
    assert (shipped.code, shipped.taxonomy_class) == ("order_not_cancellable", "STALE_STATE")
    assert "shipped" in shipped.message
    again = failed(store.cancel_order(cancel("WO-12345-A")))  # a new call, a new key
    assert (again.code, again.taxonomy_class) == ("already_cancelled", "STALE_STATE")
    unknown = failed(store.cancel_order(cancel("WO-99999-Z")))
    assert unknown.taxonomy_class == "SEMANTIC_INVALIDITY"
    foreign = failed(store.cancel_order(cancel("WO-77777-C")))
    assert foreign.taxonomy_class == "SEMANTIC_INVALIDITY"
    assert row(store, "WO-77777-C", "other")["status"] == "processing"


def test_refund_bounds(store: SupportStore) -> None:
    not_yet = failed(store.refund_order(refund("WO-12345-A", 10)))
    assert (not_yet.code, not_yet.taxonomy_class) == ("order_not_refundable", "STALE_STATE")
    first = succeeded(store.refund_order(refund("WO-24680-B", 19.99)))
    assert first.data["status"] == "settled" and first.data["refund_id"].startswith("RF-")
    assert first.references[0].attributes == {
        "amount": 59.9,
        "currency": "USD",
        "refunded_amount": 19.99,
    }
    too_much = failed(store.refund_order(refund("WO-24680-B", 39.92)))
    assert (too_much.code, too_much.taxonomy_class) == (
        "refund_exceeds_refundable",
        "OUT_OF_BOUNDS",
    )
    assert "39.91 USD" in too_much.message
    wrong = failed(store.refund_order(refund("WO-24680-B", 1, currency="EUR")))
    assert wrong.taxonomy_class == "OUT_OF_BOUNDS"
    succeeded(store.refund_order(refund("WO-24680-B", 39.91)))  # exactly the rest
    balance = succeeded(
        store.account_balance(
            make_call("account_balance", {"customer_id": "CUS-004211", "order_id": "WO-24680-B"})
        )
    )
    assert balance.data["refundable_amount"] == 0.0


def test_a_replayed_key_returns_the_stored_answer_and_changes_nothing(
    store: SupportStore,
) -> None:
    call = refund("WO-24680-B", 10, key="idem-1")
    first = succeeded(store.refund_order(call))
    again = succeeded(store.refund_order(call))
    assert again.data == first.data
    assert row(store, "WO-24680-B")["refunded_cents"] == 1000
    assert store.db.execute("SELECT count(*) FROM refunds").fetchone()[0] == 1
    # A stored refusal is replayed too, even though the state has changed since.
    shipped = cancel("WO-55555-B", key="idem-2")
    failed(store.cancel_order(shipped))
    store.db.execute("UPDATE orders SET status = 'processing' WHERE order_id = 'WO-55555-B'")
    assert failed(store.cancel_order(shipped)).code == "order_not_cancellable"
    # The same key for other arguments is refused, never answered with the first result.
    reused = failed(store.refund_order(refund("WO-24680-B", 20, key="idem-1")))
    assert (reused.code, reused.taxonomy_class) == ("idempotency_key_reused", "SIGNATURE_MISMATCH")
    assert row(store, "WO-24680-B")["refunded_cents"] == 1000


def test_replayed_references_are_the_current_state(store: SupportStore) -> None:
    """A redelivered cancel must not republish stale attributes over a later refund."""
    call = cancel("WO-12345-A", key="idem-c")
    succeeded(store.cancel_order(call))
    succeeded(store.refund_order(refund("WO-12345-A", 5)))
    replay = succeeded(store.cancel_order(call))
    assert replay.references[0].attributes["refunded_amount"] == 5.0


def test_idempotency_keys_are_per_tenant(store: SupportStore) -> None:
    store.seed([("other/order/WO-24680-B", {"state": "delivered", "owner": "CUS-000001"})])
    mine = succeeded(store.refund_order(refund("WO-24680-B", 10, key="shared")))
    theirs = refund("WO-24680-B", 10, key="shared")
    theirs = Call(**{**theirs.__dict__, "tenant_id": "other"})
    other = succeeded(store.refund_order(theirs))
    assert other.data["refund_id"] != mine.data["refund_id"]
    assert row(store, "WO-24680-B", "other")["refunded_cents"] == 1000


def test_fail_after_commit(db_path: Path) -> None:
    store = SupportStore(db_path, fail_after_commit={"refund_order", "cancel_order"})
    store.seed(ORDERS)
    call = refund("WO-24680-B", 12.5, key="idem-f")
    answer = failed(store.refund_order(call))
    assert answer.code == "failed_after_commit"
    assert answer.taxonomy_class == "COMPENSATION_REQUIRED"
    assert answer.committed_steps == ("refund_issued",)
    assert answer.compensation_arguments is not None
    assert answer.compensation_arguments["amount"] == 12.5
    assert answer.compensation_arguments["order_id"] == "WO-24680-B"
    assert answer.compensation_arguments["refund_id"].startswith("RF-")
    assert row(store, "WO-24680-B")["refunded_cents"] == 1250
    assert failed(store.refund_order(call)) == answer  # replayed, not refunded twice
    assert row(store, "WO-24680-B")["refunded_cents"] == 1250
    cancelled = failed(store.cancel_order(cancel("WO-12345-A")))
    assert cancelled.committed_steps == ("order_cancelled",)
    assert row(store, "WO-12345-A")["status"] == "cancelled"
    store.close()
    with pytest.raises(ValueError, match="lookup_order"):
        SupportStore(db_path, fail_after_commit={"lookup_order"})


def test_a_failure_after_a_commit_publishes_the_state_it_committed(db_path: Path) -> None:
    """The cancel or the refund stands although the call failed: tool.reference must show
    it, or the gates decide the next proposal against the order as it was before."""
    store = SupportStore(db_path, fail_after_commit={"refund_order", "cancel_order"})
    store.seed(ORDERS)
    cancelled = failed(store.cancel_order(cancel("WO-12345-A")))
    assert cancelled.references == (CANCELLED,)
    call = refund("WO-24680-B", 12.5, key="idem-r")
    [ref] = failed(store.refund_order(call)).references
    assert (ref.entity_id, ref.state) == ("WO-24680-B", "delivered")
    assert ref.attributes is not None and ref.attributes["refunded_amount"] == 12.5
    # Replayed or recorded, the failure carries the order as it is now, not as it was.
    store.db.execute("UPDATE orders SET status = 'returned' WHERE order_id = 'WO-24680-B'")
    assert [r.state for r in failed(store.refund_order(call)).references] == ["returned"]
    recorded = store.recorded(call)
    assert isinstance(recorded, Failed)
    assert [r.state for r in recorded.references] == ["returned"]
    # A refusal commits nothing and publishes nothing.
    assert failed(store.cancel_order(cancel("WO-55555-B"))).references == ()
    store.close()


def test_a_ticket_that_failed_after_its_insert_is_finished_by_the_retry(db_path: Path) -> None:
    """create_ticket is an idempotent write: the model is told PARTIAL_SUCCESS and to
    retry the same key, and that retry completes, without a second ticket."""
    store = SupportStore(db_path, fail_after_commit={"create_ticket"})
    store.seed(ORDERS)
    args = {"customer_id": "CUS-004211", "category": "delivery", "priority": "normal",
            "summary": "Parcel arrived crushed."}  # fmt: skip
    call = make_call("create_ticket", args, key="idem-partial")
    first = failed(store.create_ticket(call))
    assert first.committed_steps == ("ticket_created",)
    assert "retry the same call" in first.message
    done = succeeded(store.create_ticket(call))
    assert first.compensation_arguments is not None
    assert done.data == {"ticket_id": first.compensation_arguments["ticket_id"]}
    assert succeeded(store.create_ticket(call)).data == done.data  # and stays done
    assert store.recorded(call) == done
    assert store.db.execute("SELECT count(*) FROM tickets").fetchone()[0] == 1
    store.close()


def test_a_store_held_by_another_writer_answers_retryable_and_nothing_ran(
    db_path: Path,
) -> None:
    store = SupportStore(db_path)
    store.seed(ORDERS)
    store.db.execute("PRAGMA busy_timeout = 50")
    other = sqlite3.connect(db_path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # holds the write lock
    call = cancel("WO-12345-A", key="idem-busy")
    busy = failed(store.cancel_order(call))
    assert (busy.code, busy.retryable, busy.taxonomy_class) == (
        "store_busy",
        True,
        "DEPENDENCY_UNAVAILABLE",
    )
    assert not store.db.in_transaction
    other.execute("ROLLBACK")
    other.close()
    assert row(store, "WO-12345-A")["status"] != "cancelled"
    assert store.recorded(call) is None  # nothing ran: the retry runs it
    succeeded(store.cancel_order(call))
    assert row(store, "WO-12345-A")["status"] == "cancelled"
    store.close()


def test_search_kb_and_tickets(store: SupportStore) -> None:
    found = succeeded(
        store.search_kb(make_call("search_kb", {"query": "how do I return a damaged item"}))
    )
    assert found.data["results"][0]["article_id"] == "KB-0001"
    assert found.data["next_action"] is None
    nothing = succeeded(store.search_kb(make_call("search_kb", {"query": "xylophone"})))
    assert nothing.data["match_count"] == 0 and nothing.data["next_action"]
    args = {
        "customer_id": "CUS-004211",
        "order_id": "WO-12345-A",
        "category": "delivery",
        "priority": "normal",
        "summary": "Parcel arrived crushed; customer wants a replacement.",
    }
    call = make_call("create_ticket", args, key="idem-t")
    ticket = succeeded(store.create_ticket(call))
    assert succeeded(store.create_ticket(call)).data == ticket.data
    assert store.db.execute("SELECT count(*) FROM tickets").fetchone()[0] == 1
    bad = failed(store.create_ticket(make_call("create_ticket", {**args, "order_id": "WO-1-X"})))
    assert bad.taxonomy_class == "SEMANTIC_INVALIDITY"
    assert store.db.execute("SELECT count(*) FROM tickets").fetchone()[0] == 1


@pytest.mark.parametrize("amount", [-5, 0, 0.004])
def test_a_refund_of_nothing_or_less_is_refused_and_changes_nothing(
    store: SupportStore, amount: float
) -> None:
    """The contract refuses such an amount, but the store keeps its own bound as it keeps
    the refundable one: a negative refund would lower what was refunded, and the next
    refunds could then pay out more than the order was worth."""
    refused = failed(store.refund_order(refund("WO-24680-B", amount)))
    assert (refused.code, refused.taxonomy_class) == ("refund_amount_invalid", "OUT_OF_BOUNDS")
    assert row(store, "WO-24680-B")["refunded_cents"] == 0
    assert store.db.execute("SELECT count(*) FROM refunds").fetchone()[0] == 0
    assert failed(store.refund_order(refund("WO-24680-B", 60))).code == "refund_exceeds_refundable"
