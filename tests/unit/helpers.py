"""Builders shared by the unit tests: records, envelopes, decisions. No Kafka, no Redis."""

from __future__ import annotations

import io
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import CollectorRegistry
from rich.console import Console, RenderableType

from processor.app import Processor
from processor.approvals import Approver, sign_approval
from processor.config import IdentitySettings, Settings
from processor.contracts.registry import ContractSet
from processor.gates.parse import Limits
from processor.gates.semantic import RefAnswers, RefEntry, RefKey
from processor.keys import DEFAULT_APPROVERS, init_keys
from processor.metrics import Metrics
from processor.model import Decision, SideEffectClass, SourceRecord
from processor.pipeline import Gates, decide

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


class Consumed:
    """A consumed record, as far as the processor's and the executor's loops look at one."""

    def __init__(
        self, topic: str, offset: int, value: bytes, partition: int = 0, key: bytes = b"run-1"
    ) -> None:
        self._topic, self._offset, self._value = topic, offset, value
        self._partition, self._key = partition, key

    def error(self) -> None:
        return None

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes:
        return self._key

    def value(self) -> bytes:
        return self._value

    def timestamp(self) -> tuple[int, int]:
        return 1, 1_700_000_000_000


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


def existing_references(env: dict[str, Any], contracts: ContractSet) -> RefAnswers:
    """Reference data in which every id the proposal names exists, for its tenant, in the
    first state its contract allows: the other gates' tests start from a call that passes."""
    args = env.get("arguments")
    tool = env.get("tool")
    name = tool.get("name") if isinstance(tool, dict) else None
    if not isinstance(args, dict) or not isinstance(name, str):
        return {}
    answers: dict[RefKey, RefEntry | None] = {}
    for contract in contracts.versions(name):
        for ref in contract.references:
            value = args.get(ref.argument)
            if isinstance(value, str):
                key = (str(env.get("tenant_id")), ref.entity, value)
                answers[key] = RefEntry(key[0], ref.allowed_states[0], "owner-1", {})
    return answers


APPROVER_KEYS = {name: Ed25519PrivateKey.generate() for name in ("ops-1", "ops-2", "viewer")}
APPROVERS = {
    name: Approver(
        name,
        key.public_key(),
        frozenset() if name == "viewer" else frozenset(SideEffectClass),
        frozenset({"*"}),
    )
    for name, key in APPROVER_KEYS.items()
}


def gates(contracts: ContractSet, **kw: Any) -> Gates:
    """Development identity (the envelope's tenant is trusted), the test approvers."""
    return Gates.development(contracts, LIMITS, approvers=APPROVERS, **kw)


def approvals_for(
    env: dict[str, Any], contracts: ContractSet, *approvers: str, now_ms: int = NOW_MS, **kw: Any
) -> list[dict[str, Any]]:
    """Signed approvals of the call ``env`` proposes, bound to exactly what it would run."""
    parked = decide_envelope({**env, "approvals": []}, contracts, now_ms)
    packet = parked.approval_request
    assert packet is not None, f"{env['tool']} does not need approval: {parked.rejection}"
    fields = {
        "tenant_id": packet["tenant_id"],
        "trace_id": packet["trace_id"],
        "tool_name": packet["tool_name"],
        "tool_version": packet["tool_version"],
        "payload_hash": packet["payload_hash"],
        "requested_by_user": packet["requested_by_user"],
        "requested_by_agent": packet["requested_by_agent"],
    }
    fields.update(kw)
    return [
        sign_approval(APPROVER_KEYS[a], approver_id=a, now_ms=now_ms, **fields) for a in approvers
    ]


def references_in_record(value: bytes | None, contracts: ContractSet) -> RefAnswers:
    """``existing_references`` for a raw record (arguments or arguments_raw); nothing for a
    record that is not a JSON envelope."""
    try:
        env = orjson.loads(value or b"")
    except orjson.JSONDecodeError:
        return {}
    if not isinstance(env, dict):
        return {}
    if "arguments" not in env and isinstance(env.get("arguments_raw"), str):
        try:
            env = {**env, "arguments": orjson.loads(env["arguments_raw"])}
        except orjson.JSONDecodeError:
            return {}
    return existing_references(env, contracts)


def decide_envelope(
    env: dict[str, Any],
    contracts: ContractSet,
    now_ms: int = NOW_MS,
    offset: int = OFFSET,
    gates: Gates | None = None,
    answers: RefAnswers | None = None,
) -> Decision:
    gates = gates or Gates.development(contracts, LIMITS, approvers=APPROVERS)
    if answers is None:
        answers = existing_references(env, contracts)
    return decide(record(orjson.dumps(env), offset=offset), gates, now_ms, answers)


def decide_arguments(
    contracts: ContractSet, tool: str, arguments: dict[str, Any], **fields: Any
) -> Decision:
    return decide_envelope(envelope(tool, arguments=arguments, **fields), contracts)


def keyed_processor(
    tmp_path: Path, approvers: tuple[str, ...] = DEFAULT_APPROVERS, **settings: Any
) -> tuple[Processor, Path]:
    """A processor with keys of its own (``init_keys`` in ``tmp_path``/keys: the issuer and
    ``approvers``) and a copy of the shipped policy, its files read again at every
    ``reload_trust()`` call; ``settings`` override the rest. It touches no broker or Redis
    until it runs. Returns it and its keys' folder."""
    keys = init_keys(tmp_path / "keys", approvers=approvers)
    policy = tmp_path / "policy.yaml"
    shutil.copy(ROOT / "policy" / "policy.yaml", policy)
    config = Settings(
        contracts_dir=CONTRACTS_DIR,
        identity=IdentitySettings(jwks_file=keys.jwks),
        approvers_file=keys.approvers,
        policy_file=policy,
        contracts_poll_s=0.0,
        metrics_port=0,
        **settings,
    )
    return Processor(config, metrics=Metrics(CollectorRegistry())), tmp_path / "keys"


def printed(parts: Iterable[RenderableType]) -> str:
    """What a command's renderables print, as plain text on a wide console."""
    out = io.StringIO()
    console = Console(file=out, width=400, color_system=None)
    for part in parts:
        console.print(part)
    return out.getvalue()
