"""Builders shared by the unit tests: records, envelopes, decisions. No Kafka, no Redis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from processor.contracts.registry import ContractSet
from processor.gates.parse import Limits
from processor.model import Decision, SourceRecord
from processor.pipeline import decide

ROOT = Path(__file__).resolve().parents[2]
CONTRACTS_DIR = ROOT / "contracts"
SCHEMAS_DIR = ROOT / "schemas"
LIMITS = Limits()
NOW_MS = 1_700_000_000_000
TOPIC = "tool.proposals"
PARTITION = 3
OFFSET = 42

VALID_ARGUMENTS: dict[str, dict[str, Any]] = {
    "cancel_order": {"order_id": "WO-12345-A", "reason_code": "customer_request", "confirm": True},
    "lookup_order": {"order_id": "WO-12345-A"},
    "search_kb": {"query": "return policy", "limit": 10},
    "refund_order": {
        "order_id": "WO-12345-A",
        "amount": 19.99,
        "currency": "USD",
        "reason_code": "damaged",
    },
    "create_ticket": {
        "customer_id": "CUS-004211",
        "category": "delivery",
        "priority": "normal",
        "summary": "Parcel arrived crushed; customer wants a replacement.",
    },
}


def record(
    value: bytes | None,
    *,
    topic: str = TOPIC,
    partition: int = PARTITION,
    offset: int = OFFSET,
    key: bytes | None = b"run-1",
) -> SourceRecord:
    return SourceRecord(topic, partition, offset, key, value, NOW_MS - 5)


def envelope(tool: str = "cancel_order", **fields: Any) -> dict[str, Any]:
    """A valid proposal envelope for ``tool``; ``fields`` override or add envelope fields."""
    env: dict[str, Any] = {
        "proposal_id": "prop-1",
        "run_id": "run-1",
        "tenant_id": "tenant-1",
        "tool": {"name": tool},
        "arguments": dict(VALID_ARGUMENTS.get(tool, {})),
    }
    env.update(fields)
    return env


def decide_envelope(
    env: dict[str, Any], contracts: ContractSet, now_ms: int = NOW_MS, offset: int = OFFSET
) -> Decision:
    return decide(record(orjson.dumps(env), offset=offset), contracts, LIMITS, now_ms)


def decide_arguments(
    contracts: ContractSet, tool: str, arguments: dict[str, Any], **fields: Any
) -> Decision:
    return decide_envelope(envelope(tool, arguments=arguments, **fields), contracts)
