"""Loading tool contracts: validate every file, compile once, all or nothing.

A contract set is loaded whole or refused whole: a processor never decides
with half a set. Each problem names the file, the JSON path inside it, and
the reason.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, TypeVar, cast

import orjson
import yaml_rs
from jsonschema import SchemaError

from processor.codec.avro import SCHEMAS_DIR
from processor.contracts import cel_engine, cel_syntax
from processor.contracts.validation import ArgumentValidator, SchemaRecursion, check_schema
from processor.model import Lifecycle, SideEffectClass

T = TypeVar("T")

CONTRACT_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True, slots=True)
class Problem:
    file: str
    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.path}: {self.reason}"


class ContractError(Exception):
    """A contract set was refused; ``problems`` lists every reason found."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"{len(problems)} problem(s) in the contract set:\n{lines}")


@dataclass(frozen=True, slots=True)
class SemanticRule:
    """A compiled CEL rule: true means the call may proceed."""

    rule_id: str
    program: Any
    message: str
    next_action: str
    cost_exponent: int = 1
    """The evaluation cost is at most the context's size to this power (see
    ``cost_exponent``): 1 for a rule without comprehensions."""
    reads: tuple[cel_syntax.Path, ...] = ((),)
    """The parts of the context the rule can read, each whole (see ``cel_syntax.reads``);
    the empty path, the default, is all of it."""


@dataclass(frozen=True, slots=True)
class Reference:
    """An argument that names an entity in ``tool.reference``, and the states it may be in."""

    argument: str
    entity: str
    allowed_states: tuple[str, ...]
    lookup_tool: str


@dataclass(frozen=True, slots=True)
class Contract:
    """One version of one tool, compiled for the gates."""

    name: str
    version: str
    lifecycle: Lifecycle
    side_effect_class: SideEffectClass
    timeout_ms: int
    confirmation_required: bool
    post_action_verification_required: bool
    input_schema: dict[str, Any]
    validator: ArgumentValidator
    raw: dict[str, Any]
    source: str
    rules: tuple[SemanticRule, ...] = ()
    references: tuple[Reference, ...] = ()
    derived: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """What later stages compute from this version once (see ``once``); it goes with the
    version when a reload replaces the set."""

    def once(self, key: str, compute: Callable[[Contract], T]) -> T:
        """``compute(self)``, computed on first use and kept with this version."""
        try:
            return cast(T, self.derived[key])
        except KeyError:
            value = self.derived[key] = compute(self)
            return value

    @property
    def version_key(self) -> tuple[int, ...]:
        return tuple(int(p) for p in self.version.split("."))

    @property
    def argument_names(self) -> tuple[str, ...]:
        return tuple(self.input_schema.get("properties", {}))

    @property
    def required_scopes(self) -> tuple[str, ...]:
        return tuple(self.raw["security"]["required_scopes"])

    @property
    def data_classification(self) -> str:
        return str(self.raw["security"]["data_classification"])

    @property
    def egress_policy(self) -> str:
        return str(self.raw["security"]["egress_policy"])

    @property
    def description(self) -> str:
        return str(self.raw["affordance"]["model_description"])

    @property
    def compensation_tool(self) -> str | None:
        tool = self.raw["transactional"]["compensation_tool"]
        return str(tool) if tool else None


@dataclass(frozen=True)
class ContractSet:
    """Every loaded contract, by name, newest version first."""

    by_name: dict[str, tuple[Contract, ...]]
    fingerprint: str
    directory: str = ""
    names: tuple[str, ...] = field(default=())
    callable_names: tuple[str, ...] = field(default=())
    """Tools with at least one version that is not sunsetted."""

    def versions(self, name: str) -> tuple[Contract, ...]:
        return self.by_name.get(name, ())

    def get(self, name: str, version: str) -> Contract | None:
        """One exact version, or None."""
        return next((c for c in self.versions(name) if c.version == version), None)

    def __len__(self) -> int:
        return sum(len(v) for v in self.by_name.values())


