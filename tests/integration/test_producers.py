"""The processor's transactional producer and another holding the same transactional id:
a restarted instance fences its predecessor's, and one fenced while it runs rebuilds its
clients and carries on."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer

from processor.app import producer_config
from processor.client import ToolsentryClient
from processor.config import Settings
from tests.integration.harness import ProcessorProcess, isolated, read_all, token

pytestmark = pytest.mark.integration

FENCED = (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH)


def _as_instance(settings: Settings, instance_id: str) -> Settings:
    return settings.model_copy(update={"instance_id": instance_id})


def _fenced(producer: Producer) -> bool:
    try:
        producer.commit_transaction(30)
    except KafkaException as exc:
        return bool(exc.args[0].code() in FENCED or exc.args[0].fatal())
    return False


def _search(client: ToolsentryClient, query: str, run_id: str) -> None:
    obs = client.call("search_kb", {"query": query}, run_id=run_id, timeout=60)
    assert obs["decision"] == "ROUTED", (obs["status"], obs["next_action"])


def test_a_restarted_instance_fences_its_predecessors_open_transaction(
    stack_settings: Settings, tmp_path: Path
) -> None:
    settings = isolated(stack_settings, f"fence-{uuid.uuid4().hex[:6]}")
    zombie = Producer(producer_config(_as_instance(settings, "fence-1")))
    zombie.init_transactions(30)
    zombie.begin_transaction()
    zombie.produce(settings.topics.observations, key=b"zombie", value=b"never committed")
    zombie.flush(10)

    proc = ProcessorProcess(settings, "fence-1", tmp_path).start().wait_ready()
    client = ToolsentryClient(settings, "acme", principal_token=token(settings, "acme"))
    try:
        assert _fenced(zombie)
        # The open transaction was aborted, not left to hold the observations back until
        # it timed out: the processor's own are read at once.
        _search(client, "refund policy", "r-fence")
        values = [m.value() for m in read_all(settings, settings.topics.observations, idle=1.0)]
        assert b"never committed" not in values
    finally:
        client.close()
        assert proc.terminate() == 0, proc.log()[-3000:]


def test_a_processor_fenced_while_running_rebuilds_its_clients_and_doubles_nothing(
    stack_settings: Settings, tmp_path: Path
) -> None:
    settings = isolated(stack_settings, f"usurped-{uuid.uuid4().hex[:6]}")
    proc = ProcessorProcess(settings, "usurped-1", tmp_path).start().wait_ready()
    client = ToolsentryClient(settings, "acme", principal_token=token(settings, "acme"))
    try:
        _search(client, "before the usurper", "r-before")
        # Another producer takes the transactional id: the processor's epoch is stale,
        # and its next transaction fails as fenced.
        usurper = Producer(producer_config(_as_instance(settings, "usurped-1")))
        usurper.init_transactions(30)
        ids = []
        for i in range(3):
            ids.append(client.propose("search_kb", {"query": f"after {i}"}, run_id=f"a-{i}"))
            assert client.wait(ids[-1], timeout=60)["decision"] == "ROUTED"
        assert "rebuilding clients" in proc.log(), proc.log()[-3000:]
        assert proc.alive()
        seen = [m.value() for m in read_all(settings, settings.topics.observations, idle=1.5)]
        for pid in ids:
            assert sum(pid.encode() in v for v in seen) == 1, pid
    finally:
        client.close()
        assert proc.terminate() == 0, proc.log()[-3000:]
