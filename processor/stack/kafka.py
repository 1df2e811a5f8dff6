"""The local single-node Apache Kafka broker (KRaft, broker and controller in one JVM).

Owns fetching the broker jars from Maven Central into a cache outside git (once),
writing ``server.properties`` and the log4j2 config into the data dir, formatting the
KRaft storage once, the ``java`` command line, and the broker's readiness probe.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import uuid
from importlib import resources
from pathlib import Path

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from processor import b64url
from processor.config import StackSettings
from processor.stack.process import Service, StackError, run_checked

STARTED_LINE = "Kafka Server started"
MAVEN_DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.6.1"
_NODE_ID = 1

_probe_log = logging.getLogger(__name__ + ".probe")


def server_properties(stack: StackSettings, log_dir: Path) -> str:
    """``server.properties`` for one node on loopback that also runs transactions."""
    host = "127.0.0.1"
    broker = f"PLAINTEXT://{host}:{stack.kafka_port}"
    controller = f"CONTROLLER://{host}:{stack.kafka_controller_port}"
    props: dict[str, str | int] = {
        "process.roles": "broker,controller",
        "node.id": _NODE_ID,
        # A static voter set keeps no endpoint in the formatted storage, so the
        # ports in the settings may change between runs on the same data dir.
        "controller.quorum.voters": f"{_NODE_ID}@{host}:{stack.kafka_controller_port}",
        "listeners": f"{broker},{controller}",
        "advertised.listeners": broker,
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(log_dir),
        "num.partitions": stack.partitions,
        "default.replication.factor": 1,
        "min.insync.replicas": 1,
        "auto.create.topics.enable": "false",
        # The defaults (3 replicas, min ISR 2) would block the internal topics on one node.
        "offsets.topic.replication.factor": 1,
        "offsets.topic.num.partitions": 1,
        "transaction.state.log.replication.factor": 1,
        "transaction.state.log.min.isr": 1,
        "transaction.state.log.num.partitions": 1,
        "share.coordinator.state.topic.replication.factor": 1,
        "share.coordinator.state.topic.min.isr": 1,
        "group.initial.rebalance.delay.ms": 0,
        # A SIGKILLed broker's registration blocks its restart until the session times
        # out (9 s by default); heartbeats never leave this JVM, so a short one is safe.
        "broker.heartbeat.interval.ms": 500,
        "broker.session.timeout.ms": 3000,
        # Tests use consumer session timeouts far below the 6 s default minimum.
        "group.min.session.timeout.ms": 1000,
        # The cleaner's 128 MiB default buffer would not fit the small heap.
        "log.cleaner.dedupe.buffer.size": 16 * 1024 * 1024,
    }
    return "".join(f"{k}={v}\n" for k, v in props.items())


def random_cluster_id() -> str:
    """A Kafka ``Uuid`` string, as ``kafka-storage.sh random-uuid`` prints, without a JVM."""
    while True:
        text = b64url.encode(uuid.uuid4().bytes)
        if not text.startswith("-"):  # Kafka refuses ids that look like a CLI flag
            return text


def find_java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").is_file():
        return str(Path(java_home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise StackError("java not found: the Kafka broker needs a Java 17+ runtime on PATH")
    return found


def fetch_jars(stack: StackSettings) -> Path:
    """The broker's lib dir, filled with mvn on first use; a marker says the fetch completed."""
    home = stack.kafka_cache_dir.expanduser().resolve() / f"kafka-{stack.kafka_version}"
    lib = home / "lib"
    marker = home / ".fetched"
    if marker.exists():
        return lib
    home.mkdir(parents=True, exist_ok=True)
    # Two stacks coming up at once (parallel test sessions) must not fetch into one dir.
    with (home / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            return lib
        if shutil.which("mvn") is None:
            raise StackError("mvn not found: Maven is needed once to fetch the Kafka jars")
        shutil.rmtree(lib, ignore_errors=True)
        pom = home / "kafka-pom.xml"
        pom.write_text(resources.files("processor.stack").joinpath("kafka-pom.xml").read_text())
        run_checked(
            [
                "mvn",
                "-q",
                "-B",
                # A download whose checksum does not match fails the fetch (Maven's default
                # only warns), so a corrupt jar from a bad proxy is never cached as done.
                "--strict-checksums",
                "-f",
                str(pom),
                f"{MAVEN_DEPENDENCY_PLUGIN}:copy-dependencies",
                "-DincludeScope=runtime",
                f"-DoutputDirectory={lib}",
                f"-Dkafka.version={stack.kafka_version}",
            ],
            f"fetching Kafka {stack.kafka_version} jars with mvn",
        )
        if not any(lib.glob("kafka_2.13-*.jar")):
            raise StackError(f"mvn finished but {lib} holds no kafka_2.13 jar")
        marker.write_text(f"{stack.kafka_version}\n")
    return lib


class KafkaService(Service):
    """The broker process: data under ``<data_dir>/kafka``, log in ``logs/server.log``."""

    name = "kafka"

    def __init__(self, stack: StackSettings, data_dir: Path) -> None:
        super().__init__(data_dir, stack.ready_timeout_s)
        self.stack = stack
        self.log_dir = data_dir / "kafka"
        self.properties_path = data_dir / "kafka-server.properties"
        self.log4j_path = data_dir / "kafka-log4j2.properties"
        self.cluster_id_path = data_dir / "kafka-cluster-id"
        self._lib: Path | None = None
        self._log_offset: int | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.stack.kafka_port}"

    def log_path(self) -> Path:
        return self.data_dir / "logs" / "server.log"

    def lib(self) -> Path:
        if self._lib is None:
            self._lib = fetch_jars(self.stack)
        return self._lib

    def _java(self, main: str, *args: str, heap: str | None = None) -> list[str]:
        memory = [f"-Xms{heap}", f"-Xmx{heap}"] if heap else []
        return [
            find_java(),
            *memory,
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true",
            f"-Dkafka.logs.dir={self.data_dir / 'logs'}",
            f"-Dlog4j2.configurationFile={self.log4j_path}",
            "-cp",
            f"{self.lib()}/*",  # expanded by java itself, no shell involved
            main,
            *args,
        ]

    def prepare(self) -> None:
        self.lib()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.properties_path.write_text(server_properties(self.stack, self.log_dir))
        self.log4j_path.write_text(
            resources.files("processor.stack").joinpath("log4j2.properties").read_text()
        )
        self._format()

    def _format(self) -> None:
        if (self.log_dir / "meta.properties").exists():
            return
        if self.cluster_id_path.exists():
            cluster_id = self.cluster_id_path.read_text().strip()
        else:
            cluster_id = random_cluster_id()
            self.cluster_id_path.write_text(f"{cluster_id}\n")
        run_checked(
            self._java(
                "kafka.tools.StorageTool",
                "format",
                "-t",
                cluster_id,
                "-c",
                str(self.properties_path),
                "-g",
            ),
            "formatting the KRaft storage",
            timeout_s=120.0,
        )

    def command(self) -> list[str]:
        return self._java("kafka.Kafka", str(self.properties_path), heap=self.stack.kafka_heap)

    def ports(self) -> list[int]:
        return [self.stack.kafka_port, self.stack.kafka_controller_port]

    def owns(self, cmd: str) -> bool:
        return "kafka.Kafka" in cmd and str(self.properties_path) in cmd

    def before_spawn(self) -> None:
        try:
            self._log_offset = self.log_path().stat().st_size
        except FileNotFoundError:
            self._log_offset = 0

    def started_ok(self) -> bool:
        # The port opens before the broker serves requests; its own log line comes last.
        # For a broker some other process started, any earlier start line will do.
        offset = self._log_offset or 0
        try:
            with self.log_path().open("rb") as f:
                if f.seek(0, os.SEEK_END) < offset:
                    offset = 0
                f.seek(offset)
                return STARTED_LINE.encode() in f.read()
        except FileNotFoundError:
            return False

    def probe(self, timeout_s: float) -> str | None:
        admin = AdminClient(
            {
                "bootstrap.servers": self.address,
                "socket.connection.setup.timeout.ms": max(1000, int(timeout_s * 1000)),
            },
            # Connection-refused noise goes to logging rather than stderr.
            logger=_probe_log,
        )
        try:
            admin.list_topics(timeout=timeout_s)
        except KafkaException as e:
            return f"not answering: {e.args[0]}"
        return None