@cache
def _meta_validator() -> ArgumentValidator:
    """The contract meta-schema, compiled once: the fast path answers valid documents,
    the reference validator lists the problems of invalid ones."""
    return ArgumentValidator(orjson.loads((SCHEMAS_DIR / "tool-contract.schema.json").read_bytes()))


def _pointer(path: Any) -> str:
    return "/" + "/".join(str(p) for p in path) if path else "/"


def read_contract_file(path: Path) -> Any:
    """Parse one contract file (JSON, or YAML 1.2).

    yaml-rs rather than PyYAML: it refuses duplicate keys (PyYAML keeps the
    last one silently), reads YAML 1.2 (``no`` stays a string, not false),
    keeps dates as the ISO strings the meta-schema expects, and parses about
    seven times faster, which is most of a large set's load time.
    """
    text = path.read_bytes()
    if path.suffix == ".json":
        doc = orjson.loads(text)
        # orjson keeps the last of two equal keys, as PyYAML would: the reviewed
        # ``confirmation_required: true`` could be undone by a later ``false``.
        json.loads(text, object_pairs_hook=_unique_keys)
    else:
        doc = yaml_rs.loads(text.decode("utf-8"), parse_datetime=False)
    _refuse_non_finite(doc)
    return doc


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def leaves(doc: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """(path, value) of every value in ``doc`` that is neither a map nor a list, without
    recursion (the document may be hostile)."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(doc, ())]
    while stack:
        node, where = stack.pop()
        if type(node) is dict:
            stack.extend((v, (*where, k)) for k, v in node.items())
        elif type(node) is list:
            stack.extend((v, (*where, i)) for i, v in enumerate(node))
        else:
            yield where, node


def _refuse_non_finite(doc: Any) -> None:
    """Raise ``ValueError`` at a YAML ``.nan`` or ``.inf`` (or a number too large for a
    float). JSON has neither, and nothing downstream expects one: a bound of NaN refuses
    every number, and a cost of NaN reaches the budget script as null."""
    for where, node in leaves(doc):
        if type(node) is float and not math.isfinite(node):
            raise ValueError(f"{_pointer(where)}: {node} is not a JSON number")


def _compile(doc: dict[str, Any], rel: str, problems: list[Problem]) -> Contract | None:
    schema = doc["affordance"]["input_schema"]
    try:
        check_schema(schema)
    except SchemaError as exc:
        where = _pointer(["affordance", "input_schema", *exc.path])
        problems.append(Problem(rel, where, f"not a valid 2020-12 schema: {exc.message}"))
        return None
    except ValueError as exc:
        problems.append(Problem(rel, "/affordance/input_schema", str(exc)))
        return None
    if schema.get("type") != "object":
        problems.append(
            Problem(rel, "/affordance/input_schema/type", "arguments must be an object")
        )
        return None
    try:
        validator = ArgumentValidator(schema)
        _probe(validator)
    except Exception as exc:  # check_schema let through what the validator cannot use
        problems.append(Problem(rel, "/affordance/input_schema", f"unusable schema: {exc}"))
        return None
    output = doc["affordance"].get("output_schema")
    if isinstance(output, dict) and not _usable_output_schema(output, rel, problems):
        return None
    for i, example in enumerate(doc["affordance"]["examples"]):
        expected = example.get("valid", True)
        try:
            actual = validator.reference_is_valid(example["arguments"])
        except SchemaRecursion as exc:
            problems.append(Problem(rel, f"/affordance/examples/{i}", str(exc)))
            return None
        if actual != expected:
            verdict = "fails" if expected else "passes"
            problems.append(
                Problem(rel, f"/affordance/examples/{i}", f"example {verdict} the input schema")
            )
    rules, references = _semantics(doc, rel, problems)
    ident, tx = doc["identity"], doc["transactional"]
    lc = ident["lifecycle"]
    return Contract(
        name=ident["name"],
        version=ident["version"],
        lifecycle=Lifecycle(lc["status"], lc["sunset_date"], lc["replacement"]),
        side_effect_class=SideEffectClass(tx["side_effect_class"]),
        timeout_ms=doc["runtime"]["timeout_ms"],
        confirmation_required=tx["confirmation_required"],
        post_action_verification_required=tx["post_action_verification_required"],
        input_schema=schema,
        validator=validator,
        raw=doc,
        source=rel,
        rules=rules,
        references=references,
    )


def _probe(validator: ArgumentValidator) -> None:
    """Validate a few values, and objects holding each declared property, as calls will:
    a schema that recurses without end through a reference check_schema cannot follow
    (an anchor, a URI, a $dynamicRef) raises SchemaRecursion here, not on a live call.
    (The examples are checked with the reference validator below.)"""
    properties = validator.schema.get("properties")
    names = list(properties) if isinstance(properties, dict) else []
    values: tuple[Any, ...] = (None, [], {}, dict.fromkeys(names), {n: {} for n in names})
    for value in values:
        validator.is_valid(value)


def _usable_output_schema(schema: dict[str, Any], rel: str, problems: list[Problem]) -> bool:
    """The output schema is held to what the input schema is: a bad one would otherwise
    surface only when a result arrives, as a defect of the batch that carries it."""
    try:
        check_schema(schema)
        _probe(ArgumentValidator(schema))
    except SchemaError as exc:
        where = _pointer(["affordance", "output_schema", *exc.path])
        problems.append(Problem(rel, where, f"not a valid 2020-12 schema: {exc.message}"))
        return False
    except Exception as exc:  # a pattern, a $ref, a cycle, or what the validator cannot build
        problems.append(Problem(rel, "/affordance/output_schema", f"unusable schema: {exc}"))
        return False
    return True


_RULE_VARIABLES = frozenset({"args", "principal", "refs"})


def _semantics(
    doc: dict[str, Any], rel: str, problems: list[Problem]
) -> tuple[tuple[SemanticRule, ...], tuple[Reference, ...]]:
    """Compile the CEL rules once; check each reference names a real argument."""
    section = doc.get("semantics", {})
    rules: list[SemanticRule] = []
    examples = [e["arguments"] for e in doc["affordance"]["examples"] if e.get("valid", True)]
    for i, rule in enumerate(section.get("rules", [])):
        where = f"/semantics/rules/{i}/expression"
        expression = rule["expression"]
        try:
            program = cel_engine.compile_expression(expression)
        except ValueError as exc:
            problems.append(Problem(rel, where, f"CEL does not compile: {exc}"))
            continue
        try:
            tree = cel_syntax.parse(expression)
        except cel_syntax.Unanalysable as exc:
            reason: str | None = f"the registry cannot analyse this expression: {exc}"
        else:
            reason = _unusable_rule(program, tree, examples)
        if reason is not None:
            problems.append(Problem(rel, where, f"rule {rule['id']!r}: {reason}"))
            continue
        rules.append(
            SemanticRule(rule["id"], program, rule["message"], rule["next_action"],
                         cost_exponent(expression), cel_syntax.reads(tree, _RULE_VARIABLES))
        )  # fmt: skip
    arguments = doc["affordance"]["input_schema"].get("properties", {})
    references: list[Reference] = []
    for i, ref in enumerate(section.get("references", [])):
        if ref["argument"] not in arguments:
            problems.append(
                Problem(rel, f"/semantics/references/{i}/argument",
                        f"{ref['argument']!r} is not an argument of this tool")
            )  # fmt: skip
            continue
        if any(r.argument == ref["argument"] for r in references):
            # One argument names one entity; two references on it would also hide, from
            # the semantic gate, which answers are about another tenant.
            problems.append(
                Problem(rel, f"/semantics/references/{i}/argument",
                        f"{ref['argument']!r} has a reference already")
            )  # fmt: skip
            continue
        references.append(
            Reference(ref["argument"], ref["entity"], tuple(ref["allowed_states"]),
                      ref["lookup_tool"])
        )  # fmt: skip
    ids = [r.rule_id for r in rules]
    for dup in sorted({r for r in ids if ids.count(r) > 1}):
        problems.append(Problem(rel, "/semantics/rules", f"rule id {dup!r} is used twice"))
    return tuple(rules), tuple(references)


def _unusable_rule(program: Any, tree: cel_syntax.Node, examples: list[Any]) -> str | None:
    """Why a compiled rule would misbehave on live calls, or None.

    Each of these would otherwise compile, load, and then refuse every call naming the
    rule, as if the model's arguments broke it, or check something else than it says."""
    reason = _unbound_names(program, cel_syntax.names(tree))
    if reason is not None:
        return reason
    functions = [f for f in program.functions() if not cel_engine.is_operator(f)]
    missing = [f for f in functions if not cel_engine.has_function(f)]
    if missing:
        return f"the CEL engine has no function {', '.join(missing)}"
    if _NEGATION in program.functions():
        # The engine negates the smallest int64 into itself instead of failing with an
        # overflow; subtraction is checked.
        return "unary minus on a computed value can overflow silently; write 0 - x or 0.0 - x"
    for i, arguments in enumerate(examples):
        try:
            program.execute({"args": arguments})
        except Exception as exc:  # principal and refs are absent: only this error counts
            name = cel_engine.undefined_name(exc)
            if name in functions:
                return f"the CEL engine has no {name} for the arguments of valid example {i}"
    return None


def _unbound_names(program: Any, names: cel_syntax.Names) -> str | None:
    """A name the rule uses that nothing defines where it is used, or a macro variable that
    hides another name.

    The engine resolves a name outside the macro binding it as a variable of the context,
    which is never there: the rule fails on every call, or, as ``all(...) || i == 1``,
    passes whenever the other side is true. A macro variable called ``args`` makes the
    body compare each element where the author meant the arguments, and one reusing an
    enclosing macro's variable hides that variable from the body. The type denotations
    (``int`` in ``type(x) == int``) are free names the engine resolves itself."""
    variables = {v for v, _ in names.bindings}
    for variable, around in names.bindings:
        if variable in _RULE_VARIABLES or cel_engine.names_itself(variable):
            return f"the macro variable {variable!r} hides {variable}; give it another name"
        if variable in around:
            return (
                f"the macro variable {variable!r} hides the variable of an enclosing macro; "
                "give it another name"
            )
    outside = sorted(names.free & variables)
    if outside:
        return f"macro variables {outside} used outside the macro that binds them"
    unknown = sorted(v for v in names.free - _RULE_VARIABLES if not cel_engine.names_itself(v))
    if unknown:
        return f"unknown variables {unknown}; use args, principal, refs"
    unseen = set(program.variables()) - names.free - variables
    if unseen:  # the engine reads a name this parse did not: its analysis cannot be trusted
        return f"the registry cannot analyse this expression: the engine reads {sorted(unseen)}"
    return None


_NEGATION = "-_"

_MACRO = re.compile(
    r"\.\s*(all|exists|exists_one|existsOne|map|filter)\s*\(\s*([A-Za-z_][A-Za-z0-9_]*)\s*,"
)
"""A comprehension macro and its variable; any identifier may name the variable."""

_MACRO_WEIGHT = {"map": 2, "filter": 2}
"""The engine builds the list a ``map`` or ``filter`` returns by copying it once per
element, so those cost the square of their range by themselves; the other macros stop
or go on per element and cost their range."""


def cost_exponent(expression: str) -> int:
    """An exponent ``e`` such that evaluating the rule costs at most ``size ** e`` steps,
    ``size`` being that of the values it reads (see ``semantic.context_size``).

    Without comprehensions a CEL expression reads each value it names a bounded number of
    times: linear, ``e = 1``. Each comprehension repeats its body once per element of a
    range no larger than ``size`` (a ``map`` or ``filter`` twice over, see
    ``_MACRO_WEIGHT``), and reading an argument inside a body costs up to ``size`` again
    in this engine, so every macro in the text, nested, chained or side by side, adds its
    weight to the exponent. Counting in the source text over-estimates (a macro name in a
    string literal counts too), never under-estimates.
    """
    return 1 + sum(_MACRO_WEIGHT.get(macro, 1) for macro, _ in _MACRO.findall(expression))


def contract_files(directory: Path) -> tuple[list[Path], list[Problem]]:
    """The contract files under ``directory``, sorted, and a problem for each folder that
    cannot be listed (see ``contract_tree``)."""
    _, files, problems = contract_tree(directory)
    return files, problems


def contract_tree(directory: Path) -> tuple[list[Path], list[Path], list[Problem]]:
    """The folders ``load_contracts`` looks in (``directory`` first), the contract files in
    them, sorted, and a problem for each folder that cannot be listed.

    Names that start with a dot are skipped, files and folders alike: editors keep their
    swap, lock and temporary files there (Emacs's ``.#name.yaml`` lock is a dangling
    link), and a Kubernetes ConfigMap or Secret volume keeps every file a second time in
    a hidden ``..<timestamp>`` folder behind its ``..data`` link, which would otherwise
    be loaded as a duplicate of each contract. A folder that cannot be listed (permission
    denied, gone half-way, too many open files) is a problem rather than a folder with no
    contracts in it, so that the set is refused, not loaded without that folder's tools.
    Linked folders are not followed; linked files are (read through the link).
    """
    files: list[Path] = []
    problems: list[Problem] = []
    seen: list[Path] = []
    folders = [Path(directory)]
    while folders:
        folder = folders.pop()
        seen.append(folder)
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError as exc:
            rel = str(folder.relative_to(directory))
            problems.append(Problem(rel, "/", f"folder cannot be listed: {exc.strerror or exc}"))
            continue
        for entry in entries:
            if entry.name.startswith("."):
                continue
            path = folder / entry.name
            try:
                is_folder = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_folder = False
            if is_folder:
                folders.append(path)
            elif path.suffix in CONTRACT_SUFFIXES:
                files.append(path)
    return seen, sorted(files), problems


def load_contracts(directory: Path) -> ContractSet:
    """Load every contract file under ``directory``; raise ``ContractError`` if any is bad."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ContractError([Problem(str(directory), "/", "no such directory")])
    meta = _meta_validator()
    files, problems = contract_files(directory)
    contracts: list[Contract] = []
    digest = hashlib.sha256()
    for path in files:
        rel = str(path.relative_to(directory))
        try:
            doc = read_contract_file(path)
        except Exception as exc:
            problems.append(Problem(rel, "/", f"cannot be parsed: {exc}"))
            continue
        errors = (
            []
            if meta.is_valid(doc)
            else sorted(meta.errors(doc), key=lambda e: list(e.absolute_path))
        )
        if errors:
            problems.extend(Problem(rel, _pointer(e.absolute_path), e.message) for e in errors)
            continue
        contract = _compile(doc, rel, problems)
        if contract is not None:
            contracts.append(contract)
            digest.update(rel.encode() + b"\0" + orjson.dumps(doc, option=orjson.OPT_SORT_KEYS))
    if not files and not problems:
        problems.append(Problem(str(directory), "/", "no contract files"))
    by_name: dict[str, list[Contract]] = {}
    for c in contracts:
        by_name.setdefault(c.name, []).append(c)
    for name, versions in by_name.items():
        seen: dict[str, str] = {}
        for c in versions:
            if c.version in seen:
                problems.append(
                    Problem(
                        c.source,
                        "/identity/version",
                        f"{name}@{c.version} also in {seen[c.version]}",
                    )
                )
            seen[c.version] = c.source
    if problems:
        raise ContractError(problems)
    ordered = {
        n: tuple(sorted(v, key=lambda c: c.version_key, reverse=True)) for n, v in by_name.items()
    }
    return ContractSet(
        by_name=ordered,
        fingerprint="sha256:" + digest.hexdigest()[:16],
        directory=str(directory),
        names=tuple(sorted(ordered)),
        callable_names=tuple(
            n for n in sorted(ordered) if any(c.lifecycle.status != "sunsetted" for c in ordered[n])
        ),
    )
