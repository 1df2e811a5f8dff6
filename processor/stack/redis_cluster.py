"""A local Redis Cluster: cluster-enabled redis-servers sharing the 16,384 slots, no replicas.

What the product must also run against in production, brought up on one machine so the
integration suite can prove it: every key under a ``{tenant}`` hash tag, every script
call routed by its tenant's slot, nothing that needs two slots in one command.

Each node is a ``RedisService`` in cluster mode (persistence off, its own pid file,
log and working dir under the data dir). The cluster bus port of every node is given
explicitly: the default (client port + 10,000) is out of range for many free ports.
The slots are assigned once, by ``redis-cli --cluster create``; nodes restarted on the
same data dir find each other again through their ``nodes-<port>.conf``.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from processor.stack.local import free_ports
from processor.stack.process import ServiceStatus, StackError, run_checked
from processor.stack.redis import RedisService, ensure_redis_server

SLOTS = 16384


class ClusterNodeService(RedisService):
    """One cluster-enabled redis-server: pid file ``redis-<port>.pid``, log
    ``logs/redis-<port>.out``, working dir ``redis-<port>`` holding ``nodes-<port>.conf``."""

    def __init__(self, port: int, bus_port: int, data_dir: Path, ready_timeout_s: float) -> None:
        self.name = f"redis-{port}"
        super().__init__(port, data_dir, ready_timeout_s)
        self.bus_port = bus_port

    def ports(self) -> list[int]:
        return [self.port, self.bus_port]

    def extra_args(self) -> list[str]:
        return [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            f"nodes-{self.port}.conf",
            "--cluster-port",
            str(self.bus_port),
        ]


def redis_cli() -> str:
    """Path of ``redis-cli``: on PATH, or next to redis-server (the same package ships both)."""
    found = shutil.which("redis-cli")
    if found is not None:
        return found
    beside = Path(ensure_redis_server()).with_name("redis-cli")
    if beside.exists():
        return str(beside)
    raise StackError("redis-cli is not on PATH: install redis-tools")


class LocalRedisCluster:
    """Starts, checks and stops a Redis Cluster of ``len(ports)`` masters on loopback."""

    def __init__(
        self,
        data_dir: Path,
        ports: Sequence[int],
        bus_ports: Sequence[int] | None = None,
        ready_timeout_s: float = 60.0,
    ) -> None:
        if len(ports) < 3:
            raise ValueError("a Redis Cluster needs at least 3 masters")
        buses = list(bus_ports) if bus_ports is not None else [p + 10000 for p in ports]
        if len(buses) != len(ports):
            raise ValueError("one cluster bus port per node")
        self.data_dir = data_dir.expanduser().resolve()
        self.ready_timeout_s = ready_timeout_s
        self.nodes = [
            ClusterNodeService(p, b, self.data_dir, ready_timeout_s)
            for p, b in zip(ports, buses, strict=True)
        ]

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes]

    @property
    def url(self) -> str:
        """The ``redis_url`` that reaches this cluster (see ``processor.state.connection``)."""
        return "redis+cluster://" + ",".join(self.addresses)

    def up(self) -> None:
        """Idempotent: start the nodes that are not running, assign the slots if no node
        has any yet, and wait until every node reports ``cluster_state:ok``.

        Raises ``StackError`` with the nodes' log tails when a node does not start, or the
        cluster is not whole within ``ready_timeout_s``."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        started = [n for n in self.nodes if n.spawn()]
        try:
            for node in self.nodes:
                node.wait_ready()
            if all(self.cluster_info(n.port).get("cluster_slots_assigned") == "0"
                   for n in self.nodes):  # fmt: skip
                run_checked(
                    [redis_cli(), "--cluster", "create", *self.addresses,
                     "--cluster-replicas", "0", "--cluster-yes"],
                    "redis-cli --cluster create",
                    timeout_s=self.ready_timeout_s,
                )  # fmt: skip
            self._wait_ok()
        except BaseException:
            for node in started:
                node.stop()
            raise

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            infos = {n.port: self.cluster_info(n.port) for n in self.nodes}
            if all(i.get("cluster_state") == "ok" for i in infos.values()):
                return
            if time.monotonic() >= deadline:
                states = {p: i.get("cluster_state", "unknown") for p, i in infos.items()}
                raise StackError(
                    f"Redis Cluster not ok after {self.ready_timeout_s:.0f} s: {states}"
                )
            time.sleep(0.1)

    def cluster_info(self, port: int) -> dict[str, str]:
        """``CLUSTER INFO`` of the node on ``port`` as a dict; empty if it does not answer."""
        try:
            out = run_checked(
                [redis_cli(), "-h", "127.0.0.1", "-p", str(port), "cluster", "info"],
                f"CLUSTER INFO on {port}",
                timeout_s=5.0,
            )
        except StackError:
            return {}
        pairs = (line.strip().split(":", 1) for line in out.splitlines() if ":" in line)
        return {k: v for k, v in pairs}

    def down(self) -> None:
        """Stop every node cleanly (SIGTERM, then SIGKILL after 30 s). Idempotent."""
        for node in self.nodes:
            node.stop()

    def status(self) -> dict[str, ServiceStatus]:
        return {n.name: n.status() for n in self.nodes}


def private_redis_cluster(data_dir: Path, masters: int = 3) -> LocalRedisCluster:
    """A cluster of its own on free ports (client and bus), for tests and benchmarks."""
    ports = free_ports(2 * masters)
    return LocalRedisCluster(data_dir, ports[:masters], ports[masters:])
