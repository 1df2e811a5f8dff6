"""The shipped contracts as tests run them, whatever the date.

``charge_customer_card_v2@2.0.0`` is deprecated with a sunset date, and the
processor reads the wall clock: from that day on the version is refused.
Tests that call it as a deprecated version that still runs (the end-to-end
lifecycle test, the conformance suite) run on a copy of the pack in which
every sunset date still ahead when the pack was written is moved to a year
from today. The shipped date itself is covered by the resolve gate's unit
tests, with the clock given.
"""

from __future__ import annotations

import datetime as dt
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = ROOT / "contracts"

_SUNSET = re.compile(r'(status: deprecated, sunset_date: )"([0-9]{4}-[0-9]{2}-[0-9]{2})"')


def sunset_ahead() -> str:
    """The sunset date the copies carry: a year from today (UTC)."""
    return (dt.datetime.now(dt.UTC).date() + dt.timedelta(days=365)).isoformat()


def contracts_with_sunsets_ahead(directory: Path, sunset: str | None = None) -> Path:
    """Copy the shipped contracts into ``directory``, every deprecated version's sunset date
    set to ``sunset`` (default ``sunset_ahead()``). Fails if no version was moved: the tests
    that use the copy would then no longer exercise a deprecated version."""
    shutil.copytree(CONTRACTS, directory, dirs_exist_ok=True)
    sunset = sunset or sunset_ahead()
    moved = 0
    for path in sorted(directory.rglob("*.yaml")):
        text, n = _SUNSET.subn(rf'\g<1>"{sunset}"', path.read_text())
        if n:
            path.write_text(text)
            moved += n
    assert moved, "no deprecated contract with a sunset date in the pack"
    return directory
