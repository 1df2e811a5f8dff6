"""The local stack's pure parts: which process is ours, whether a port is taken, and the
``stack logs`` command's answers to bad input."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from processor.cli import app
from processor.stack.local import free_ports
from processor.stack.process import port_free
from processor.stack.redis import RedisService


@pytest.mark.parametrize(
    ("cmd", "ours"),
    [
        ("redis-server 127.0.0.1:6379", True),
        ("redis-server 127.0.0.1:6379 [cluster]", True),
        ("/usr/bin/redis-server --port 6379 --bind 127.0.0.1", True),
        ("redis-server 127.0.0.1:63790", False),
        ("redis-server *:63791 [cluster]", False),
        ("/usr/bin/redis-server --port 63790 --bind 127.0.0.1", False),
        ("python -m http.server 6379", False),
    ],
)
def test_only_the_redis_server_on_our_port_is_ours(cmd: str, ours: bool) -> None:
    """A stale pid file whose pid now belongs to a redis-server on a longer port that
    starts with ours must not make ``down`` signal that server."""
    assert RedisService(6379, Path("/nonexistent"), 1.0).owns(cmd) is ours


def test_a_port_someone_listens_on_is_not_free() -> None:
    (port,) = free_ports(1)
    assert port_free(port)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        assert not port_free(port)
    assert port_free(port)


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TOOLSENTRY_CONFIG", "")
    monkeypatch.setenv("TOOLSENTRY_STACK__DATA_DIR", str(tmp_path))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "server.log").write_text("one\ntwo\nthree\n")
    return tmp_path


def test_logs_of_an_unknown_service_is_a_usage_error(data_dir: Path) -> None:
    result = CliRunner().invoke(app, ["stack", "logs", "zookeeper"], env={"COLUMNS": "200"})
    assert result.exit_code == 2, (result.output, result.exception)
    assert "unknown service 'zookeeper'" in result.output


def test_logs_prints_the_last_lines_and_refuses_a_count_below_one(data_dir: Path) -> None:
    result = CliRunner().invoke(app, ["stack", "logs", "kafka", "-n", "2"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == ["two", "three"]
    for count in ("0", "-1"):
        refused = CliRunner().invoke(app, ["stack", "logs", "kafka", "-n", count])
        assert refused.exit_code == 2, (count, refused.output)


def test_logs_of_a_service_that_never_ran_says_so(data_dir: Path) -> None:
    result = CliRunner().invoke(app, ["stack", "logs", "redis"], env={"COLUMNS": "200"})
    assert result.exit_code == 1
    assert "no log at" in result.output
