"""Deployment policy: which classes a tenant may use, what needs approval, egress,
and the budgets a run and a tenant may spend.

Contracts say what a tool is; policy says what this deployment lets tenants
do with it. The file is small YAML (``policy/policy.yaml``); without one, the
defaults apply: every class allowed, approvals for the two riskiest classes,
dual control for critical mutations, secrets scanning on, no egress domains.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml_rs

from processor.gates.policy_scan import domain_entry
from processor.model import SideEffectClass

MAX_APPROVAL_LIFETIME_S = 86_400
"""The default bound on an approval's ``expires_at - approved_at``."""

ALL_CLASSES = tuple(SideEffectClass)


class PolicyError(ValueError):
    """The policy file is unusable; the processor refuses to start with it."""


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    allowed_classes: frozenset[SideEffectClass]
    allowed_domains: tuple[str, ...] = ()


BUDGET_GROUPS = ("read", "write", "external", "financial", "critical")
"""What a run's class budgets count. A tool listed under ``financial_tools`` counts as
financial whatever its side-effect class; every other tool by its class."""

DEFAULT_GROUP_OF: dict[SideEffectClass, str] = {
    SideEffectClass.READ_ONLY: "read",
    SideEffectClass.EPHEMERAL_WRITE: "write",
    SideEffectClass.LOW_RISK_INTERNAL: "write",
    SideEffectClass.MEDIUM_RISK_WRITE: "write",
    SideEffectClass.HIGH_RISK_EXTERNAL: "external",
    SideEffectClass.CRITICAL_MUTATION: "critical",
}


@dataclass(frozen=True, slots=True)
class Budgets:
    """What one run and one tenant-day may spend (seed 000: twelve steps a run).

    A run's calls are capped per budget group; financial and critical calls get
    none unless the policy grants them."""

    steps: int = 12
    """Proposals a run may make, refused ones included."""
    classes: dict[str, int] = field(
        default_factory=lambda: {"read": 30, "write": 5, "external": 3, "financial": 0,
                                 "critical": 0}
    )  # fmt: skip
    run_cost: float = 5.0
    """Cost (the contracts' cost_per_call) a run may spend."""
    day_cost: float | None = 100.0
    """Cost a tenant may spend per UTC day (None: no cap)."""
    repeats: int = 2
    """Times a run may make the same call (tool and canonical arguments)."""
    repairs: int = 3
    """Refused proposals a run may repair before it is stopped and escalated."""
    financial_tools: frozenset[str] = frozenset()
    rate_limit_scale: float = 1.0
    """Multiplies every contract's ``max_requests`` (load tests loosen them, never off)."""
    in_flight_grace_ms: int = 30_000
    """How long after its deadline an unanswered call keeps its idempotency key; then
    the key is retryable (the executor never starts a call past its deadline)."""

    def group(self, tool: str, cls: SideEffectClass) -> str:
        return "financial" if tool in self.financial_tools else DEFAULT_GROUP_OF[cls]


@dataclass(frozen=True, slots=True)
class Policy:
    confirmation_classes: frozenset[SideEffectClass] = frozenset(
        {SideEffectClass.HIGH_RISK_EXTERNAL, SideEffectClass.CRITICAL_MUTATION}
    )
    dual_control_classes: frozenset[SideEffectClass] = frozenset(
        {SideEffectClass.CRITICAL_MUTATION}
    )
    approval_ttl_s: int = 600
    approval_max_lifetime_s: int = MAX_APPROVAL_LIFETIME_S
    allowed_domains: tuple[str, ...] = ()
    internal_domains: tuple[str, ...] = ()
    secrets_enabled: bool = True
    tenants: dict[str, TenantPolicy] = field(default_factory=dict)
    default_tenant: TenantPolicy = TenantPolicy(frozenset(ALL_CLASSES))
    budgets: Budgets = field(default_factory=Budgets)
    tenant_budgets: dict[str, Budgets] = field(default_factory=dict)

    def for_tenant(self, tenant_id: str) -> TenantPolicy:
        return self.tenants.get(tenant_id, self.default_tenant)

    def budgets_for(self, tenant_id: str) -> Budgets:
        return self.tenant_budgets.get(tenant_id, self.budgets)

    def approvals_needed(self, cls: SideEffectClass, contract_flag: bool) -> int:
        """How many distinct approvers a call needs (0: none)."""
        if cls in self.dual_control_classes:
            return 2
        if contract_flag or cls in self.confirmation_classes:
            return 1
        return 0


def _seconds(conf: dict[str, Any], name: str, default: int, where: str) -> int:
    value = conf.get(name, default)
    if type(value) is not int or value <= 0:
        raise PolicyError(f"{where}: confirmation.{name} must be a positive integer")
    return value


