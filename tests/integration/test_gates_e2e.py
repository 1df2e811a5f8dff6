"""The gates on meaning, identity, policy and approvals, end to end.

A real broker and redis-server, one ``toolsentry run`` subprocess with identity
verification on, reference data published on ``tool.reference``, principals
holding tokens the test issuer signed, and approvers signing with their own
Ed25519 keys. Every refusal is checked for what it tells the agent (class,
gate, codes, next action) and, where something must not run, for the absence
of an approved call on ``tool.exec.<class>``.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    Message,
    Producer,
    TopicPartition,
)
from cryptography.hazmat.primitives.asymmetric import ed25519

from processor.approvals import (
    approval_id_for,
    load_private_key,
    sign_approval,
    sign_for_request,
)
from processor.client import ToolsentryClient
from processor.codec.avro import codec
from processor.config import Settings
from processor.identity import TokenIssuer
from processor.pipeline import canonical_json, hash_payload
from processor.reference_data import publish_references, wait_until_loaded
from processor.state.admission import AdmissionStore
from processor.state.approvals import ApprovalStore
from processor.state.connection import connect
from processor.state.references import entity_key, position_key
from tests.integration.harness import (
    ROOT,
    ProcessorProcess,
    approval_request,
    isolated,
    issuer,
    settings_env,
    token,
)

pytestmark = pytest.mark.integration

ACME, GLOBEX = "acme-g", "globex-g"
"""Tenants of this module only: reference keys are global per tenant, entity and id."""

ORDER = "WO-12345-A"  # acme-g, processing
ORDER_2 = "WO-12346-B"  # acme-g, processing
SHIPPED = "WO-55555-B"  # acme-g, shipped
CANCELLED = "WO-66666-C"  # acme-g, cancelled
GLOBEX_ORDER = "WO-77777-G"  # globex-g only
UNKNOWN = "WO-99999-Z"  # nowhere
ACC_FROM, ACC_TO = "acc_0012345678", "acc_0098765432"  # acme-g, active
TICKET = "TCK-0042117"  # acme-g, open

REFERENCES: list[tuple[str, dict[str, Any] | None]] = [
    (f"{ACME}/order/{ORDER}", {"state": "processing", "owner": "cust-1"}),
    (f"{ACME}/order/{ORDER_2}", {"state": "processing", "owner": "cust-1"}),
    (f"{ACME}/order/{SHIPPED}", {"state": "shipped", "owner": "cust-1"}),
    (f"{ACME}/order/{CANCELLED}", {"state": "cancelled", "owner": "cust-2"}),
    (f"{GLOBEX}/order/{GLOBEX_ORDER}", {"state": "processing", "owner": "g-cust-1"}),
    (f"{ACME}/account/{ACC_FROM}", {"state": "active", "attributes": {"currency": "USD"}}),
    (f"{ACME}/account/{ACC_TO}", {"state": "active", "attributes": {"currency": "USD"}}),
    (f"{ACME}/ticket/{TICKET}", {"state": "open", "owner": "cust-1"}),
]


def cancel(order_id: str = ORDER, reason: str = "customer_request") -> dict[str, Any]:
    return {"order_id": order_id, "reason_code": reason, "confirm": True}


TRANSFER = {
    "from_account_id": ACC_FROM,
    "to_account_id": ACC_TO,
    "amount": 1250.5,
    "currency": "USD",
    "purpose": "internal_rebalance",
}


def payload_hash(arguments: dict[str, Any]) -> str:
    return hash_payload(canonical_json(arguments))


def new_trace() -> tuple[str, str]:
    """(traceparent, trace_id): an approval is bound to the trace, so flows pin one."""
    trace_id = uuid.uuid4().hex
    return f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01", trace_id


def run_id() -> str:
    return f"run-{uuid.uuid4().hex[:10]}"


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def errors(obs: dict[str, Any]) -> list[tuple[str | None, str]]:
    return [(e["field"], e["code"]) for e in obs["result_payload"]["errors"]]


def refused(
    obs: dict[str, Any], taxonomy: str, gate: str, codes: list[str], decision: str = "REJECTED"
) -> list[dict[str, Any]]:
    """The common shape of a refusal; returns the errors for further checks."""
    seen = (obs["decision"], obs["gate"], obs["status"]["taxonomy_class"], errors(obs))
    assert seen[:3] == (decision, gate, taxonomy), seen
    assert obs["status"]["is_error"] is True
    errs: list[dict[str, Any]] = obs["result_payload"]["errors"]
    assert [e["code"] for e in errs] == codes, errs
    action = obs["next_action"]
    assert isinstance(action, str) and len(action) > 30
    assert "sent for execution" not in action  # not the routed observation's text
    return errs


def value(m: Message) -> bytes:
    v = m.value()
    assert isinstance(v, bytes)
    return v


def header(m: Message, name: str) -> str:
    raw = m.headers()
    items = list(raw.items()) if isinstance(raw, dict) else list(raw or [])
    found = [v for k, v in items if k == name]
    assert len(found) == 1 and isinstance(found[0], bytes), raw
    return found[0].decode()


class TopicReader:
    """Everything committed on a topic, read up to its end as of each ``sync()``.

    Waiting for quiet (as ``read_all`` does) can return before the first fetch and so
    make an absence trivially true; this waits for end-of-partition at or past each
    partition's high watermark instead, which read_committed reaches only once every
    transaction before it has ended.
    """

    def __init__(self, settings: Settings, topic: str) -> None:
        self.topic = topic
        self.consumer = Consumer(
            settings.client_config(
                **{
                    "group.id": f"gates-reader-{uuid.uuid4().hex}",
                    "enable.auto.commit": False,
                    "isolation.level": "read_committed",
                    "enable.partition.eof": True,
                    "fetch.wait.max.ms": 20,
                }
            )
        )
        meta = self.consumer.list_topics(topic, timeout=10)
        self.partitions = sorted(meta.topics[topic].partitions)
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in self.partitions])
        self.messages: list[Message] = []
        self.at = dict.fromkeys(self.partitions, 0)

    def sync(self, timeout: float = 20) -> list[Message]:
        ends = {
            p: self.consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=10)[1]
            for p in self.partitions
        }
        deadline = time.monotonic() + timeout
        while any(self.at[p] < end for p, end in ends.items()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.topic} not read to its end in {timeout}s")
            for m in self.consumer.consume(1000, 0.1):
                err = m.error()
                if err is None:
                    self.messages.append(m)
                elif err.code() == KafkaError._PARTITION_EOF:
                    partition, offset = m.partition(), m.offset()
                    assert partition is not None and offset is not None
                    self.at[partition] = max(self.at[partition], offset)
        return self.messages

    def close(self) -> None:
        self.consumer.close()


@dataclass
class Parked:
    """A call waiting for approval, as the agent and the approver see it."""

    proposal_id: str
    run_id: str
    request_id: str
    trace_id: str
    traceparent: str
    tool: str
    arguments: dict[str, Any]
    requester: str
    """The principal (a key of ``World.principals``) the call was proposed under."""


class World:
    """The module's deployment: settings, one processor, a client per principal, approvers."""

    def __init__(self, settings: Settings, proc: ProcessorProcess) -> None:
        self.settings = settings
        self.proc = proc
        self.issuer: TokenIssuer = issuer(settings)
        self.principals = {
            "agent": ("u-agent", "agent-1"),
            "globex": ("u-globex", "agent-g"),
            # The requester is an approver itself: it may not approve its own call.
            "ops1": ("ops-1", "agent-ops"),
            "narrow": ("u-narrow", "agent-test"),
            "public": ("u-public", "agent-test"),
        }
        """Each principal's (user id, agent id): an approval names the requester it is for."""
        p = self.principals
        self.tokens = {
            "agent": token(settings, ACME, user=p["agent"][0], agent=p["agent"][1]),
            "globex": token(settings, GLOBEX, user=p["globex"][0], agent=p["globex"][1]),
            "ops1": token(settings, ACME, user=p["ops1"][0], agent=p["ops1"][1]),
            "narrow": token(settings, ACME, scopes=["orders:read"], user=p["narrow"][0]),
            "public": token(settings, ACME, clearance="public", user=p["public"][0]),
        }
        self.clients = {
            name: ToolsentryClient(
                settings, GLOBEX if name == "globex" else ACME, principal_token=t
            )
            for name, t in self.tokens.items()
        }
        self.clients["anonymous"] = ToolsentryClient(settings, ACME)
        assert settings.approvers_file is not None
        keys = Path(settings.approvers_file).parent
        self.approver_keys = {
            a: load_private_key(keys / f"approver-{a}.jwk") for a in ("ops-1", "ops-2", "viewer")
        }
        self.producer = Producer(settings.client_config(**{"enable.idempotence": True}))
        self.readers: dict[str, TopicReader] = {}

    def reader(self, topic: str) -> TopicReader:
        if topic not in self.readers:
            self.readers[topic] = TopicReader(self.settings, topic)
        return self.readers[topic]

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        for r in self.readers.values():
            r.close()
        self.producer.flush(10)

    # -- proposing ---------------------------------------------------------------------------

    def propose(self, who: str, tool: str, arguments: dict[str, Any] | None, **kw: Any) -> str:
        kw.setdefault("run_id", run_id())
        # Observations are read through the agent's client, which keeps only the runs it
        # proposed under and those it follows.
        self.clients["agent"].follow(kw["run_id"])
        return self.clients[who].propose(tool, arguments, **kw)

    def wait(self, pid: str, timeout: float = 60) -> dict[str, Any]:
        return self.clients["agent"].wait(pid, timeout)

    def final(self, pid: str, timeout: float = 60) -> dict[str, Any]:
        return self.clients["agent"].wait_final(pid, timeout)

    def history(self, pid: str) -> list[dict[str, Any]]:
        return self.clients["agent"].history(pid)

    def call(self, who: str, tool: str, arguments: dict[str, Any], **kw: Any) -> dict[str, Any]:
        return self.wait(self.propose(who, tool, arguments, **kw))

    def park(self, who: str, tool: str, arguments: dict[str, Any]) -> Parked:
        return self.park_many([(who, tool, arguments)])[0]

    def park_many(self, calls: list[tuple[str, str, dict[str, Any]]]) -> list[Parked]:
        sent = []
        for who, tool, arguments in calls:
            traceparent, trace_id = new_trace()
            rid = run_id()
            pid = self.propose(who, tool, arguments, run_id=rid, traceparent=traceparent)
            sent.append((pid, rid, traceparent, trace_id, tool, arguments, who))
        out = []
        for pid, rid, traceparent, trace_id, tool, arguments, who in sent:
            obs = self.wait(pid)
            refused(
                obs,
                "CONFIRMATION_MISSING",
                "confirmation",
                ["approval_required"],
                "PENDING_APPROVAL",
            )
            request_id = obs["approval_request_id"]
            assert isinstance(request_id, str) and request_id.startswith("req_")
            assert request_id in obs["next_action"]
            out.append(Parked(pid, rid, request_id, trace_id, traceparent, tool, arguments, who))
        return out

    # -- approvals ---------------------------------------------------------------------------

    def sign(
        self,
        approver: str,
        *,
        trace_id: str,
        tool: str,
        arguments: dict[str, Any],
        tenant: str = ACME,
        requester: str = "agent",
        request_id: str | None = None,
        decision: str = "approved",
        now_ms: int | None = None,
        ttl_s: int = 600,
        key: ed25519.Ed25519PrivateKey | None = None,
        reason: str | None = None,
        approval_id: str | None = None,
    ) -> dict[str, Any]:
        if approval_id is None and request_id is None:
            # Attached approvals have no request; without an id of their own, two
            # approvals of the same payload by the same approver would share one.
            approval_id = f"appr_{uuid.uuid4().hex[:24]}"
        return sign_approval(
            key or self.approver_keys[approver],
            approver_id=approver,
            tenant_id=tenant,
            trace_id=trace_id,
            tool_name=tool,
            tool_version="1.0.0",
            payload_hash=payload_hash(arguments),
            requested_by_user=self.principals[requester][0],
            requested_by_agent=self.principals[requester][1],
            decision=decision,
            request_id=request_id,
            now_ms=int(time.time() * 1000) if now_ms is None else now_ms,
            ttl_s=ttl_s,
            reason=reason,
            approval_id=approval_id,
        )

    def sign_for(self, parked: Parked, approver: str, **kw: Any) -> dict[str, Any]:
        kw.setdefault("arguments", parked.arguments)
        kw.setdefault("requester", parked.requester)
        return self.sign(
            approver,
            trace_id=parked.trace_id,
            tool=parked.tool,
            request_id=parked.request_id,
            **kw,
        )

    def publish(
        self, record: dict[str, Any] | bytes, key: str, timestamp_ms: int | None = None
    ) -> bytes:
        """One record on tool.approvals, as an approver's console sends it."""
        value = record if isinstance(record, bytes) else orjson.dumps(record)
        topic = self.settings.topics.approvals
        if timestamp_ms is None:
            self.producer.produce(topic, value, key.encode())
        else:  # the record's CreateTime, which the producer chooses
            self.producer.produce(topic, value, key.encode(), timestamp=timestamp_ms)
        assert self.producer.flush(15) == 0
        return value

    # -- outputs -----------------------------------------------------------------------------

    def calls(self, side_effect: str) -> list[dict[str, Any]]:
        """Every approved call on tool.exec.<class>. An observation and its call are
        committed in one transaction, so once the observation is seen the call is too."""
        topic = self.settings.topics.execution(side_effect)
        return [codec("approved_call").decode(value(m)) for m in self.reader(topic).sync()]

    def calls_for(self, pids: list[str], side_effect: str) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {pid: [] for pid in pids}
        for c in self.calls(side_effect):
            if c["proposal_id"] in out:
                out[c["proposal_id"]].append(c)
        return out

    def none_ran(self, pids: list[str], side_effect: str) -> None:
        ran = {pid: c for pid, c in self.calls_for(pids, side_effect).items() if c}
        assert ran == {}, ran

    def requests(self, request_ids: list[str]) -> dict[str, dict[str, Any]]:
        decoded = (
            codec("approval_request").decode(value(m))
            for m in self.reader(self.settings.topics.approval_requests).sync()
        )
        return {r["request_id"]: r for r in decoded if r["request_id"] in request_ids}

    def dead_letters(
        self, values: list[bytes], until: list[bytes] | None = None, timeout: float = 30
    ) -> dict[bytes, str]:
        """The DLQ reason of those of these tool.approvals records that are on the DLQ,
        once all of ``until`` (default: all of them) are."""
        wanted = set(values if until is None else until)
        deadline = time.monotonic() + timeout
        while True:
            found = {}
            for m in self.reader(self.settings.topics.dlq).sync():
                if m.value() in values:
                    assert header(m, "toolsentry.error.class") == "CONFIRMATION_MISSING"
                    assert header(m, "toolsentry.source.topic") == self.settings.topics.approvals
                    found[value(m)] = header(m, "toolsentry.error.reason")
            if wanted <= found.keys() or time.monotonic() > deadline:
                return found
            time.sleep(0.2)


