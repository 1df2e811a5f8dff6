"""A record whose outputs the broker would refuse goes to the DLQ, once, instead of
aborting its batch for ever (``Processor._encode``; no broker involved)."""

from __future__ import annotations

import dataclasses
from typing import Any

from prometheus_client import CollectorRegistry

from processor.app import Processor
from processor.config import Settings
from processor.contracts.registry import ContractSet
from processor.metrics import Metrics
from processor.model import Outcome
from tests.unit.helpers import CONTRACTS_DIR, decide_envelope, envelope


class _Record:
    """What ``_encode`` reads of a consumed record."""

    def __init__(self, value: bytes) -> None:
        self._value = value

    def key(self) -> bytes:
        return b"run-1"

    def value(self) -> bytes:
        return self._value

    def partition(self) -> int:
        return 3

    def offset(self) -> int:
        return 42


def _processor() -> Processor:
    settings = Settings(contracts_dir=CONTRACTS_DIR, policy_file=None, metrics_port=0,
                        redis_url="redis://127.0.0.1:1/0")  # fmt: skip
    return Processor(settings, metrics=Metrics(CollectorRegistry()))


def test_an_output_over_message_max_bytes_is_a_dead_letter(contracts: ContractSet) -> None:
    p = _processor()
    d = decide_envelope(envelope("search_kb", arguments={"query": "refunds"}), contracts)
    assert d.outcome is Outcome.ROUTED
    assert d.call is not None
    big = '{"query":"' + "x" * 1_100_000 + '"}'
    huge = dataclasses.replace(d, call=dataclasses.replace(d.call, canonical_arguments=big))
    out: list[Any] = []
    p._encode(out, _Record(b"{}"), huge)
    [(topic, _, _, headers)] = out
    assert topic == p.settings.topics.dlq
    assert dict(headers)["toolsentry.error.reason"] == b"encoding_failed"
    assert huge.outcome is Outcome.DEAD_LETTER

    out = []
    p._encode(out, _Record(b"{}"), d)
    assert [t for t, *_ in out] == [
        p.settings.topics.execution("READ_ONLY"),
        p.settings.topics.observations,
    ]


def test_an_output_whose_key_takes_it_over_message_max_bytes_is_a_dead_letter(
    contracts: ContractSet,
) -> None:
    """The broker counts a record's key against its limit as it does the value: an
    observation keyed by a long run id (a result's answer goes to the run the result
    names) that fits only on its own would be refused, and its batch would come back for
    ever."""
    p = _processor()
    d = decide_envelope(envelope("search_kb", arguments={"query": "refunds"}), contracts)
    assert d.outcome is Outcome.ROUTED and d.proposal is not None
    run = "\U0001f600" * 1024  # four bytes each: twice, in the key and the observation
    keyed = dataclasses.replace(d, proposal=dataclasses.replace(d.proposal, run_id=run))
    out: list[Any] = []
    p._encode(out, _Record(b"{}"), keyed)
    p._max_message_bytes = max(len(value) for _, _, value, _ in out)  # each value fits
    out = []
    p._encode(out, _Record(b"{}"), dataclasses.replace(keyed))
    [(topic, _, _, headers)] = out
    assert topic == p.settings.topics.dlq
    assert dict(headers)["toolsentry.error.reason"] == b"encoding_failed"
