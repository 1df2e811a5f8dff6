"""A reference executor: the support agent's tools over a small SQLite store.

It runs the tools the demo agent calls (``lookup_order``, ``cancel_order``,
``refund_order``, ``search_kb``, ``create_ticket``, ``account_balance``)
against orders, refunds, tickets and knowledge-base articles kept in one
SQLite file, so the whole loop (proposal, gates, execution, result) can be
watched without a real order system.

Idempotency is the point of the example. A mutating tool writes its effect and
its answer (table ``executed``, keyed by tenant and idempotency key) in one
SQLite transaction. A call delivered again, after a crash or an aborted Kafka
transaction, finds its answer there and returns it without touching the
orders again. A key reused for a different tool or payload is refused
(``SIGNATURE_MISMATCH``), never answered with another call's result.

Business refusals are ``Failed`` results with the taxonomy class the gates
would have used had they known: an order past cancelling is ``STALE_STATE``,
a refund above what is refundable ``OUT_OF_BOUNDS``, an order that does not
exist ``SEMANTIC_INVALIDITY``. Reference data can lag behind the store, so
these checks are repeated here.

``fail_after_commit`` names tools that commit their step and then report a
failure with that step, the arguments to undo it and the order as the step left
it (for ``tool.reference``): the partial effect a compensation flow has to
handle, on demand, for tests and the demo.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

from processor.executor import Call, Failed, Handler, ReferenceUpdate, Succeeded

MUTATING_TOOLS = ("cancel_order", "refund_order", "create_ticket")
CANCELLABLE = ("received", "processing")
REFUNDABLE = ("delivered", "cancelled")
DEFAULT_AMOUNT_CENTS = 10_000
"""The demo publishes order states only; an order seeded without an ``amount``
attribute is worth 100.00 in its currency, enough for the demo's partial refund."""
DEFAULT_CURRENCY = "USD"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (
    tenant TEXT NOT NULL,
    order_id TEXT NOT NULL,
    customer_id TEXT,
    status TEXT NOT NULL,
    amount_cents INTEGER NOT NULL,
    currency TEXT NOT NULL,
    refunded_cents INTEGER NOT NULL DEFAULT 0,
    placed_on TEXT,
    PRIMARY KEY (tenant, order_id)
);
CREATE TABLE IF NOT EXISTS refunds (
    refund_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    order_id TEXT NOT NULL,
    amount_cents INTEGER NOT NULL,
    currency TEXT NOT NULL,
    reason_code TEXT NOT NULL,
    status TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS tickets (
    ticket_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    customer_id TEXT NOT NULL,
    order_id TEXT,
    category TEXT NOT NULL,
    priority TEXT NOT NULL,
    summary TEXT NOT NULL,
    tags TEXT NOT NULL,
    created_at_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS kb_articles (
    article_id TEXT PRIMARY KEY,
    locale TEXT NOT NULL,
    title TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS executed (
    tenant TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    tool_name TEXT NOT NULL,
    payload_hash TEXT NOT NULL,
    outcome TEXT NOT NULL,
    PRIMARY KEY (tenant, idempotency_key)
);
"""

KB_ARTICLES = (
    ("KB-0001", "en-GB", "Returning a damaged item",
     "If an item arrived damaged, start a return within 30 days; we collect it and refund "
     "or replace it. Keep the packaging until the courier has collected the parcel."),
    ("KB-0002", "en-GB", "Cancelling an order",
     "An order can be cancelled until it ships. Once shipped, wait for delivery and start a "
     "return instead."),
    ("KB-0003", "en-GB", "When will my refund arrive",
     "Refunds go back to the original payment method and arrive within 5 to 10 working days."),
    ("KB-0004", "en-US", "Tracking a delivery",
     "Use the tracking link in the shipping email; deliveries usually arrive in 2 to 4 days."),
    ("KB-0005", "en-US", "Changing the delivery address",
     "The delivery address can be changed while the order is received or processing."),
)  # fmt: skip
"""The knowledge base every store starts with."""

Order = dict[str, Any]


class _Refusal(Exception):
    """A business refusal inside a store transaction: the answer is stored, the effect not."""

    def __init__(self, failed: Failed) -> None:
        super().__init__(failed.code)
        self.failed = failed


def _refuse(code: str, message: str, taxonomy_class: str, retryable: bool = False) -> _Refusal:
    return _Refusal(Failed(code, message, retryable, taxonomy_class))


class SupportStore:
    """The support tools over one SQLite file. ``handlers()`` is what an Executor takes."""

    def __init__(
        self,
        path: str | Path,
        fail_after_commit: Iterable[str] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.fail_after_commit = frozenset(fail_after_commit)
        unknown = sorted(self.fail_after_commit - set(MUTATING_TOOLS))
        if unknown:
            raise ValueError(
                f"fail_after_commit: {', '.join(unknown)} (one of {', '.join(MUTATING_TOOLS)})"
            )
        self.clock = clock
        # Autocommit mode: every transaction is an explicit BEGIN IMMEDIATE, so two
        # executors sharing the file serialise their writes instead of failing to upgrade.
        # Built in one thread, used by the executor's: one thread at a time uses it.
        self.db = sqlite3.connect(path, isolation_level=None, timeout=30, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.executescript(_SCHEMA)
        self.db.executemany("INSERT OR IGNORE INTO kb_articles VALUES (?, ?, ?, ?)", KB_ARTICLES)

    def close(self) -> None:
        self.db.close()

    def handlers(self) -> dict[str, Handler]:
        return {
            "lookup_order": self.lookup_order,
            "account_balance": self.account_balance,
            "search_kb": self.search_kb,
            "cancel_order": self.cancel_order,
            "refund_order": self.refund_order,
            "create_ticket": self.create_ticket,
        }

    def seed(self, entities: Iterable[tuple[str, dict[str, Any] | None]]) -> int:
        """See ``seed``."""
        return seed(self.db, entities)

    def order(self, tenant: str, order_id: str) -> Order | None:
        row = self.db.execute(
            "SELECT * FROM orders WHERE tenant = ? AND order_id = ?", (tenant, order_id)
        ).fetchone()
        return None if row is None else dict(row)

    # -- read-only tools: no stored answer, always today's state -----------------------------

    def lookup_order(self, call: Call) -> Succeeded | Failed:
        a = call.arguments
        where, params = ["tenant = ?"], [call.tenant_id]
        for arg, clause in (
            ("order_id", "order_id = ?"),
            ("customer_id", "customer_id = ?"),
            ("date_from", "placed_on >= ?"),
            ("date_to", "placed_on <= ?"),
        ):
            if arg in a:
                where.append(clause)
                params.append(a[arg])
        rows = self.db.execute(
            f"SELECT * FROM orders WHERE {' AND '.join(where)} ORDER BY placed_on DESC, order_id",
            params,
        ).fetchall()
        orders = [_order_view(dict(r)) for r in rows[: int(a.get("limit", 10))]]
        next_action = None if rows else (
            "No order matches; ask the customer for the work order id. Never construct one."
        )  # fmt: skip
        return Succeeded({"orders": orders, "match_count": len(rows), "next_action": next_action})

    def account_balance(self, call: Call) -> Succeeded | Failed:
        a = call.arguments
        customer = a["customer_id"]
        rows = [
            dict(r)
            for r in self.db.execute(
                "SELECT * FROM orders WHERE tenant = ? AND customer_id = ?",
                (call.tenant_id, customer),
            )
        ]
        if "order_id" in a:
            rows = [r for r in rows if r["order_id"] == a["order_id"]]
            if not rows:
                return Failed(
                    "order_not_found",
                    f"customer {customer} has no order {a['order_id']}; call lookup_order",
                    taxonomy_class="SEMANTIC_INVALIDITY",
                )
        if not rows:
            return Failed(
                "customer_not_found",
                f"no orders for customer {customer}; call lookup_customer",
                taxonomy_class="SEMANTIC_INVALIDITY",
            )
        currencies = {r["currency"] for r in rows}
        if len(currencies) > 1:
            return Failed(
                "mixed_currencies",
                "the account holds orders in several currencies; pass order_id",
                taxonomy_class="OUT_OF_BOUNDS",
            )
        return Succeeded(
            {
                "customer_id": customer,
                "order_id": a.get("order_id"),
                "currency": currencies.pop(),
                "open_invoice_ids": [],
                "amount_due": 0.0,
                "credit_balance": 0.0,
                "refundable_amount": sum(_refundable_cents(r) for r in rows) / 100,
            }
        )

    def search_kb(self, call: Call) -> Succeeded | Failed:
        a = call.arguments
        words = {w for w in re.findall(r"[a-z0-9]+", a["query"].lower()) if len(w) > 2}
        scored = []
        for r in self.db.execute("SELECT * FROM kb_articles ORDER BY article_id"):
            if "locale" in a and r["locale"] != a["locale"]:
                continue
            text = set(re.findall(r"[a-z0-9]+", f"{r['title']} {r['body']}".lower()))
            score = len(words & text)
            if score:
                scored.append((score, dict(r)))
        scored.sort(key=lambda s: -s[0])
        results = [
            {"article_id": r["article_id"], "title": r["title"], "locale": r["locale"],
             "snippet": r["body"][:160], "score": score}
            for score, r in scored[: int(a.get("limit", 5))]
        ]  # fmt: skip
        next_action = None if results else (
            "Nothing matches; ask the customer to describe the problem differently "
            "instead of repeating the search."
        )  # fmt: skip
        return Succeeded(
            {"results": results, "match_count": len(scored), "next_action": next_action}
        )

    # -- mutating tools: effect and answer in one transaction -------------------------------

    def cancel_order(self, call: Call) -> Succeeded | Failed:
        def effect(db: sqlite3.Connection) -> tuple[Succeeded | Failed, list[str]]:
            order = _existing_order(db, call)
            if order["status"] == "cancelled":
                raise _refuse(
                    "already_cancelled",
                    f"order {order['order_id']} is already cancelled",
                    "STALE_STATE",
                )
            if order["status"] not in CANCELLABLE:
                raise _refuse(
                    "order_not_cancellable",
                    f"order {order['order_id']} is already {order['status']}; it can no longer "
                    "be cancelled (call lookup_order and tell the customer its actual state)",
                    "STALE_STATE",
                )
            db.execute(
                "UPDATE orders SET status = 'cancelled' WHERE tenant = ? AND order_id = ?",
                (call.tenant_id, order["order_id"]),
            )
            order_id = order["order_id"]
            if "cancel_order" in self.fail_after_commit:
                # The cancel stands: the order's new state is published with the failure.
                return _failed_after_commit("order_cancelled", {"order_id": order_id}), [order_id]
            return Succeeded({"order_id": order_id, "status": "cancelled"}), [order_id]

        return self._once(call, effect)

    def refund_order(self, call: Call) -> Succeeded | Failed:
        a = call.arguments
        cents = round(float(a["amount"]) * 100)

        def effect(db: sqlite3.Connection) -> tuple[Succeeded | Failed, list[str]]:
            order = _existing_order(db, call)
            if order["status"] not in REFUNDABLE:
                raise _refuse(
                    "order_not_refundable",
                    f"order {order['order_id']} is {order['status']}; only delivered or "
                    "cancelled orders are refunded",
                    "STALE_STATE",
                )
            if a["currency"] != order["currency"]:
                raise _refuse(
                    "currency_mismatch",
                    f"order {order['order_id']} was paid in {order['currency']}",
                    "OUT_OF_BOUNDS",
                )
            if cents <= 0:
                # The contract refuses it, but this is the store's own bound: a negative
                # refund would lower what was refunded, and let later refunds exceed the order.
                raise _refuse(
                    "refund_amount_invalid",
                    f"a refund must be at least 0.01 {order['currency']}",
                    "OUT_OF_BOUNDS",
                )
            refundable = _refundable_cents(order)
            if cents > refundable:
                raise _refuse(
                    "refund_exceeds_refundable",
                    f"at most {refundable / 100:.2f} {order['currency']} of order "
                    f"{order['order_id']} is refundable; call account_balance",
                    "OUT_OF_BOUNDS",
                )
            refund_id = "RF-" + _digest(call)[:12].upper()
            db.execute(
                "INSERT INTO refunds VALUES (?, ?, ?, ?, ?, ?, 'settled')",
                (refund_id, call.tenant_id, order["order_id"], cents, order["currency"],
                 a["reason_code"]),
            )  # fmt: skip
            db.execute(
                "UPDATE orders SET refunded_cents = refunded_cents + ? "
                "WHERE tenant = ? AND order_id = ?",
                (cents, call.tenant_id, order["order_id"]),
            )
            if "refund_order" in self.fail_after_commit:
                undo = {"refund_id": refund_id, "order_id": order["order_id"],
                        "amount": cents / 100, "currency": order["currency"]}  # fmt: skip
                return _failed_after_commit("refund_issued", undo), [order["order_id"]]
            return Succeeded({"refund_id": refund_id, "status": "settled"}), [order["order_id"]]

        return self._once(call, effect)

    def create_ticket(self, call: Call) -> Succeeded | Failed:
        a = call.arguments

        def effect(db: sqlite3.Connection) -> tuple[Succeeded | Failed, list[str]]:
            if "order_id" in a:
                _existing_order(db, call)
            ticket_id = "TCK-" + _digest(call)[:10].upper()
            db.execute(
                "INSERT INTO tickets VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (ticket_id, call.tenant_id, a["customer_id"], a.get("order_id"), a["category"],
                 a["priority"], a["summary"], orjson.dumps(a.get("tags", [])).decode(),
                 int(self.clock() * 1000)),
            )  # fmt: skip
            if "create_ticket" in self.fail_after_commit:
                failed = _failed_after_commit("ticket_created", {"ticket_id": ticket_id})
                # create_ticket is an idempotent write: the model is told to retry, and the
                # retry finishes the rest (see resume below), never repeating the insert.
                return replace(failed, message="the ticket was created, then the tool "
                               "failed; retry the same call to finish"), []  # fmt: skip
            return Succeeded({"ticket_id": ticket_id}), []

        def resume(doc: dict[str, Any]) -> Succeeded:
            return Succeeded({"ticket_id": (doc["compensation_arguments"] or {})["ticket_id"]})

        return self._once(call, effect, resume)

    def recorded(self, call: Call) -> Succeeded | Failed | None:
        """The answer stored under the call's key, if it ran (``Executor(recorded=...)``):
        a call delivered again past its deadline is answered with it, not TIMED_OUT."""
        row = _executed(self.db, call)
        if row is None or not _same_call(row, call):
            return None
        doc = orjson.loads(row["outcome"])
        return _answer(doc, self._references(self.db, call.tenant_id, doc["touched"]))

    def _once(
        self,
        call: Call,
        effect: Callable[[sqlite3.Connection], tuple[Succeeded | Failed, list[str]]],
        resume: Callable[[dict[str, Any]], Succeeded] | None = None,
    ) -> Succeeded | Failed:
        """Run ``effect`` at most once per (tenant, idempotency key): its writes and its
        answer commit together, and a repeat gets the stored answer. The reference updates
        are rebuilt from the orders as they are now, never replayed: another call may
        have changed the order since, and the compacted topic keeps the last value.

        ``resume``, for a tool a retry finishes (an idempotent write): a repeat of a call
        that failed after committing steps completes the rest, and that answer is stored
        in place of the failure."""
        try:
            return self._once_in_transaction(call, effect, resume)
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            # Another writer held the store: rolled back, nothing ran; a retry may pass.
            return Failed("store_busy", "the store was busy and nothing ran", retryable=True,
                          taxonomy_class="DEPENDENCY_UNAVAILABLE")  # fmt: skip

    def _once_in_transaction(
        self,
        call: Call,
        effect: Callable[[sqlite3.Connection], tuple[Succeeded | Failed, list[str]]],
        resume: Callable[[dict[str, Any]], Succeeded] | None,
    ) -> Succeeded | Failed:
        with self._transaction() as db:
            stored = _executed(db, call)
            if stored is not None:
                if not _same_call(stored, call):
                    return Failed(
                        "idempotency_key_reused",
                        "this idempotency key was used for another call; nothing ran",
                        taxonomy_class="SIGNATURE_MISMATCH",
                    )
                doc = orjson.loads(stored["outcome"])
                if resume is not None and not doc["succeeded"] and doc["committed_steps"]:
                    finished = resume(doc)
                    db.execute(
                        "UPDATE executed SET outcome = ? WHERE tenant = ? AND idempotency_key = ?",
                        (orjson.dumps(_stored(finished, doc["touched"])).decode(), call.tenant_id,
                         call.idempotency_key),
                    )  # fmt: skip
                    refs = self._references(db, call.tenant_id, doc["touched"])
                    return _answer(_stored(finished, doc["touched"]), refs)
                return _answer(doc, self._references(db, call.tenant_id, doc["touched"]))
            try:
                answer, touched = effect(db)
            except _Refusal as refusal:
                answer, touched = refusal.failed, []
            doc = _stored(answer, touched)
            db.execute(
                "INSERT INTO executed VALUES (?, ?, ?, ?, ?)",
                (call.tenant_id, call.idempotency_key, call.tool_name, call.payload_hash,
                 orjson.dumps(doc).decode()),
            )  # fmt: skip
            return _answer(doc, self._references(db, call.tenant_id, touched))

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
            self.db.execute("COMMIT")
        except BaseException:
            # Also when COMMIT itself fails (busy, disk full): the transaction must not
            # stay open, or every later call would fail on it.
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise

    def _references(
        self, db: sqlite3.Connection, tenant: str, order_ids: list[str]
    ) -> tuple[ReferenceUpdate, ...]:
        out = []
        for order_id in order_ids:
            row = db.execute(
                "SELECT * FROM orders WHERE tenant = ? AND order_id = ?", (tenant, order_id)
            ).fetchone()
            if row is not None:
                out.append(order_reference(dict(row)))
        return tuple(out)


def _executed(db: sqlite3.Connection, call: Call) -> sqlite3.Row | None:
    """What ran under the call's (tenant, idempotency key), if anything did."""
    row: sqlite3.Row | None = db.execute(
        "SELECT tool_name, payload_hash, outcome FROM executed "
        "WHERE tenant = ? AND idempotency_key = ?",
        (call.tenant_id, call.idempotency_key),
    ).fetchone()
    return row


def _same_call(row: sqlite3.Row, call: Call) -> bool:
    return bool((row["tool_name"], row["payload_hash"]) == (call.tool_name, call.payload_hash))


def order_reference(order: Order) -> ReferenceUpdate:
    """The order as ``tool.reference`` holds it: state, owner, and the money the gates
    (and an agent reading ``lookup_order``) may need."""
    return ReferenceUpdate(
        "order",
        order["order_id"],
        order["status"],
        order["customer_id"],
        {
            "amount": order["amount_cents"] / 100,
            "currency": order["currency"],
            "refunded_amount": order["refunded_cents"] / 100,
        },
    )


def seed(db: sqlite3.Connection, entities: Iterable[tuple[str, dict[str, Any] | None]]) -> int:
    """Load orders from the pairs ``publish_references`` takes: ``("acme/order/WO-12345-A",
    {"state": "processing", "owner": "CUS-004211", "attributes": {...}})``, so the store
    and the gates' reference data start from the same orders. Optional attributes:
    ``amount``, ``currency``, ``refunded_amount``, ``placed_on`` (YYYY-MM-DD).

    Only orders the store does not hold yet are added: the store's own rows are newer
    than any seed (a cancelled order stays cancelled when the demo seeds again).
    Other entities and tombstones are ignored. Returns how many orders were added."""
    rows = []
    for key, value in entities:
        tenant, _, rest = key.partition("/")
        entity, _, order_id = rest.partition("/")
        if entity != "order" or not tenant or not order_id or value is None:
            continue
        attrs = value.get("attributes") or {}
        rows.append(
            (
                tenant,
                order_id,
                value.get("owner"),
                value["state"],
                round(float(attrs.get("amount", DEFAULT_AMOUNT_CENTS / 100)) * 100),
                attrs.get("currency", DEFAULT_CURRENCY),
                round(float(attrs.get("refunded_amount", 0)) * 100),
                attrs.get("placed_on"),
            )
        )
    before = db.total_changes
    db.executemany("INSERT OR IGNORE INTO orders VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
    return db.total_changes - before


def demo_orders(tenant: str) -> list[tuple[str, dict[str, Any] | None]]:
    """Exactly the orders ``toolsentry demo`` publishes to ``tool.reference`` for ``tenant``."""
    from processor.demo import OTHER_TENANT_ORDER, TENANT_DATA

    entities: list[tuple[str, dict[str, Any] | None]] = [
        (f"{tenant}/{key}", value) for key, value in TENANT_DATA
    ]
    entities.append((f"other-{tenant}/order/{OTHER_TENANT_ORDER}", {"state": "processing"}))
    return entities


def _existing_order(db: sqlite3.Connection, call: Call) -> Order:
    order_id = call.arguments["order_id"]
    row = db.execute(
        "SELECT * FROM orders WHERE tenant = ? AND order_id = ?", (call.tenant_id, order_id)
    ).fetchone()
    if row is None:
        raise _refuse(
            "order_not_found",
            f"there is no order {order_id}; call lookup_order and never construct an id",
            "SEMANTIC_INVALIDITY",
        )
    return dict(row)


def _refundable_cents(order: Order) -> int:
    if order["status"] not in REFUNDABLE:
        return 0
    return max(0, int(order["amount_cents"]) - int(order["refunded_cents"]))


def _order_view(order: Order) -> dict[str, Any]:
    return {
        "order_id": order["order_id"],
        "customer_id": order["customer_id"],
        "status": order["status"],
        "placed_on": order["placed_on"],
        "amount": order["amount_cents"] / 100,
        "currency": order["currency"],
        "refunded_amount": order["refunded_cents"] / 100,
        "refundable_amount": _refundable_cents(order) / 100,
    }


def _digest(call: Call) -> str:
    """Ids derived from the idempotency key: a repeat could never mint a second one."""
    return hashlib.sha256(f"{call.tenant_id}/{call.idempotency_key}".encode()).hexdigest()


def _failed_after_commit(step: str, undo: dict[str, Any]) -> Failed:
    return Failed(
        "failed_after_commit",
        f"the step {step} committed, then the tool failed; compensate before retrying",
        retryable=False,
        taxonomy_class="COMPENSATION_REQUIRED",
        committed_steps=(step,),
        compensation_arguments=undo,
    )


def _stored(answer: Succeeded | Failed, touched: list[str]) -> dict[str, Any]:
    if isinstance(answer, Succeeded):
        return {"succeeded": True, "data": answer.data, "touched": touched}
    return {
        "succeeded": False,
        "code": answer.code,
        "message": answer.message,
        "retryable": answer.retryable,
        "taxonomy_class": answer.taxonomy_class,
        "committed_steps": list(answer.committed_steps),
        "compensation_arguments": answer.compensation_arguments,
        "touched": touched,
    }


def _answer(doc: dict[str, Any], references: tuple[ReferenceUpdate, ...]) -> Succeeded | Failed:
    """The stored answer, with the touched orders as they are now (a failure after a
    commit touched them too: its steps stand)."""
    if doc["succeeded"]:
        return Succeeded(doc["data"], references)
    return Failed(
        doc["code"],
        doc["message"],
        doc["retryable"],
        doc["taxonomy_class"],
        tuple(doc["committed_steps"]),
        doc["compensation_arguments"],
        references,
    )