def _classes(value: Any, where: str) -> frozenset[SideEffectClass]:
    if not isinstance(value, list):
        raise PolicyError(f"{where}: expected a list of side-effect classes")
    try:
        return frozenset(SideEffectClass(v) for v in value)
    except ValueError as exc:
        raise PolicyError(f"{where}: {exc}") from exc


def _domains(value: Any, where: str) -> tuple[str, ...]:
    """Egress entries as ``host`` or ``host:port``, normalised (lowercase ASCII, no ``*.``).

    An entry the egress check could not use, or one that would open more than the
    deployment's own hosts (``com``, ``co.uk``, ``github.io``), stops the policy from
    loading, named, rather than being dropped without a word or allowing every host
    under it: see :func:`~processor.gates.policy_scan.domain_entry`.
    """
    if value is None:
        return ()
    if not isinstance(value, list):
        raise PolicyError(f"{where}: expected a list of domain names")
    out: list[str] = []
    for raw in value:
        try:
            host, port = domain_entry(raw)
        except ValueError as exc:
            raise PolicyError(f"{where}: entry {raw!r} {exc}") from None
        out.append(host if port is None else f"{host}:{port}")
    return tuple(out)


_TOP_KEYS = {"confirmation", "egress", "tenants", "secrets", "budgets"}
_CONFIRMATION_KEYS = {
    "classes",
    "dual_control_classes",
    "ttl_seconds",
    "max_approval_lifetime_seconds",
}
_EGRESS_KEYS = {"allowed_domains", "internal_domains"}
_TENANT_KEYS = {"allowed_classes", "allowed_domains"}
_SECRETS_KEYS = {"enabled"}
_BUDGET_KEYS = {"steps", "classes", "run_cost", "day_cost", "repeats", "repairs",
                "financial_tools", "in_flight_grace_ms", "rate_limit_scale", "tenants"}  # fmt: skip


_MAX_NUMBER = 2**53
"""The largest number a policy may give: the admission script reads numbers as doubles,
and the JSON that carries them there holds no infinity or NaN (``.inf`` reached it as
null, and every call of the tenant failed in the script)."""


