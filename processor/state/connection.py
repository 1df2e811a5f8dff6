"""Redis clients from one URL, and Lua script calls that work on one node or a cluster.

``Settings.redis_url`` is the only knob. Its scheme picks the client:

- ``redis://``, ``rediss://``, ``unix://``: one Redis server (``redis.Redis.from_url``);
- ``redis+cluster://[user[:password]@]host:port[,host:port...][?option=value...]``, or
  ``rediss+cluster://`` for TLS: a Redis Cluster (``redis.cluster.RedisCluster``),
  discovered from any of the listed nodes. redis-py has no URL form for several
  nodes, so this one is ours; the credentials and query options apply to every node.

Every key the processor writes carries its tenant's ``{tenant}`` hash tag, and every
script touches one tenant's keys only, so the same code runs on both: a pipeline on
a cluster is split by node and still costs one round trip per node, all sent at once.

Two things differ on a cluster and are handled here rather than at each call site:
redis-py's cluster pipeline refuses ``EVALSHA`` (and ``Script.__call__`` with a
pipeline), and a node that has never seen a script (a new node, a restart, a
failover) answers ``NOSCRIPT``. ``run_scripts`` sends ``EVALSHA`` as a raw command,
which the cluster pipeline routes by the slot of ``KEYS[1]``, and on ``NOSCRIPT``
loads the script on every primary and runs just those calls again (a ``NOSCRIPT``
call did not run, so running it again is safe).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import NoScriptError, RedisClusterException

RedisClient: TypeAlias = "redis.Redis[bytes] | RedisCluster[bytes]"

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
"""Cluster URL schemes and the per-node scheme each stands for."""

REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)
"""What a Redis call can raise when Redis is unreachable or unwell. The cluster client
raises ``RedisClusterException`` (not a ``RedisError``) when no node of the cluster
answers, so code that waits Redis out must catch both."""


def is_script_error(exc: BaseException) -> bool:
    """A Lua script that failed on what it was given: a defect, not Redis being
    unreachable or busy, so waiting for Redis would only meet it again."""
    if not isinstance(exc, redis.exceptions.ResponseError) or isinstance(exc, NoScriptError):
        return False
    text = str(exc)
    # redis-py cuts the code off the messages it maps to a class of its own (OOM,
    # READONLY, LOADING, ...) and keeps it as status_code.
    code = getattr(exc, "status_code", None) or text.split(" ", 1)[0]
    if code in _UNWELL or isinstance(exc, _UNWELL_CLASSES):
        return False
    return "user_script" in text or "Error running script" in text


_UNWELL_CLASSES: tuple[type[Exception], ...] = tuple(
    c
    for name in ("OutOfMemoryError", "ReadOnlyError", "BusyLoadingError")
    if isinstance(c := getattr(redis.exceptions, name, None), type)
)
"""The same, for redis-py versions that map the codes to classes without keeping them."""

_UNWELL = frozenset(
    {"OOM", "READONLY", "BUSY", "LOADING", "MASTERDOWN", "NOREPLICAS", "CLUSTERDOWN",
     "TRYAGAIN", "MISCONF"}
)  # fmt: skip
"""Error codes Redis answers a script's command with when Redis, not the script, is the
trouble: out of memory, a replica after a failover, another script running, loading its
data, no master or too few replicas, a cluster down, a slot moving, a failed snapshot that
stops writes. The command runs once Redis recovers; waited out like an outage."""


def tenant_tag(tenant: str) -> str:
    """The ``{hash tag}`` every key of a tenant carries, so that all of them share one
    cluster slot and one script can touch them.

    A tenant id is its own tag, unless it would not make one (empty, or holding a '}',
    which would end the tag early and scatter the tenant's keys over slots) or starts
    with '#': those are tagged ``{#<digest>}``. No two ids share a tag: an id's own tag
    never starts with '#', and two digest tags match only if the ids' SHA-256 agree on
    their first 128 bits. (Such a tenant's keys written by versions before these rules
    are not read: see the README's upgrade notes.)"""
    if tenant and "}" not in tenant and not tenant.startswith("#"):
        return f"{{{tenant}}}"
    return "{#" + hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:32] + "}"


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES


def connect(
    url: str,
    *,
    socket_timeout: float | None = None,
    socket_connect_timeout: float | None = None,
) -> RedisClient:
    """A client for ``url``: one server for ``redis://`` and friends, a cluster client for
    ``redis+cluster://`` (see the module docstring). Options in the URL's query win.

    A single-server client connects on first use; a cluster client asks its nodes for
    the slot map at once, so it raises here when none of them answers."""
    options: dict[str, Any] = {}
    if socket_timeout is not None:
        options["socket_timeout"] = socket_timeout
    if socket_connect_timeout is not None:
        options["socket_connect_timeout"] = socket_connect_timeout
    if not is_cluster_url(url):
        return redis.Redis.from_url(url, **options)
    first, others = _cluster_nodes(url)
    return RedisCluster(url=first, startup_nodes=others, **options)


def _cluster_nodes(url: str) -> tuple[str, list[ClusterNode]]:
    """The first node as a one-node URL (credentials, TLS and options included) and the
    other nodes as startup nodes."""
    parts = urlsplit(url)
    scheme = CLUSTER_SCHEMES[parts.scheme.lower()]
    userinfo, at, hosts = parts.netloc.rpartition("@")
    addresses = [h.strip() for h in hosts.split(",") if h.strip()]
    if not addresses:
        raise ValueError(f"{scheme}+cluster URL names no node: expected host:port[,host:port]")
    nodes = [_node(a) for a in addresses]
    first = urlunsplit((scheme, f"{userinfo}{at}{addresses[0]}", parts.path, parts.query, ""))
    return first, nodes[1:]


def _node(address: str) -> ClusterNode:
    if address.startswith("["):  # [::1]:7000
        host, _, rest = address[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = address.partition(":")
    if not host or (port and not port.isdigit()):
        raise ValueError(f"bad cluster node {address!r}: expected host:port")
    return ClusterNode(host, int(port) if port else 6379)


@dataclass(frozen=True)
class LuaScript:
    """A Lua script called by its SHA1; the text is sent only to a node that lacks it."""

    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


ScriptCall: TypeAlias = tuple[Sequence[str], Sequence[Any]]
"""One call of a script: (KEYS, ARGV). On a cluster every key must share one slot."""


def run_scripts(
    client: RedisClient,
    script: LuaScript,
    calls: Iterable[ScriptCall],
    pipe: Any | None = None,
) -> list[Any]:
    """Call ``script`` once per (keys, args), in one round trip, on one node or a cluster.

    ``pipe`` (from ``client.pipeline(transaction=False)``) may already hold plain
    commands: they go in the same round trip, first. Returns every reply of the
    pipeline in order, so the scripts' replies are the last ``len(calls)``. Raises the
    first error any command answered, after running again the calls that found the
    script missing."""
    if pipe is None:
        pipe = client.pipeline(transaction=False)
    plain = len(pipe)
    queued = list(calls)
    for keys, args in queued:
        pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    replies: list[Any] = pipe.execute(raise_on_error=False)
    missing = [n for n, r in enumerate(replies[plain:]) if isinstance(r, NoScriptError)]
    if missing:
        client.execute_command("SCRIPT LOAD", script.source)  # on every primary of a cluster
        again = client.pipeline(transaction=False)
        for n in missing:
            keys, args = queued[n]
            again.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        for n, reply in zip(missing, again.execute(raise_on_error=False), strict=True):
            replies[plain + n] = reply
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies
