"""The local stack against a real broker and a real redis-server: no mocks."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]  # public, untyped re-export
    AdminClient,
    ConfigResource,
    ResourceType,
)

from processor.config import Settings
from processor.kafka.topics import ensure_topics, topic_partitions
from processor.stack import LocalStack, StackError, private_stack_settings

pytestmark = pytest.mark.integration


@pytest.fixture
def local_stack(stack_settings: Settings) -> LocalStack:
    """The session's LocalStack; tests that control services skip on an external stack."""
    if os.environ.get("TOOLSENTRY_TEST_BOOTSTRAP"):
        pytest.skip("the stack is external; this test controls a LocalStack")
    return LocalStack(stack_settings)


def _produce(producer: Producer, topic: str, key: bytes, value: bytes) -> tuple[int, int]:
    """Produce one record and return its (partition, offset) once delivered."""
    where: list[tuple[int, int]] = []

    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        assert err is None, err
        partition, offset = msg.partition(), msg.offset()
        assert partition is not None and offset is not None
        where.append((partition, offset))

    producer.produce(topic, key=key, value=value, on_delivery=on_delivery)
    assert producer.flush(30) == 0
    assert len(where) == 1
    return where[0]


def _read(settings: Settings, topic: str, partition: int, offset: int, **conf: Any) -> Message:
    """The record at ``topic[partition]@offset``, read by an assigned (group-less) consumer."""
    consumer = Consumer(
        settings.client_config(
            **{"group.id": f"test-{uuid.uuid4()}", "enable.auto.commit": False, **conf}
        )
    )
    try:
        consumer.assign([TopicPartition(topic, partition, offset)])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            return msg
        raise AssertionError(f"nothing read from {topic}[{partition}]@{offset}")
    finally:
        consumer.close()


def _ping(redis_url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(redis_url, socket_timeout=2).ping())
    except redis.ConnectionError:
        return False


def test_every_topic_exists_with_configured_partitions(stack_settings: Settings) -> None:
    for topic in stack_settings.topics.all():
        assert topic_partitions(stack_settings, topic) == stack_settings.stack.partitions, topic


def test_unknown_topic_is_a_lookup_error(stack_settings: Settings) -> None:
    with pytest.raises(LookupError):
        topic_partitions(stack_settings, f"missing.{uuid.uuid4()}")


def test_reference_topic_is_compacted(stack_settings: Settings) -> None:
    admin = AdminClient(stack_settings.client_config())
    resource = ConfigResource(ResourceType.TOPIC, stack_settings.topics.reference)
    configs = admin.describe_configs([resource])[resource].result(timeout=30)
    assert configs["cleanup.policy"].value == "compact"
    other = ConfigResource(ResourceType.TOPIC, stack_settings.topics.proposals)
    assert (
        admin.describe_configs([other])[other].result(timeout=30)["cleanup.policy"].value
        == "delete"
    )


