"""The README's settings table and environment variables against ``processor.config``.

An operator configures the processor from the README: a setting missing there cannot be
found, one listed that does not exist is refused at start, and a wrong default is the
value they did not expect to be running with.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from processor.config import (
    ENV_PREFIX,
    LOG_LEVELS,
    NOT_SETTINGS,
    NOT_SETTINGS_PREFIXES,
    Settings,
)

ROOT = Path(__file__).resolve().parents[2]
SUMMARISED = {"stack": "`stack.*`"}
"""Nested settings the table gives one row, pointing at ``processor/config.py``."""
COMPUTED = {"instance_id": "host name"}
"""Defaults computed where the processor runs, which the table names in words."""


def readme() -> str:
    return (ROOT / "README.md").read_text()


def table_rows() -> dict[str, str]:
    """Each setting the Configuration section's table names, with the default it gives
    (a row naming several settings, ``a`` / ``b``, gives each its own default, or one for
    all)."""
    section = readme().split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        names = [n.strip().strip("`") for n in cells[0].split(" / ")]
        defaults = [d.strip() for d in cells[1].split(" / ")]
        if len(defaults) == 1:
            defaults *= len(names)
        assert len(defaults) == len(names), line
        for name, default in zip(names, defaults, strict=True):
            assert name not in rows, f"{name} is listed twice"
            rows[name] = default
    return rows


def shown(value: Any) -> str:
    """A default as the table writes it."""
    if value is None or value == ():
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def settings_defaults() -> dict[str, str]:
    """Every setting, nested ones by their dotted name, with its default as the table
    writes it."""
    out: dict[str, str] = {}
    for name, field in Settings.model_fields.items():
        if name in SUMMARISED:
            out[f"{name}.*"] = "see `processor/config.py`"
            continue
        if name in COMPUTED:
            out[name] = COMPUTED[name]
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            for sub, value in default.model_dump().items():
                out[f"{name}.{sub}"] = shown(value)
        else:
            out[name] = shown(default)
    return out


def test_the_table_lists_every_setting_and_only_those() -> None:
    assert set(table_rows()) == set(settings_defaults())


def test_the_table_gives_each_setting_its_default() -> None:
    rows, defaults = table_rows(), settings_defaults()
    wrong = {name: (rows[name], defaults[name]) for name in rows if rows[name] != defaults[name]}
    assert wrong == {}, "(README, code)"


def test_the_table_names_every_log_level() -> None:
    [row] = [line for line in readme().splitlines() if line.startswith("| `log_level` |")]
    assert set(re.findall(r"`([A-Z]+)`", row)) == set(LOG_LEVELS)


def test_the_variables_are_named_as_the_readme_says() -> None:
    """``TOOLSENTRY_<FIELD>``, with ``__`` for nesting."""
    assert Settings.model_config.get("env_prefix") == ENV_PREFIX == "TOOLSENTRY_"
    assert Settings.model_config.get("env_nested_delimiter") == "__"


def test_every_variable_the_readme_names_is_read() -> None:
    """An example variable that names no setting would be refused at start."""
    fields = {name.upper(): field for name, field in Settings.model_fields.items()}
    for variable in set(re.findall(r"\bTOOLSENTRY_[A-Z0-9_]*[A-Z0-9]", readme())):
        rest = variable.removeprefix(ENV_PREFIX)
        if rest in NOT_SETTINGS or rest.startswith(NOT_SETTINGS_PREFIXES):
            continue
        head, _, nested = rest.partition("__")
        assert head in fields, variable
        if nested:
            model = fields[head].annotation
            assert isinstance(model, type) and issubclass(model, BaseModel), variable
            assert nested.lower() in model.model_fields, variable
