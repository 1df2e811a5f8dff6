"""The conformance suite's own consistency, checked without a broker.

``tests/conformance`` holds labelled proposals that ``toolsentry eval`` publishes
to a running processor. These tests keep the labels honest: the files load,
ids are unique, every category is covered, the tools exist, and each label
is what the gate order of the design gives for the suite's own principals,
references, approvers and policy. Parse, resolve and schema labels are
checked against the real gates; the later gates against a small model of
the design (identity, semantic, ownership, policy, state, confirmation), and
admission (budgets, rate limits, the loop and repair guards, idempotency)
against a model of its rules run over each case's steps in the runner's order.
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
from processor.policy import Budgets, Policy, parse_policy
from tests.lifecycle import contracts_with_sunsets_ahead

ROOT = Path(__file__).resolve().parents[2]
SUITE_DIR = ROOT / "tests" / "conformance"
CATEGORIES = (
    "lookup", "multi_step", "ambiguous", "clarification", "already_done",
    "confirmation", "out_of_scope", "multilingual", "adversarial", "budgets",
)  # fmt: skip
MULTI_STEP = frozenset({"multi_step", "budgets"})
"""The categories whose cases are runs of several steps (and only those)."""
ADMISSION = ("budget", "idempotency")
GATES = (
    "parse", "resolve", "schema", "identity", "semantic", "policy", "state",
    "confirmation", "route", *ADMISSION,
)  # fmt: skip
AFTER_SCHEMA = frozenset(GATES[GATES.index("schema") + 1 :]) - set(ADMISSION)
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
    "requester": "approval_requester_mismatch",
    "expired": "approval_expired",
    "signature": "approval_signature_invalid",
    "unregistered": "approver_unknown",
}
PROPOSAL_KEYS = frozenset(
    {"principal", "token", "tenant_id", "tool", "version", "arguments", "arguments_raw",
     "active_tools", "approvals", "envelope", "expect"}
)  # fmt: skip
ENVELOPE_KEYS = frozenset({"idempotency_key"})
"""What a proposal's ``envelope:`` may set (the runner merges it into the envelope)."""
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
    envelope: dict[str, Any] = field(default_factory=dict)
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
            envelope=dict(body.get("envelope") or {}),  # the runner sends a step's own only
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
def pack(tmp_path_factory: pytest.TempPathFactory) -> ContractSet:
    """The pack the integration run's processor loads (see tests/lifecycle.py)."""
    return load_contracts(contracts_with_sunsets_ahead(tmp_path_factory.mktemp("contracts")))


# -- the structure -----------------------------------------------------------------------------


def test_every_file_loads_and_names_its_category(suite: Suite) -> None:
    assert set(suite.files) == set(CATEGORIES)
    for stem, cases in suite.files.items():
        assert isinstance(cases, list) and cases, stem
        for c in cases:
            assert c["category"] == stem, c["id"]
            assert set(c) <= CASE_KEYS, (c["id"], set(c) - CASE_KEYS)
            assert isinstance(c["description"], str) and c["description"].strip(), c["id"]
            assert ("steps" in c) == (stem in MULTI_STEP), c["id"]
            if "steps" in c:
                assert len(c["steps"]) >= 2, c["id"]
                assert "tool" not in c and "expect" not in c and "envelope" not in c, c["id"]
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
        assert set(p.envelope) <= ENVELOPE_KEYS, p.where
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


def test_explicit_idempotency_keys_are_not_shared_between_cases(suite: Suite) -> None:
    """A key names one operation of a tenant, whatever the run: two cases sharing one
    would decide each other's labels."""
    owner: dict[tuple[str, str], str] = {}
    for p in suite.proposals:
        if "idempotency_key" in p.envelope:
            key = (p.tenant_id, p.envelope["idempotency_key"])
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
    env.update(p.envelope)
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


