"""``toolsentry eval``: a labelled suite of proposals through a running processor.

A suite is a folder: ``suite.yaml`` (principals, reference data, approvers,
policy) and ``cases/*.yaml`` (proposals with the observation each must get).
Running one takes two steps, because the processor must trust the suite's
keys before it starts:

1. ``prepare_keys`` writes a JWKS (Ed25519, P-256 and HMAC keys), the suite's
   approvers with fresh Ed25519 keys, and keeps the private halves;
2. ``run_suite`` publishes the reference data, waits until the processors
   have loaded it, mints a token per case (or a broken one, as the case says),
   signs any approvals, sends every case in its own run and compares each
   observation with the label. Multi-step cases run their steps in order.

The answer is per-category accuracy; the suite passes only at 100%.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
import orjson
import yaml_rs
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from processor import b64url
from processor.approvals import load_private_key, sign_approval
from processor.client import ToolsentryClient
from processor.config import Settings
from processor.contracts.registry import ContractSet, load_contracts
from processor.gates.resolve import resolve_tool
from processor.identity import TokenIssuer, generate_ed25519_jwk
from processor.keys import init_keys
from processor.model import Proposal, Rejection, SideEffectClass
from processor.pipeline import canonical_json
from processor.reference_data import publish_references, wait_until_loaded

CATEGORIES = (
    "lookup",
    "multi_step",
    "ambiguous",
    "clarification",
    "already_done",
    "confirmation",
    "out_of_scope",
    "multilingual",
    "adversarial",
    "budgets",
)


@dataclass
class Suite:
    directory: Path
    principals: dict[str, dict[str, Any]]
    references: list[dict[str, Any]]
    approvers: list[dict[str, Any]]
    policy: Path
    cases: list[dict[str, Any]]


def _yaml(path: Path) -> Any:
    return yaml_rs.loads(path.read_text(), parse_datetime=False)


def load_suite(directory: Path) -> Suite:
    directory = Path(directory)
    doc: dict[str, Any] = _yaml(directory / "suite.yaml")
    cases: list[dict[str, Any]] = []
    for path in sorted((directory / "cases").glob("*.yaml")):
        cases.extend(_yaml(path) or [])
    return Suite(
        directory,
        doc["principals"],
        doc.get("references", []),
        doc.get("approvers", []),
        directory / doc.get("policy", "policy.yaml"),
        cases,
    )


@dataclass(frozen=True)
class SuiteKeys:
    """Where ``prepare_keys`` put things: hand ``jwks``, ``approvers`` and ``delegation``
    to the processor."""

    directory: Path

    @property
    def delegation(self) -> Path:
        return self.directory / "delegation.jwk"

    @property
    def jwks(self) -> Path:
        return self.directory / "jwks.json"

    @property
    def approvers(self) -> Path:
        return self.directory / "approvers.yaml"


def prepare_keys(suite: Suite, directory: Path) -> SuiteKeys:
    """Issuer keys of all three algorithms, the suite's approvers, and an unregistered one."""
    directory = Path(directory)
    classes = {
        a["id"]: tuple(SideEffectClass(c) for c in a.get("classes", [])) for a in suite.approvers
    }
    bundle = init_keys(directory, classes, issuer_kid="suite-eddsa")
    jwks = orjson.loads(bundle.jwks.read_bytes())
    p256 = ec.generate_private_key(ec.SECP256R1())
    numbers = p256.public_key().public_numbers()
    es_public = {
        "kty": "EC",
        "crv": "P-256",
        "kid": "suite-es256",
        "alg": "ES256",
        "x": b64url.encode(numbers.x.to_bytes(32, "big")),
        "y": b64url.encode(numbers.y.to_bytes(32, "big")),
    }
    es_private = {
        **es_public,
        "d": b64url.encode(p256.private_numbers().private_value.to_bytes(32, "big")),
    }
    secret = uuid.uuid4().bytes + uuid.uuid4().bytes
    oct_key = {"kty": "oct", "kid": "suite-hs256", "alg": "HS256", "k": b64url.encode(secret)}
    jwks["keys"] = [k for k in jwks["keys"] if k["kid"] == "suite-eddsa"] + [es_public, oct_key]
    bundle.jwks.write_text(json.dumps(jwks, indent=2) + "\n")
    (directory / "es256.jwk").write_text(json.dumps(es_private))
    (directory / "hs256.jwk").write_text(json.dumps(oct_key))
    eve, _ = generate_ed25519_jwk("eve")
    (directory / "approver-eve.jwk").write_text(json.dumps(eve))
    forger, _ = generate_ed25519_jwk("suite-eddsa")
    (directory / "forger.jwk").write_text(json.dumps(forger))
    return SuiteKeys(directory)


