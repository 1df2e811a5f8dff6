"""Gates on meaning: references, cross-field rules, tenancy of ids, entity state.

JSON Schema says ``WO-12345-A`` looks like an order id; only the reference
data says whether that order exists, belongs to this tenant and may still be
cancelled. The data comes from ``tool.reference`` (materialised in Redis,
fetched once per batch); these functions only read the fetched values, so
they stay pure.

Outcomes, in order:

- an id that exists nowhere: ``SEMANTIC_INVALIDITY``, and ``next_action``
  names the lookup tool: the model invented or misremembered it;
- an argument too large for the rules to be checked within ``RULE_COST_LIMIT``, or an
  integer outside the 64 bits CEL computes with where a rule can read it: ``OUT_OF_BOUNDS``;
- a rule of the contract is false: ``SEMANTIC_INVALIDITY`` naming the rule;
- an id of another tenant: ``PERMISSION_DENIED``;
- an entity in a state the action does not allow: ``STALE_STATE``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from processor.contracts.registry import Contract, Reference, SemanticRule, leaves
from processor.gates.schema import field_path
from processor.model import FieldError, Gate, Principal, Proposal, Rejection, TaxonomyClass

RefKey = tuple[str, str, str]
"""(tenant, entity, id): one entity in ``tool.reference``."""


@dataclass(frozen=True, slots=True)
class RefEntry:
    tenant_id: str
    state: str
    owner: str | None
    attributes: dict[str, Any]

    def as_cel(self) -> dict[str, Any]:
        return {
            "tenant_id": self.tenant_id,
            "state": self.state,
            "owner": self.owner or "",
            "attributes": self.attributes,
        }


FOREIGN = RefEntry("", "", None, {})
"""The lookup's answer for an id that exists, but only under other tenants."""

RefAnswers = Mapping[RefKey, RefEntry | None]


def reference_keys(p: Proposal, contract: Contract, tenant_id: str) -> list[RefKey]:
    out: list[RefKey] = []
    args = p.arguments
    for ref in contract.references:
        value = args.get(ref.argument) if isinstance(args, dict) else None
        if isinstance(value, str):
            out.append((tenant_id, ref.entity, value))
    return out


Resolved = list[tuple[Reference, Any, RefEntry | None]]
"""Each reference the call makes: the contract's declaration, the id, the entity found."""


def resolve_references(
    p: Proposal, contract: Contract, tenant_id: str, answers: RefAnswers
) -> Resolved:
    """An argument left out or null names no entity. Any other value that is not text (a
    number, where the schema allows one) is no key of tool.reference: it names none that
    exists, rather than going unchecked."""
    out: Resolved = []
    args = p.arguments
    for ref in contract.references:
        value = args.get(ref.argument) if isinstance(args, dict) else None
        if isinstance(value, str):
            out.append((ref, value, answers.get((tenant_id, ref.entity, value))))
        elif value is not None:
            out.append((ref, value, None))
    return out


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def check_semantics(
    p: Proposal, contract: Contract, principal: Principal, resolved: Resolved
) -> Rejection | None:
    unknown = [
        FieldError(
            ref.argument,
            f"no {ref.entity} {value!r} exists",
            "unknown_reference",
            hint=f"call {ref.lookup_tool}",
        )
        for ref, value, entry in resolved
        if entry is None
    ]
    if unknown:
        first = next(ref for ref, _, entry in resolved if entry is None)
        return Rejection(
            TaxonomyClass.SEMANTIC_INVALIDITY,
            Gate.SEMANTIC,
            tuple(unknown),
            f"{first.argument} names no existing {first.entity}: call {first.lookup_tool} to "
            f"get the {first.entity}'s id; never construct {_article(first.entity)} "
            f"{first.entity} id.",
        )
    if contract.rules:
        refs = {
            ref.argument: entry.as_cel()
            for ref, _, entry in resolved
            if entry is not None and entry is not FOREIGN
        }
        context: dict[str, Any] = {
            "args": p.arguments,
            "principal": principal.as_cel(),
            "refs": refs,
        }
        size, beyond, unread = context_size(context, contract.rules)
        refusal = _beyond_the_engine(contract.rules, size, beyond)
        if refusal is not None:
            return refusal
        if unread:
            context = _emptied(context, unread)
        failed: list[tuple[str, str, str]] = []
        for rule in contract.rules:
            try:
                ok = rule.program.execute(context)
            except Exception:
                if len(refs) < len(resolved):
                    continue  # reads another tenant's entity: refused just below instead
                ok = False
            if ok is not True:
                failed.append((rule.rule_id, rule.message, rule.next_action))
        if failed:
            return Rejection(
                TaxonomyClass.SEMANTIC_INVALIDITY,
                Gate.SEMANTIC,
                tuple(
                    FieldError(None, f"rule {rid}: {message}", "rule_failed", expected=rid)
                    for rid, message, _ in failed
                ),
                failed[0][2],
            )
    foreign = [
        FieldError(
            ref.argument,
            f"{ref.entity} {value!r} does not belong to tenant {principal.tenant_id}",
            "cross_tenant_reference",
        )
        for ref, value, entry in resolved
        if entry is FOREIGN
    ]
    if foreign:
        return Rejection(
            TaxonomyClass.PERMISSION_DENIED,
            Gate.IDENTITY,
            tuple(foreign),
            "Do not retry: the call names another tenant's data. Use only ids returned by "
            "this tenant's lookups.",
        )
    return None