@dataclass
class Gated:
    """What the gates before admission decide, and what admission needs to know."""

    outcome: Outcome
    arguments: Any
    contract: Contract | None


def _observe(p: Proposal, pack: ContractSet, suite: Suite) -> Gated:
    parsed = parse_proposal(SourceRecord("tool.proposals", 0, 0, None, _envelope(p), 0), Limits())
    assert not isinstance(parsed, DeadLetter), p.where
    proposal, rejection, _ = parsed
    if rejection is not None:
        return Gated(Outcome.of(rejection), proposal.arguments, None)
    resolved = resolve_tool(proposal, pack)
    if isinstance(resolved, Rejection):
        return Gated(Outcome.of(resolved), proposal.arguments, None)
    # Credentials are refused before the schema gate, which would quote them back.
    refused = check_secrets(proposal, Policy()) or check_arguments(proposal.arguments, resolved)
    if refused is not None:
        return Gated(Outcome.of(refused), proposal.arguments, resolved)
    return Gated(_model(p, resolved, proposal.arguments, suite), proposal.arguments, resolved)


# -- admission: a model of its rules over the runs ---------------------------------------------

REPAIRS = frozenset(
    {"SYNTACTIC_PARSE_FAIL", "STRUCTURAL_VIOLATION", "TYPE_MISMATCH", "OUT_OF_BOUNDS",
     "SEMANTIC_INVALIDITY"}
)  # fmt: skip
"""Refusals of a proposal's own arguments: what the repair guard counts."""
HANDOFF = ("handoff_to_human",)
ADMISSION_ACTIONS = {
    "step_cap": "This run is out of steps: stop calling tools and call handoff_to_human.",
    "class_budget": "This run may make no more {group} calls. Do not retry.",
    "run_cost_cap": "This run has spent its cost budget. Do not retry; call handoff_to_human.",
    "tenant_day_cost_cap": "The tenant's daily budget is spent; call handoff_to_human.",
    "repeated_call": "Do not repeat this call: change the arguments or use another tool.",
    "repair_loop": "Stop: the same invalid call will not succeed; call handoff_to_human.",
    "repair_cap": "Stop: this run has failed to repair its calls {repairs} times; call "
    "handoff_to_human.",
    "rate_limited": "Wait, then propose the same call again unchanged.",
    "idempotency_in_flight": "The same operation is already running: wait for its result, or "
    "retry with the same idempotency key later.",
    "idempotency_key_reused": "Nothing ran: use a new key for a new operation.",
}
"""What the model must be told for each admission refusal (labels quote these words)."""


