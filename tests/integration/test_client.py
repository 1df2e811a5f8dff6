"""The agent client against a real broker: it says so when there is nothing to read, and a
proposal the broker refuses is reported to whoever waits on it, whatever else is in flight."""

from __future__ import annotations

import time
import uuid

import pytest

from processor.client import DeliveryError, ToolsentryClient, TopicMissing
from processor.config import Settings, Topics
from tests.integration.harness import isolated

pytestmark = pytest.mark.integration


def test_a_client_started_before_its_topics_exist_says_which_is_missing(
    stack_settings: Settings,
) -> None:
    """Its consumer was assigned no partitions: every wait ended in ObservationTimeout, and
    the topic's partitions, once created, were never read."""
    prefix = f"absent-{uuid.uuid4().hex[:6]}."
    settings = stack_settings.model_copy(update={"topics": Topics(prefix=prefix)})
    with pytest.raises(TopicMissing, match=f"topic {prefix}observations does not exist") as raised:
        ToolsentryClient(settings, "acme")
    assert raised.value.topic == settings.topics.observations


def test_a_refused_proposal_reaches_its_waiter_while_another_record_is_in_flight(
    stack_settings: Settings,
) -> None:
    """A wait flushed the whole producer before it looked for a delivery failure: one record
    stuck in the queue (as behind a partition whose leader is away) held every caller's wait
    until its timeout, whatever had become of its own proposal."""
    settings = isolated(stack_settings, f"client-{uuid.uuid4().hex[:6]}")
    kafka = {
        **settings.kafka,
        # A record for a topic that does not exist waits this long before it fails.
        "topic.metadata.propagation.max.ms": 60_000,
        # Sent, and refused by the broker (a record of at most about 1 MB by default).
        "message.max.bytes": 4_000_000,
    }
    client = ToolsentryClient(settings.model_copy(update={"kafka": kafka}), "acme")
    try:
        client._producer.produce(f"{settings.topics.prefix}nowhere", b"stuck")
        pid = client.propose("search_kb", {"query": "x" * 2_000_000}, run_id="run-too-large")
        started = time.monotonic()
        with pytest.raises(DeliveryError, match=pid):
            client.wait(pid, 30)
        assert time.monotonic() - started < 15
        with pytest.raises(DeliveryError, match=pid):  # every wait on it is told
            client.wait(pid, 1)
    finally:
        client._producer.purge()
        client.close()