# -- tokens ------------------------------------------------------------------------------------


class Tokens:
    def __init__(self, keys: SuiteKeys) -> None:
        d = keys.directory
        self.eddsa = TokenIssuer.from_jwk_file(d / "issuer.jwk")
        self.es256 = TokenIssuer.from_jwk_file(d / "es256.jwk")
        self.hs256 = TokenIssuer.from_jwk_file(d / "hs256.jwk")
        self.forger = TokenIssuer.from_jwk_file(d / "forger.jwk")

    def mint(self, principal: dict[str, Any], kind: str) -> str | None:
        args = (
            principal["tenant_id"],
            principal["user_id"],
            principal["agent_id"],
            principal.get("scopes", []),
            principal.get("clearance", "internal"),
        )
        now = time.time()
        if kind == "missing":
            return None
        if kind in ("valid", "eddsa"):
            return self.eddsa.mint(*args)
        if kind == "es256":
            return self.es256.mint(*args)
        if kind == "hs256":
            return self.hs256.mint(*args)
        if kind == "expired":
            return self.eddsa.mint(*args, ttl_s=600, now=now - 3600)
        if kind == "not_yet_valid":
            return self.eddsa.mint(*args, nbf=int(now + 3600))
        if kind == "forged":
            return self.forger.mint(*args)
        if kind == "unknown_key":
            issuer = TokenIssuer("no-such-kid", "EdDSA", self.forger.private_key)
            return issuer.mint(*args)
        if kind == "wrong_audience":
            return TokenIssuer("suite-eddsa", "EdDSA", self.eddsa.private_key, "elsewhere").mint(
                *args
            )
        if kind == "alg_none":
            header = b64url.encode(b'{"alg":"none","typ":"JWT","kid":"suite-eddsa"}')
            claims = {
                "sub": args[1],
                "tenant_id": args[0],
                "agent_id": args[2],
                "scope": " ".join(args[3]),
                "clearance": args[4],
                "aud": "toolsentry",
                "iat": int(now),
                "exp": int(now + 600),
            }
            return f"{header}.{b64url.encode(orjson.dumps(claims))}."
        if kind == "tampered":
            head, body, sig = self.eddsa.mint(*args).split(".")
            claims = orjson.loads(b64url.decode(body))
            claims["scope"] = claims["scope"] + " users:admin payments:transfer"
            return f"{head}.{b64url.encode(orjson.dumps(claims))}.{sig}"
        if kind == "hs256_confusion":
            public = self.eddsa.private_key.public_key().public_bytes(
                serialization.Encoding.Raw, serialization.PublicFormat.Raw
            )
            claims = {
                "sub": args[1],
                "tenant_id": args[0],
                "agent_id": args[2],
                "aud": "toolsentry",
                "iat": int(now),
                "exp": int(now + 600),
            }
            return jwt.encode(claims, public, algorithm="HS256", headers={"kid": "suite-eddsa"})
        raise ValueError(f"unknown token kind {kind!r}")


# -- running -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    case_id: str
    category: str
    passed: bool
    problems: list[str] = field(default_factory=list)


def _version(contracts: ContractSet, step: dict[str, Any]) -> str:
    """The version the processor will resolve the step's tool to (what approvals bind)."""
    asked = str(step["version"]) if step.get("version") else None
    wanted = Proposal("", "", None, None, step["tool"], asked, None)
    resolved = resolve_tool(wanted, contracts)
    return (asked or "0.0.0") if isinstance(resolved, Rejection) else resolved.version


