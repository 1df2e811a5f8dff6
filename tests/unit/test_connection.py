"""The Redis URL schemes: which client each one builds, and how a cluster URL is read.
No server: a single-server client connects on first use, and the cluster URL is
checked by the function that splits it."""

from __future__ import annotations

import hashlib

import pytest
import redis

from processor.state.connection import (
    LuaScript,
    _cluster_nodes,
    connect,
    is_cluster_url,
    tenant_tag,
)


def test_a_single_server_url_builds_the_usual_client_without_connecting() -> None:
    client = connect("redis://127.0.0.1:1/3", socket_timeout=5, socket_connect_timeout=2)
    assert isinstance(client, redis.Redis)
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["port"], kwargs["db"], kwargs["socket_timeout"]) == (1, 3, 5)


@pytest.mark.parametrize(
    ("url", "cluster"),
    [
        ("redis://h:6379/0", False),
        ("rediss://h:6379/0", False),
        ("unix:///tmp/redis.sock", False),
        ("redis+cluster://h:7000", True),
        ("REDISS+CLUSTER://h:7000", True),
    ],
)
def test_the_scheme_decides(url: str, cluster: bool) -> None:
    assert is_cluster_url(url) is cluster


def test_a_cluster_url_names_every_startup_node_and_keeps_credentials_and_options() -> None:
    first, others = _cluster_nodes(
        "redis+cluster://app:s3cret@h1:7000,h2:7001,[::1]:7002,h4/0?socket_keepalive=true"
    )
    assert first == "redis://app:s3cret@h1:7000/0?socket_keepalive=true"
    assert [(n.host, n.port) for n in others] == [("h2", 7001), ("::1", 7002), ("h4", 6379)]


def test_a_tls_cluster_url_uses_tls_on_every_node() -> None:
    first, _ = _cluster_nodes("rediss+cluster://h1:7000,h2:7001")
    assert first == "rediss://h1:7000"


@pytest.mark.parametrize(
    "url", ["redis+cluster://", "redis+cluster://user@", "redis+cluster://h1:port"]
)
def test_a_cluster_url_without_a_usable_node_is_refused(url: str) -> None:
    with pytest.raises(ValueError):
        _cluster_nodes(url)


def test_a_script_is_named_by_the_sha1_redis_gives_it() -> None:
    source = "return KEYS[1]"
    assert LuaScript(source).sha == hashlib.sha1(source.encode()).hexdigest()


@pytest.mark.parametrize("tenant", ["acme", "globex-eu_1.prod", "ACME.42", "a{b", "ünï"])
def test_a_tenant_id_is_its_own_tag(tenant: str) -> None:
    assert tenant_tag(tenant) == "{" + tenant + "}"


def test_no_two_tenant_ids_share_a_tag() -> None:
    digest = "#" + hashlib.sha256(b"globex}eu").hexdigest()[:32]
    tenants = ["", "}", "globex}eu", digest, "#" + digest, "#", "#acme", "acme", "{#acme}"]
    tags = [tenant_tag(t) for t in tenants]
    assert len(set(tags)) == len(tenants), dict(zip(tenants, tags, strict=True))
    for tenant, tag in zip(tenants, tags, strict=True):
        assert tag.startswith("{") and tag.endswith("}") and tag.count("}") == 1, tenant
