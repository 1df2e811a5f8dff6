"""The conformance suite's own consistency, checked without a broker.

``tests/conformance`` holds labelled proposals that ``toolsentry eval`` publishes
to a running processor. These tests keep the labels honest: the files load,
ids are unique, every category is covered, the tools exist, and each label
is what the gate order of the design gives for the suite's own principals,
references, approvers and policy. Parse, resolve and schema labels are
checked against the real gates; the later gates against a small model of
the design (identity, semantic, ownership, policy, state, confirmation).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest
import yaml_rs

from processor.contracts.registry import Contract, ContractSet, load_contracts
from processor.gates.parse import DeadLetter, Limits, parse_proposal
from processor.gates.policy import check_secrets
from processor.gates.resolve import resolve_tool
from processor.gates.schema import check_arguments
from processor.model import Rejection, SourceRecord, TaxonomyClass
from processor.policy import Policy

ROOT = Path(__file__).resolve().parents[2]
SUITE_DIR = ROOT / "tests" / "conformance"
CATEGORIES = (
    "lookup", "multi_step", "ambiguous", "clarification", "already_done",
    "confirmation", "out_of_scope", "multilingual", "adversarial",
)  # fmt: skip
GATES = (
    "parse", "resolve", "schema", "identity", "semantic", "policy", "state",
    "confirmation", "route",
)  # fmt: skip
AFTER_SCHEMA = frozenset(GATES[GATES.index("schema") + 1 :])
CLEARANCE = ("public", "internal", "confidential", "regulated", "secret")
TOKEN_CODES = {
    "valid": None,
    "eddsa": None,
    "es256": None,
    "hs256": None,
    "hs256_confusion": "token_alg_refused",
    "alg_none": "token_alg_refused",
    "missing": "token_missing",
    "expired": "token_expired",
    "not_yet_valid": "token_not_yet_valid",
    "forged": "token_signature_invalid",
    "tampered": "token_signature_invalid",
    "unknown_key": "token_unknown_key",
    "wrong_audience": "token_wrong_audience",
}
TAMPER_CODES = {
    "none": None,
    "payload": "approval_payload_mismatch",
    "version": "approval_version_mismatch",
    "trace": "approval_trace_mismatch",
    "tool": "approval_tool_mismatch",
    "expired": "approval_expired",
    "signature": "approval_signature_invalid",
    "unregistered": "approver_unknown",
}
PROPOSAL_KEYS = frozenset(
    {"principal", "token", "tenant_id", "tool", "version", "arguments", "arguments_raw",
     "active_tools", "approvals", "expect"}
)  # fmt: skip
CASE_KEYS = PROPOSAL_KEYS | {"id", "category", "description", "steps"}
EXPECT_KEYS = frozenset(
    {"taxonomy", "gate", "codes", "fields", "next_action_contains", "allowed_tools_contains"}
)

# The secret formats the policy gate looks for (fakes in the suite are built to match them).
SECRET_PATTERNS = (
    re.compile(r"AKIA[A-Z0-9]{16}"),
    re.compile(r"ghp_[A-Za-z0-9]{36}"),
    re.compile(r"xox[abposr]-[A-Za-z0-9-]{10,}"),
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+"),
)
SECRET_KEY = re.compile(
    r"(?i)^(?:password|passwd|secret|client_secret|api_?key|access_?token|token|private_?key)$"
)
BASE62_RUN = re.compile(r"[A-Za-z0-9]{24,}")
URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+|(?i:www)\.\S+")


def _load(path: Path) -> Any:
    return yaml_rs.loads(path.read_text(encoding="utf-8"), parse_datetime=False)


# -- the suite as data -------------------------------------------------------------------------


@dataclass
class Proposal:
    """One proposal of the suite: a single case, or one step of a multi_step case."""

    case_id: str
    where: str
    principal: str
    token: str
    tenant_id: str
    tool: str
    version: str | None
    arguments: Any
    raw: str | None
    active_tools: list[str] | None
    approvals: list[dict[str, Any]]
    expect: dict[str, Any]
    reused: bool = False
    step: int | None = None


@dataclass
class Suite:
    doc: dict[str, Any]
    policy: dict[str, Any]
    cases: list[dict[str, Any]]
    files: dict[str, list[dict[str, Any]]]
    proposals: list[Proposal] = field(default_factory=list)

    @property
    def principals(self) -> dict[str, dict[str, Any]]:
        return dict(self.doc["principals"])

    @property
    def approvers(self) -> dict[str, list[str]]:
        return {a["id"]: list(a["classes"]) for a in self.doc["approvers"]}

    def reference(self, entity: str, id_: str) -> list[dict[str, Any]]:
        return [r for r in self.doc["references"] if r["entity"] == entity and r["id"] == id_]


def _proposals(case: dict[str, Any], principals: dict[str, Any]) -> Iterator[Proposal]:
    steps = case.get("steps")
    bodies = list(enumerate(steps, 1)) if steps else [(None, case)]
    for n, body in bodies:
        merged = {**{k: v for k, v in case.items() if k != "steps"}, **body}
        principal = merged.get("principal", "agent")
        approvals = merged.get("approvals") or []
        reused = False
        if approvals and "reuse" in approvals[0]:
            assert steps and n and 1 <= approvals[0]["reuse"] < n, case["id"]
            source = steps[approvals[0]["reuse"] - 1]
            approvals, reused = source.get("approvals") or [], True
        raw = merged.get("arguments_raw")
        yield Proposal(
            case_id=case["id"],
            where=case["id"] if n is None else f"{case['id']} step {n}",
            principal=principal,
            token=merged.get("token", "valid"),
            tenant_id=merged.get("tenant_id", principals.get(principal, {}).get("tenant_id")),
            tool=merged["tool"],
            version=merged.get("version"),
            arguments=merged.get("arguments"),
            raw=raw,
            active_tools=merged.get("active_tools"),
            approvals=approvals,
            expect=merged["expect"],
            reused=reused,
            step=n,
        )


@pytest.fixture(scope="module")
def suite() -> Suite:
    doc = _load(SUITE_DIR / "suite.yaml")
    policy = _load(SUITE_DIR / doc["policy"])
    files = {p.stem: _load(p) for p in sorted((SUITE_DIR / "cases").glob("*.yaml"))}
    cases = [c for stem in files for c in files[stem]]
    s = Suite(doc, policy, cases, files)
    for c in cases:
        s.proposals.extend(_proposals(c, s.principals))
    return s


@pytest.fixture(scope="module")
def pack() -> ContractSet:
    return load_contracts(ROOT / "contracts")


# -- the structure -----------------------------------------------------------------------------


def test_every_file_loads_and_names_its_category(suite: Suite) -> None:
    assert set(suite.files) == set(CATEGORIES)
    for stem, cases in suite.files.items():
        assert isinstance(cases, list) and cases, stem
        for c in cases:
            assert c["category"] == stem, c["id"]
            assert set(c) <= CASE_KEYS, (c["id"], set(c) - CASE_KEYS)
            assert isinstance(c["description"], str) and c["description"].strip(), c["id"]
            assert ("steps" in c) == (stem == "multi_step"), c["id"]
            if "steps" in c:
                assert len(c["steps"]) >= 2, c["id"]
                assert "tool" not in c and "expect" not in c, c["id"]
                for s in c["steps"]:
                    assert set(s) <= PROPOSAL_KEYS, (c["id"], set(s) - PROPOSAL_KEYS)


def test_ids_are_unique(suite: Suite) -> None:
    counts = Counter(c["id"] for c in suite.cases)
    assert not [i for i, n in counts.items() if n > 1]


def test_size_and_coverage(suite: Suite) -> None:
    assert len(suite.cases) >= 150
    per_category = Counter(c["category"] for c in suite.cases)
    for category in CATEGORIES:
        assert per_category[category] >= 12, (category, per_category[category])


def test_every_proposal_is_well_formed(suite: Suite) -> None:
    for p in suite.proposals:
        assert p.principal in suite.principals, p.where
        assert p.token in TOKEN_CODES, p.where
        assert isinstance(p.tenant_id, str) and p.tenant_id, p.where
        assert isinstance(p.tool, str) and p.tool, p.where
        assert (p.arguments is None) != (p.raw is None), p.where
        assert p.arguments is None or isinstance(p.arguments, dict), p.where
        for a in p.approvals:
            assert set(a) <= {"approver", "tamper", "decision"}, p.where
            assert a["approver"] in suite.approvers or a.get("tamper") == "unregistered", p.where
            assert a.get("tamper", "none") in TAMPER_CODES, p.where
            assert a.get("decision", "approved") in ("approved", "rejected"), p.where
        assert set(p.expect) <= EXPECT_KEYS, p.where
        assert p.expect["gate"] in GATES, p.where
        for key in EXPECT_KEYS - {"taxonomy", "gate"}:
            assert all(isinstance(v, str) for v in p.expect.get(key, [])), (p.where, key)


def test_every_taxonomy_is_a_class(suite: Suite) -> None:
    classes = {c.value for c in TaxonomyClass}
    for p in suite.proposals:
        assert p.expect["taxonomy"] in classes, p.where
        assert (p.expect["taxonomy"] == "SUCCESS") == (p.expect["gate"] == "route"), p.where


def test_tools_exist_unless_expected_unknown(suite: Suite, pack: ContractSet) -> None:
    for p in suite.proposals:
        if not pack.versions(p.tool):
            assert "unknown_tool" in p.expect.get("codes", []), p.where


def test_the_suite_data_is_well_formed(suite: Suite, pack: ContractSet) -> None:
    keys = Counter((r["tenant"], r["entity"], r["id"]) for r in suite.doc["references"])
    assert not [k for k, n in keys.items() if n > 1]
    ids = Counter((r["entity"], r["id"]) for r in suite.doc["references"])
    # An id lives under one tenant only, so "unknown" and "another tenant's" never blur.
    assert not [k for k, n in ids.items() if n > 1]
    entities = {ref.entity for vs in pack.by_name.values() for c in vs for ref in c.references}
    assert {r["entity"] for r in suite.doc["references"]} <= entities
    for name, p in suite.principals.items():
        assert p["clearance"] in CLEARANCE, name
        assert all(isinstance(s, str) for s in p["scopes"]), name
    tenants = suite.policy["tenants"]
    assert "*" in tenants
    assert set(suite.policy["confirmation"]["dual_control_classes"]) <= set(
        suite.policy["confirmation"]["classes"]
    )
    assert suite.policy["secrets"]["enabled"] is True


# -- labels against the pack -------------------------------------------------------------------


def _contract(p: Proposal, pack: ContractSet) -> Contract | None:
    versions = pack.versions(p.tool)
    if not versions:
        return None
    if p.version is not None:
        return next((c for c in versions if c.version == p.version), None)
    return next((c for c in versions if c.lifecycle.status == "active"), versions[0])


def _arguments(p: Proposal) -> Any:
    if p.raw is None:
        return p.arguments
    try:
        return orjson.loads(p.raw)
    except orjson.JSONDecodeError:
        return None


def test_arguments_pass_the_schema_exactly_when_a_later_gate_decides(
    suite: Suite, pack: ContractSet
) -> None:
    for p in suite.proposals:
        gate = p.expect["gate"]
        if gate not in AFTER_SCHEMA and gate != "schema":
            continue
        if "secret_in_arguments" in p.expect.get("codes", []):
            continue  # refused before the schema gate looks, whatever it would say
        contract = _contract(p, pack)
        assert contract is not None, p.where
        valid = contract.validator.reference.is_valid(_arguments(p))
        assert valid == (gate in AFTER_SCHEMA), p.where


def test_success_references_exist_for_the_tenant_in_an_allowed_state(
    suite: Suite, pack: ContractSet
) -> None:
    for p in suite.proposals:
        if p.expect["taxonomy"] != "SUCCESS":
            continue
        contract = _contract(p, pack)
        assert contract is not None, p.where
        args = _arguments(p)
        for ref in contract.references:
            if ref.argument not in args:
                continue
            found = [
                r
                for r in suite.reference(ref.entity, args[ref.argument])
                if r["tenant"] == p.tenant_id
            ]
            assert found, (p.where, ref.argument)
            assert found[0]["state"] in ref.allowed_states, (p.where, ref.argument)


def test_mutations_that_reach_confirmation_do_not_share_payloads(
    suite: Suite, pack: ContractSet
) -> None:
    """Runs are independent: two cases must not race for one operation (idempotency)."""
    owner: dict[tuple[str, str, bytes], str] = {}
    for p in suite.proposals:
        contract = _contract(p, pack)
        if p.expect["gate"] not in ("confirmation", "route") or contract is None:
            continue
        if contract.side_effect_class.value == "READ_ONLY":
            continue
        key = (p.tenant_id, p.tool, orjson.dumps(_arguments(p), option=orjson.OPT_SORT_KEYS))
        assert owner.setdefault(key, p.case_id) == p.case_id, (p.where, owner[key])


# -- the gates: real ones up to schema, a model of the design after it -------------------------


@dataclass
class Outcome:
    taxonomy: str
    gate: str
    codes: set[str] = field(default_factory=set)
    fields: set[str] = field(default_factory=set)
    next_action: str = ""
    allowed_tools: tuple[str, ...] = ()

    @classmethod
    def of(cls, r: Rejection) -> Outcome:
        return cls(
            r.taxonomy.value,
            r.gate.value,
            {e.code for e in r.errors},
            {e.field for e in r.errors if e.field},
            r.next_action,
            r.allowed_tools,
        )


def _envelope(p: Proposal) -> bytes:
    env: dict[str, Any] = {
        "proposal_id": f"{p.where}".replace(" ", "-"),
        "run_id": f"run-{p.case_id}",
        "tenant_id": p.tenant_id,
        "tool": {"name": p.tool} | ({"version": p.version} if p.version else {}),
    }
    if p.raw is not None:
        env["arguments_raw"] = p.raw
    else:
        env["arguments"] = p.arguments
    if p.active_tools is not None:
        env["active_tools"] = p.active_tools
    return orjson.dumps(env)


def _entropy(text: str) -> float:
    counts = Counter(text)
    return -sum(n / len(text) * math.log2(n / len(text)) for n in counts.values())


def _secrets(value: Any, path: str = "") -> Iterator[str]:
    if isinstance(value, dict):
        for k, v in value.items():
            where = f"{path}/{k}" if path else str(k)
            if SECRET_KEY.match(str(k)) and v not in (None, ""):
                yield where
            yield from _secrets(v, where)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _secrets(v, f"{path}/{i}" if path else str(i))
    elif isinstance(value, str) and _looks_secret(value):
        yield path


def _looks_secret(text: str) -> bool:
    if any(pat.search(text) for pat in SECRET_PATTERNS):
        return True
    return any(_entropy(run) >= 4.0 for run in BASE62_RUN.findall(text))


def _urls(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(path, url) for every string argument that is a URL as a whole (prose is not)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _urls(v, f"{path}/{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _urls(v, f"{path}/{i}" if path else str(i))
    elif isinstance(value, str) and URL.fullmatch(value):
        yield path, value


def _within(host: str, domains: list[str]) -> bool:
    return any(host == d or host.endswith("." + d) for d in domains)


def _egress_allowed(url: str, egress_policy: str, egress: dict[str, Any]) -> bool:
    """Only https to a named host of the allowed (or, for private tools, internal) domains."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme != "https" or "@" in parts.netloc or not re.fullmatch(r"[a-z0-9.-]+", host):
        return False
    if re.fullmatch(r"[0-9.]+", host):
        return False
    if egress_policy == "allowlisted_domains":
        return _within(host, egress["allowed_domains"])
    if egress_policy == "private_network_only":
        return _within(host, egress["internal_domains"])
    return False


