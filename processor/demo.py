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

import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from processor.approval_flow import publish_approvals
from processor.approvals import load_private_key, sign_for_request
from processor.client import ObservationTimeout, ToolsentryClient
from processor.config import Settings
from processor.identity import TokenIssuer, generate_ed25519_jwk
from processor.keys import KeyBundle, init_keys
from processor.reference_data import publish_references, wait_until_loaded
from processor.state.approvals import ApprovalStore
from processor.state.connection import connect


@dataclass(frozen=True)
class Step:
    says: str
    tool: str
    arguments: dict[str, Any] | None = None
    expect: str = "SUCCESS"
    extra: dict[str, Any] = field(default_factory=dict)
    approvers: tuple[str, ...] = ()
    """Operators who approve the parked call; then the released observation is awaited."""
    forged: bool = False
    """Send with a token signed by a key the processor does not trust."""


TENANT_DATA: tuple[tuple[str, dict[str, Any]], ...] = (
    ("order/WO-12345-A", {"state": "processing", "owner": "CUS-004211"}),
    ("order/WO-24680-B", {"state": "delivered", "owner": "CUS-004211"}),
    ("order/WO-55555-B", {"state": "shipped", "owner": "CUS-004211"}),
)
OTHER_TENANT_ORDER = "WO-77777-C"
SCOPES = ("orders:read", "orders:write", "payments:refund", "kb:read", "tickets:write")


SCRIPT: tuple[Step, ...] = (
    Step(
        "look up the customer's recent orders",
        "lookup_order",
        {"customer_id": "CUS-004211", "date_from": "2026-11-16", "date_to": "2026-11-22"},
    ),
    Step(
        "cancel with an invented id (the incident)",
        "cancel_order",
        {"order_id": "ORD-12345", "reason_code": "customer_request", "confirm": True},
        "OUT_OF_BOUNDS",
    ),
    Step(
        "cancel with the suffix missing",
        "cancel_order",
        {"order_id": "WO-12345", "reason_code": "customer_request", "confirm": True},
        "OUT_OF_BOUNDS",
    ),
    Step(
        "cancel an id that looks right but exists nowhere",
        "cancel_order",
        {"order_id": "WO-99999-Z", "reason_code": "customer_request", "confirm": True},
        "SEMANTIC_INVALIDITY",
    ),
    Step("follow the hint: look the order up", "lookup_order", {"order_id": "WO-12345-A"}),
    Step(
        "cancel an order that has already shipped",
        "cancel_order",
        {"order_id": "WO-55555-B", "reason_code": "customer_request", "confirm": True},
        "STALE_STATE",
    ),
    Step(
        "cancel another tenant's order",
        "cancel_order",
        {"order_id": OTHER_TENANT_ORDER, "reason_code": "customer_request", "confirm": True},
        "PERMISSION_DENIED",
    ),
    Step(
        "cancel the real order: parked for approval",
        "cancel_order",
        {"order_id": "WO-12345-A", "reason_code": "customer_request", "confirm": True},
        "CONFIRMATION_MISSING",
    ),
    Step(
        "... operator ops-1 approves it: released",
        "cancel_order",
        {"order_id": "WO-12345-A", "reason_code": "customer_request", "confirm": True},
        approvers=("ops-1",),
    ),
    Step(
        "search with limit as a string",
        "search_kb",
        {"query": "how do I return a damaged item", "limit": "10"},
        "TYPE_MISMATCH",
    ),
    Step(
        "search again with an integer",
        "search_kb",
        {"query": "how do I return a damaged item", "limit": 10},
    ),
    Step(
        "invent a notify_customer field",
        "cancel_order",
        {
            "order_id": "WO-12345-A",
            "reason_code": "customer_request",
            "confirm": True,
            "notify_customer": True,
        },
        "STRUCTURAL_VIOLATION",
    ),
    Step(
        "call a tool that does not exist",
        "search_orders",
        {"query": "tuesday"},
        "STRUCTURAL_VIOLATION",
    ),
    Step(
        "call a look-alike tool name (Cyrillic a)",
        "c\u0430ncel_order",
        {"order_id": "WO-12345-A", "reason_code": "customer_request", "confirm": True},
        "STRUCTURAL_VIOLATION",
    ),
    Step(
        "call a tool not offered at this step",
        "refund_order",
        {"order_id": "WO-12345-A", "amount": 19.99, "currency": "USD", "reason_code": "damaged"},
        "STRUCTURAL_VIOLATION",
        {"active_tools": ["lookup_order", "search_kb"]},
    ),
    Step(
        "stream cut off mid-arguments",
        "cancel_order",
        None,
        "SYNTACTIC_PARSE_FAIL",
        {"arguments_raw": '{"order_id": "WO-12345-A", "reason_co'},
    ),
    Step(
        "a ticket with a missing summary and priority 'asap'",
        "create_ticket",
        {"customer_id": "CUS-004211", "category": "delivery", "priority": "asap"},
        "STRUCTURAL_VIOLATION",
    ),
    Step(
        "refund a negative amount",
        "refund_order",
        {"order_id": "WO-12345-A", "amount": -5, "currency": "USD", "reason_code": "damaged"},
        "OUT_OF_BOUNDS",
    ),
    Step(
        "refund part of a delivered order: two approvers release it",
        "refund_order",
        {"order_id": "WO-24680-B", "amount": 19.99, "currency": "USD", "reason_code": "damaged"},
        approvers=("ops-1", "ops-2"),
    ),
    Step(
        "paste the customer's API key into a ticket",
        "create_ticket",
        {
            "customer_id": "CUS-004211",
            "category": "delivery",
            "priority": "normal",
            "summary": "Customer key is " + "sk_live_" + "4eC39HqLyjWDarjtT1zdp7dc",
        },
        "POLICY_VIOLATION",
    ),
    Step(
        "call with a forged identity token",
        "lookup_order",
        {"order_id": "WO-12345-A"},
        "PERMISSION_DENIED",
        forged=True,
    ),
    Step(
        "open a ticket for the courier",
        "create_ticket",
        {
            "customer_id": "CUS-004211",
            "order_id": "WO-12345-A",
            "category": "delivery",
            "priority": "normal",
            "summary": "Parcel arrived crushed; customer wants a replacement.",
        },
    ),
)

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
    assert entry is not None, "the parked call is not in Redis"
    now_ms = int(time.time() * 1000)
    approvals = [
        sign_for_request(load_private_key(keys.approver_key(a)), a, entry, now_ms)
        for a in approvers
    ]
    publish_approvals(settings, entry["run_id"], approvals)