@pytest.fixture(scope="module")
def world(stack_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    settings = isolated(stack_settings, "gates")
    publish_references(settings, REFERENCES)
    proc = ProcessorProcess(settings, "gates-1", tmp_path_factory.mktemp("gates-logs")).start()
    w: World | None = None
    try:
        proc.wait_ready()
        wait_until_loaded(settings, timeout=60)
        w = World(settings, proc)
        yield w
    finally:
        if w is not None:
            w.close()
        if proc.alive():
            assert proc.terminate() == 0, proc.log()[-3000:]


# -- 1. the seed story -------------------------------------------------------------------------


def test_seed_story_from_invented_id_to_approved_cancellation(world: World) -> None:
    run = run_id()
    traceparent, trace_id = new_trace()

    invented = world.call("agent", "cancel_order", cancel("ORD-12345"), run_id=run)
    [err] = refused(invented, "OUT_OF_BOUNDS", "schema", ["pattern_mismatch"])
    assert err["field"] == "order_id"
    assert "lookup_order" in invented["next_action"]

    looked_up = world.call("agent", "lookup_order", {"order_id": ORDER}, run_id=run)
    assert looked_up["decision"] == "ROUTED" and looked_up["gate"] == "route"
    assert looked_up["status"]["taxonomy_class"] == "SUCCESS"
    assert looked_up["result_payload"]["errors"] == []

    unknown = world.call("agent", "cancel_order", cancel(UNKNOWN), run_id=run)
    [err] = refused(unknown, "SEMANTIC_INVALIDITY", "semantic", ["unknown_reference"])
    assert err["field"] == "order_id" and err["hint"] == "call lookup_order"
    assert "lookup_order" in unknown["next_action"]
    assert "never construct" in unknown["next_action"]

    pid = world.propose("agent", "cancel_order", cancel(), run_id=run, traceparent=traceparent)
    pending = world.wait(pid)
    [err] = refused(
        pending, "CONFIRMATION_MISSING", "confirmation", ["approval_required"], "PENDING_APPROVAL"
    )
    assert err["expected"] == "1"
    request_id = pending["approval_request_id"]
    assert request_id and request_id in pending["next_action"]
    assert "do not propose it again" in pending["next_action"]

    packet = world.requests([request_id])[request_id]
    assert packet["proposal_id"] == pid and packet["tenant_id"] == ACME
    assert packet["trace_id"] == trace_id
    assert packet["tool_name"] == "cancel_order" and packet["action"] == "cancel_order@1.0.0"
    assert packet["side_effect_class"] == "HIGH_RISK_EXTERNAL"
    assert packet["before_state"] == f"order {ORDER} is processing"
    assert orjson.loads(packet["arguments"]) == cancel()
    assert packet["arguments"] == canonical_json(cancel()).decode()
    assert packet["payload_hash"] == payload_hash(cancel())
    assert packet["approvals_required"] == 1
    assert packet["requested_by_user"] == "u-agent"
    assert "cannot be undone" in packet["consequence"]
    lifetime = packet["expires_at"] - packet["created_at"]
    assert lifetime.total_seconds() == pytest.approx(600, abs=1)
    assert world.calls_for([pid], "HIGH_RISK_EXTERNAL") == {pid: []}

    # The operator finds it in the queue and reads the packet with the CLI, as documented.
    def cli_run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "processor", "approvals", *args],
            cwd=ROOT,
            env={**settings_env(world.settings, "gates-cli"), "COLUMNS": "250"},
            capture_output=True,
            text=True,
            timeout=60,
        )

    listed = cli_run("list")
    assert listed.returncode == 0 and request_id in listed.stdout, listed.stdout + listed.stderr
    shown = cli_run("show", request_id)
    assert shown.returncode == 0, shown.stderr
    for text in ("cancel_order@1.0.0", "order WO-12345-A is processing", "HIGH_RISK_EXTERNAL",
                 "cannot be undone", "0 of 1"):  # fmt: skip
        assert text in shown.stdout, shown.stdout
    assert cli_run("show", "req_nothing").returncode == 1

    # The operator approves with the CLI, exactly as documented.
    assert world.settings.approvers_file is not None
    key = Path(world.settings.approvers_file).parent / "approver-ops-1.jwk"
    cli_args = ["--key", str(key), "--as", "ops-1"]
    cli = subprocess.run(
        [sys.executable, "-m", "processor", "approvals", "approve", request_id, *cli_args],
        cwd=ROOT,
        env=settings_env(world.settings, "gates-cli"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    approval_id = approval_id_for(request_id, "ops-1", payload_hash(cancel()))
    assert approval_id in cli.stdout

    released = world.final(pid)
    assert released["decision"] == "ROUTED" and released["gate"] == "approval"
    assert released["status"]["taxonomy_class"] == "SUCCESS"
    assert released["approval_request_id"] is None
    assert any("ops-1" in w and request_id in w for w in released["result_payload"]["warnings"])
    assert [o["decision"] for o in world.history(pid)] == ["PENDING_APPROVAL", "ROUTED"]

    [call] = world.calls_for([pid], "HIGH_RISK_EXTERNAL")[pid]
    assert call["approval_ids"] == [approval_id]
    assert call["payload_hash"] == payload_hash(cancel())
    assert orjson.loads(call["arguments"]) == cancel()
    assert call["trace_id"] == trace_id and call["tenant_id"] == ACME


# -- 2. tokens ---------------------------------------------------------------------------------


def _claims(tenant: str = ACME) -> dict[str, Any]:
    now = int(time.time())
    return {
        "sub": "u-agent",
        "tenant_id": tenant,
        "agent_id": "agent-1",
        "scope": "orders:read orders:write",
        "clearance": "secret",
        "aud": "toolsentry",
        "iat": now,
        "exp": now + 3600,
    }


def _unsigned(header: dict[str, Any], claims: dict[str, Any]) -> str:
    return b64(orjson.dumps(header)) + "." + b64(orjson.dumps(claims))


def test_tokens_that_do_not_prove_identity_are_refused(world: World) -> None:
    s = world.settings
    kid = world.issuer.kid
    stranger = ed25519.Ed25519PrivateKey.generate()
    good = token(s, ACME, user="u-agent", agent="agent-1")

    header, body, signature = good.split(".")
    claims = orjson.loads(unb64(body))
    assert claims["tenant_id"] == ACME
    tampered = ".".join([header, b64(orjson.dumps({**claims, "tenant_id": GLOBEX})), signature])

    assert s.identity.jwks_file is not None
    [jwk] = orjson.loads(Path(s.identity.jwks_file).read_bytes())["keys"]
    hs_input = _unsigned({"alg": "HS256", "typ": "JWT", "kid": kid}, _claims())
    hs_sig = hmac.new(unb64(jwk["x"]), hs_input.encode(), hashlib.sha256).digest()

    cases: list[tuple[str, str | None, str, str]] = [
        # (name, token, envelope tenant, expected code)
        ("missing", None, ACME, "token_missing"),
        ("expired", token(s, ACME, now=time.time() - 7200, ttl_s=3600), ACME, "token_expired"),
        ("not yet valid", token(s, ACME, nbf=int(time.time()) + 600), ACME, "token_not_yet_valid"),
        (
            "alg none",
            _unsigned({"alg": "none", "typ": "JWT", "kid": kid}, _claims()) + ".",
            ACME,
            "token_alg_refused",
        ),
        (
            "forged",
            TokenIssuer(kid, "EdDSA", stranger).mint(ACME, "u-agent", "agent-1", ["orders:read"]),
            ACME,
            "token_signature_invalid",
        ),
        (
            "unknown kid",
            TokenIssuer("rogue-kid", "EdDSA", stranger).mint(ACME, "u", "a", ["orders:read"]),
            ACME,
            "token_unknown_key",
        ),
        (
            "wrong audience",
            TokenIssuer(kid, "EdDSA", world.issuer.private_key, audience="billing").mint(
                ACME, "u-agent", "agent-1", ["orders:read"]
            ),
            ACME,
            "token_wrong_audience",
        ),
        ("tampered", tampered, GLOBEX, "token_signature_invalid"),
        ("hs256 with public key", hs_input + "." + b64(hs_sig), ACME, "token_alg_refused"),
    ]
    sent = []
    for name, tok, tenant, code in cases:
        envelope: dict[str, Any] = {"tenant_id": tenant}
        if tok is not None:
            envelope["principal_token"] = tok
        # A read that would run for a verified principal: only identity can stop it.
        pid = world.propose("anonymous", "lookup_order", {"order_id": ORDER}, **envelope)
        sent.append((name, pid, code))
    pids = [pid for _, pid, _ in sent]
    for name, pid, code in sent:
        obs = world.wait(pid)
        [err] = refused(obs, "PERMISSION_DENIED", "identity", [code])
        assert err["field"] == "principal_token", name
        assert obs["status"]["fail_closed"] is True
        assert "fresh principal token" in obs["next_action"], name
    world.none_ran(pids, "READ_ONLY")

    # The same read with the real token runs: the refusals above are the tokens' doing.
    assert world.call("agent", "lookup_order", {"order_id": ORDER})["decision"] == "ROUTED"


def test_tenant_and_scope_come_from_the_token_only(world: World) -> None:
    wrong_tenant = world.propose("agent", "lookup_order", {"order_id": ORDER}, tenant_id=GLOBEX)
    unsigned_claims = {
        "principal": {"tenant_id": ACME, "user_id": "admin", "scopes": ["*"]},
        "scopes": ["*", "orders:write"],
        "clearance": "secret",
    }
    no_scope = world.propose("narrow", "cancel_order", cancel(), **unsigned_claims)

    obs = world.wait(wrong_tenant)
    [err] = refused(obs, "PERMISSION_DENIED", "identity", ["tenant_mismatch"])
    assert (err["field"], err["expected"], err["actual"]) == ("tenant_id", ACME, GLOBEX)
    assert "only act for the tenant" in obs["next_action"]

    obs = world.wait(no_scope)
    [err] = refused(obs, "PERMISSION_DENIED", "identity", ["scope_missing"])
    assert (err["expected"], err["actual"]) == ("orders:write", "orders:read")
    assert "handoff_to_human" in obs["next_action"]
    [warning] = obs["result_payload"]["warnings"]
    assert "ignored unknown envelope fields" in warning
    assert "principal" in warning and "scopes" in warning
    world.none_ran([wrong_tenant], "READ_ONLY")
    world.none_ran([no_scope], "HIGH_RISK_EXTERNAL")


# -- 3. references, state and rules -------------------------------------------------------------


def test_references_state_and_rules(world: World) -> None:
    foreign = world.propose(
        "agent",
        "cancel_order",
        cancel(GLOBEX_ORDER),
        # An unsigned claim to be globex changes nothing.
        principal={"tenant_id": GLOBEX},
    )
    shipped = world.propose("agent", "cancel_order", cancel(SHIPPED))
    cancelled = world.propose("agent", "cancel_order", cancel(CANCELLED))
    same_account = world.propose("agent", "transfer_funds", {**TRANSFER, "to_account_id": ACC_FROM})
    same_currency = world.propose(
        "agent", "convert_currency", {"amount": 19.99, "from_currency": "EUR", "to_currency": "EUR"}
    )
    # The owner of that order gets past the semantic gate (and waits for approval).
    globex_own = world.propose("globex", "cancel_order", cancel(GLOBEX_ORDER))

    obs = world.wait(foreign)
    [err] = refused(obs, "PERMISSION_DENIED", "identity", ["cross_tenant_reference"])
    assert err["field"] == "order_id" and ACME in err["message"]
    assert "another tenant" in obs["next_action"]

    for pid, state in ((shipped, "shipped"), (cancelled, "cancelled")):
        obs = world.wait(pid)
        [err] = refused(obs, "STALE_STATE", "state", ["invalid_state"])
        assert (err["field"], err["expected"], err["actual"]) == (
            "order_id",
            "received, processing",
            state,
        )
        assert f"already {state}" in obs["next_action"] and "lookup_order" in obs["next_action"]

    obs = world.wait(same_account)
    [err] = refused(obs, "SEMANTIC_INVALIDITY", "semantic", ["rule_failed"])
    assert err["expected"] == "distinct_accounts" and "distinct_accounts" in err["message"]
    assert "lookup_account" in obs["next_action"]

    obs = world.wait(same_currency)
    [err] = refused(obs, "SEMANTIC_INVALIDITY", "semantic", ["rule_failed"])
    assert err["expected"] == "currencies_differ"
    assert "which currency" in obs["next_action"]

    assert world.wait(globex_own)["decision"] == "PENDING_APPROVAL"

    world.none_ran([foreign, shipped, cancelled], "HIGH_RISK_EXTERNAL")
    world.none_ran([same_account], "CRITICAL_MUTATION")
    world.none_ran([same_currency], "READ_ONLY")


def test_a_reference_state_redis_lost_is_loaded_again_before_it_decides(world: World) -> None:
    """Redis goes back (a flush, a restore): the cancelled order reads as processing again
    and the loaders' positions are gone. The processor waits for its loader to load the
    topic again instead of deciding on the older state, under which this cancellation
    of a cancelled order would go through."""
    s = world.settings
    redis = connect(s.redis_url)
    ek = entity_key(s.redis_namespace, ACME, "order", CANCELLED)
    assert orjson.loads(redis.get(ek) or b"{}")["state"] == "cancelled"
    redis.set(ek, orjson.dumps({"state": "processing", "owner": "cust-2"}))
    redis.delete(position_key(s.redis_namespace, s.reference_group_id))
    pid = world.propose("agent", "cancel_order", cancel(CANCELLED))
    [err] = refused(world.wait(pid), "STALE_STATE", "state", ["invalid_state"])
    assert err["actual"] == "cancelled"
    world.none_ran([pid], "HIGH_RISK_EXTERNAL")


# -- 4. policy -----------------------------------------------------------------------------------

AWS_KEY = "AKIAIOSFODNN7EXAMPLE"
GITHUB_TOKEN = "ghp_" + "a1B2c3D4e5" * 4
PASSWORD = "hunter2-Xq9"


def test_policy_secrets_egress_and_clearance(world: World) -> None:
    in_note = world.propose(
        "agent",
        "update_ticket",
        {"ticket_id": TICKET, "note": f"customer pasted their token {GITHUB_TOKEN} here"},
    )
    in_query = world.propose("agent", "search_kb", {"query": f"password={PASSWORD} reset"})
    aws = world.propose("agent", "search_kb", {"query": f"key {AWS_KEY} leaked"})
    clean = world.propose("agent", "search_kb", {"query": "how do I reset my password"})

    urls = {
        "https://evil.example.org/collect": "not an allowed domain",
        "https://169.254.169.254/latest/meta-data/iam/": "IP address",
        "https://metadata.google.internal/computeMetadata/v1/": "metadata",
    }
    egress = {u: world.propose("agent", "fetch_url", {"url": u}) for u in urls}
    allowed = world.propose("agent", "fetch_url", {"url": "https://docs.example.com/returns"})

    low = world.propose("public", "lookup_order", {"order_id": ORDER}, clearance="secret")

    for pid, field, kind, secret in (
        (in_note, "note", "github_token", GITHUB_TOKEN),
        (in_query, "query", "password", PASSWORD),
        (aws, "query", "aws_access_key_id", AWS_KEY),
    ):
        obs = world.wait(pid)
        [err] = refused(obs, "POLICY_VIOLATION", "policy", ["secret_in_arguments"])
        assert err["field"] == field and kind in err["message"]
        assert "Never put credentials" in obs["next_action"]
        assert secret not in orjson.dumps(obs).decode()
    assert world.wait(clean)["decision"] == "ROUTED"

    for url, reason in urls.items():
        obs = world.wait(egress[url])
        [err] = refused(obs, "POLICY_VIOLATION", "policy", ["egress_denied"])
        assert err["field"] == "url" and reason in err["message"], err
        assert "docs.example.com" in obs["next_action"]
    assert world.wait(allowed)["decision"] == "ROUTED"

    obs = world.wait(low)
    [err] = refused(obs, "POLICY_VIOLATION", "policy", ["clearance_insufficient"])
    assert (err["expected"], err["actual"]) == ("confidential", "public")
    assert "handoff_to_human" in obs["next_action"]

    world.none_ran([in_query, aws, *egress.values(), low], "READ_ONLY")
    world.none_ran([in_note], "LOW_RISK_INTERNAL")


def test_a_credential_in_an_argument_key_or_bad_value_is_never_echoed(world: World) -> None:
    secret = "sk_live_" + "Zx9" * 8
    github = "ghp_" + "Q7x" * 12
    address = {"line1": "1 Main St", "city": "Springfield", "postal_code": "12345",
               "country_code": "US"}  # fmt: skip
    as_key = world.propose("agent", "search_kb", {"query": "return policy", secret: "x"})
    as_id = world.propose("agent", "lookup_order", {"order_id": secret})
    nested_key = world.propose(
        "agent", "validate_address", {"address": {**address, github: "see the vault"}}
    )
    for pid in (as_key, as_id, nested_key):
        obs = world.wait(pid)
        # Refused as a credential, before the schema gate could quote the key or value.
        refused(obs, "POLICY_VIOLATION", "policy", ["secret_in_arguments"])
        for leaked in (secret, github):
            assert leaked not in orjson.dumps(obs).decode(), obs["result_payload"]["errors"]
    fields = {e["field"] for e in world.wait(nested_key)["result_payload"]["errors"]}
    assert fields == {"address/ghp_…"}, fields
    world.none_ran([as_key, as_id, nested_key], "READ_ONLY")


# -- 5. approvals ----------------------------------------------------------------------------


def test_an_attached_approval_runs_the_call_once(world: World) -> None:
    traceparent, trace_id = new_trace()
    run = run_id()
    approval = world.sign("ops-1", trace_id=trace_id, tool="cancel_order", arguments=cancel())
    first = world.propose(
        "agent", "cancel_order", cancel(), run_id=run, traceparent=traceparent, approvals=[approval]
    )
    # The same proposal again in the same run has the same idempotency key: the in-flight
    # call answers it. In another run (another key) only the spent approval stops it.
    again = world.propose(
        "agent", "cancel_order", cancel(), run_id=run, traceparent=traceparent, approvals=[approval]
    )
    obs = world.wait(first)
    assert obs["decision"] == "ROUTED" and obs["gate"] == "route"
    assert obs["status"]["taxonomy_class"] == "SUCCESS"
    replay = world.propose(
        "agent", "cancel_order", cancel(), run_id=run_id(), traceparent=traceparent,
        approvals=[approval],
    )  # fmt: skip
    refused(world.wait(again), "IDEMPOTENCY_CONFLICT", "idempotency", ["idempotency_in_flight"])
    obs = world.wait(replay)
    [err] = refused(obs, "CONFIRMATION_MISSING", "confirmation", ["approval_reused"])
    assert approval["approval_id"] in err["message"]
    assert "one execution only" in obs["next_action"]

    calls = world.calls_for([first, again, replay], "HIGH_RISK_EXTERNAL")
    assert calls[replay] == [] and calls[again] == []
    [call] = calls[first]
    assert call["approval_ids"] == [approval["approval_id"]]
    spent = [
        c for c in world.calls("HIGH_RISK_EXTERNAL") if approval["approval_id"] in c["approval_ids"]
    ]
    assert len(spent) == 1


def test_attached_approvals_not_valid_for_the_call_are_refused(world: World) -> None:
    stranger = ed25519.Ed25519PrivateKey.generate()
    stale = int(time.time() * 1000) - 700_000
    forever = {"expires_at": "2099-01-01T00:00:00.000Z"}
    other = {"arguments": cancel(reason="duplicate_order")}
    # (proposing principal, approver, signing options, changes after signing, expected code)
    cases: list[tuple[str, str, dict[str, Any], dict[str, Any], str]] = [
        ("agent", "ops-1", other, {}, "approval_payload_mismatch"),
        ("agent", "ops-1", {"now_ms": stale}, {}, "approval_expired"),
        ("agent", "mallory", {"key": stranger}, {}, "approver_unknown"),
        ("agent", "ops-1", {"key": stranger}, {}, "approval_signature_invalid"),
        ("agent", "ops-1", {}, forever, "approval_signature_invalid"),
        ("agent", "viewer", {}, {}, "approver_not_allowed"),
        ("ops1", "ops-1", {}, {}, "self_approval"),
        ("agent", "ops-2", {"decision": "rejected", "reason": "no"}, {}, "approval_rejected"),
        # Given for another agent's identical call (same trace, same arguments).
        ("agent", "ops-1", {"requester": "narrow"}, {}, "approval_requester_mismatch"),
    ]  # fmt: skip
    sent = []
    for who, approver, options, changes, code in cases:
        traceparent, trace_id = new_trace()
        options = {"arguments": cancel(), **options}
        options.setdefault("requester", who)
        approval = {**world.sign(approver, trace_id=trace_id, tool="cancel_order", **options)}
        approval.update(changes)
        pid = world.propose(
            who, "cancel_order", cancel(), traceparent=traceparent, approvals=[approval]
        )
        sent.append((pid, code))
    for pid, code in sent:
        obs = world.wait(pid)
        [err] = refused(obs, "CONFIRMATION_MISSING", "confirmation", [code])
        assert err["field"] == "approvals/0", code
        assert "propose the call without one" in obs["next_action"], code
    world.none_ran([pid for pid, _ in sent], "HIGH_RISK_EXTERNAL")


def test_attached_approvals_for_a_critical_mutation_need_two_approvers(world: World) -> None:
    traceparent, trace_id = new_trace()
    run = run_id()

    def approval(approver: str) -> dict[str, Any]:
        return world.sign(approver, trace_id=trace_id, tool="transfer_funds", arguments=TRANSFER)

    ops1, ops1_again, ops2 = approval("ops-1"), approval("ops-1"), approval("ops-2")
    assert ops1["approval_id"] != ops1_again["approval_id"]
    attempts = [[ops1], [ops1, ops1_again], [ops1, ops2]]
    pids = [
        world.propose(
            "agent", "transfer_funds", TRANSFER, run_id=run, traceparent=traceparent, approvals=a
        )
        for a in attempts
    ]

    for pid in pids[:2]:
        obs = world.wait(pid)
        [err] = refused(obs, "CONFIRMATION_MISSING", "confirmation", ["approvals_insufficient"])
        assert (err["expected"], err["actual"]) == ("2", "1")
        assert "2 different approvers" in obs["next_action"]
    # A refused attempt does not spend its approvals: ops-1's first one still counts.
    obs = world.wait(pids[2])
    assert obs["decision"] == "ROUTED" and obs["gate"] == "route"
    assert obs["tool_identity"]["side_effect_class"] == "CRITICAL_MUTATION"

    calls = world.calls_for(pids, "CRITICAL_MUTATION")
    assert calls[pids[0]] == [] and calls[pids[1]] == []
    [call] = calls[pids[2]]
    assert sorted(call["approval_ids"]) == sorted([ops1["approval_id"], ops2["approval_id"]])


def test_decisions_on_tool_approvals_are_checked_and_release_once(world: World) -> None:
    parked, own = world.park_many(
        [("agent", "cancel_order", cancel()), ("ops1", "cancel_order", cancel(ORDER_2))]
    )
    stranger = ed25519.Ed25519PrivateKey.generate()
    now_ms = int(time.time() * 1000)
    bad = {
        "approval_payload_mismatch": world.sign_for(
            parked, "ops-1", arguments=cancel(reason="fraud_suspected")
        ),
        "approval_expired": world.sign_for(parked, "ops-1", now_ms=now_ms - 700_000),
        "approver_unknown": world.sign_for(parked, "mallory", key=stranger),
        "approval_signature_invalid": {
            **world.sign_for(parked, "ops-2"),
            "expires_at": "2099-01-01T00:00:00.000Z",
        },
        "approver_not_allowed": world.sign_for(parked, "viewer"),
        # Signed for the request, but naming another requester than its packet does.
        "approval_requester_mismatch": world.sign_for(parked, "ops-2", requester="narrow"),
        "approval_unknown_request": {
            **world.sign_for(parked, "ops-2"),
            "request_id": "req_000000000000000000000000",
        },
    }
    sent = {world.publish(a, parked.run_id): code for code, a in bad.items()}
    self_approval = world.publish(world.sign_for(own, "ops-1"), own.run_id)

    good = world.sign_for(parked, "ops-1")
    world.publish(good, parked.run_id)
    released = world.final(parked.proposal_id)
    assert released["decision"] == "ROUTED" and released["gate"] == "approval"
    assert released["status"]["taxonomy_class"] == "SUCCESS"

    # The requester's own approval did nothing; a different approver releases it.
    world.publish(world.sign_for(own, "ops-2"), own.run_id)
    assert world.final(own.proposal_id)["gate"] == "approval"

    dead = world.dead_letters([*sent, self_approval])
    assert dead == {**sent, self_approval: "self_approval"}

    # The same approval again, on tool.approvals and attached to a resubmission: no second
    # run. (Resubmitted in the same run, the released call's idempotency key answers first;
    # in another run, the spent approval does.)
    world.publish(good, parked.run_id)
    same_run = world.propose(
        "agent", "cancel_order", parked.arguments, run_id=parked.run_id,
        traceparent=parked.traceparent, approvals=[good],
    )  # fmt: skip
    refused(world.wait(same_run), "IDEMPOTENCY_CONFLICT", "idempotency", ["idempotency_in_flight"])
    resubmitted = world.propose(
        "agent",
        "cancel_order",
        parked.arguments,
        run_id=run_id(),
        traceparent=parked.traceparent,
        approvals=[good],
    )
    obs = world.wait(resubmitted)
    [err] = refused(obs, "CONFIRMATION_MISSING", "confirmation", ["approval_reused"])
    assert good["approval_id"] in err["message"]

    calls = world.calls_for(
        [parked.proposal_id, own.proposal_id, resubmitted], "HIGH_RISK_EXTERNAL"
    )
    [call] = calls[parked.proposal_id]
    assert call["approval_ids"] == [good["approval_id"]]
    [own_call] = calls[own.proposal_id]
    assert own_call["approval_ids"] == [
        approval_id_for(own.request_id, "ops-2", payload_hash(own.arguments))
    ]
    assert calls[resubmitted] == []
    assert [o["decision"] for o in world.history(parked.proposal_id)] == [
        "PENDING_APPROVAL",
        "ROUTED",
    ]


def test_a_parked_critical_mutation_waits_for_a_second_distinct_approver(world: World) -> None:
    parked = world.park("agent", "transfer_funds", TRANSFER)
    packet = world.requests([parked.request_id])[parked.request_id]
    assert packet["approvals_required"] == 2
    assert packet["before_state"] == f"account {ACC_FROM} is active; account {ACC_TO} is active"

    first = world.sign_for(parked, "ops-1")
    world.publish(first, parked.run_id)
    # ops-1 once more under another approval id: the same approver does not count twice,
    # and the decision that changed nothing is accounted for in the DLQ.
    again = world.sign_for(parked, "ops-1", approval_id=f"appr_{uuid.uuid4().hex[:24]}")
    assert again["approval_id"] != first["approval_id"]
    again_value = world.publish(again, parked.run_id)
    replay = world.publish(first, parked.run_id)
    dead = world.dead_letters([again_value, replay], until=[replay])
    assert dead == {again_value: "approver_already_counted", replay: "approval_reused"}
    # Everything before the replay (same partition) is decided: the call still waits.
    assert [o["decision"] for o in world.history(parked.proposal_id)] == ["PENDING_APPROVAL"]
    assert world.calls_for([parked.proposal_id], "CRITICAL_MUTATION") == {parked.proposal_id: []}

    second = world.sign_for(parked, "ops-2")
    world.publish(second, parked.run_id)
    released = world.final(parked.proposal_id)
    assert released["decision"] == "ROUTED" and released["gate"] == "approval"
    [call] = world.calls_for([parked.proposal_id], "CRITICAL_MUTATION")[parked.proposal_id]
    assert call["approval_ids"] == [first["approval_id"], second["approval_id"]]


def test_a_proposal_reusing_a_parked_ones_id_does_not_inherit_its_votes(world: World) -> None:
    """The same proposal id and arguments, in another run (so another idempotency key):
    it parks a request of its own. Were it to share the first one's, ops-1's vote on
    the first and ops-2's on the second would release a critical mutation in a run no
    two approvers looked at."""
    first = world.park("agent", "transfer_funds", TRANSFER)
    world.publish(world.sign_for(first, "ops-1"), first.run_id)
    traceparent, trace_id = new_trace()
    other_run = run_id()
    world.propose(
        "agent",
        "transfer_funds",
        TRANSFER,
        run_id=other_run,
        traceparent=traceparent,
        proposal_id=first.proposal_id,
    )
    deadline = time.monotonic() + 60
    while len(world.history(first.proposal_id)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    first_obs, second_obs = world.history(first.proposal_id)
    assert first_obs["approval_request_id"] == first.request_id
    assert second_obs["decision"] == "PENDING_APPROVAL", second_obs["status"]
    second = Parked(
        first.proposal_id,
        other_run,
        second_obs["approval_request_id"],
        trace_id,
        traceparent,
        "transfer_funds",
        TRANSFER,
        first.requester,
    )
    assert second.request_id != first.request_id

    world.publish(world.sign_for(second, "ops-2"), other_run)
    # A refused decision after it, on the same partition: once it is in the DLQ, ops-2's
    # approval has been decided too.
    marker = world.publish(world.sign_for(second, "viewer"), other_run)
    assert world.dead_letters([marker]) == {marker: "approver_not_allowed"}
    world.none_ran([first.proposal_id], "CRITICAL_MUTATION")
    assert [o["decision"] for o in world.history(first.proposal_id)] == [
        "PENDING_APPROVAL",
        "PENDING_APPROVAL",
    ]


def test_a_rejection_ends_the_parked_call(world: World) -> None:
    parked = world.park("agent", "cancel_order", cancel())
    world.publish(
        world.sign_for(parked, "ops-2", decision="rejected", reason="customer changed their mind"),
        parked.run_id,
    )
    obs = world.final(parked.proposal_id)
    [err] = refused(obs, "CONFIRMATION_MISSING", "approval", ["approval_rejected"])
    assert "ops-2" in err["message"] and "customer changed their mind" in err["message"]
    assert "declined" in obs["next_action"] and "cancel_order" in obs["next_action"]

    # A late approval finds the request ended: still nothing runs.
    late = world.publish(world.sign_for(parked, "ops-1"), parked.run_id)
    # A refused decision after it, on the same partition: once it is in the DLQ, the late
    # approval has been decided too.
    marker = world.publish(world.sign_for(parked, "viewer"), parked.run_id)
    assert world.dead_letters([late, marker], until=[marker]) == {
        late: "approval_request_ended",
        marker: "approver_not_allowed",
    }
    assert len(world.history(parked.proposal_id)) == 2
    world.none_ran([parked.proposal_id], "HIGH_RISK_EXTERNAL")

    # An ended request stays readable for a day (approvals show), then its payload goes.
    store = ApprovalStore(connect(world.settings.redis_url), world.settings.redis_namespace)
    ended = store.find(parked.request_id)
    assert ended is not None and ended["state"] == "rejected"
    assert ended["rejected_by"] == "ops-2" and ended["reason"] == "customer changed their mind"
    assert store.forget_ended(int(time.time() * 1000)) == 0
    assert store.forget_ended(int(time.time() * 1000) + 86_400_000 + 60_000) >= 1
    assert store.find(parked.request_id) is None


def test_an_approval_that_came_after_its_request_ended_cannot_run_the_call_again(
    world: World,
) -> None:
    """ops-2's approval arrives once the request ended (released by ops-1, or declined by
    ops-2 themselves before ops-1's): it ends nothing, and it is spent all the same. The
    agent that attaches it to the same call in another run does not get the call run a
    second time, nor the declined call run after all."""
    released, declined = world.park_many(
        [("agent", "cancel_order", cancel()), ("agent", "cancel_order", cancel(ORDER_2))]
    )
    world.publish(world.sign_for(released, "ops-1"), released.run_id)
    assert world.final(released.proposal_id)["decision"] == "ROUTED"
    world.publish(
        world.sign_for(declined, "ops-2", decision="rejected", reason="no"), declined.run_id
    )
    assert world.final(declined.proposal_id)["decision"] == "REJECTED"
    late = {
        released.proposal_id: world.sign_for(released, "ops-2"),
        declined.proposal_id: world.sign_for(declined, "ops-1"),
    }
    sent = [world.publish(a, released.run_id) for a in late.values()]
    # A refused decision after them, on the same partition: once it is in the DLQ, the
    # late approvals have been decided too.
    marker = world.publish(world.sign_for(released, "viewer"), released.run_id)
    assert world.dead_letters([*sent, marker], until=[marker]) == {
        **dict.fromkeys(sent, "approval_request_ended"),
        marker: "approver_not_allowed",
    }

    attached = [
        world.propose(
            "agent",
            parked.tool,
            parked.arguments,
            run_id=run_id(),
            traceparent=parked.traceparent,
            approvals=[late[parked.proposal_id]],
        )
        for parked in (released, declined)
    ]
    for pid in attached:
        refused(world.wait(pid), "CONFIRMATION_MISSING", "confirmation", ["approval_reused"])
    world.none_ran([*attached, declined.proposal_id], "HIGH_RISK_EXTERNAL")
    ran = world.calls_for([released.proposal_id], "HIGH_RISK_EXTERNAL")
    assert len(ran[released.proposal_id]) == 1


def test_a_rejection_after_the_call_went_ahead_with_attached_approvals_is_not_a_decline(
    world: World,
) -> None:
    """Parked, then sent again in its run with ops-1's approval attached: the resubmission
    takes the key over and runs. ops-2's later rejection of the request must not tell the
    agent the call was declined and did not run; but the parked proposal, told it would
    hear either way, has had no final answer: it is told that its call went ahead as
    another proposal (as a release of the request would tell it), once."""
    parked = world.park("agent", "cancel_order", cancel())
    resubmitted = world.propose(
        "agent", "cancel_order", parked.arguments, run_id=parked.run_id,
        traceparent=parked.traceparent, approvals=[world.sign_for(parked, "ops-1")],
    )  # fmt: skip
    obs = world.wait(resubmitted)
    assert obs["decision"] == "ROUTED" and obs["gate"] == "route"
    rejection = world.publish(
        world.sign_for(parked, "ops-2", decision="rejected", reason="too late"), parked.run_id
    )
    final = world.final(parked.proposal_id)
    refused(final, "IDEMPOTENCY_CONFLICT", "idempotency",
            ["approval_rejected", "approval_request_superseded"])  # fmt: skip
    marker = world.publish(world.sign_for(parked, "viewer"), parked.run_id)
    assert world.dead_letters([rejection, marker], until=[marker]) == {
        marker: "approver_not_allowed",
    }
    assert [o["decision"] for o in world.history(parked.proposal_id)] == [
        "PENDING_APPROVAL",
        "REJECTED",
    ]
    calls = world.calls_for([parked.proposal_id, resubmitted], "HIGH_RISK_EXTERNAL")
    assert calls[parked.proposal_id] == [] and len(calls[resubmitted]) == 1


def test_an_approved_call_whose_order_moved_on_meanwhile_does_not_run(world: World) -> None:
    """The approver said yes to cancelling an order in processing; by the time the
    approval arrives the order has shipped. The call is checked again at release and
    refused as a fresh proposal would be (STALE_STATE), instead of running."""
    order = "WO-64646-R"
    ref = f"{ACME}/order/{order}"
    publish_references(world.settings, [(ref, {"state": "processing", "owner": "cust-1"})])
    wait_until_loaded(world.settings, timeout=60)
    parked = world.park("agent", "cancel_order", cancel(order))
    publish_references(world.settings, [(ref, {"state": "shipped", "owner": "cust-1"})])
    wait_until_loaded(world.settings, timeout=60)
    world.publish(world.sign_for(parked, "ops-1"), parked.run_id)
    obs = world.final(parked.proposal_id)
    assert (obs["decision"], obs["gate"]) == ("REJECTED", "state"), obs
    assert obs["status"]["taxonomy_class"] == "STALE_STATE"
    assert [code for _, code in errors(obs)] == ["invalid_state", "release_refused"]
    assert "approved but did not run" in obs["next_action"]
    assert "already shipped" in obs["next_action"]
    world.none_ran([parked.proposal_id], "HIGH_RISK_EXTERNAL")
    # The same order back in processing: a release goes ahead as before.
    publish_references(world.settings, [(ref, {"state": "processing", "owner": "cust-1"})])
    wait_until_loaded(world.settings, timeout=60)
    again = world.park("agent", "cancel_order", cancel(order, reason="duplicate_order"))
    world.publish(world.sign_for(again, "ops-1"), again.run_id)
    assert world.final(again.proposal_id)["decision"] == "ROUTED"


def test_a_forged_expiry_check_cannot_end_a_parked_call_early(world: World) -> None:
    parked = world.park("agent", "cancel_order", cancel())
    forged = {"type": "expiry_check", "tenant_id": ACME, "request_id": parked.request_id}
    world.publish(forged, parked.run_id, timestamp_ms=int(time.time() * 1000) + 1_200_000)
    world.publish(world.sign_for(parked, "ops-1"), parked.run_id)
    obs = world.final(parked.proposal_id)
    assert obs["decision"] == "ROUTED", errors(obs)


def test_a_back_dated_expired_approval_is_refused(world: World) -> None:
    parked = world.park("agent", "cancel_order", cancel())
    now_ms = int(time.time() * 1000)
    stale = world.sign_for(parked, "ops-1", now_ms=now_ms - 700_000)
    world.publish(stale, parked.run_id, timestamp_ms=now_ms - 650_000)
    world.publish(world.sign_for(parked, "ops-2", decision="rejected", reason="no"), parked.run_id)
    obs = world.final(parked.proposal_id)
    assert obs["decision"] == "REJECTED" and errors(obs) == [(None, "approval_rejected")]


# -- 6. expiry -----------------------------------------------------------------------------------


def test_a_parked_call_nobody_answers_expires(stack_settings: Settings, tmp_path: Path) -> None:
    expires_unanswered(isolated(stack_settings, "gates-exp"), "acme-gx", tmp_path)


@contextlib.contextmanager
def lapsing_approvals(
    settings: Settings, tenant: str, tmp_path: Path, ttl_s: int, grace_ms: int = 30_000
) -> Iterator[ToolsentryClient]:
    """A processor whose approval requests lapse after ``ttl_s`` (and whose in-flight grace
    is ``grace_ms``), order WO-12345-A of ``tenant`` in processing, and a client of that
    tenant."""
    policy = (ROOT / "policy" / "policy.yaml").read_text()
    assert "ttl_seconds: 600" in policy and "in_flight_grace_ms: 30000" in policy
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(
        policy.replace("ttl_seconds: 600", f"ttl_seconds: {ttl_s}").replace(
            "in_flight_grace_ms: 30000", f"in_flight_grace_ms: {grace_ms}"
        )
    )
    publish_references(settings, [(f"{tenant}/order/{ORDER}", {"state": "processing"})])
    proc = ProcessorProcess(
        settings, f"{tenant}-1", tmp_path, TOOLSENTRY_POLICY_FILE=str(policy_file)
    ).start()
    client = None
    try:
        proc.wait_ready()
        wait_until_loaded(settings, timeout=60)
        client = ToolsentryClient(
            settings, tenant, principal_token=token(settings, tenant, user="u-agent")
        )
        yield client
    finally:
        if client is not None:
            client.close()
        if proc.alive():
            assert proc.terminate() == 0, proc.log()[-3000:]


def expires_unanswered(settings: Settings, tenant: str, tmp_path: Path) -> None:
    """A processor whose approvals lapse after 2 s parks a call nobody answers; its expiry
    sweeper ends it with an observation within seconds, and nothing runs. Shared with the
    Redis Cluster suite, which runs it with ``settings`` pointing at a cluster."""
    with lapsing_approvals(settings, tenant, tmp_path, ttl_s=2) as client:
        pid = client.propose("cancel_order", cancel(), run_id=run_id())
        pending = client.wait(pid, 60)
        assert pending["decision"] == "PENDING_APPROVAL"
        started = time.monotonic()
        obs = client.wait_final(pid, 15)
        assert time.monotonic() - started < 12
        [err] = refused(obs, "CONFIRMATION_MISSING", "approval", ["approval_expired"])
        assert pending["approval_request_id"] in err["message"]
        assert "not approved in time" in obs["next_action"]
        lapse = obs["execution_metadata"]["timestamp"] - pending["execution_metadata"]["timestamp"]
        assert lapse.total_seconds() >= 2
        calls = TopicReader(settings, settings.topics.execution("HIGH_RISK_EXTERNAL"))
        try:
            assert [m.value() for m in calls.sync()] == []
        finally:
            calls.close()


def test_a_proposal_sent_again_after_its_request_lapsed_asks_afresh(
    stack_settings: Settings, tmp_path: Path
) -> None:
    """The same proposal record sent again once its approval request has expired (an
    agent's retry, a producer's duplicate): it is a new attempt of the call, and it gets a
    request of its own that approvers can answer. Under the lapsed request's id, every
    approval would find that request ended, and the call would wait for ever."""
    settings = isolated(stack_settings, "gates-again")
    with lapsing_approvals(settings, "acme-ga", tmp_path, ttl_s=4, grace_ms=200) as client:
        traceparent, _ = new_trace()
        same = {"run_id": run_id(), "proposal_id": str(uuid.uuid4()), "traceparent": traceparent}
        pid = client.propose("cancel_order", cancel(), **same)
        first = client.wait(pid, 60)
        assert first["decision"] == "PENDING_APPROVAL"
        lapsed = client.wait_final(pid, 30)
        refused(lapsed, "CONFIRMATION_MISSING", "approval", ["approval_expired"])
        # It never ran: what parking it took is given back (its step stays).
        admission = AdmissionStore(connect(settings.redis_url), settings.redis_namespace)
        counters = admission.run_counters("acme-ga", same["run_id"])
        assert counters == {"steps": 1.0}, counters
        time.sleep(0.5)  # past the in-flight grace

        client.propose("cancel_order", cancel(), **same)
        deadline = time.monotonic() + 60
        while len(client.history(pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        again = client.history(pid)[2]
        assert again["decision"] == "PENDING_APPROVAL", again["status"]
        assert again["approval_request_id"] != first["approval_request_id"]
        assert again["approval_request_id"] in again["next_action"]

        packet = approval_request(settings, again["approval_request_id"])
        assert packet["request_id"] == again["approval_request_id"]
        key = load_private_key(Path(str(settings.approvers_file)).parent / "approver-ops-1.jwk")
        signed = sign_for_request(key, "ops-1", packet, int(time.time() * 1000))
        producer = Producer(settings.client_config())
        producer.produce(settings.topics.approvals, orjson.dumps(signed), same["run_id"].encode())
        assert producer.flush(15) == 0
        deadline = time.monotonic() + 60
        while len(client.history(pid)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        released = client.history(pid)[3]
        assert (released["decision"], released["gate"]) == ("ROUTED", "approval"), released
        calls = TopicReader(settings, settings.topics.execution("HIGH_RISK_EXTERNAL"))
        try:
            [call] = [codec("approved_call").decode(value(m)) for m in calls.sync()]
        finally:
            calls.close()
        assert call["proposal_id"] == pid and call["attempt"] == 2
        counters = admission.run_counters("acme-ga", same["run_id"])
        assert counters["steps"] == 2 and counters["class:external"] == 1, counters


# -- 7. look-alike tool names -------------------------------------------------------------------


def test_a_look_alike_tool_name_is_unknown(world: World) -> None:
    name = "c\u0430ncel_order"  # Cyrillic a
    obs = world.call("agent", name, cancel())
    [err] = refused(obs, "STRUCTURAL_VIOLATION", "resolve", ["unknown_tool"])
    assert name in err["message"]
    assert obs["tool_identity"]["name"] == name
    assert "cancel_order" in obs["allowed_tools"] and name not in obs["allowed_tools"]
    assert "did you mean cancel_order?" in obs["next_action"]
    world.none_ran([obs["proposal_id"]], "HIGH_RISK_EXTERNAL")
