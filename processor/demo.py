"""A scripted support agent, played against the running stack.

The script is the incident from seed 000 and its neighbours: the
hallucinated ``ORD-12345``, the id missing its suffix, an id that looks
right but exists nowhere, an order already shipped, another tenant's order,
``"limit": "10"``, an invented ``notify_customer`` field, a tool that does
not exist, a look-alike tool name, model JSON cut off mid-stream, a
credential pasted into arguments, a forged token, and the calls that should
go through: a cancellation parked until an operator approves it, and a
refund (a critical mutation) released only by two different approvers.

The demo plays the systems around the agent too: it publishes the orders to
``tool.reference`` as a system of record would, signs the agent's principal
token with the development issuer key, and approves as the operators
``ops-1`` and ``ops-2`` with their keys (see ``toolsentry keys init``).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
from confluent_kafka import KafkaException
from redis.exceptions import RedisClusterException, RedisError
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table
from rich.text import Text

from processor.approval_flow import publish_approvals
from processor.approvals import load_private_key, sign_for_request
from processor.client import ObservationTimeout, ToolsentryClient, TopicMissing
from processor.config import Settings
from processor.executor import Executor
from processor.identity import TokenIssuer, generate_ed25519_jwk
from processor.kafka.produce import DeliveryError
from processor.keys import KeyBundle, init_keys
from processor.reference_data import publish_references, wait_until_loaded
from processor.state.approvals import ApprovalStore
from processor.state.connection import connect
from processor.support_executor import SupportStore, demo_orders


class StackUnavailable(RuntimeError):
    """The broker, Redis or the processors' reference loader did not answer: the script
    could not be played, which is not a decision that differs from it."""


UNAVAILABLE = (
    KafkaException,
    RedisError,
    RedisClusterException,
    TimeoutError,
    DeliveryError,
    TopicMissing,
)
"""What the demo's (and the conformance runner's) own calls raise when the stack is not up
or a processor not running (a decision that does not come is ObservationTimeout, caught
where it is awaited)."""


@dataclass(frozen=True)
class Step:
    says: str
    tool: str
    arguments: dict[str, Any] | None = None
    expect: str = "SUCCESS"
    extra: dict[str, Any] = field(default_factory=dict)
    approvers: tuple[str, ...] = ()
    """Operators who approve the parked call; then its result is awaited."""
    forged: bool = False
    """Send with a token signed by a key the processor does not trust."""
    fresh_key: bool = False
    """Send under a new idempotency key (an agent that retries as if it were new)."""


@dataclass(frozen=True)
class Conversation:
    """One run of the agent: its steps share a run_id, so its budgets and guards."""

    title: str
    steps: tuple[Step, ...]


TENANT_DATA: tuple[tuple[str, dict[str, Any]], ...] = (
    ("order/WO-12345-A", {"state": "processing", "owner": "CUS-004211",
                          "attributes": {"placed_on": "2026-11-18", "amount": 64.0}}),
    ("order/WO-24680-B", {"state": "delivered", "owner": "CUS-004211",
                          "attributes": {"placed_on": "2026-11-09", "amount": 42.5}}),
    ("order/WO-55555-B", {"state": "shipped", "owner": "CUS-004211",
                          "attributes": {"placed_on": "2026-11-20", "amount": 18.0}}),
)  # fmt: skip
OTHER_TENANT_ORDER = "WO-77777-C"
SCOPES = ("orders:read", "orders:write", "payments:refund", "kb:read", "tickets:write")
_CANCEL = {"order_id": "WO-12345-A", "reason_code": "customer_request", "confirm": True}
_REFUND = {"order_id": "WO-24680-B", "amount": 19.99, "currency": "USD", "reason_code": "damaged"}


SCRIPT: tuple[Conversation, ...] = (
    Conversation("the incident (seed 000), done right", (
        Step("look up the customer's recent orders", "lookup_order",
             {"customer_id": "CUS-004211", "date_from": "2026-11-16", "date_to": "2026-11-22"}),
        Step("cancel with an invented id (the incident)", "cancel_order",
             {**_CANCEL, "order_id": "ORD-12345"}, "OUT_OF_BOUNDS"),
        Step("cancel with the suffix missing", "cancel_order",
             {**_CANCEL, "order_id": "WO-12345"}, "OUT_OF_BOUNDS"),
        Step("cancel an id that looks right but exists nowhere", "cancel_order",
             {**_CANCEL, "order_id": "WO-99999-Z"}, "SEMANTIC_INVALIDITY"),
        Step("follow the hint: look the order up", "lookup_order", {"order_id": "WO-12345-A"}),
        Step("cancel the real order: parked, ops-1 approves, it runs", "cancel_order", _CANCEL,
             approvers=("ops-1",)),
        Step("the model sends the cancellation again", "cancel_order", _CANCEL),
    )),
    Conversation("wrong targets and a stolen identity", (
        Step("cancel an order that has already shipped", "cancel_order",
             {**_CANCEL, "order_id": "WO-55555-B"}, "STALE_STATE"),
        Step("cancel another tenant's order", "cancel_order",
             {**_CANCEL, "order_id": OTHER_TENANT_ORDER}, "PERMISSION_DENIED"),
        Step("call with a forged identity token", "lookup_order", {"order_id": "WO-12345-A"},
             "PERMISSION_DENIED", forged=True),
        Step("paste the customer's API key into a ticket", "create_ticket",
             {"customer_id": "CUS-004211", "category": "delivery", "priority": "normal",
              "summary": "Customer key is " + "sk_live_" + "4eC39HqLyjWDarjtT1zdp7dc"},
             "POLICY_VIOLATION"),
    )),
    Conversation("malformed calls, repaired", (
        Step("search with limit as a string", "search_kb",
             {"query": "how do I return a damaged item", "limit": "10"}, "TYPE_MISMATCH"),
        Step("search again with an integer", "search_kb",
             {"query": "how do I return a damaged item", "limit": 10}),
        Step("invent a notify_customer field", "cancel_order",
             {**_CANCEL, "notify_customer": True}, "STRUCTURAL_VIOLATION"),
        Step("call a tool that does not exist", "search_orders", {"query": "tuesday"},
             "STRUCTURAL_VIOLATION"),
    )),
    Conversation("more malformed calls", (
        Step("call a look-alike tool name (Cyrillic a)", "c\u0430ncel_order", _CANCEL,
             "STRUCTURAL_VIOLATION"),
        Step("call a tool not offered at this step", "refund_order", _REFUND,
             "STRUCTURAL_VIOLATION", {"active_tools": ["lookup_order", "search_kb"]}),
        Step("stream cut off mid-arguments", "cancel_order", None, "SYNTACTIC_PARSE_FAIL",
             {"arguments_raw": '{"order_id": "WO-12345-A", "reason_co'}),
    )),
    Conversation("a refund under dual control", (
        Step("a ticket with a missing summary and priority 'asap'", "create_ticket",
             {"customer_id": "CUS-004211", "category": "delivery", "priority": "asap"},
             "STRUCTURAL_VIOLATION"),
        Step("refund a negative amount", "refund_order", {**_REFUND, "amount": -5},
             "OUT_OF_BOUNDS"),
        Step("refund part of a delivered order: two approvers release it", "refund_order",
             _REFUND, approvers=("ops-1", "ops-2")),
        Step("a second refund in the same conversation: over the run's budget",
             "refund_order", {**_REFUND, "amount": 5.0}, "BUDGET_EXHAUSTED"),
        Step("open a ticket for the courier", "create_ticket",
             {"customer_id": "CUS-004211", "order_id": "WO-12345-A", "category": "delivery",
              "priority": "normal",
              "summary": "Parcel arrived crushed; customer wants a replacement."}),
    )),
    Conversation("the runaway loop (seed 001)", (
        Step("check the refund went through", "lookup_order", {"order_id": "WO-24680-B"},
             fresh_key=True),
        Step("... and check again, under a new key", "lookup_order", {"order_id": "WO-24680-B"},
             fresh_key=True),
        Step("... and again: the loop guard stops it", "lookup_order",
             {"order_id": "WO-24680-B"}, "BUDGET_EXHAUSTED", fresh_key=True),
    )),
)  # fmt: skip
STEPS = sum(len(c.steps) for c in SCRIPT)

_STYLE = {"SUCCESS": "green"}


def _prepare(settings: Settings, tenant: str, keys: KeyBundle) -> tuple[str, str]:
    """Publish the demo's reference data; mint the agent's token and a forged one."""
    entities: list[tuple[str, dict[str, Any] | None]] = [
        (f"{tenant}/{key}", value) for key, value in TENANT_DATA
    ]
    entities.append((f"other-{tenant}/order/{OTHER_TENANT_ORDER}", {"state": "processing"}))
    publish_references(settings, entities)
    wait_until_loaded(settings, timeout=60)
    issuer = TokenIssuer.from_jwk_file(keys.issuer)
    token = issuer.mint(tenant, "u-demo", "support-agent", SCOPES, "regulated")
    forger_key, _ = generate_ed25519_jwk(issuer.kid)
    forger = TokenIssuer(issuer.kid, "EdDSA", jwt.PyJWK(forger_key, "EdDSA").key)
    return token, forger.mint(tenant, "u-demo", "support-agent", SCOPES, "regulated")


def _approve(
    settings: Settings, keys: KeyBundle, observation: dict[str, Any], approvers: tuple[str, ...]
) -> None:
    """What ``toolsentry approvals approve`` does, for each operator in turn."""
    store = ApprovalStore(connect(settings.redis_url), settings.redis_namespace)
    entry = store.find(observation["approval_request_id"])
    if entry is None:
        raise StackUnavailable(
            f"the parked call {observation['approval_request_id']} is not in Redis: does the "
            "processor use the same redis_url and redis_namespace?"
        )
    now_ms = int(time.time() * 1000)
    approvals = [
        sign_for_request(load_private_key(keys.approver_key(a)), a, entry, now_ms)
        for a in approvers
    ]
    publish_approvals(settings, entry["run_id"], approvals)


def _run_executor(settings: Settings, tenant: str, db: Path) -> tuple[Executor, threading.Thread]:
    """The support tools over a fresh SQLite store, seeded with the demo's orders."""
    db.unlink(missing_ok=True)
    store = SupportStore(db)
    store.seed(demo_orders(tenant))
    executor = Executor(
        settings,
        store.handlers(),
        executor_id=f"demo-{uuid.uuid4().hex[:6]}",
        recorded=store.recorded,
    )
    thread = threading.Thread(target=executor.run, name="demo-executor", daemon=True)
    thread.start()
    executor.wait_ready(60)
    return executor, thread