def play(settings: Settings, tenant: str, timeout: float, console: Console, keys_dir: Path) -> bool:
    """Run the script; True when every decision matched what the script expects."""
    keys = init_keys(keys_dir)
    token, forged = _prepare(settings, tenant, keys)
    run_id = f"demo-{uuid.uuid4().hex[:8]}"
    table = Table(expand=True)
    for name, ratio in (("#", 1), ("agent does", 5), ("tool", 4), ("decision", 3), ("class", 5),
                        ("next_action", 10)):  # fmt: skip
        table.add_column(name, ratio=ratio, overflow="fold")
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn())
    task = progress.add_task(f"run {run_id}", total=len(SCRIPT))
    tally: Counter[str] = Counter()
    mismatches = 0
    with (
        ToolsentryClient(settings, tenant, principal_token=token) as client,
        Live(Group(table, progress), console=console, refresh_per_second=8),
    ):
        for i, step in enumerate(SCRIPT, 1):
            kwargs = dict(step.extra)
            if step.forged:
                kwargs["principal_token"] = forged
            try:
                obs = client.call(
                    step.tool, step.arguments, run_id=run_id, timeout=timeout, **kwargs
                )
                if step.approvers and obs["decision"] == "PENDING_APPROVAL":
                    _approve(settings, keys, obs, step.approvers)
                    obs = client.wait_final(obs["proposal_id"], timeout)
            except ObservationTimeout:
                table.add_row(
                    str(i),
                    step.says,
                    step.tool,
                    "[red]no answer[/red]",
                    "-",
                    "is the processor running? (toolsentry run)",
                )
                progress.advance(task)
                mismatches += 1
                break
            cls = obs["status"]["taxonomy_class"]
            tally[cls] += 1
            mismatches += cls != step.expect
            style = _STYLE.get(cls, "yellow")
            said = obs["next_action"]
            if obs["decision"] == "ROUTED":
                said = f"sent to exec.{obs['tool_identity']['side_effect_class'].lower()}"
                if step.approvers:
                    said += f" after approval by {' and '.join(step.approvers)}"
            table.add_row(
                str(i), step.says, step.tool, obs["decision"], f"[{style}]{cls}[/{style}]", said
            )
            progress.advance(task)
    summary = Table("taxonomy class", "proposals", title="summary by taxonomy class")
    for cls, n in sorted(tally.items(), key=lambda kv: (-kv[1], kv[0])):
        summary.add_row(cls, str(n))
    console.print(summary)
    if mismatches:
        console.print(f"[red]{mismatches} decision(s) differed from the script[/red]")
    else:
        console.print(f"[green]all {len(SCRIPT)} decisions as expected[/green]")
    return mismatches == 0
