"""Session fixtures shared by the test suite."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from processor.config import Settings, StackSettings
from processor.stack import LocalStack


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


@pytest.fixture(scope="session")
def stack_settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """Settings pointing at a running Kafka broker and redis-server.

    Uses the stack named by TOOLSENTRY_TEST_BOOTSTRAP and TOOLSENTRY_TEST_REDIS_URL
    when both are set; otherwise starts a private LocalStack on free ports in a temp
    dir for the session (6 partitions per topic) and stops it at the end.
    """
    bootstrap = os.environ.get("TOOLSENTRY_TEST_BOOTSTRAP")
    redis_url = os.environ.get("TOOLSENTRY_TEST_REDIS_URL")
    if bootstrap and redis_url:
        yield Settings(bootstrap_servers=bootstrap, redis_url=redis_url, metrics_port=0)
        return
    kafka_port, controller_port, redis_port = free_ports(3)
    settings = Settings(
        bootstrap_servers=f"127.0.0.1:{kafka_port}",
        redis_url=f"redis://127.0.0.1:{redis_port}/0",
        stack=StackSettings(
            data_dir=tmp_path_factory.mktemp("stack"),
            kafka_port=kafka_port,
            kafka_controller_port=controller_port,
            redis_port=redis_port,
            partitions=6,
        ),
        metrics_port=0,
    )
    stack = LocalStack(settings)
    try:
        stack.up()
        yield settings
    finally:
        stack.down()
