"""Session fixtures shared by the test suite."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from processor.config import IdentitySettings, Settings
from processor.keys import APPROVAL_CLASSES, init_keys
from processor.stack import LocalStack, private_stack_settings
from processor.stack.redis_cluster import private_redis_cluster

LOAD_POLICY = Path(__file__).parent / "policies" / "load.yaml"
"""The shipped policy with loose budgets: the default for tests that are not about budgets."""

TEST_APPROVERS = {"ops-1": APPROVAL_CLASSES, "ops-2": APPROVAL_CLASSES, "viewer": ()}
"""Two approvers for every class that needs one, and one registered but allowed nothing."""


def _with_identity(settings: Settings, keys_dir: Path) -> Settings:
    """Identity verification on, as in production: test keys, test approvers."""
    bundle = init_keys(keys_dir, TEST_APPROVERS)
    return settings.model_copy(
        update={
            "identity": IdentitySettings(
                jwks_file=bundle.jwks, delegation_key_file=bundle.delegation
            ),
            "approvers_file": bundle.approvers,
            "policy_file": LOAD_POLICY,
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


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The ``redis_url`` of a Redis Cluster of 3 masters, no replicas.

    Uses the cluster named by TOOLSENTRY_TEST_REDIS_CLUSTER_URL when set (a
    ``redis+cluster://`` URL); otherwise starts one on free ports in a temp dir for the
    session and stops it at the end.
    """
    url = os.environ.get("TOOLSENTRY_TEST_REDIS_CLUSTER_URL")
    if url:
        yield url
        return
    cluster = private_redis_cluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.up()
        yield cluster.url
    finally:
        cluster.down()


@pytest.fixture(params=["single", "cluster"])
def redis_backend(request: pytest.FixtureRequest, stack_settings: Settings) -> str:
    """The ``redis_url`` of each kind of Redis the product runs on: the stack's
    redis-server, then the 3-master cluster (started only when a test asks for it)."""
    if request.param == "single":
        return stack_settings.redis_url
    url: str = request.getfixturevalue("redis_cluster_url")
    return url
