"""The semantic gate's reference checks: an argument a contract declares as an entity's id
passes only when it names an entity of the caller's tenant in tool.reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from processor.contracts.registry import ContractSet, load_contracts
from processor.model import Outcome, TaxonomyClass
from tests.unit.helpers import CONTRACTS_DIR, decide_envelope, envelope


def _cancel_order_with_untyped_id(tmp_path: Path) -> ContractSet:
    """cancel_order whose ``order_id`` schema says nothing of its type (a pattern checks
    only strings): a number, a boolean, an object or a list passes the schema gate."""
    doc: dict[str, Any] = yaml.safe_load((CONTRACTS_DIR / "cancel_order/1.0.0.yaml").read_text())
    schema = doc["affordance"]["input_schema"]["properties"]["order_id"]
    del schema["type"], schema["examples"]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc))
    return load_contracts(tmp_path)


@pytest.mark.parametrize("order_id", [12345, 0, True, {"id": "WO-12345-A"}, ["WO-12345-A"]])
def test_an_id_that_is_not_text_names_no_entity(tmp_path: Path, order_id: Any) -> None:
    """It is no key of tool.reference. It was left out of the reference checks instead,
    and the call went on as if it named no entity at all: here, parked for approval with
    an empty before_state, to be cancelled once approved."""
    contracts = _cancel_order_with_untyped_id(tmp_path)
    env = envelope("cancel_order")
    env["arguments"]["order_id"] = order_id
    d = decide_envelope(env, contracts, answers={})
    assert d.outcome is Outcome.REJECTED, (d.outcome, d.rejection)
    assert d.rejection is not None
    assert d.rejection.taxonomy is TaxonomyClass.SEMANTIC_INVALIDITY
    assert [(e.field, e.code) for e in d.rejection.errors] == [("order_id", "unknown_reference")]
    assert "lookup_order" in d.rejection.next_action
