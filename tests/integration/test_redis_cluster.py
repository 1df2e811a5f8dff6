"""The processor on a Redis Cluster of 3 masters, end to end.

Every key carries its tenant's ``{tenant}`` hash tag and every script runs once per
tenant per batch with the tenant's prefix as ``KEYS[1]``, so one processor serves
tenants whose keys live on different nodes. The two tenants here hash to slots on
different nodes (asserted from the keys the processor wrote, not assumed), and the
expiry case uses a third. The reference index, the loader's position and the
sweeper's tenant set are single keys, each in a slot of its own.

Also here: ``connection.run_scripts`` on both backends, including a node that lost its
scripts (as after a restart or a failover).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from processor.approval_flow import publish_approvals
from processor.client import ToolsentryClient
from processor.config import Settings
from processor.reference_data import publish_references, wait_until_loaded
from processor.state.approvals import ApprovalStore
from processor.state.connection import LuaScript, connect, run_scripts
from tests.integration.harness import ProcessorProcess, approval, isolated, token
from tests.integration.test_gates_e2e import (
    GLOBEX_ORDER,
    ORDER,
    SHIPPED,
    UNKNOWN,
    TopicReader,
    cancel,
    expires_unanswered,
    refused,
    run_id,
)

pytestmark = pytest.mark.integration

ACME, GLOBEX = "acme-cluster", "globex-cluster"
"""Slots 12752 and 432: the last and the first third of the slots, two different masters."""
EXPIRING = "acme-cx"
"""Slot 8899, the middle third: the expiry case touches the third master."""


@dataclass
class Deployment:
    settings: Settings
    proc: ProcessorProcess
    clients: dict[str, ToolsentryClient]
    redis: RedisCluster[bytes]


@pytest.fixture(scope="module")
def deployment(
    stack_settings: Settings, redis_cluster_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    settings = isolated(stack_settings, "cluster").model_copy(
        update={"redis_url": redis_cluster_url}
    )
    publish_references(
        settings,
        [
            (f"{ACME}/order/{ORDER}", {"state": "processing", "owner": "cust-1"}),
            (f"{ACME}/order/{SHIPPED}", {"state": "shipped", "owner": "cust-1"}),
            (f"{GLOBEX}/order/{GLOBEX_ORDER}", {"state": "processing", "owner": "g-cust-1"}),
        ],
    )
    proc = ProcessorProcess(settings, "cluster-1", tmp_path_factory.mktemp("cluster-logs"))
    clients: dict[str, ToolsentryClient] = {}
    try:
        proc.start().wait_ready()
        wait_until_loaded(settings, timeout=60)
        for tenant in (ACME, GLOBEX):
            clients[tenant] = ToolsentryClient(
                settings, tenant, principal_token=token(settings, tenant, user="u-agent")
            )
        client = connect(redis_cluster_url)
        assert isinstance(client, RedisCluster)
        yield Deployment(settings, proc, clients, client)
    finally:
        for c in clients.values():
            c.close()
        if proc.alive():
            assert proc.terminate() == 0, proc.log()[-3000:]


def keys_by_node(client: RedisCluster[bytes], ns: str) -> dict[str, set[str]]:
    """Every key of namespace ``ns``, read from each master directly, by node."""
    out: dict[str, set[str]] = {}
    for node in client.get_primaries():
        direct: redis.Redis[bytes] = redis.Redis(host=node.host, port=node.port)
        out[node.name] = {k.decode() for k in direct.scan_iter(match=f"{ns}:*", count=1000)}
        direct.close()
    return out


def node_of(found: dict[str, set[str]], tenant: str) -> str:
    """The one node holding every key of ``tenant``."""
    nodes = [n for n, keys in found.items() if any(f"{{{tenant}}}" in k for k in keys)]
    assert len(nodes) == 1, (tenant, nodes)
    return nodes[0]


def test_reference_data_decides_for_tenants_on_different_nodes(deployment: Deployment) -> None:
    acme, globex = deployment.clients[ACME], deployment.clients[GLOBEX]
    # Proposed together, so batches mix both tenants: one MGET per tenant, per node.
    sent = {
        "routed": (acme, "lookup_order", {"order_id": ORDER}),
        "unknown": (acme, "cancel_order", cancel(UNKNOWN)),
        "foreign": (acme, "cancel_order", cancel(GLOBEX_ORDER)),
        "stale": (acme, "cancel_order", cancel(SHIPPED)),
        "foreign_back": (globex, "cancel_order", cancel(ORDER)),
        "globex_own": (globex, "lookup_order", {"order_id": GLOBEX_ORDER}),
    }
    pids = {k: (c, c.propose(tool, args, run_id=run_id())) for k, (c, tool, args) in sent.items()}
    obs = {k: c.wait(pid, 60) for k, (c, pid) in pids.items()}

    assert obs["routed"]["decision"] == "ROUTED", obs["routed"]["result_payload"]
    assert obs["globex_own"]["decision"] == "ROUTED", obs["globex_own"]["result_payload"]
    [err] = refused(obs["unknown"], "SEMANTIC_INVALIDITY", "semantic", ["unknown_reference"])
    assert err["field"] == "order_id" and "lookup_order" in obs["unknown"]["next_action"]
    for name in ("foreign", "foreign_back"):
        [err] = refused(obs[name], "PERMISSION_DENIED", "identity", ["cross_tenant_reference"])
        assert err["field"] == "order_id"
    [err] = refused(obs["stale"], "STALE_STATE", "state", ["invalid_state"])
    assert err["actual"] == "shipped"

    found = keys_by_node(deployment.redis, deployment.settings.redis_namespace)
    ns = deployment.settings.redis_namespace
    assert f"{ns}:ref:{{{ACME}}}:order:{ORDER}" in found[node_of(found, ACME)]
    assert f"{ns}:ref:{{{GLOBEX}}}:order:{GLOBEX_ORDER}" in found[node_of(found, GLOBEX)]
    assert node_of(found, ACME) != node_of(found, GLOBEX)


def test_parked_calls_are_released_by_approvals_after_the_nodes_lost_their_scripts(
    deployment: Deployment,
) -> None:
    settings = deployment.settings
    parked = {}
    for tenant, order in ((ACME, ORDER), (GLOBEX, GLOBEX_ORDER)):
        run = run_id()
        pid = deployment.clients[tenant].propose("cancel_order", cancel(order), run_id=run)
        parked[tenant] = (run, pid)
    pending = {t: deployment.clients[t].wait(pid, 60) for t, (_, pid) in parked.items()}
    for obs in pending.values():
        assert obs["decision"] == "PENDING_APPROVAL", obs["result_payload"]

    found = keys_by_node(deployment.redis, settings.redis_namespace)
    for tenant in (ACME, GLOBEX):
        assert f"{settings.redis_namespace}:{{{tenant}}}:parked" in found[node_of(found, tenant)]
    assert node_of(found, ACME) != node_of(found, GLOBEX)

    # As after a restart or a failover: the masters forget every script.
    deployment.redis.execute_command("SCRIPT FLUSH")
    for tenant, (run, _) in parked.items():
        publish_approvals(settings, run, [approval(settings, "ops-1", pending[tenant])])
    for tenant, (_, pid) in parked.items():
        final = deployment.clients[tenant].wait_final(pid, 60)
        assert (final["decision"], final["gate"]) == ("ROUTED", "approval"), final
        assert [o["decision"] for o in deployment.clients[tenant].history(pid)] == [
            "PENDING_APPROVAL",
            "ROUTED",
        ]

    store = ApprovalStore(deployment.redis, settings.redis_namespace)
    for tenant in (ACME, GLOBEX):
        entry = store.find(pending[tenant]["approval_request_id"])
        assert entry is not None and entry["state"] == "released", entry
    calls = TopicReader(settings, settings.topics.execution("HIGH_RISK_EXTERNAL"))
    try:
        routed = [m.value() for m in calls.sync()]
    finally:
        calls.close()
    assert len(routed) == 2


def test_the_expiry_sweeper_ends_an_unanswered_call(
    stack_settings: Settings, redis_cluster_url: str, tmp_path: Path
) -> None:
    settings = isolated(stack_settings, "cluster-exp").model_copy(
        update={"redis_url": redis_cluster_url}
    )
    expires_unanswered(settings, EXPIRING, tmp_path)


def test_run_scripts_reloads_a_lost_script_and_keeps_plain_commands_first(
    redis_backend: str,
) -> None:
    client = connect(redis_backend)
    script = LuaScript("return {KEYS[1], redis.call('INCRBY', KEYS[1] .. ':n', ARGV[1])}")
    prefix = f"rs-{uuid.uuid4().hex[:8]}"
    bases = [f"{prefix}:{{t{n}}}" for n in range(12)]  # slots on every master of a cluster
    calls = [([base], [2]) for base in bases]
    client.execute_command("SCRIPT FLUSH")  # on every master: as after restarts or failovers
    pipe = client.pipeline(transaction=False)
    pipe.set(f"{prefix}:{{plain}}", "x")
    replies = run_scripts(client, script, calls, pipe)
    assert replies == [True, *[[base.encode(), 2] for base in bases]]
    assert [r[1] for r in run_scripts(client, script, calls)] == [4] * len(bases)
    with pytest.raises(redis.ResponseError, match="attempt to perform arithmetic"):
        run_scripts(client, LuaScript("return nil + 1"), [([f"{prefix}:{{x}}"], [])])
    for key in [f"{prefix}:{{plain}}", *[f"{base}:n" for base in bases]]:
        client.delete(key)
