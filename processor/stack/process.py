"""Detached background processes of the local stack: spawn, pid files, liveness, signals.

Owns everything the Kafka and Redis services share: starting a process in its own
session with its output in a log file, recording and validating its pid (a stale pid
file must never make us signal an unrelated process), stopping it cleanly or killing
it, and waiting until it answers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

STOP_TIMEOUT_S = 30.0
_POLL_S = 0.1

# Children spawned by this interpreter, kept so they can be reaped (no zombies) and so
# their Popen objects are never collected while running (that would warn).
_children: dict[int, subprocess.Popen[bytes]] = {}


class StackError(RuntimeError):
    """A local stack service could not be installed, started or reached."""


@dataclass(frozen=True)
class ServiceStatus:
    """What ``LocalStack.status()`` reports for one service."""

    running: bool
    ready: bool
    pid: int | None
    address: str
    detail: str


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file, or a note that it does not exist."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return f"({path} does not exist)"
    return "\n".join(text.splitlines()[-lines:])


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; reaps it if it is our exited child, treats zombies as dead."""
    child = _children.get(pid)
    if child is not None:
        if child.poll() is None:
            return True
        del _children[pid]
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        # Gone since os.kill, or no procfs at all (macOS) where os.kill is all we have.
        return not Path("/proc").is_dir()
    # The state letter follows the parenthesised command name, which may hold spaces.
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def cmdline(pid: int) -> str | None:
    """The process's command line joined by spaces, or None where procfs is missing."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw.replace(b"\0", b" ").decode("utf-8", errors="replace")


class Service(ABC):
    """One detached background process with a pid file, a log file and a readiness probe."""

    name: str

    def __init__(self, data_dir: Path, ready_timeout_s: float) -> None:
        self.data_dir = data_dir
        self.ready_timeout_s = ready_timeout_s
        self.pid_file = data_dir / f"{self.name}.pid"

    @property
    def out_path(self) -> Path:
        """Where the process's stdout and stderr go."""
        return self.data_dir / "logs" / f"{self.name}.out"

    @property
    @abstractmethod
    def address(self) -> str: ...

    @abstractmethod
    def log_path(self) -> Path:
        """The log that tells what the service did (shown in errors)."""

    @abstractmethod
    def prepare(self) -> None:
        """Install, fetch and initialise whatever the process needs before it starts."""

    @abstractmethod
    def command(self) -> list[str]: ...

    @abstractmethod
    def ports(self) -> list[int]:
        """The loopback ports the process listens on."""

    @abstractmethod
    def probe(self, timeout_s: float) -> str | None:
        """None when the service answers, else why it does not."""

    @abstractmethod
    def owns(self, cmd: str) -> bool:
        """Whether a process command line is this service (guards against pid reuse)."""

    def started_ok(self) -> bool:
        """Extra readiness condition checked before the probe (e.g. a startup log line)."""
        return True

    def before_spawn(self) -> None:  # noqa: B027 - an optional hook, empty by default
        """Hook to remember state (e.g. a log offset) right before spawning."""

    # --- pid handling -------------------------------------------------------

    def pid(self) -> int | None:
        """The pid of the running service, or None (a stale pid file is removed)."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        if pid_alive(pid):
            if pid in _children:
                return pid
            cmd = cmdline(pid)
            if cmd is None or self.owns(cmd):
                return pid
        self.pid_file.unlink(missing_ok=True)
        return None

    def status(self) -> ServiceStatus:
        pid = self.pid()
        if pid is None:
            return ServiceStatus(False, False, None, self.address, "not running")
        problem = self.probe(timeout_s=2.0)
        return ServiceStatus(True, problem is None, pid, self.address, problem or "ready")

    # --- lifecycle ----------------------------------------------------------

    def spawn(self) -> bool:
        """Start the process detached unless it already runs; does not wait.

        Returns whether it started a process.
        """
        if self.pid() is not None:
            return False
        self._check_ports_free()
        self.prepare()
        (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.before_spawn()
        with self.out_path.open("ab") as out:
            proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                start_new_session=True,
            )
        _children[proc.pid] = proc
        self.pid_file.write_text(f"{proc.pid}\n")
        return True

    def _check_ports_free(self) -> None:
        """Refuse to start on a port another process listens on. The new process would
        exit at once, but the readiness probe could be answered by that other process
        first (another redis-server answers PING), and ``up`` would report it ready."""
        for port in self.ports():
            if not port_free(port):
                raise StackError(
                    f"{self.name} cannot start: 127.0.0.1:{port} is in use by another "
                    "process; stop it or choose another port in the stack settings"
                )

    def wait_ready(self) -> None:
        """Block until the service answers; raise with the log tail on exit or timeout."""
        deadline = time.monotonic() + self.ready_timeout_s
        problem = "not started"
        while True:
            pid = self.pid()
            if pid is None:
                raise StackError(f"{self.name} exited during startup; {self._log_tails()}")
            if self.started_ok():
                answer = self.probe(timeout_s=min(2.0, max(0.1, deadline - time.monotonic())))
                if answer is None:
                    return
                problem = answer
            else:
                problem = "startup not finished yet"
            if time.monotonic() >= deadline:
                raise StackError(
                    f"{self.name} (pid {pid}) not ready after {self.ready_timeout_s:.0f} s "
                    f"({problem}); {self._log_tails()}"
                )
            time.sleep(0.2)

    def _log_tails(self) -> str:
        paths = dict.fromkeys([self.log_path(), self.out_path])
        return "\n".join(f"{p} ends with:\n{tail(p)}" for p in paths)

    def start(self) -> None:
        self.spawn()
        self.wait_ready()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, wait up to ``timeout_s`` for a clean exit, then SIGKILL. Idempotent."""
        pid = self.pid()
        if pid is not None:
            self._signal(pid, signal.SIGTERM)
            if not self._wait_gone(pid, timeout_s):
                self._signal(pid, signal.SIGKILL)
                self._wait_gone(pid, 10.0)
        self.pid_file.unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL without any chance to clean up, as a crash would."""
        pid = self.pid()
        if pid is not None:
            self._signal(pid, signal.SIGKILL)
            self._wait_gone(pid, 10.0)
        self.pid_file.unlink(missing_ok=True)

    def _signal(self, pid: int, sig: signal.Signals) -> None:
        # The service leads its own session, so its group holds any child it forked.
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _wait_gone(self, pid: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return True
            time.sleep(_POLL_S)
        return not pid_alive(pid)


def port_free(port: int) -> bool:
    """Whether a server could listen on ``127.0.0.1:port`` now. SO_REUSEADDR, as servers
    set it, so connections of a stopped process lingering in TIME_WAIT do not count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def run_checked(cmd: Sequence[str], what: str, timeout_s: float | None = None) -> str:
    """Run a short command to completion; raise StackError with its output if it fails."""
    try:
        done = subprocess.run(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
        )
    except FileNotFoundError as e:
        raise StackError(f"{what}: {cmd[0]} not found") from e
    except subprocess.TimeoutExpired as e:
        raise StackError(f"{what}: timed out after {timeout_s} s") from e
    output = done.stdout.decode("utf-8", errors="replace")
    if done.returncode != 0:
        last = "\n".join(output.splitlines()[-40:])
        raise StackError(f"{what} failed (exit {done.returncode}):\n{last}")
    return output