class Runner:
    def __init__(self, settings: Settings, suite: Suite, keys: SuiteKeys) -> None:
        self.settings = settings
        self.suite = suite
        self.keys = keys
        self.tokens = Tokens(keys)
        self.contracts = load_contracts(settings.contracts_dir)
        self.approver_keys = {
            a["id"]: load_private_key(keys.directory / f"approver-{a['id']}.jwk")
            for a in suite.approvers
        }
        self.approver_keys["eve"] = load_private_key(keys.directory / "approver-eve.jwk")
        self.client = ToolsentryClient(settings, "")
        self._traces: dict[tuple[str, int], str] = {}

    def publish_references(self, timeout: float = 60.0) -> None:
        entities: list[tuple[str, dict[str, Any] | None]] = []
        for r in self.suite.references:
            value: dict[str, Any] = {"state": r["state"]}
            if r.get("owner"):
                value["owner"] = r["owner"]
            if r.get("attributes"):
                value["attributes"] = r["attributes"]
            entities.append((f"{r['tenant']}/{r['entity']}/{r['id']}", value))
        publish_references(self.settings, entities)
        wait_until_loaded(self.settings, timeout)

    def _approvals(
        self,
        step: dict[str, Any],
        envelope: dict[str, Any],
        trace_id: str,
        principal: dict[str, Any],
        earlier: list[list[dict[str, Any]]],
    ) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        now_ms = int(time.time() * 1000)
        args = envelope.get("arguments")
        payload_hash = "sha256:" + hashlib.sha256(canonical_json(args)).hexdigest()
        for spec in step.get("approvals", []):
            if "reuse" in spec:
                out.extend(earlier[int(spec["reuse"]) - 1])
                continue
            tamper = spec.get("tamper", "none")
            approver = "eve" if tamper == "unregistered" else spec["approver"]
            fields = {
                "tenant_id": principal["tenant_id"],
                "trace_id": trace_id,
                "tool_name": step["tool"],
                "tool_version": _version(self.contracts, step),
                "payload_hash": payload_hash,
                "requested_by_user": principal["user_id"],
                "requested_by_agent": principal["agent_id"],
            }
            if tamper == "payload":
                fields["payload_hash"] = "sha256:" + hashlib.sha256(b"other").hexdigest()
            elif tamper == "version":
                fields["tool_version"] = "9.9.9"
            elif tamper == "trace":
                fields["trace_id"] = uuid.uuid4().hex
            elif tamper == "tool":
                fields["tool_name"] = "lookup_order"
            elif tamper == "requester":  # given for another user's identical call
                fields["requested_by_user"] = principal["user_id"] + "-other"
            when = now_ms - 3_600_000 if tamper == "expired" else now_ms
            approval = sign_approval(
                self.approver_keys[approver],
                approver_id=approver,
                now_ms=when,
                approval_id=f"appr_{uuid.uuid4().hex[:24]}",
                decision=spec.get("decision", "approved"),
                **fields,
            )
            if tamper == "signature":
                sig = approval["signature"]
                approval["signature"] = ("A" if sig[0] != "A" else "B") + sig[1:]
            out.append(approval)
        return out

    def _send(
        self,
        step: dict[str, Any],
        case: dict[str, Any],
        run_id: str,
        earlier: list[list[dict[str, Any]]],
    ) -> tuple[str, list[dict[str, Any]]]:
        inherited = ("principal", "token", "tenant_id", "active_tools")
        merged: dict[str, Any] = {k: case[k] for k in inherited if k in case}
        merged.update(step)
        principal = self.suite.principals[merged.get("principal", "agent")]
        trace_id = uuid.uuid4().hex
        reused = [a["reuse"] for a in step.get("approvals", []) if "reuse" in a]
        if reused:  # a replay: the same call, same trace, the approval it was granted before
            trace_id = self._traces[(run_id, int(reused[0]))]
        envelope: dict[str, Any] = {
            "proposal_id": f"{case['id']}-{uuid.uuid4().hex[:8]}",
            "tenant_id": merged.get("tenant_id", principal["tenant_id"]),
            "run_id": run_id,
            "tool": {"name": step["tool"]},
            "traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01",
        }
        if step.get("version"):
            envelope["tool"]["version"] = str(step["version"])
        if "arguments_raw" in step:
            envelope["arguments_raw"] = step["arguments_raw"]
        else:
            envelope["arguments"] = step.get("arguments", {})
        if "active_tools" in merged:
            envelope["active_tools"] = merged["active_tools"]
        token = self.tokens.mint(principal, merged.get("token", "valid"))
        if token is not None:
            envelope["principal_token"] = token
        approvals = self._approvals(step, envelope, trace_id, principal, earlier)
        if approvals:
            envelope["approvals"] = approvals
        for k, v in step.get("envelope", {}).items():
            envelope[k] = v
        self._traces[(run_id, len(earlier) + 1)] = trace_id
        self.client.send_raw(orjson.dumps(envelope), run_id.encode())
        return envelope["proposal_id"], approvals

    def run(self, timeout: float = 60.0) -> list[Outcome]:
        single = [c for c in self.suite.cases if "steps" not in c]
        multi = [c for c in self.suite.cases if "steps" in c]
        results: list[Outcome] = []
        sent = []
        for case in single:
            pid, _ = self._send(case, case, f"eval-{case['id']}-{uuid.uuid4().hex[:6]}", [])
            sent.append((case, pid))
        self.client.flush(30)
        for case, pid in sent:
            results.append(self._judge(case, [(case, pid)], timeout))
        for case in multi:
            run_id = f"eval-{case['id']}-{uuid.uuid4().hex[:6]}"
            earlier: list[list[dict[str, Any]]] = []
            pairs = []
            problems: list[str] = []
            for i, step in enumerate(case["steps"], 1):
                pid, approvals = self._send(step, case, run_id, earlier)
                earlier.append(approvals)
                pairs.append((step, pid))
                try:
                    self.client.wait(pid, timeout)
                except TimeoutError:
                    problems.append(f"step {i}: no observation")
                    break
            judged = self._judge(case, pairs, timeout)
            judged.problems = problems + judged.problems
            judged.passed = not judged.problems
            results.append(judged)
        return results

    def _judge(
        self, case: dict[str, Any], pairs: list[tuple[dict[str, Any], str]], timeout: float
    ) -> Outcome:
        problems: list[str] = []
        for i, (step, pid) in enumerate(pairs, 1):
            where = f"step {i}: " if len(pairs) > 1 else ""
            try:
                obs = self.client.wait(pid, timeout)
            except TimeoutError:
                problems.append(f"{where}no observation")
                continue
            problems += [where + p for p in compare(step["expect"], obs)]
        return Outcome(case["id"], case["category"], not problems, problems)

    def close(self) -> None:
        self.client.close()


