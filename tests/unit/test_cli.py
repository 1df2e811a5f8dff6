"""The command line: contract commands load what the processor loads, and the lines meant
to be copied into an environment come out whole."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from processor.cli import app, tail
from processor.config import load_settings
from processor.stack.local import free_ports
from tests.unit.helpers import CONTRACTS_DIR, ROOT


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


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"TOOLSENTRY_CONSUMER": '{"enable.auto.commit": true}'}, "enable.auto.commit"),
        ({"TOOLSENTRY_PRODUCER": '{"acks": 1}'}, "acks=1 is not allowed"),
        ({"TOOLSENTRY_KAFKA": '{"partition.assignment.strategy": "cooperative-sticky"}'},
         "kafka: Value error, partition.assignment.strategy"),
        ({"TOOLSENTRY_BATCH_MAX_RECORDS": "0"}, "batch_max_records: Input should be"),
        ({"TOOLSENTRY_LOG_LEVEL": "loud"}, "log_level: Value error, 'loud' is not a log level"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("command", [["run"], ["executor", "run", "--db", "x.db"]])
def test_a_setting_refused_at_start_exits_2_naming_it(
    tmp_path: Path, env: dict[str, str], says: str, command: list[str]
) -> None:
    """Before, the consumer's unsafe settings were refused only once the clients were built
    (a traceback, and a start that went on waiting for the broker), and invalid settings in
    a traceback."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-m", "processor", *command, "--metrics-port", "0"],
        cwd=tmp_path,
        env={
            **os.environ,
            **env,
            "PYTHONPATH": str(root),  # this tree's processor, wherever the test runs from
            "TOOLSENTRY_BOOTSTRAP_SERVERS": "127.0.0.1:1",
            "TOOLSENTRY_CONTRACTS_DIR": str(root / "contracts"),
            "TOOLSENTRY_POLICY_FILE": str(root / "policy" / "policy.yaml"),
            "COLUMNS": "200",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert says in out.stdout and "Traceback" not in out.stdout + out.stderr


@pytest.mark.parametrize(
    ("env", "file", "says"),
    [
        ({"TOOLSENTRY_KAFKA": "{not json"}, None, 'error parsing value for field "kafka"'),
        ({"TOOLSENTRY_CONFIG": "missing.yaml"}, None, "No such file or directory"),
        ({"TOOLSENTRY_BOOTSTRAP_SERVER": "b:9092"}, None, "did you mean"),
        ({}, "stack: {partitons: 3}\n", "stack.partitons: Extra inputs are not permitted"),
        ({}, "kafka: [\n", "while parsing"),
        ({}, "- kafka\n", "the config file must hold a mapping"),
    ],
)
def test_settings_that_cannot_be_read_exit_2_saying_why(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    file: str | None,
    says: str,
) -> None:
    """Every command reads its settings through one door: a variable that is not the JSON
    its setting takes, or a settings file that is missing, not YAML or not a mapping, is
    named, not a traceback."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TOOLSENTRY_CONFIG", "")  # load_settings names --config's file here
    args = ["config"]
    if file is not None:
        (tmp_path / "settings.yaml").write_text(file)
        args += ["--config", str(tmp_path / "settings.yaml")]
    result = CliRunner().invoke(app, args, env={**env, "COLUMNS": "200"})
    assert result.exit_code == 2, (result.output, result.exception)
    assert "invalid settings" in result.output and says in result.output, result.output


def test_a_log_level_is_read_in_any_case() -> None:
    assert load_settings(None, log_level="debug").log_level == "DEBUG"


def test_config_shows_the_settings_with_their_secrets_masked() -> None:
    result = CliRunner().invoke(
        app,
        ["config"],
        env={
            "TOOLSENTRY_CONFIG": "",
            "TOOLSENTRY_KAFKA": '{"sasl.username": "ts", "sasl.password": "kafka-s3cret"}',
            "TOOLSENTRY_REDIS_URL": "redis://ts:redis-s3cret@cache:6379/0",
        },
    )
    assert result.exit_code == 0, result.output
    assert "s3cret" not in result.output, result.output
    assert '"sasl.username": "ts"' in result.output
    assert "redis://ts:***@cache:6379/0" in result.output


def _nowhere() -> dict[str, str]:
    """Settings naming a broker and a Redis that are not there (closed ports), and records
    that expire unsent at once."""
    kafka_port, redis_port = free_ports(2)
    return {
        "TOOLSENTRY_BOOTSTRAP_SERVERS": f"127.0.0.1:{kafka_port}",
        "TOOLSENTRY_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        "TOOLSENTRY_KAFKA": '{"message.timeout.ms": 300, "log_level": 0}',
        "COLUMNS": "200",
    }


def test_the_demo_without_a_stack_exits_2_saying_what_to_start(tmp_path: Path) -> None:
    """It ended in a traceback (exit 1, as for a decision that differs from the script)."""
    result = CliRunner().invoke(
        app,
        ["demo", "--keys", str(tmp_path / "keys"), "--executor-db", str(tmp_path / "s.db")],
        env=_nowhere(),
    )
    assert result.exit_code == 2, (result.output, result.exception)
    assert "the demo cannot run" in result.output and "not delivered" in result.output
    assert "toolsentry stack up" in result.output


@pytest.mark.parametrize(
    "command", [["demo"], ["eval", "--suite", str(ROOT / "tests" / "conformance")]]
)
@pytest.mark.parametrize("timeout", ["0", "-1"])
def test_a_wait_of_no_time_is_a_usage_error(command: list[str], timeout: str) -> None:
    """It reported every decision as missing (is the processor running?)."""
    result = CliRunner().invoke(app, [*command, "--timeout", timeout], env={"COLUMNS": "200"})
    assert result.exit_code == 2, (result.output, result.exception)
    assert "--timeout" in result.output and "more than 0" in result.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["stack", "logs", "zookeeper"], "unknown service 'zookeeper'"),
        (["taxonomy", "--readme", "missing.md"], "does not exist"),
        (["eval", "--suite", "missing"], "does not exist"),
        (["executor", "run", "--db", "missing/support.db"], "cannot start"),
    ],
)
def test_a_bad_value_is_named_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], says: str
) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2, (result.output, result.exception)
    assert says in result.output, result.output


@pytest.mark.parametrize(
    "args",
    [
        ["approvals", "list"],
        ["approvals", "show", "r-1"],
        ["approvals", "approve", "r-1", "--key", "k.jwk", "--as", "ops-1"],
    ],
)
def test_approvals_without_redis_exit_2_saying_so(args: list[str]) -> None:
    result = CliRunner().invoke(app, args, env=_nowhere())
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Redis does not answer" in result.output


def test_reference_data_the_broker_did_not_take_is_not_published() -> None:
    result = CliRunner().invoke(
        app, ["reference", "put", "acme/order/WO-1", "--state", "shipped"], env=_nowhere()
    )
    assert result.exit_code == 1, (result.output, result.exception)
    assert "not published" in result.output and "shipped" not in result.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["acme/Order/WO-1", "--state", "shipped"], "entity must be a lower-case name"),
        (["acme/order", "--state", "shipped"], "key must be tenant/entity/id"),
        (["acme/order/WO-1", "--state", ""], "non-empty state"),
        (["acme/order/WO-1", "--owner", "CUS-1"], "--owner needs --state"),
    ],
)
def test_reference_data_the_loader_would_refuse_is_not_published(
    args: list[str], says: str
) -> None:
    """Refused before anything is sent (the broker here is not even there). It was
    published: the loader refused it, and forgot the entity an empty state names, while
    the command printed it as set; an owner without a state published a tombstone."""
    result = CliRunner().invoke(app, ["reference", "put", *args], env=_nowhere())
    assert result.exit_code == 2, (result.output, result.exception)
    assert "not published" in result.output and says in result.output, result.output


def test_eval_before_its_keys_are_prepared_exits_2_saying_how(tmp_path: Path) -> None:
    """It ended in a FileNotFoundError traceback."""
    keys = tmp_path / "eval-keys"
    result = CliRunner().invoke(
        app,
        ["eval", "--suite", str(ROOT / "tests" / "conformance"), "--keys", str(keys)],
        env=_nowhere(),
    )
    assert result.exit_code == 2, (result.output, result.exception)
    assert f"no suite keys in {keys}" in result.output, result.output
    assert "toolsentry eval --prepare" in result.output, result.output


def test_eval_without_a_broker_exits_2_saying_what_to_start(tmp_path: Path) -> None:
    """With its keys prepared and no broker, it ended in a KafkaException traceback."""
    keys = tmp_path / "eval-keys"
    suite = ["eval", "--suite", str(ROOT / "tests" / "conformance"), "--keys", str(keys)]
    assert CliRunner().invoke(app, [*suite, "--prepare"]).exit_code == 0
    result = CliRunner().invoke(app, [*suite, "--timeout", "1"], env=_nowhere())
    assert result.exit_code == 2, (result.output, result.exception)
    assert "the suite cannot run" in result.output, result.output
    assert "toolsentry stack up" in result.output, result.output


@pytest.mark.parametrize(
    "command",
    [
        ["keys", "init"],
        ["eval", "--suite", str(ROOT / "tests" / "conformance"), "--prepare", "--keys"],
    ],
)
def test_keys_that_cannot_be_written_exit_2_saying_why(tmp_path: Path, command: list[str]) -> None:
    """It ended in an OSError traceback. A file where the folder should be stops even root."""
    (tmp_path / "taken").write_text("")
    folder = tmp_path / "taken" / "keys"
    result = CliRunner().invoke(app, [*command, str(folder)], env={"COLUMNS": "200"})
    assert result.exit_code == 2, (result.output, result.exception)
    assert f"cannot write keys into {folder}" in result.output, result.output


def _commands(command: Any, path: list[str]) -> Iterator[list[str]]:
    """The path of ``command`` and of every command under it."""
    yield path
    if hasattr(command, "list_commands"):
        ctx = command.context_class(command)
        for name in command.list_commands(ctx):
            yield from _commands(command.get_command(ctx, name), [*path, name])


def test_help_shows_no_source_markup() -> None:
    """The docstrings' reStructuredText backticks (``--prepare``) were shown as they are."""
    paths = list(_commands(typer.main.get_command(app), []))
    assert ["eval"] in paths
    for path in paths:
        result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (path, result.output)
        assert "`" not in result.output, (path, result.output)


@pytest.mark.parametrize("block", [1, 3, 64, 65_536])
def test_a_log_s_end_is_read_backwards_as_its_lines(tmp_path: Path, block: int) -> None:
    """``stack logs`` read the whole log into memory; ``tail`` reads blocks from the end
    until it holds the lines asked for, which must be the file's own last lines, whatever
    the block size, including multibyte text split across blocks and a missing last
    newline."""
    log = tmp_path / "server.log"
    rng = random.Random(7)
    for trial in range(60):
        pieces = ["a", "b\n", "\n", "é", "€\n", "xyz" * rng.randint(0, 40), "\r\n"]
        log.write_text("".join(rng.choice(pieces) for _ in range(rng.randint(0, 200))))
        whole = log.read_text(errors="replace").splitlines()
        for lines in (1, 2, 5, 500):
            assert tail(log, lines, block) == whole[-lines:], (trial, lines)
