"""Publishing what an operator, the demo or a system of record sends when the broker does
not take it: an error, never a return that reads as delivered. No broker: the bootstrap is
a closed port, and records expire unsent at once."""

from __future__ import annotations

import pytest

from processor.approval_flow import publish_approvals
from processor.config import Settings
from processor.kafka.produce import DeliveryError
from processor.reference_data import publish_references
from processor.stack.local import free_ports


@pytest.fixture
def nowhere() -> Settings:
    (port,) = free_ports(1)  # nothing listens there
    return Settings(
        bootstrap_servers=f"127.0.0.1:{port}",
        metrics_port=0,
        kafka={"message.timeout.ms": 200, "reconnect.backoff.max.ms": 100},
    )


def test_an_approval_the_broker_never_took_is_a_delivery_error(nowhere: Settings) -> None:
    """flush() counts only the records still queued: an expired one had left the queue,
    and ``toolsentry approvals approve`` said it had approved."""
    with pytest.raises(DeliveryError, match="1 record"):
        publish_approvals(nowhere, "run-1", [{"approval_id": "a-1"}])


def test_reference_data_the_broker_never_took_is_a_delivery_error(nowhere: Settings) -> None:
    with pytest.raises(DeliveryError, match="2 record"):
        publish_references(nowhere, [("acme/order/WO-1", {"state": "shipped"}), ("acme/x/y", None)])
