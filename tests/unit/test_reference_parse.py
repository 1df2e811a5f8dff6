"""Reading one tool.reference record: what the loader keeps, and what it refuses."""

from __future__ import annotations

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
