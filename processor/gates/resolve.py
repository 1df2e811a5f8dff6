"""Gate 2, tool resolution: which contract (name and version) decides this call.

Refusals are repairable and list the tools the model may call at this step:
an unknown name (including look-alikes: names are compared byte for byte,
so ``cancel_order`` spelled with a Cyrillic U+0430 for its ``a`` is simply
unknown), a tool outside the step's ``active_tools``, an unknown version, a
sunsetted version.
"""

from __future__ import annotations

import difflib
import time
from functools import lru_cache

from processor.contracts.registry import Contract, ContractSet
from processor.gates.policy_scan import quotable
from processor.model import FieldError, Gate, Proposal, Rejection, TaxonomyClass


def _refuse(code: str, message: str, next_action: str, allowed: tuple[str, ...]) -> Rejection:
    return Rejection(
        TaxonomyClass.STRUCTURAL_VIOLATION,
        Gate.RESOLVE,
        (FieldError("tool/name", message, code),),
        next_action,
        allowed,
    )


def _palette(p: Proposal, contracts: ContractSet) -> tuple[str, ...]:
    if p.active_tools is None:
        return contracts.callable_names
    active = set(p.active_tools)
    return tuple(n for n in contracts.callable_names if n in active)


@lru_cache(maxsize=4)
def _utc_day(day_number: int) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(day_number * 86400))


def resolve_tool(
    p: Proposal, contracts: ContractSet, now_ms: int | None = None
) -> Contract | Rejection:
    name = p.tool_name or ""
    versions = contracts.versions(name)
    if p.tool_version is None and p.active_tools is None and versions:
        newest = versions[0]
        if newest.lifecycle.status == "active":
            return newest
    allowed = _palette(p, contracts)
    if not versions:
        close = difflib.get_close_matches(name, allowed, n=1, cutoff=0.75)
        suggestion = f"did you mean {close[0]}? " if close else ""
        return _refuse(
            "unknown_tool",
            f"there is no tool named {quotable(name)!r}",
            f"{suggestion}Call one of the available tools: {', '.join(allowed) or 'none'}.",
            allowed,
        )
    if p.active_tools is not None and name not in p.active_tools:
        return _refuse(
            "tool_not_active",
            f"{name} is not among the tools offered at this step",
            f"{name} is not available at this step; call one of: {', '.join(allowed) or 'none'}.",
            allowed,
        )
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    today = _utc_day(ms // 86_400_000)
    if p.tool_version is None:
        for c in versions:
            if c.lifecycle.status_on(today) == "active":
                return c
        for c in versions:
            if c.lifecycle.status_on(today) == "deprecated":
                return c
        return _sunsetted(versions[0], allowed)
    for c in versions:
        if c.version == p.tool_version:
            if c.lifecycle.status_on(today) == "sunsetted":
                return _sunsetted(c, allowed)
            return c
    known = ", ".join(c.version for c in versions)
    return _refuse(
        "unknown_version",
        f"{name} has no version {quotable(p.tool_version)} (known: {known})",
        f"Propose {name} without a version, or with one of: {known}.",
        allowed,
    )


def _sunsetted(c: Contract, allowed: tuple[str, ...]) -> Rejection:
    repl = c.lifecycle.replacement
    then = f" on {c.lifecycle.sunset_date}" if c.lifecycle.sunset_date else ""
    action = f"Call {repl} instead." if repl else "Pick another tool from the allowed list."
    return _refuse(
        "tool_sunsetted",
        f"{c.name}@{c.version} was sunsetted{then}",
        f"{c.name}@{c.version} no longer runs. {action}",
        allowed,
    )
