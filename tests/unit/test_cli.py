"""The command line: contract commands load what the processor loads, and the lines meant
to be copied into an environment come out whole."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from processor.cli import app
from tests.unit.helpers import CONTRACTS_DIR


def test_contracts_check_loads_the_settings_folder(tmp_path: Path) -> None:
    empty = tmp_path / "nothing-here"
    refused = CliRunner().invoke(
        app, ["contracts", "check"], env={"TOOLSENTRY_CONTRACTS_DIR": str(empty)}
    )
    assert refused.exit_code == 1, refused.output
    assert "no such directory" in refused.output
    loaded = CliRunner().invoke(
        app, ["contracts", "check"], env={"TOOLSENTRY_CONTRACTS_DIR": str(CONTRACTS_DIR)}
    )
    assert loaded.exit_code == 0, loaded.output
    assert "contracts," in loaded.output
    # A folder named on the command line still wins.
    named = CliRunner().invoke(
        app,
        ["contracts", "check", str(CONTRACTS_DIR)],
        env={"TOOLSENTRY_CONTRACTS_DIR": str(empty)},
    )
    assert named.exit_code == 0, named.output


def test_key_paths_are_printed_on_one_line_however_long(tmp_path: Path) -> None:
    deep = tmp_path / ("a-directory-name-long-enough-to-wrap-" * 3) / "keys"
    result = CliRunner().invoke(app, ["keys", "init", str(deep)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for name in ("issuer.jwk", "jwks.json", "approvers.yaml", "delegation.jwk"):
        assert any(str(deep / name) in line for line in lines), (name, result.output)


def test_a_problem_is_printed_as_it_is_never_read_as_console_markup(tmp_path: Path) -> None:
    folder = tmp_path / "contracts" / "lookup_order"
    folder.mkdir(parents=True)
    (folder / "[bold]1.0.0.yaml").write_text("tool: [/red]\n  broken: {")
    result = CliRunner().invoke(app, ["contracts", "check", str(tmp_path / "contracts")])
    assert result.exit_code == 1, result.output
    assert "lookup_order/[bold]1.0.0.yaml" in result.output, result.output
