"""The CEL engine the semantic rules compile with, without the package's command line.

``import cel`` runs the package's ``__init__``, which imports its interactive shell
(typer, rich, prompt_toolkit, pygments: about 250 modules, 10 MB of resident memory
and 0.15 s of start-up in every processor, executor and CLI command). The rules need
only the compiled extension, ``cel.cel``, so it is loaded from the installed package by
itself. It is registered under its own name: a later ``import cel`` (a test, a user's
plugin) takes this module instead of initialising the extension a second time, which
PyO3 refuses.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import itertools
import re
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

_NAME = "cel.cel"


def _load() -> ModuleType:
    loaded = sys.modules.get(_NAME)
    if loaded is not None:
        return loaded
    package = importlib.util.find_spec("cel")
    if package is None or not package.submodule_search_locations:
        raise ImportError("the CEL engine (common-expression-language) is not installed")
    folder = Path(next(iter(package.submodule_search_locations)))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = folder / f"cel{suffix}"
        if path.is_file():
            break
    else:
        raise ImportError(f"no compiled CEL extension in {folder}")
    spec = importlib.util.spec_from_file_location(_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[_NAME] = module
    return module


_ENGINE = _load()


def compile_expression(expression: str) -> Any:
    """A compiled CEL program (``ValueError`` when the expression does not compile)."""
    return _ENGINE.compile(expression)


_UNDEFINED = "Undefined variable or function: "
"""How the extension words an identifier it cannot resolve: a variable missing from the
context, a function it lacks, or a function it has called with no matching overload."""


def undefined_name(exc: BaseException) -> str | None:
    """The name an evaluation error says the engine could not resolve, or None."""
    text = str(exc)
    if not isinstance(exc, RuntimeError) or not text.startswith(_UNDEFINED + "'"):
        return None
    return text[len(_UNDEFINED) + 1 :].split("'", 1)[0]


_PROBE_VALUES = (
    "0", "0u", "0.0", "''", "b''", "true", "null", "[]", "{}", "int",
    "timestamp('2000-01-01T00:00:00Z')", "duration('1s')",
)  # fmt: skip
"""One value of each CEL type; each evaluates without error on its own."""

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def is_operator(name: str) -> bool:
    """Whether ``name`` (from ``Program.functions()``) is one the parser emits for an
    operator (``_==_``, ``!_``, ``@in``, ``_?_:_``): no rule can spell those as a call."""
    return re.fullmatch(r"[A-Za-z0-9_.]+", name) is None


@cache
def has_function(name: str) -> bool:
    """Whether the engine itself implements a function called ``name``.

    The extension keeps its function table to itself, and it answers a call it cannot
    match in one way whether the name is unknown or only the argument types are
    (``size()``), so the name is called with every value of every type, as ``f()``,
    ``f(a)``, ``f(a, b)``, ``a.f()`` and ``a.f(b)``: it is implemented when any one of
    those calls is not answered "undefined". The probe values never fail by themselves
    and arguments are evaluated before the function is looked up, so any other error
    comes from the function. Every built-in takes at most two values besides a receiver.
    """
    if _IDENTIFIER.fullmatch(name) is None:
        return False
    calls = [f"{name}()"]
    for a in _PROBE_VALUES:
        calls += [f"{name}({a})", f"({a}).{name}()"]
    for a, b in itertools.product(_PROBE_VALUES, repeat=2):
        calls += [f"{name}({a}, {b})", f"({a}).{name}({b})"]
    return any(_resolves(call) for call in calls)


def _resolves(call: str) -> bool:
    try:
        compile_expression(call).execute({})
    except Exception as exc:
        return undefined_name(exc) is None
    return True


@cache
def names_itself(name: str) -> bool:
    """Whether the engine resolves the identifier ``name`` with no variables at all: the
    type denotations (``int``, ``string``, ``null_type`` ...) that ``type(x) == int``
    compares with, which ``Program.variables()`` lists as if they were variables."""
    try:
        compile_expression(name).execute({})
    except Exception:
        return False
    return True