RULE_COST_LIMIT = 4_000_000
"""The most ``context_size(...) ** rule.cost_exponent`` a rule is evaluated at. The engine
has no step limit of its own and cannot be interrupted, and a rule runs on the consumer's
thread: at this bound the costliest shapes measured (a comprehension whose body reads an
argument list, a ``map`` producing lists) take about 0.1 s. A rule without comprehensions
(exponent 1) is never limited; one comprehension allows about 2,000 values, a ``map`` or two
nested comprehensions about 150."""

_STRING_UNIT = 16
"""Characters of a string counted as one value: a rule scans strings (``contains``,
``matches``) many times faster than it steps through a list."""

_INT64 = (-(2**63), 2**63 - 1)


_Link = tuple[Any, "_Link"] | None
"""A path as (last key, the parent's path)."""

ContextPath = tuple[Any, ...]
"""Keys from the context down to one value: ``("args", "items", 0)``."""


def context_size(
    value: Any, rules: tuple[SemanticRule, ...] | None = None
) -> tuple[int, ContextPath | None, list[ContextPath]]:
    """The size of what a rule may read: one per value (a list, a map, each element and
    each entry included), plus one per ``_STRING_UNIT`` characters; the path of the first
    integer outside int64 that ``rules`` can read (any, without rules), which the engine
    would turn into a uint or a rounded double instead of failing with an overflow; and
    the paths of those no rule reads. Iterative, and each value's path is a link to its
    parent's, so that deep nesting costs neither recursion nor copies."""
    size = 0
    beyond: ContextPath | None = None
    unread: list[ContextPath] = []
    stack: list[tuple[Any, _Link]] = [(value, None)]
    while stack:
        node, where = stack.pop()
        size += 1
        if isinstance(node, dict):
            stack.extend((v, (k, where)) for k, v in node.items())
        elif isinstance(node, list | tuple):
            stack.extend((v, (i, where)) for i, v in enumerate(node))
        elif isinstance(node, str | bytes):
            size += len(node) // _STRING_UNIT
        elif type(node) is int and beyond is None and not _INT64[0] <= node <= _INT64[1]:
            path = _unlink(where)
            if rules is None or _read(rules, path):
                beyond = path
            else:
                unread.append(path)
    return size, beyond, unread


def _unlink(link: _Link) -> ContextPath:
    parts: list[Any] = []
    while link is not None:
        parts.append(link[0])
        link = link[1]
    return tuple(reversed(parts))


def _read(rules: tuple[SemanticRule, ...], path: ContextPath) -> bool:
    """Whether a rule can read the value at ``path``: it reads that value, a value holding
    it (all of which it may read), or a value inside it (which it reaches through it)."""
    for rule in rules:
        for read in rule.reads:
            n = min(len(read), len(path))
            if read[:n] == path[:n]:
                return True
    return False


def _emptied(context: dict[str, Any], paths: list[ContextPath]) -> dict[str, Any]:
    """``context`` with null at each of ``paths``, copying only the maps and lists on the
    way. An integer beyond the double range fails the engine's conversion of the whole
    context, so one that no rule reads must not reach it; null cannot change a verdict
    that does not read it."""
    out = dict(context)
    copied = {id(out)}
    for path in paths:
        node: Any = out
        for key in path[:-1]:
            child = node[key]
            if id(child) not in copied:
                child = dict(child) if isinstance(child, dict) else list(child)
                copied.add(id(child))
                node[key] = child
            node = child
        node[path[-1]] = None
    return out


