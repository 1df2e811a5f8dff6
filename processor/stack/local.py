"""``LocalStack``: the development stack of one Kafka broker and one redis-server.

Owns bringing both services up (jars, install, format, start, readiness, topics) and
down again. All state lives in ``settings.stack.data_dir`` (pid files, logs, data), so
any process with the same settings can query or stop a stack another one started.
"""

from __future__ import annotations

import fcntl
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from processor.config import Settings, StackSettings
from processor.kafka.topics import ensure_topics
from processor.stack.kafka import KafkaService
from processor.stack.process import Service, ServiceStatus
from processor.stack.redis import RedisService


class LocalStack:
    """Starts and stops the local Kafka broker and redis-server as background processes."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.data_dir = settings.stack.data_dir.expanduser().resolve()
        # Redis first: it starts in milliseconds while the broker's jars may still download.
        self._services: dict[str, Service] = {
            "redis": RedisService(
                settings.stack.redis_port, self.data_dir, settings.stack.ready_timeout_s
            ),
            "kafka": KafkaService(settings.stack, self.data_dir),
        }

    def _service(self, service: str) -> Service:
        try:
            return self._services[service]
        except KeyError:
            raise ValueError(
                f"unknown service {service!r}; expected one of {sorted(self._services)}"
            ) from None

    @contextmanager
    def _locked(self) -> Iterator[None]:
        # Two callers bringing the same data dir up at once must not both spawn a broker.
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with (self.data_dir / "stack.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def up(self) -> None:
        """Idempotent: start whatever is not running, wait until all answer, create topics.

        Fetches the broker jars once, installs redis-server only when it is missing,
        formats the KRaft storage once. A service already running and answering is
        left alone. Raises ``StackError`` with the log tail when a service fails to
        start or is not ready within ``settings.stack.ready_timeout_s``.
        """
        with self._locked():
            started: list[Service] = []
            try:
                for svc in self._services.values():
                    if svc.spawn():
                        started.append(svc)
                for svc in self._services.values():
                    svc.wait_ready()
            except BaseException:
                # A half-started stack would make the next up() leave a broken service alone.
                for svc in started:
                    svc.stop()
                raise
        ensure_topics(self.settings, timeout_s=self.settings.stack.ready_timeout_s)

    def down(self) -> None:
        """SIGTERM each service, wait up to 30 s, then SIGKILL; remove pid files. Idempotent."""
        for svc in reversed(self._services.values()):
            svc.stop()

    def status(self) -> dict[str, ServiceStatus]:
        """``{"kafka": ..., "redis": ...}``; ready means the service answered just now."""
        return {name: self._services[name].status() for name in ("kafka", "redis")}

    def log_path(self, service: str) -> Path:
        """The log to read for ``service`` (the broker's server.log, redis's output)."""
        return self._service(service).log_path()

    def kill(self, service: str) -> None:
        """SIGKILL ``service`` and wait until it is gone, as a crash would (fault tests)."""
        self._service(service).kill()

    def start(self, service: str) -> None:
        """Start ``service`` again if it is not running and wait until it answers."""
        svc = self._service(service)
        with self._locked():
            svc.start()

    def stop(self, service: str) -> None:
        """Stop ``service`` cleanly (SIGTERM, then SIGKILL after 30 s)."""
        self._service(service).stop()


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (all held open until chosen, so no repeats)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def private_stack_settings(data_dir: Path, partitions: int = 6) -> Settings:
    """Settings for a stack of its own on free ports: for tests and benchmarks that must
    not meet a developer's running stack."""
    kafka_port, controller_port, redis_port = free_ports(3)
    return Settings(
        bootstrap_servers=f"127.0.0.1:{kafka_port}",
        redis_url=f"redis://127.0.0.1:{redis_port}/0",
        stack=StackSettings(
            data_dir=data_dir,
            kafka_port=kafka_port,
            kafka_controller_port=controller_port,
            redis_port=redis_port,
            partitions=partitions,
        ),
        metrics_port=0,
    )
