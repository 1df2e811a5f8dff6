"""Fixtures for the unit tests."""

from __future__ import annotations

import pytest

from processor.contracts.registry import ContractSet, load_contracts
from tests.unit.helpers import CONTRACTS_DIR


@pytest.fixture(scope="session")
def contracts() -> ContractSet:
    """The contracts shipped in ``contracts/``, loaded once."""
    return load_contracts(CONTRACTS_DIR)