def _said(obs: dict[str, Any], step: Step) -> str:
    """The observation in one line: a result's data, or the next action."""
    if obs["decision"] == "COMPLETED":
        data = obs["result_payload"]["data"] or ""
        hit = "cached result (idempotency hit): " if obs["execution_metadata"][
            "idempotency_hit"] else ""  # fmt: skip
        approved = f"approved by {' and '.join(step.approvers)}; " if step.approvers else ""
        return f"{approved}{hit}{data[:160]}"
    return str(obs["next_action"])


WIDE = 120
"""Console columns from which the agent's words, the tool, the decision and its class
each get a column of their own; a narrower console stacks them in pairs."""


class _Board:
    """The live table of decisions. Every cell is plain text: an executor's result
    and the agent's words are shown as they are, never read as console markup."""

    def __init__(self, width: int) -> None:
        self.wide = width >= WIDE
        self.table = Table(expand=True)
        add = self.table.add_column
        add("#", justify="right", no_wrap=True)
        if self.wide:
            add("agent does", ratio=4, overflow="fold")
            add("tool", no_wrap=True)
            add("decision", no_wrap=True)
            add("class", no_wrap=True)
        else:
            add("agent does (tool)", ratio=4, overflow="fold")
            add("decision (class)", no_wrap=True)
        add("next_action / result", ratio=7, overflow="fold")

    def conversation(self, title: str, run_id: str) -> None:
        self.table.add_section()
        blanks = [""] * (len(self.table.columns) - 3)
        self.table.add_row("", Text(title, "bold"), *blanks, Text(run_id))

    def row(self, n: int, step: Step, decision: Text, cls: Text, said: str) -> None:
        if self.wide:
            cells = [Text(step.says), Text(step.tool), decision, cls]
        else:
            cells = [Text.assemble(step.says, "\n", (step.tool, "dim")),
                     Text.assemble(decision, "\n", cls)]  # fmt: skip
        self.table.add_row(str(n), *cells, Text(said))