def _count(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_NUMBER:
        raise PolicyError(f"{where}: expected a non-negative integer of at most 2**53")
    return value


def _cost(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise PolicyError(f"{where}: expected a non-negative number")
    if not value <= _MAX_NUMBER:  # also refuses NaN
        raise PolicyError(f"{where}: expected a finite number of at most 2**53")
    return float(value)


def _section(value: Any, keys: set[str], where: str) -> dict[str, Any]:
    """A mapping of some of ``keys`` (None: empty). A misspelt key is refused, never
    ignored: a tenant entry missing its ``allowed_classes`` gets every class."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PolicyError(f"{where}: expected a mapping of {sorted(keys)}")
    unknown = set(value) - keys
    if unknown:
        raise PolicyError(f"{where}: unknown keys {sorted(unknown)} (expected {sorted(keys)})")
    return value


def parse_budgets(doc: Any, where: str, base: Budgets) -> Budgets:
    """A ``budgets`` mapping over ``base``: keys left out keep base's values."""
    if not isinstance(doc, dict):
        raise PolicyError(f"{where}: expected a mapping")
    unknown = set(doc) - _BUDGET_KEYS
    if unknown:
        raise PolicyError(f"{where}: unknown keys {sorted(unknown)}")
    classes = dict(base.classes)
    groups = doc.get("classes") or {}
    if not isinstance(groups, dict):
        raise PolicyError(f"{where}.classes: expected a mapping of budget groups to counts")
    for group, n in groups.items():
        if group not in BUDGET_GROUPS:
            raise PolicyError(f"{where}.classes: unknown group {group!r} ({BUDGET_GROUPS})")
        classes[group] = _count(n, f"{where}.classes.{group}")
    tools = doc.get("financial_tools", sorted(base.financial_tools))
    if not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
        raise PolicyError(f"{where}.financial_tools: expected a list of tool names")
    day = doc.get("day_cost", base.day_cost)
    return Budgets(
        steps=_count(doc.get("steps", base.steps), f"{where}.steps"),
        classes=classes,
        run_cost=_cost(doc.get("run_cost", base.run_cost), f"{where}.run_cost"),
        day_cost=None if day is None else _cost(day, f"{where}.day_cost"),
        repeats=_count(doc.get("repeats", base.repeats), f"{where}.repeats"),
        repairs=_count(doc.get("repairs", base.repairs), f"{where}.repairs"),
        financial_tools=frozenset(tools),
        rate_limit_scale=_cost(
            doc.get("rate_limit_scale", base.rate_limit_scale), f"{where}.rate_limit_scale"
        )
        or 1.0,
        in_flight_grace_ms=_count(
            doc.get("in_flight_grace_ms", base.in_flight_grace_ms), f"{where}.in_flight_grace_ms"
        ),
    )


def parse_policy(doc: Any, where: str = "policy") -> Policy:
    if doc is None:
        return Policy()
    if not isinstance(doc, dict):
        raise PolicyError(f"{where}: the policy must be a mapping")
    unknown = set(doc) - _TOP_KEYS
    if unknown:
        raise PolicyError(f"{where}: unknown keys {sorted(unknown)}")
    base = Policy()
    conf = doc.get("confirmation") or {}
    if not isinstance(conf, dict) or set(conf) - _CONFIRMATION_KEYS:
        raise PolicyError(
            f"{where}: confirmation must be a mapping of {sorted(_CONFIRMATION_KEYS)}"
        )
    egress = _section(doc.get("egress"), _EGRESS_KEYS, f"{where}: egress")
    secrets = _section(doc.get("secrets"), _SECRETS_KEYS, f"{where}: secrets")
    tenants_doc = {} if doc.get("tenants") is None else doc["tenants"]
    if not isinstance(tenants_doc, dict):
        raise PolicyError(f"{where}: tenants must be a mapping of tenant ids to entries")
    ttl = _seconds(conf, "ttl_seconds", base.approval_ttl_s, where)
    lifetime = _seconds(conf, "max_approval_lifetime_seconds", base.approval_max_lifetime_s, where)
    tenants: dict[str, TenantPolicy] = {}
    for name, entry in tenants_doc.items():
        if entry is None:
            raise PolicyError(f"{where}: tenants.{name} must be a mapping")
        t = _section(entry, _TENANT_KEYS, f"{where}: tenants.{name}")
        classes = t.get("allowed_classes", [c.value for c in ALL_CLASSES])
        tenants[str(name)] = TenantPolicy(
            _classes(classes, f"{where}: tenants.{name}.allowed_classes"),
            _domains(t.get("allowed_domains"), f"{where}: tenants.{name}.allowed_domains"),
        )
    default = tenants.pop("*", base.default_tenant)
    budgets_doc = {} if doc.get("budgets") is None else doc["budgets"]
    if not isinstance(budgets_doc, dict):
        raise PolicyError(f"{where}: budgets: expected a mapping")
    budgets = parse_budgets(
        {k: v for k, v in budgets_doc.items() if k != "tenants"}, f"{where}: budgets", Budgets()
    )
    per_tenant = budgets_doc.get("tenants") or {}
    if not isinstance(per_tenant, dict):
        raise PolicyError(f"{where}: budgets.tenants must be a mapping")
    tenant_budgets = {
        str(name): parse_budgets(b, f"{where}: budgets.tenants.{name}", budgets)
        for name, b in per_tenant.items()
    }
    return Policy(
        confirmation_classes=_classes(
            conf.get("classes", [c.value for c in base.confirmation_classes]),
            f"{where}: confirmation.classes",
        ),
        dual_control_classes=_classes(
            conf.get("dual_control_classes", [c.value for c in base.dual_control_classes]),
            f"{where}: confirmation.dual_control_classes",
        ),
        approval_ttl_s=ttl,
        approval_max_lifetime_s=lifetime,
        allowed_domains=_domains(egress.get("allowed_domains"), f"{where}: egress.allowed_domains"),
        internal_domains=_domains(
            egress.get("internal_domains"), f"{where}: egress.internal_domains"
        ),
        secrets_enabled=_enabled(secrets.get("enabled", True), f"{where}: secrets.enabled"),
        tenants=tenants,
        default_tenant=default,
        budgets=budgets,
        tenant_budgets=tenant_budgets,
    )


def _enabled(value: object, where: str) -> bool:
    """A switch is true or false: an empty YAML value (null) or a word such as "off" is a
    mistake to refuse, not a reason to turn the credential scan off (or on)."""
    if type(value) is not bool:
        raise PolicyError(f"{where} must be true or false, not {value!r}")
    return value


def load_policy(path: Path | None) -> Policy:
    if path is None:
        return Policy()
    path = Path(path)
    try:
        doc = yaml_rs.loads(path.read_text(), parse_datetime=False)
    except OSError as exc:
        raise PolicyError(f"{path}: {exc}") from exc
    except Exception as exc:
        raise PolicyError(f"{path}: cannot be parsed: {exc}") from exc
    return parse_policy(doc, str(path))
