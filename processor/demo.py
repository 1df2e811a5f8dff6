"""A scripted support agent, played against the running stack.

The script is the incident from seed 000 and its neighbours: the
hallucinated ``ORD-12345``, the id missing its suffix, ``"limit": "10"``,
an invented ``notify_customer`` field, a tool that does not exist, a
look-alike tool name, model JSON cut off mid-stream, and the calls that
should go through.
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from processor.client import ObservationTimeout, ToolsentryClient
from processor.config import Settings


@dataclass(frozen=True)
class Step:
    says: str
    tool: str
    arguments: dict[str, Any] | None = None
    expect: str = "SUCCESS"
    extra: dict[str, Any] = field(default_factory=dict)


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
    Step("follow the hint: look the order up", "lookup_order", {"order_id": "WO-12345-A"}),
    Step(
        "cancel the real order, confirmed",
        "cancel_order",
        {"order_id": "WO-12345-A", "reason_code": "customer_request", "confirm": True},
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
        "refund part of a damaged order",
        "refund_order",
        {"order_id": "WO-12345-A", "amount": 19.99, "currency": "USD", "reason_code": "damaged"},
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


def play(settings: Settings, tenant: str, timeout: float, console: Console) -> bool:
    """Run the script; True when every decision matched what the script expects."""
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
        ToolsentryClient(settings, tenant) as client,
        Live(Group(table, progress), console=console, refresh_per_second=8),
    ):
        for i, step in enumerate(SCRIPT, 1):
            kwargs = dict(step.extra)
            try:
                obs = client.call(
                    step.tool, step.arguments, run_id=run_id, timeout=timeout, **kwargs
                )
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