def test_ensure_topics_again_creates_nothing(
    stack_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    assert ensure_topics(stack_settings) == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_topics_with_another_partition_count_are_kept_with_a_warning(
    stack_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Adding partitions would move keys; an operator who asked for more is told instead
    of being answered that every topic exists."""
    asked = stack_settings.stack.partitions + 2
    with caplog.at_level(logging.WARNING, logger="processor.kafka.topics"):
        assert ensure_topics(stack_settings, partitions=asked) == []
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"not the {asked} asked for" in warning
    for topic in stack_settings.topics.all():
        assert f"{topic} ({stack_settings.stack.partitions})" in warning
        assert topic_partitions(stack_settings, topic) == stack_settings.stack.partitions


def test_produce_and_consume(stack_settings: Settings) -> None:
    topic = stack_settings.topics.proposals
    key, value = b"k-" + uuid.uuid4().bytes, b"hello"
    producer = Producer(stack_settings.client_config())
    partition, offset = _produce(producer, topic, key, value)
    msg = _read(stack_settings, topic, partition, offset)
    assert (msg.key(), msg.value()) == (key, value)


def test_transactional_producer_commits(stack_settings: Settings) -> None:
    topic = stack_settings.topics.results
    producer = Producer(
        stack_settings.client_config(**{"transactional.id": f"test-tx-{uuid.uuid4()}"})
    )
    producer.init_transactions(60)
    producer.begin_transaction()
    key, value = b"tx", uuid.uuid4().bytes
    partition, offset = _produce(producer, topic, key, value)
    producer.commit_transaction(60)
    msg = _read(stack_settings, topic, partition, offset, **{"isolation.level": "read_committed"})
    assert (msg.key(), msg.value()) == (key, value)


def test_redis_ping(stack_settings: Settings) -> None:
    assert _ping(stack_settings.redis_url)


def test_status_reports_ready(local_stack: LocalStack, stack_settings: Settings) -> None:
    status = local_stack.status()
    assert set(status) == {"kafka", "redis"}
    for name, st in status.items():
        assert st.running and st.ready and st.pid is not None, (name, st)
        assert st.detail == "ready"
    assert status["kafka"].address == f"127.0.0.1:{stack_settings.stack.kafka_port}"
    assert status["redis"].address == f"127.0.0.1:{stack_settings.stack.redis_port}"
    assert "Kafka Server started" in local_stack.log_path("kafka").read_text()
    assert "Ready to accept connections" in local_stack.log_path("redis").read_text()


def test_second_up_is_a_noop(local_stack: LocalStack) -> None:
    before = {name: st.pid for name, st in local_stack.status().items()}
    started = time.monotonic()
    local_stack.up()
    assert time.monotonic() - started < 5
    assert {name: st.pid for name, st in local_stack.status().items()} == before


def test_redis_stop_start_round_trip(local_stack: LocalStack, stack_settings: Settings) -> None:
    old_pid = local_stack.status()["redis"].pid
    local_stack.stop("redis")
    st = local_stack.status()["redis"]
    assert (st.running, st.ready, st.pid) == (False, False, None)
    assert not _ping(stack_settings.redis_url)
    local_stack.start("redis")
    st = local_stack.status()["redis"]
    assert st.ready and st.pid != old_pid
    assert _ping(stack_settings.redis_url)


def test_redis_kill_start_round_trip(local_stack: LocalStack, stack_settings: Settings) -> None:
    local_stack.kill("redis")
    assert not local_stack.status()["redis"].running
    assert not _ping(stack_settings.redis_url)
    local_stack.start("redis")
    assert local_stack.status()["redis"].ready
    assert _ping(stack_settings.redis_url)


def test_unknown_service_is_rejected(local_stack: LocalStack) -> None:
    with pytest.raises(ValueError, match="unknown service"):
        local_stack.stop("zookeeper")


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie no one reaped is gone too
        return f.read().rsplit(")", 1)[-1].split()[0] == "Z"


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_second_independent_stack_up_and_down(tmp_path_factory: pytest.TempPathFactory) -> None:
    settings = private_stack_settings(tmp_path_factory.mktemp("stack2"), partitions=2)
    stack = LocalStack(settings)
    try:
        stack.up()
        status = stack.status()
        assert all(st.ready for st in status.values()), status
        pids = {name: st.pid for name, st in status.items()}
        assert topic_partitions(settings, settings.topics.proposals) == 2
    finally:
        stack.down()
    for name, pid in pids.items():
        assert pid is not None and _pid_gone(pid), name
    assert not any((stack.data_dir / f"{name}.pid").exists() for name in pids)
    ports = (settings.stack.kafka_port, settings.stack.redis_port)
    assert not any(_port_open(port) for port in ports)
    assert all(not st.running for st in stack.status().values())
    stack.down()  # idempotent


def test_a_redis_port_another_server_answers_on_is_refused(tmp_path: Path) -> None:
    """Our redis-server would exit at once, but the other one answers PING: ``up`` must
    say the port is taken, not report a stack ready that is not ours."""
    settings = private_stack_settings(tmp_path / "stack")
    port = settings.stack.redis_port
    redis_server = shutil.which("redis-server")
    assert redis_server is not None
    other = subprocess.Popen(
        [redis_server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir",
         str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    stack = LocalStack(settings)
    try:
        deadline = time.monotonic() + 10
        while not _ping(settings.redis_url):
            assert time.monotonic() < deadline, "the other redis-server did not start"
            time.sleep(0.05)
        with pytest.raises(StackError, match=f"127.0.0.1:{port} is in use"):
            stack.up()
        assert all(not st.running for st in stack.status().values())
        assert other.poll() is None and _ping(settings.redis_url)
    finally:
        stack.down()
        other.terminate()
        other.wait(10)


def test_a_taken_broker_port_is_refused_and_redis_stopped_again(tmp_path: Path) -> None:
    settings = private_stack_settings(tmp_path / "stack")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", settings.stack.kafka_controller_port))
        taken.listen()
        stack = LocalStack(settings)
        try:
            with pytest.raises(
                StackError,
                match=f"kafka cannot start: 127.0.0.1:{settings.stack.kafka_controller_port}",
            ):
                stack.up()
            assert all(not st.running for st in stack.status().values())
        finally:
            stack.down()
