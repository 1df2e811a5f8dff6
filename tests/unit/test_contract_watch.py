"""Hot reload of the contract folder: a change is loaded once it has settled and only if
it held still while it was read; a copy that keeps its mtime is still noticed. The
watcher's poll is driven by calling ``check`` directly, so nothing here sleeps."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from processor.contracts import watch
from processor.contracts.registry import ContractSet, load_contracts
from processor.contracts.watch import ContractWatcher
from processor.metrics import Metrics
from processor.model import SideEffectClass
from tests.unit.helpers import CONTRACTS_DIR

CANCEL = "cancel_order/1.0.0.yaml"


def _watcher(tmp_path: Path) -> tuple[ContractWatcher, Path, CollectorRegistry]:
    folder = tmp_path / "contracts"
    for rel in (CANCEL, "lookup_order/1.0.0.yaml"):
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(CONTRACTS_DIR / rel, folder / rel)
    registry = CollectorRegistry()
    w = ContractWatcher(folder, load_contracts(folder), Metrics(registry), poll_s=2.0)
    return w, folder, registry


def _reloads(registry: CollectorRegistry, result: str) -> float:
    value = registry.get_sample_value("toolsentry_contract_reloads_total", {"result": result})
    return value or 0.0


def _references(cs: ContractSet) -> list[str]:
    return [r.argument for r in cs.get("cancel_order", "1.0.0").references]


def test_a_file_caught_mid_write_is_loaded_only_once_it_holds_still(tmp_path: Path) -> None:
    w, folder, _ = _watcher(tmp_path)
    path = folder / CANCEL
    full = path.read_bytes()
    # A prefix without the semantics section still loads, with no reference checks.
    path.write_bytes(full[: full.index(b"\nsemantics:") + 1])
    w.check()
    assert w.take() is None

    changed = full.replace(b"timeout_ms: 6000", b"timeout_ms: 7000")
    assert changed != full
    path.write_bytes(changed)
    w.check()  # changed again since the last poll: still settling
    assert w.take() is None
    w.check()
    loaded = w.take()
    assert loaded is not None and loaded.get("cancel_order", "1.0.0").timeout_ms == 7000
    assert _references(loaded) == ["order_id"]
    w.check()
    assert w.take() is None  # loaded once


def test_a_folder_that_changes_while_being_read_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w, folder, registry = _watcher(tmp_path)
    path = folder / CANCEL
    full = path.read_text()
    writes = [full.replace("timeout_ms: 6000", "timeout_ms: 7000")]

    def load_while_written(directory: Path) -> ContractSet:
        loaded = load_contracts(directory)
        if writes:
            path.write_text(writes.pop())
        return loaded

    monkeypatch.setattr(watch, "load_contracts", load_while_written)
    path.write_text(full.replace("timeout_ms: 6000", "timeout_ms: 6500"))
    w.check()
    w.check()  # settled, but the file changes while it is read
    assert w.take() is None
    assert _reloads(registry, "refused") == 0
    w.check()
    loaded = w.take()
    assert loaded is not None and loaded.get("cancel_order", "1.0.0").timeout_ms == 7000


def test_a_forced_check_loads_at_once_but_refuses_a_folder_changing_under_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w, folder, registry = _watcher(tmp_path)
    path = folder / CANCEL
    full = path.read_text()
    path.write_text(full.replace("timeout_ms: 6000", "timeout_ms: 6500"))
    w.check(force=True)
    loaded = w.take()
    assert loaded is not None and loaded.get("cancel_order", "1.0.0").timeout_ms == 6500

    real = load_contracts

    def load_while_written(directory: Path) -> ContractSet:
        loaded = real(directory)
        path.write_text(full.replace("timeout_ms: 6000", "timeout_ms: 7000"))
        return loaded

    monkeypatch.setattr(watch, "load_contracts", load_while_written)
    w.check(force=True)
    assert w.take() is None
    assert _reloads(registry, "refused") == 1
    monkeypatch.setattr(watch, "load_contracts", real)
    w.check()  # unchanged since the refused read: it has settled
    loaded = w.take()
    assert loaded is not None and loaded.get("cancel_order", "1.0.0").timeout_ms == 7000


def test_a_file_replaced_with_its_size_and_mtime_kept_is_noticed(tmp_path: Path) -> None:
    w, folder, _ = _watcher(tmp_path)
    path = folder / CANCEL
    st = path.stat()
    text = path.read_text()
    new = text.replace(
        "side_effect_class: HIGH_RISK_EXTERNAL", "side_effect_class: CRITICAL_MUTATION "
    )
    assert len(new) == len(text) and new != text
    tmp = path.with_suffix(".tmp")  # as rsync -a or cp -p over a rename leave it
    tmp.write_text(new)
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, path)
    w.check()
    w.check()
    loaded = w.take()
    assert loaded is not None
    assert (
        loaded.get("cancel_order", "1.0.0").side_effect_class is SideEffectClass.CRITICAL_MUTATION
    )


def test_a_refused_folder_keeps_the_old_set_and_is_not_read_again_until_it_changes(
    tmp_path: Path,
) -> None:
    w, folder, registry = _watcher(tmp_path)
    (folder / "broken.yaml").write_text("identity: [not, a, contract\n")
    w.check()
    w.check()
    assert w.take() is None and _reloads(registry, "refused") == 1
    w.check()
    assert _reloads(registry, "refused") == 1
    w.check(force=True)
    assert w.take() is None and _reloads(registry, "refused") == 2
    (folder / "broken.yaml").unlink()
    w.check()
    w.check()
    assert w.take() is None  # the same set as before the broken file: nothing to swap
    assert _reloads(registry, "loaded") == 0
