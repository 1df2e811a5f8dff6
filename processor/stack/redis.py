"""The local ``redis-server``: installing it when missing, its command line and its probe.

Persistence is off: the local stack's Redis holds development state only.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path

from processor.stack.process import Service, StackError, run_checked


def ensure_redis_server() -> str:
    """Path of ``redis-server``, installed with apt-get only when it is not on PATH."""
    found = shutil.which("redis-server")
    if found is not None:
        return found
    if shutil.which("apt-get") is None:
        raise StackError("redis-server is not on PATH and apt-get is missing: install Redis")
    prefix: list[str] = []
    if os.geteuid() != 0:
        if shutil.which("sudo") is None:
            raise StackError("redis-server is not on PATH; installing it needs root or sudo")
        prefix = ["sudo", "-n", "env", "DEBIAN_FRONTEND=noninteractive"]
    os.environ.setdefault("DEBIAN_FRONTEND", "noninteractive")
    run_checked([*prefix, "apt-get", "update"], "apt-get update", timeout_s=600.0)
    run_checked(
        [*prefix, "apt-get", "install", "-y", "redis-server"],
        "apt-get install -y redis-server",
        timeout_s=600.0,
    )
    found = shutil.which("redis-server") or shutil.which("redis-server", path="/usr/bin:/usr/sbin")
    if found is None:
        raise StackError("apt-get installed redis-server but it is still not on PATH")
    return found


def ping(port: int, timeout_s: float) -> str | None:
    """None when Redis on ``127.0.0.1:port`` answers PING with PONG, else why not."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as conn:
            conn.sendall(b"*1\r\n$4\r\nPING\r\n")
            reply = conn.recv(256)
    except OSError as e:
        return f"not answering: {e}"
    if reply.startswith(b"+PONG"):
        return None
    return f"PING answered {reply.decode('utf-8', errors='replace').strip()!r}"


class RedisService(Service):
    """The redis-server process: working dir ``<data_dir>/redis``, log ``logs/redis.out``."""

    name = "redis"

    def __init__(self, port: int, data_dir: Path, ready_timeout_s: float) -> None:
        super().__init__(data_dir, ready_timeout_s)
        self.port = port
        self.work_dir = data_dir / self.name
        self._binary: str | None = None

    def extra_args(self) -> list[str]:
        """Arguments a variant of the server adds to the command line (cluster mode)."""
        return []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_path(self) -> Path:
        return self.out_path

    def prepare(self) -> None:
        self._binary = ensure_redis_server()
        self.work_dir.mkdir(parents=True, exist_ok=True)

    def command(self) -> list[str]:
        return [
            self._binary or ensure_redis_server(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.work_dir),
            "--daemonize",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
            *self.extra_args(),
        ]

    def ports(self) -> list[int]:
        return [self.port]

    def owns(self, cmd: str) -> bool:
        # redis-server rewrites its title to "redis-server 127.0.0.1:<port>" soon after exec.
        # The port must end there: ours on 6379 is not the server on 63790.
        return "redis-server" in cmd and (
            re.search(rf":{self.port}(?!\d)", cmd) is not None
            or f"--port {self.port} " in f"{cmd} "
        )

    def probe(self, timeout_s: float) -> str | None:
        return ping(self.port, timeout_s)