def _only(codes: list[tuple[str, str | None]], where: str) -> tuple[set[str], set[str]]:
    distinct = {c for c, _ in codes}
    assert len(distinct) == 1, f"{where}: ambiguous label, several failures {sorted(distinct)}"
    return distinct, {f for _, f in codes if f}


def _model(p: Proposal, contract: Contract, args: dict[str, Any], suite: Suite) -> Outcome:
    """The gates after schema, as the design describes them."""
    who = suite.principals[p.principal]
    raw = contract.raw
    code = TOKEN_CODES[p.token]
    if code:
        return Outcome("PERMISSION_DENIED", "identity", {code}, {"principal_token"})
    if p.tenant_id != who["tenant_id"]:
        return Outcome("PERMISSION_DENIED", "identity", {"tenant_mismatch"}, {"tenant_id"})
    if not set(raw["security"]["required_scopes"]) <= set(who["scopes"]):
        return Outcome("PERMISSION_DENIED", "identity", {"scope_missing"}, {"principal_token"})

    refs: dict[str, dict[str, Any]] = {}
    failures: list[tuple[str, str | None]] = []
    actions: list[str] = []
    for ref in contract.references:
        if ref.argument in args:
            found = suite.reference(ref.entity, args[ref.argument])
            if not found:
                failures.append(("unknown_reference", ref.argument))
                actions.append(ref.lookup_tool)
            else:
                refs[ref.argument] = {**found[0], "ref": ref}
    cel_refs = {
        k: {"state": r["state"], "owner": r["owner"], "tenant_id": r["tenant"], "attributes": {}}
        for k, r in refs.items()
    }
    context = {
        "args": args,
        "principal": {k: who[k] for k in ("tenant_id", "user_id", "agent_id", "clearance")}
        | {"scopes": list(who["scopes"])},
        "refs": cel_refs,
    }
    for rule in contract.rules:
        if not failures and rule.program.execute(context) is not True:
            failures.append(("rule_failed", None))
            actions.append(rule.next_action)
    if failures:
        codes, fields = _only(failures, p.where)
        return Outcome("SEMANTIC_INVALIDITY", "semantic", codes, fields, " ".join(actions))

    crossed = {k for k, r in refs.items() if r["tenant"] != who["tenant_id"]}
    if crossed:
        return Outcome("PERMISSION_DENIED", "identity", {"cross_tenant_reference"}, crossed)

    policy = suite.policy
    cls = contract.side_effect_class.value
    tenants = policy["tenants"]
    allowed = tenants.get(who["tenant_id"], tenants["*"])["allowed_classes"]
    failures = [("secret_in_arguments", f) for f in _secrets(args)]
    if cls not in allowed:
        failures.append(("class_not_allowed", None))
    if CLEARANCE.index(who["clearance"]) < CLEARANCE.index(raw["security"]["data_classification"]):
        failures.append(("clearance_insufficient", None))
    for where, url in _urls(args):
        if not _egress_allowed(url, raw["security"]["egress_policy"], policy["egress"]):
            failures.append(("egress_denied", where))
    if failures:
        codes, fields = _only(failures, p.where)
        return Outcome("POLICY_VIOLATION", "policy", codes, fields)

    stale = {k for k, r in refs.items() if r["state"] not in r["ref"].allowed_states}
    if stale:
        return Outcome("STALE_STATE", "state", {"invalid_state"}, stale)

    confirmation = policy["confirmation"]
    if contract.confirmation_required or cls in confirmation["classes"]:
        if not p.approvals:
            return Outcome("CONFIRMATION_MISSING", "confirmation", {"approval_required"})
        failures = []
        for a in p.approvals:
            tamper = a.get("tamper", "none")
            if p.reused:
                failures.append(("approval_reused", None))
            elif TAMPER_CODES[tamper]:
                failures.append((TAMPER_CODES[tamper], None))
            elif cls not in suite.approvers[a["approver"]]:
                failures.append(("approver_not_allowed", None))
            elif a["approver"] in (who["user_id"], who["agent_id"]):
                failures.append(("self_approval", None))
            elif a.get("decision", "approved") == "rejected":
                failures.append(("approval_rejected", None))
        if failures:
            codes, _ = _only(failures, p.where)
            return Outcome("CONFIRMATION_MISSING", "confirmation", codes)
        distinct = {a["approver"] for a in p.approvals}
        if cls in confirmation["dual_control_classes"] and len(distinct) < 2:
            return Outcome("CONFIRMATION_MISSING", "confirmation", {"approvals_insufficient"})
    return Outcome("SUCCESS", "route")