def play(
    settings: Settings,
    tenant: str,
    timeout: float,
    console: Console,
    keys_dir: Path,
    executor_db: Path | None = None,
) -> bool:
    """Run the script; True when every decision matched what the script expects.
    StackUnavailable when the broker, Redis or the reference loader does not answer.

    ``executor_db``: run the reference support executor in-process over this SQLite
    file (recreated), so routed calls come back with results; None when an executor
    already runs elsewhere."""
    try:
        return _play(settings, tenant, timeout, console, keys_dir, executor_db)
    except UNAVAILABLE as exc:
        raise StackUnavailable(str(exc) or type(exc).__name__) from exc


def _play(
    settings: Settings,
    tenant: str,
    timeout: float,
    console: Console,
    keys_dir: Path,
    executor_db: Path | None,
) -> bool:
    keys = init_keys(keys_dir)
    token, forged = _prepare(settings, tenant, keys)
    executor = thread = None
    if executor_db is not None:
        executor, thread = _run_executor(settings, tenant, executor_db)
    board = _Board(console.width)
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn())
    task = progress.add_task("demo agent", total=STEPS)
    tally: Counter[str] = Counter()
    mismatches = 0
    n = 0
    traced: str | None = None
    try:
        with (
            ToolsentryClient(settings, tenant, principal_token=token) as client,
            Live(Group(board.table, progress), console=console, refresh_per_second=8),
        ):
            for conversation in SCRIPT:
                run_id = f"demo-{uuid.uuid4().hex[:8]}"
                board.conversation(conversation.title, run_id)
                for step in conversation.steps:
                    n += 1
                    obs = _play_step(settings, keys, client, step, run_id, forged, timeout)
                    progress.advance(task)
                    if obs is None:
                        board.row(n, step, Text("no answer", "red"), Text("-"),
                                  "is the processor running? (toolsentry run)")  # fmt: skip
                        return False
                    cls = obs["status"]["taxonomy_class"]
                    tally[cls] += 1
                    mismatches += cls != step.expect
                    board.row(n, step, Text(obs["decision"]), Text(cls, _STYLE.get(cls, "yellow")),
                              _said(obs, step))  # fmt: skip
                    if len(step.approvers) > 1 and obs["decision"] == "COMPLETED":
                        traced = str(obs["proposal_id"])
    finally:
        if executor is not None and thread is not None:
            executor.stop()
            thread.join(30)
    summary = Table("taxonomy class", "proposals", title="summary by taxonomy class")
    for cls, count in sorted(tally.items(), key=lambda kv: (-kv[1], kv[0])):
        summary.add_row(cls, str(count))
    console.print(summary)
    if mismatches:
        console.print(Text(f"{mismatches} decision(s) differed from the script", "red"))
    else:
        console.print(Text(f"all {STEPS} decisions as expected", "green"))
    if traced is not None:
        console.print(f"the dual-control refund's whole life, read back from the topics: "
                      f"toolsentry trace {traced}", soft_wrap=True)  # fmt: skip
    return mismatches == 0


def _play_step(
    settings: Settings,
    keys: KeyBundle,
    client: ToolsentryClient,
    step: Step,
    run_id: str,
    forged: str,
    timeout: float,
) -> dict[str, Any] | None:
    """Propose one step and wait for what finally happened to it (None: no answer)."""
    kwargs = dict(step.extra)
    if step.forged:
        kwargs["principal_token"] = forged
    if step.fresh_key:
        kwargs["idempotency_key"] = f"demo-{uuid.uuid4().hex}"
    try:
        pid = client.propose(step.tool, step.arguments, run_id=run_id, **kwargs)
        obs = client.wait(pid, timeout)
        if step.approvers and obs["decision"] == "PENDING_APPROVAL":
            _approve(settings, keys, obs, step.approvers)
            obs = client.wait_final(pid, timeout)
        if obs["decision"] == "ROUTED":
            obs = client.wait_result(pid, timeout)
    except ObservationTimeout:
        return None
    return obs
