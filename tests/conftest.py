"""Session fixtures shared by the test suite."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from processor.config import IdentitySettings, Settings
from processor.keys import APPROVAL_CLASSES, init_keys
from processor.stack import LocalStack, private_stack_settings

TEST_APPROVERS = {"ops-1": APPROVAL_CLASSES, "ops-2": APPROVAL_CLASSES, "viewer": ()}
"""Two approvers for every class that needs one, and one registered but allowed nothing."""


def _with_identity(settings: Settings, keys_dir: Path) -> Settings:
    """Identity verification on, as in production: test keys, test approvers."""
    bundle = init_keys(keys_dir, TEST_APPROVERS)
    return settings.model_copy(
        update={
            "identity": IdentitySettings(jwks_file=bundle.jwks),
            "approvers_file": bundle.approvers,
        }
    )


@pytest.fixture(scope="session")
def stack_settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """Settings pointing at a running Kafka broker and redis-server.

    Uses the stack named by TOOLSENTRY_TEST_BOOTSTRAP and TOOLSENTRY_TEST_REDIS_URL
    when both are set; otherwise starts a private LocalStack on free ports in a temp
    dir for the session (6 partitions per topic) and stops it at the end.
    """
    bootstrap = os.environ.get("TOOLSENTRY_TEST_BOOTSTRAP")
    redis_url = os.environ.get("TOOLSENTRY_TEST_REDIS_URL")
    keys = tmp_path_factory.mktemp("keys")
    if bootstrap and redis_url:
        base = Settings(bootstrap_servers=bootstrap, redis_url=redis_url, metrics_port=0)
        yield _with_identity(base, keys)
        return
    settings = private_stack_settings(tmp_path_factory.mktemp("stack"))
    stack = LocalStack(settings)
    try:
        stack.up()
        yield _with_identity(settings, keys)
    finally:
        stack.down()
