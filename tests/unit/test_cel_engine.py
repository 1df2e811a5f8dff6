"""The CEL engine is loaded without the package's interactive shell."""

from __future__ import annotations

import subprocess
import sys

import pytest

from processor.contracts.cel_engine import compile_expression, has_function, names_itself


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_processor_does_not_import_the_cel_shell() -> None:
    # The shell's imports cost every process about 10 MB of resident memory.
    loaded = _run(
        "import sys, processor.app, processor.executor; "
        "print(sorted(m for m in ('cel.cli', 'prompt_toolkit', 'pygments') if m in sys.modules))"
    )
    assert loaded == "[]"


def test_the_cel_package_imported_afterwards_shares_the_engine() -> None:
    # PyO3 refuses to initialise an extension twice in one interpreter: the package's own
    # import must take the module already loaded.
    out = _run(
        "from processor.contracts.cel_engine import compile_expression; "
        "import cel; "
        "print(compile_expression('args.n > 1').execute({'args': {'n': 2}}), "
        "cel.evaluate('1 + 2'))"
    )
    assert out == "True 3"


def test_a_rule_compiles_and_runs() -> None:
    program = compile_expression("args.amount <= refs.order.total")
    assert program.execute({"args": {"amount": 5}, "refs": {"order": {"total": 10}}}) is True
    assert program.execute({"args": {"amount": 50}, "refs": {"order": {"total": 10}}}) is False


def test_an_expression_that_does_not_compile_raises_value_error() -> None:
    with pytest.raises(ValueError):
        compile_expression("args.amount <=")


@pytest.mark.parametrize(
    ("name", "known"),
    [("size", True), ("matches", True), ("getFullYear", True), ("timestamp", True),
     ("type", True), ("lowerAscii", False), ("max", False), ("noSuchThing", False)],
)  # fmt: skip
def test_the_engine_is_asked_which_functions_it_has(name: str, known: bool) -> None:
    assert has_function(name) is known


def test_type_denotations_are_not_variables() -> None:
    assert names_itself("int") and names_itself("null_type")
    assert not names_itself("args") and not names_itself("order")
