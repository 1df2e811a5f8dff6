"""The agent client when the broker does not take its proposals: a wait says so at once
(DeliveryError), never "no observation yet". No broker: the bootstrap is a closed port."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from processor.client import ClientClosed, DeliveryError, ToolsentryClient, _ids
from processor.config import Settings
from processor.stack.local import free_ports


@pytest.fixture
def client() -> Iterator[ToolsentryClient]:
    (port,) = free_ports(1)  # nothing listens there
    settings = Settings(
        bootstrap_servers=f"127.0.0.1:{port}",
        metrics_port=0,
        kafka={"message.timeout.ms": 200, "reconnect.backoff.max.ms": 100},
    )
    c = ToolsentryClient(settings, "acme", watch=False)
    yield c
    c._producer.purge()
    c.close()


def test_a_proposal_the_broker_never_took_is_a_delivery_error(client: ToolsentryClient) -> None:
    pid = client.propose("search_kb", {"query": "refunds"}, run_id="run-1")
    with pytest.raises(DeliveryError, match=pid):
        client.wait(pid, 30)
    with pytest.raises(DeliveryError, match="1 proposals"):
        client.flush(30)


def test_undelivered_proposals_are_counted_not_hoarded(client: ToolsentryClient) -> None:
    for _ in range(50):
        client.send_raw(b'{"proposal_id": "%s"}' % uuid.uuid4().hex.encode(), b"run-2")
    client._producer.flush(30)  # every delivery report served, none raised yet
    assert 0 < len(client._failed) <= 16
    with pytest.raises(DeliveryError, match="50 proposals"):
        client.flush(30)
    client.flush(1)  # reported once


@pytest.mark.parametrize("value", [None, b"", b"\xff\xfe", b"[1, 2]", b"NaN"])
def test_raw_records_that_name_no_proposal_are_sent_as_they_are(
    client: ToolsentryClient, value: bytes | None
) -> None:
    """A tombstone, empty bytes, invalid UTF-8 or JSON that is not an object: sent, and
    counted undelivered here (nothing listens), never an error from reading their ids."""
    client.send_raw(value, b"run-3")
    with pytest.raises(DeliveryError, match="1 proposals"):
        client.flush(30)


@pytest.mark.parametrize(
    ("value", "ids"),
    [
        (b'{"proposal_id": "p1", "run_id": "r1"}', ("p1", "r1")),
        (b'{"proposal_id": "p1", "run_id": "r1", "x": NaN}', ("p1", "r1")),  # lenient read
        (b'{"proposal_id": "p1", "run_id": "\\ud800"}', ("p1", None)),  # no key can be made
        (b'{"proposal_id": "p1", "run_id": ""}', ("p1", None)),
        (b'{"proposal_id": 1, "run_id": ["r"]}', (None, None)),
    ],
)
def test_the_client_follows_only_a_run_the_processor_can_answer_under(
    value: bytes, ids: tuple[str | None, str | None]
) -> None:
    """The run a raw record names is followed only when the processor keys its answer by
    it; a lone surrogate was followed, and encoding it raised out of send_raw."""
    assert _ids(value) == ids


def test_closing_the_client_releases_a_caller_waiting_on_it(client: ToolsentryClient) -> None:
    """A caller waiting in another thread got no word of close(): it waited out its whole
    timeout for observations no longer read, then reported them missing."""
    raised: list[Exception] = []

    def wait() -> None:
        try:
            client.wait("p-never-answered", 30)
        except Exception as exc:
            raised.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)
    client.close()
    waiter.join(5)
    assert not waiter.is_alive()
    assert [type(e) for e in raised] == [ClientClosed]
    with pytest.raises(ClientClosed):
        client.wait("p-after-close", 30)