def _canonical(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


@dataclass
class Run:
    steps: int = 0
    repairs: int = 0
    spent: Counter[str] = field(default_factory=Counter)
    cost: float = 0.0
    made: Counter[tuple[str, bytes]] = field(default_factory=Counter)
    invalid: Counter[tuple[str, bytes]] = field(default_factory=Counter)


@dataclass
class Record:
    """An idempotency record; with no executor in the run, every one stays in flight."""

    payload: bytes
    awaiting_approval: bool
    tool: str


@dataclass
class Admission:
    """The rules the design gives admission, over the suite's runs in the runner's order.

    No time passes in the model: a rate-limit bucket never refills and a call in flight
    stays in flight. Keys, buckets and day costs are per tenant, across runs."""

    policy: Policy
    runs: dict[tuple[str, str], Run] = field(default_factory=dict)
    records: dict[tuple[Any, ...], Record] = field(default_factory=dict)
    calls: Counter[tuple[str, str]] = field(default_factory=Counter)
    callers: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    limited: set[tuple[str, str]] = field(default_factory=set)
    day: dict[str, float] = field(default_factory=dict)

    def admit(self, p: Proposal, run_id: str, gated: Gated, who: dict[str, Any]) -> Outcome:
        seen = gated.outcome
        tenant = who["tenant_id"]
        verified = TOKEN_CODES[p.token] is None and p.tenant_id == tenant
        # An identity refusal leaves no principal to charge, so only a verified
        # principal's proposals are steps (cross_tenant_reference is found after it).
        if not verified or (seen.gate == "identity" and "cross_tenant_reference" not in seen.codes):
            return seen
        budgets = self.policy.budgets_for(tenant)
        run = self.runs.setdefault((tenant, run_id), Run())
        contract = gated.contract
        parked = seen.taxonomy == "CONFIRMATION_MISSING" and seen.codes == {"approval_required"}
        # A replayed approval is found spent by admission, after the idempotency record's
        # checks and before any limit: it takes a step and nothing else.
        replayed = seen.codes == {"approval_reused"}
        if seen.taxonomy == "SUCCESS" or parked or replayed:
            assert contract is not None, p.where
            refused = self._call(p, run, run_id, gated, contract, budgets, who, parked, replayed)
            if refused is None or refused == "approval_reused":
                return seen
            # A parked call's one code is its parking notice; refused, it parks nowhere.
            return self._refusal(Outcome("SUCCESS", "route"), refused, budgets, contract)
        code = self._step(p, run, gated, budgets, repair=seen.taxonomy in REPAIRS)
        return seen if code is None else self._refusal(seen, code, budgets, None)

    def _step(
        self, p: Proposal, run: Run, gated: Gated, budgets: Budgets, repair: bool
    ) -> str | None:
        args = gated.arguments if gated.arguments is not None else p.tool
        signature = (p.tool, _canonical(args))
        before, run.steps = run.steps, run.steps + 1
        if repair:
            repairs, same = run.repairs, run.invalid[signature]
            run.repairs += 1
            run.invalid[signature] += 1
        if before >= budgets.steps:
            return "step_cap"
        if not repair:
            return None
        if same >= 1:
            return "repair_loop"
        if repairs >= budgets.repairs:
            return "repair_cap"
        return None

    def _call(
        self,
        p: Proposal,
        run: Run,
        run_id: str,
        gated: Gated,
        contract: Contract,
        budgets: Budgets,
        who: dict[str, Any],
        parked: bool,
        replayed: bool,
    ) -> str | None:
        tenant, tool = who["tenant_id"], contract.name
        payload = _canonical(gated.arguments)
        explicit = p.envelope.get("idempotency_key")
        key: tuple[Any, ...] = (
            (tenant, explicit)
            if explicit is not None
            else (tenant, run_id, who["user_id"], tool, contract.version, payload)
        )
        record = self.records.get(key)
        charged = False
        if record is not None:
            if record.payload != payload or record.tool != tool:
                run.steps += 1
                return "idempotency_key_reused"
            if record.awaiting_approval and not parked:
                charged = True  # the parked call, back with its approvals: paid already
            else:
                run.steps += 1
                return "idempotency_in_flight"
        if replayed:
            run.steps += 1
            return "approval_reused"
        code = self._limits(run, contract, budgets, tenant, payload, charged)
        if code is not None:
            run.steps += 1
            return code
        run.steps += 1
        if not charged:  # a parked call back with its approvals was counted when parked
            run.made[(tool, payload)] += 1
            group = budgets.group(tool, contract.side_effect_class)
            cost = _cost_of(contract)
            run.spent[group] += 1
            run.cost += cost
            self.day[tenant] = self.day.get(tenant, 0.0) + cost
            self.calls[(tenant, tool)] += 1
            self.callers.setdefault((tenant, tool), set()).add(p.case_id)
        self.records[key] = Record(payload, parked, tool)
        return None

    def _limits(
        self,
        run: Run,
        contract: Contract,
        budgets: Budgets,
        tenant: str,
        payload: bytes,
        charged: bool,
    ) -> str | None:
        tool = contract.name
        if run.steps >= budgets.steps:
            return "step_cap"
        if run.made[(tool, payload)] >= budgets.repeats:
            return "repeated_call"
        if charged:
            return None
        group = budgets.group(tool, contract.side_effect_class)
        cost = _cost_of(contract)
        if run.spent[group] >= budgets.classes.get(group, 0):
            return "class_budget"
        if run.cost + cost > budgets.run_cost:
            return "run_cost_cap"
        if budgets.day_cost is not None and self.day.get(tenant, 0.0) + cost > budgets.day_cost:
            return "tenant_day_cost_cap"
        burst = _burst(contract, budgets.rate_limit_scale)
        if burst is not None and self.calls[(tenant, tool)] >= burst:
            self.limited.add((tenant, tool))
            return "rate_limited"
        return None

    def _refusal(
        self, seen: Outcome, code: str, budgets: Budgets, contract: Contract | None
    ) -> Outcome:
        """A refused proposal keeps the earlier gates' errors; admission's is added."""
        taxonomy, gate, fields = "BUDGET_EXHAUSTED", "budget", set(seen.fields)
        if code == "rate_limited":
            taxonomy = "RATE_LIMITED"
        elif code.startswith("idempotency_"):
            taxonomy = (
                "IDEMPOTENCY_CONFLICT"
                if code == "idempotency_in_flight"
                else ("SIGNATURE_MISMATCH")
            )
            gate = "idempotency"
            fields.add("idempotency_key")
        group = budgets.group(contract.name, contract.side_effect_class) if contract else ""
        action = ADMISSION_ACTIONS[code].format(group=group, repairs=budgets.repairs)
        handoff = HANDOFF if code in ("step_cap", "repair_loop", "repair_cap") else ()
        codes = seen.codes | {code} if seen.taxonomy != "SUCCESS" else {code}
        return Outcome(taxonomy, gate, codes, fields, action, handoff)


def _cost_of(contract: Contract) -> float:
    profile = contract.raw["runtime"].get("cost_profile") or {}
    return float(profile.get("cost_per_call") or 0)


def _burst(contract: Contract, scale: float) -> int | None:
    """Calls a tenant may make of a tool at once: the contract's max_requests, scaled."""
    limits = contract.raw["runtime"].get("rate_limits") or {}
    if not limits.get("max_requests") or not limits.get("window_sec"):
        return None
    return max(1, int(limits["max_requests"] * scale))


def _decided(suite: Suite, pack: ContractSet) -> list[tuple[Proposal, Outcome]]:
    """Every proposal's observation, in the order the runner sends them: single cases
    first, then each multi-step case's steps in order, every case in its own run."""
    admission = Admission(parse_policy(suite.policy))
    ordered = sorted(suite.proposals, key=lambda p: p.step is not None)  # stable
    out = []
    for p in ordered:
        who = suite.principals[p.principal]
        out.append((p, admission.admit(p, f"run-{p.case_id}", _observe(p, pack, suite), who)))
    for bucket in admission.limited:
        # Buckets are per tenant and tool, across runs: a limit one case hits must not
        # depend on how fast the runner got through another.
        assert len(admission.callers[bucket]) == 1, (bucket, admission.callers[bucket])
    return out


def test_every_label_is_what_the_gates_decide(suite: Suite, pack: ContractSet) -> None:
    wrong = []
    for p, seen in _decided(suite, pack):
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


def test_admission_labels_name_all_their_codes(suite: Suite, pack: ContractSet) -> None:
    """An admission refusal keeps the earlier gates' errors: its label lists them too, so
    a budget code cannot stand in for the refusal it was added to."""
    for p, seen in _decided(suite, pack):
        if p.expect["gate"] in ADMISSION:
            assert set(p.expect.get("codes", [])) == seen.codes, (p.where, sorted(seen.codes))


def test_rejections_name_their_codes(suite: Suite) -> None:
    """Every refusal says which code to look for, so a wrong reason cannot pass."""
    for p in suite.proposals:
        if p.expect["taxonomy"] != "SUCCESS":
            assert p.expect.get("codes"), p.where
