"""Deployment policy: which classes a tenant may use, what needs approval, egress.

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

from processor.model import SideEffectClass

ALL_CLASSES = tuple(SideEffectClass)


class PolicyError(ValueError):
    """The policy file is unusable; the processor refuses to start with it."""


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    allowed_classes: frozenset[SideEffectClass]
    allowed_domains: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Policy:
    confirmation_classes: frozenset[SideEffectClass] = frozenset(
        {SideEffectClass.HIGH_RISK_EXTERNAL, SideEffectClass.CRITICAL_MUTATION}
    )
    dual_control_classes: frozenset[SideEffectClass] = frozenset(
        {SideEffectClass.CRITICAL_MUTATION}
    )
    approval_ttl_s: int = 600
    allowed_domains: tuple[str, ...] = ()
    internal_domains: tuple[str, ...] = ()
    secrets_enabled: bool = True
    tenants: dict[str, TenantPolicy] = field(default_factory=dict)
    default_tenant: TenantPolicy = TenantPolicy(frozenset(ALL_CLASSES))

    def for_tenant(self, tenant_id: str) -> TenantPolicy:
        return self.tenants.get(tenant_id, self.default_tenant)

    def approvals_needed(self, cls: SideEffectClass, contract_flag: bool) -> int:
        """How many distinct approvers a call needs (0: none)."""
        if cls in self.dual_control_classes:
            return 2
        if contract_flag or cls in self.confirmation_classes:
            return 1
        return 0


def _classes(value: Any, where: str) -> frozenset[SideEffectClass]:
    if not isinstance(value, list):
        raise PolicyError(f"{where}: expected a list of side-effect classes")
    try:
        return frozenset(SideEffectClass(v) for v in value)
    except ValueError as exc:
        raise PolicyError(f"{where}: {exc}") from exc


def _domains(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(d, str) and d for d in value):
        raise PolicyError(f"{where}: expected a list of domain names")
    return tuple(d.lower().strip(".") for d in value)


_TOP_KEYS = {"confirmation", "egress", "tenants", "secrets"}


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
    egress = doc.get("egress") or {}
    tenants_doc = doc.get("tenants") or {}
    secrets = doc.get("secrets") or {}
    ttl = conf.get("ttl_seconds", base.approval_ttl_s)
    if not isinstance(ttl, int) or ttl <= 0:
        raise PolicyError(f"{where}: confirmation.ttl_seconds must be a positive integer")
    tenants: dict[str, TenantPolicy] = {}
    for name, t in tenants_doc.items():
        if not isinstance(t, dict):
            raise PolicyError(f"{where}: tenants.{name} must be a mapping")
        classes = t.get("allowed_classes", [c.value for c in ALL_CLASSES])
        tenants[str(name)] = TenantPolicy(
            _classes(classes, f"{where}: tenants.{name}.allowed_classes"),
            _domains(t.get("allowed_domains"), f"{where}: tenants.{name}.allowed_domains"),
        )
    default = tenants.pop("*", base.default_tenant)
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
        allowed_domains=_domains(egress.get("allowed_domains"), f"{where}: egress.allowed_domains"),
        internal_domains=_domains(
            egress.get("internal_domains"), f"{where}: egress.internal_domains"
        ),
        secrets_enabled=bool(secrets.get("enabled", True)),
        tenants=tenants,
        default_tenant=default,
    )


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