CARRIED = (-(2**63), 2**64 - 1)
"""The integers a call's canonical arguments can hold (what its payload hash, its Avro
record and its executors' JSON readers take)."""


def uncarriable(arguments: Any) -> Rejection:
    """The refusal of arguments holding an integer beyond ``CARRIED``, which a schema without
    a ``maximum`` (or ``minimum``) lets through: the call could not be hashed nor routed,
    and its decision would fail as an internal error."""
    where = next(
        (path for path, v in leaves(arguments)
         if type(v) is int and not CARRIED[0] <= v <= CARRIED[1]),
        (),
    )  # fmt: skip
    field = field_path(where) if where else None
    return Rejection(
        TaxonomyClass.OUT_OF_BOUNDS,
        Gate.SEMANTIC,
        (
            FieldError(
                field,
                f"{field or 'the arguments'}: integer outside the 64-bit range a call can carry",
                "integer_overflow",
                expected=f"{CARRIED[0]}..{CARRIED[1]}",
            ),
        ),
        "Send the number within the 64-bit range; a value this large cannot be passed to the tool.",
    )


def _beyond_the_engine(
    rules: tuple[SemanticRule, ...], size: int, beyond: ContextPath | None
) -> Rejection | None:
    """Refuse, before any rule runs, a context the rules cannot be evaluated over faithfully
    (an integer beyond int64 that a rule reads) or within ``RULE_COST_LIMIT``. Both
    refusals fail closed and say the arguments are too large, not that they break a
    rule."""
    if beyond is not None:
        field = field_path(beyond[1:]) if beyond[:1] == ("args",) else None
        return Rejection(
            TaxonomyClass.OUT_OF_BOUNDS,
            Gate.SEMANTIC,
            (
                FieldError(
                    field,
                    f"{field_path(beyond)}: integer outside the 64-bit range the contract's "
                    "rules compute with",
                    "integer_overflow",
                    expected=f"{_INT64[0]}..{_INT64[1]}",
                ),
            ),
            "Send the number within the signed 64-bit range; a value this large cannot be "
            "checked against the tool's rules.",
        )
    costly = [r for r in rules if r.cost_exponent > 1 and size**r.cost_exponent > RULE_COST_LIMIT]
    if not costly:
        return None
    return Rejection(
        TaxonomyClass.OUT_OF_BOUNDS,
        Gate.SEMANTIC,
        tuple(
            FieldError(
                None,
                f"rule {r.rule_id}: arguments of size {size} are too large for this rule to "
                f"be checked (size ** {r.cost_exponent} exceeds {RULE_COST_LIMIT})",
                "rule_cost_exceeded",
                expected=r.rule_id,
            )
            for r in costly
        ),
        "The arguments are too large for the tool's rules to be checked in one call: send "
        "fewer or shorter items, splitting the work over several calls.",
    )


def check_state(contract: Contract, resolved: Resolved) -> Rejection | None:
    stale = [
        (ref, value, entry)
        for ref, value, entry in resolved
        if entry is not None and entry.state not in ref.allowed_states
    ]
    if not stale:
        return None
    ref, value, entry = stale[0]
    assert entry is not None
    return Rejection(
        TaxonomyClass.STALE_STATE,
        Gate.STATE,
        tuple(
            FieldError(
                r.argument,
                f"{r.entity} {v} is {e.state}; {contract.name} needs it "
                f"{' or '.join(r.allowed_states)}",
                "invalid_state",
                expected=", ".join(r.allowed_states),
                actual=e.state,
            )
            for r, v, e in stale
            if e is not None
        ),
        f"{ref.entity} {value} is already {entry.state}, so {contract.name} cannot run. Call "
        f"{ref.lookup_tool} to refresh what you know, then tell the user the {ref.entity}'s "
        "actual state instead of retrying.",
    )


def before_state(resolved: Resolved) -> str:
    """The referenced entities' current states, for a confirmation packet."""
    parts = [
        f"{ref.entity} {value} is {entry.state}"
        for ref, value, entry in resolved
        if entry is not None and entry is not FOREIGN
    ]
    return "; ".join(parts)
