"""The processor's transactional producers, taking turns: every one of them is fenced
on restart, and every one of them is used."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer

from processor.app import producer_config
from processor.client import ToolsentryClient
from processor.config import Settings
from tests.integration.harness import ProcessorProcess, isolated, read_all, token

pytestmark = pytest.mark.integration

LOOKUP = {"order_id": "WO-12345-A"}
FENCED = (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH)


def _instance(settings: Settings, instance_id: str) -> Settings:
    return settings.model_copy(update={"instance_id": instance_id})


def _zombie(settings: Settings, turn: int) -> Producer:
    """A producer holding transactional id number ``turn``, with a transaction open."""
    producer = Producer(producer_config(settings, turn))
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(settings.topics.observations, key=b"zombie", value=b"never committed")
    producer.flush(10)
    return producer


def _fenced(producer: Producer) -> bool:
    try:
        producer.commit_transaction(30)
    except KafkaException as exc:
        return bool(exc.args[0].code() in FENCED or exc.args[0].fatal())
    return False


def test_a_restarted_instance_fences_every_transactional_id_it_uses(
    stack_settings: Settings, tmp_path: Path
) -> None:
    settings = isolated(stack_settings, f"fence-{uuid.uuid4().hex[:6]}")
    me = _instance(settings, "fence-1")
    assert me.transactional_producers == 2
    zombies = [_zombie(me, turn) for turn in range(me.transactional_producers)]

    proc = ProcessorProcess(settings, "fence-1", tmp_path).start().wait_ready()
    client = ToolsentryClient(settings, "acme", principal_token=token(settings, "acme"))
    try:
        assert [_fenced(z) for z in zombies] == [True, True]
        # Neither open transaction is left to hold the observations back until it
        # times out: the processor's own are read at once.
        obs = client.call("search_kb", {"query": "refund policy"}, run_id="r-fence", timeout=30)
        assert obs["decision"] == "ROUTED"
        values = [m.value() for m in read_all(settings, settings.topics.observations, idle=1.0)]
        assert b"never committed" not in values
    finally:
        client.close()
        assert proc.terminate() == 0, proc.log()[-3000:]


def test_transactions_take_turns_between_the_producers(
    stack_settings: Settings, tmp_path: Path
) -> None:
    """Fencing the second producer from outside is noticed only if it is used: the
    processor then rebuilds its clients from the committed offsets and carries on."""
    settings = isolated(stack_settings, f"turns-{uuid.uuid4().hex[:6]}")
    me = _instance(settings, "turns-1")
    proc = ProcessorProcess(settings, "turns-1", tmp_path).start().wait_ready()
    client = ToolsentryClient(settings, "acme", principal_token=token(settings, "acme"))
    try:
        # One at a time, each its own batch and transaction.
        for i in range(4):
            obs = client.call("search_kb", {"query": f"query {i}"}, run_id=f"r-{i}", timeout=30)
            assert obs["decision"] == "ROUTED", (obs["status"], obs["next_action"])
        assert "rebuilding clients" not in proc.log()

        usurper = Producer(producer_config(me, 1))
        usurper.init_transactions(30)  # bumps the epoch: the processor's second is fenced

        ids = []
        for i in range(4):  # one at a time again: the second producer's turn comes
            ids.append(client.propose("search_kb", {"query": f"after {i}"}, run_id=f"a-{i}"))
            assert client.wait(ids[-1], timeout=60)["decision"] == "ROUTED"
        deadline = time.monotonic() + 30
        while "rebuilding clients" not in proc.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "rebuilding clients" in proc.log(), proc.log()[-3000:]
        # Nothing doubled by the rebuild: one observation per proposal.
        seen = [m.value() for m in read_all(settings, settings.topics.observations, idle=1.5)]
        for pid in ids:
            assert sum(pid.encode() in v for v in seen) == 1, pid
        assert proc.alive()
    finally:
        client.close()
        assert proc.terminate() == 0, proc.log()[-3000:]
