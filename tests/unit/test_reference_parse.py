"""Reading one tool.reference record: what the loader keeps, and what it refuses."""

from __future__ import annotations

import orjson
import pytest

from processor.state.references import BadReference, entity_key, parse_reference


def test_a_record_is_read_as_tenant_entity_and_id() -> None:
    rec = parse_reference(b"acme/order/WO-1:x/y", b'{"state":"open","extra":1}')
    assert (rec.tenant, rec.entity, rec.entity_id) == ("acme", "order", "WO-1:x/y")
    assert rec.value == b'{"state":"open"}'
    assert parse_reference(b"acme/order_line/7", None).value is None  # a tombstone


@pytest.mark.parametrize("entity", ["order:x", "Order", "1order", "order-line", "o" * 65, ""])
def test_an_entity_no_contract_could_name_is_refused(entity: str) -> None:
    """As the contract schema has it: a lower-case name. With ':' in it, one entity's key
    could spell another's ("order:x" with id "1" is "order" with id "x:1")."""
    with pytest.raises(BadReference):
        parse_reference(f"acme/{entity}/1".encode(), b'{"state":"open"}')
    assert entity_key("ts", "acme", "order:x", "1") == entity_key("ts", "acme", "order", "x:1")


@pytest.mark.parametrize(
    "value",
    [
        b"",  # an empty value, which is not a tombstone
        b'{"state": "refunded"',  # cut short
        b'{"state": "refunded", "owner": "\xff"}',  # not UTF-8
        b'{"state": NaN}',
        b'{"state": ""}',
        b'{"state": 7}',
        b'["refunded"]',
        b'{"state": "refunded", "owner": 4211.5}',
        b'{"state": "refunded", "owner": 1e3}',
        b'{"state": "refunded", "owner": true}',
        b'{"state": "refunded", "owner": ["cust-1"]}',
        b'{"state": "refunded", "attributes": ["refundable"]}',
        b'{"state": "refunded", "attributes": ' + b'{"a": ' * 300 + b"1" + b"}" * 301,
    ],
)
def test_an_unreadable_value_forgets_the_entity_its_key_names(value: bytes) -> None:
    """The entity's system of record has replaced its state with one that cannot be read:
    the refusal carries the entity's tombstone, so the older state is not kept."""
    with pytest.raises(BadReference) as refused:
        parse_reference(b"acme/order/WO-1", value)
    assert refused.value.forget == parse_reference(b"acme/order/WO-1", None)


@pytest.mark.parametrize("key", [None, b"acme/order", b"\xffacme/order/1", b"acme/Order/1"])
def test_an_unreadable_key_names_no_entity_to_forget(key: bytes | None) -> None:
    with pytest.raises(BadReference) as refused:
        parse_reference(key, b"x")
    assert refused.value.forget is None


def test_an_owner_or_attributes_left_null_are_none() -> None:
    rec = parse_reference(b"acme/order/WO-1", b'{"state":"open","owner":null,"attributes":null}')
    assert rec.value == b'{"state":"open"}'


@pytest.mark.parametrize(
    ("owner", "kept"), [(b"4211", "4211"), (b"-7", "-7"), (b"0", "0"), (b'"CUS-1"', "CUS-1")]
)
def test_an_owner_given_as_a_whole_number_is_read_as_its_digits(owner: bytes, kept: str) -> None:
    """A system of record that numbers its customers sends them as numbers: the entity is
    kept, with the owner rules compare as text, not forgotten as unreadable."""
    rec = parse_reference(b"acme/order/WO-1", b'{"state": "open", "owner": ' + owner + b"}")
    assert rec.value is not None and orjson.loads(rec.value) == {"state": "open", "owner": kept}
