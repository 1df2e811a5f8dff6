"""Session fixtures shared by the test suite."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from processor.config import Settings
from processor.stack import LocalStack, private_stack_settings


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
    settings = private_stack_settings(tmp_path_factory.mktemp("stack"))
    stack = LocalStack(settings)
    try:
        stack.up()
        yield settings
    finally:
        stack.down()