def _observe(p: Proposal, pack: ContractSet, suite: Suite) -> Outcome:
    parsed = parse_proposal(SourceRecord("tool.proposals", 0, 0, None, _envelope(p), 0), Limits())
    assert not isinstance(parsed, DeadLetter), p.where
    proposal, rejection, _ = parsed
    if rejection is not None:
        return Outcome.of(rejection)
    resolved = resolve_tool(proposal, pack)
    if isinstance(resolved, Rejection):
        return Outcome.of(resolved)
    # Credentials are refused before the schema gate, which would quote them back.
    refused = check_secrets(proposal, Policy()) or check_arguments(proposal.arguments, resolved)
    if refused is not None:
        return Outcome.of(refused)
    return _model(p, resolved, proposal.arguments, suite)


def test_every_label_is_what_the_gates_decide(suite: Suite, pack: ContractSet) -> None:
    wrong = []
    for p in suite.proposals:
        seen = _observe(p, pack, suite)
        e = p.expect
        problems = []
        if (seen.taxonomy, seen.gate) != (e["taxonomy"], e["gate"]):
            problems.append(f"{seen.taxonomy}/{seen.gate} {sorted(seen.codes)}")
        if not set(e.get("codes", [])) <= seen.codes:
            problems.append(f"codes {sorted(seen.codes)}")
        if not set(e.get("fields", [])) <= seen.fields:
            problems.append(f"fields {sorted(seen.fields)}")
        for text in e.get("next_action_contains", []):
            if text.lower() not in seen.next_action.lower():
                problems.append(f"next_action {seen.next_action!r}")
        if not set(e.get("allowed_tools_contains", [])) <= set(seen.allowed_tools):
            problems.append(f"allowed_tools {seen.allowed_tools}")
        if problems:
            wrong.append(f"{p.where}: labelled {e}, gates give {'; '.join(problems)}")
    assert not wrong, "\n".join(wrong)


def test_rejections_name_their_codes(suite: Suite) -> None:
    """Every refusal says which code to look for, so a wrong reason cannot pass."""
    for p in suite.proposals:
        if p.expect["taxonomy"] != "SUCCESS":
            assert p.expect.get("codes"), p.where
