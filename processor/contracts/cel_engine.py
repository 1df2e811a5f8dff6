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
import sys
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