def compare(expect: dict[str, Any], obs: dict[str, Any]) -> list[str]:
    """What differs between a label and an observation (empty: it matches)."""
    problems = []
    got = obs["status"]["taxonomy_class"]
    if got != expect["taxonomy"]:
        detail = "; ".join(f"{e['field']}: {e['code']}" for e in obs["result_payload"]["errors"])
        problems.append(f"taxonomy {got} ({detail}), expected {expect['taxonomy']}")
    if "gate" in expect and obs["gate"] != expect["gate"]:
        problems.append(f"gate {obs['gate']}, expected {expect['gate']}")
    codes = {e["code"] for e in obs["result_payload"]["errors"]}
    fields = {e["field"] for e in obs["result_payload"]["errors"]}
    for code in expect.get("codes", []):
        if code not in codes:
            problems.append(f"no error code {code} (got {sorted(codes)})")
    for name in expect.get("fields", []):
        if name not in fields:
            problems.append(f"no error on field {name} (got {sorted(map(str, fields))})")
    action = obs["next_action"].lower()
    for text in expect.get("next_action_contains", []):
        if str(text).lower() not in action:
            problems.append(f"next_action lacks {text!r}: {obs['next_action']!r}")
    for tool in expect.get("allowed_tools_contains", []):
        if tool not in obs["allowed_tools"]:
            problems.append(f"allowed_tools lacks {tool}")
    return problems


def summary(results: list[Outcome]) -> dict[str, tuple[int, int]]:
    total: Counter[str] = Counter()
    good: Counter[str] = Counter()
    for r in results:
        total[r.category] += 1
        good[r.category] += r.passed
    return {c: (good[c], total[c]) for c in sorted(total, key=_category_order)}


def _category_order(category: str) -> int:
    return CATEGORIES.index(category) if category in CATEGORIES else len(CATEGORIES)
