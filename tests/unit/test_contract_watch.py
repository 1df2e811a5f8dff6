"""Hot reload of the contract folder: a change is loaded once it has settled and only if
it held still while it was read; a copy that keeps its mtime is still noticed. The
watcher's poll is driven by calling ``check`` directly, so nothing here sleeps."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from processor.contracts import watch
from processor.contracts.registry import ContractError, ContractSet, load_contracts
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


def _configmap_version(volume: Path, version: str, timeout_ms: int) -> None:
    """Publish the two contracts as the kubelet updates a ConfigMap volume: every file in
    a new hidden timestamped folder, then the ``..data`` link swapped to it by a rename.
    The visible names are links through ``..data``."""
    stamped = volume / f"..2024_01_01_{version}"
    stamped.mkdir()
    for rel in (CANCEL, "lookup_order/1.0.0.yaml"):
        text = (CONTRACTS_DIR / rel).read_text()
        new = text.replace("timeout_ms: 6000", f"timeout_ms: {timeout_ms}")
        (stamped / rel.replace("/", "-")).write_text(new)
    (volume / "..data_tmp").symlink_to(stamped.name)
    os.replace(volume / "..data_tmp", volume / "..data")
    for rel in (CANCEL, "lookup_order/1.0.0.yaml"):
        name = volume / rel.replace("/", "-")
        if not name.is_symlink():
            name.symlink_to(f"..data/{name.name}")


def test_a_configmap_volume_loads_and_its_link_swap_is_taken(tmp_path: Path) -> None:
    volume = tmp_path / "contracts"
    volume.mkdir()
    _configmap_version(volume, "a", 6000)
    # Each file is there twice, under its own name and in the hidden folder behind ..data.
    loaded = load_contracts(volume)
    assert len(loaded) == 2 and loaded.get("cancel_order", "1.0.0").timeout_ms == 6000
    registry = CollectorRegistry()
    w = ContractWatcher(volume, loaded, Metrics(registry), poll_s=2.0)

    _configmap_version(volume, "b", 7000)
    w.check()
    w.check()
    swapped = w.take()
    assert swapped is not None and swapped.get("cancel_order", "1.0.0").timeout_ms == 7000
    assert _reloads(registry, "refused") == 0
    shutil.rmtree(volume / "..2024_01_01_a")  # as the kubelet does once the link moved
    w.check()
    w.check()
    assert w.take() is None and _reloads(registry, "refused") == 0


def test_an_editors_lock_and_swap_files_are_not_contracts(tmp_path: Path) -> None:
    w, folder, registry = _watcher(tmp_path)
    path = folder / CANCEL
    # Emacs locks a file it edits with a dangling link; vim and others keep hidden copies.
    (path.parent / ".#1.0.0.yaml").symlink_to("operator@host.4242:1700000000")
    (path.parent / ".1.0.0.yaml.json").write_text("{not json")
    path.write_text(path.read_text().replace("timeout_ms: 6000", "timeout_ms: 7000"))
    w.check()
    w.check()
    loaded = w.take()
    assert loaded is not None and loaded.get("cancel_order", "1.0.0").timeout_ms == 7000
    assert _reloads(registry, "refused") == 0


def test_a_folder_that_cannot_be_listed_refuses_the_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a set without that folder's tools: calls to them would be refused as unknown
    tools until someone noticed. (os.scandir stands in for permissions, which root, as
    tests may run, does not feel.)"""
    w, folder, registry = _watcher(tmp_path)
    locked = folder / "cancel_order"
    scandir = os.scandir

    def denied(path: Any) -> Any:
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", denied)
    with pytest.raises(ContractError, match="cancel_order: /: folder cannot be listed"):
        load_contracts(folder)
    w.check()
    w.check()
    assert w.take() is None and _reloads(registry, "refused") == 1
    w.check()
    assert _reloads(registry, "refused") == 1  # refused once, not at every poll

    monkeypatch.setattr(os, "scandir", scandir)
    w.check()
    w.check()
    assert w.take() is None  # listed again: the set it decides with already
    assert _reloads(registry, "refused") == 1 and _reloads(registry, "loaded") == 0


def test_an_unexpected_error_while_loading_refuses_the_set_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A defect met on some file (not a problem the loader names): the set is refused and
    counted, once, and the old set stays; once the files change and load, they are taken."""
    w, folder, registry = _watcher(tmp_path)
    path = folder / CANCEL

    def broken(directory: Path) -> ContractSet:
        raise RuntimeError("a loader defect")

    monkeypatch.setattr("processor.contracts.watch.load_contracts", broken)
    path.write_text(path.read_text().replace("timeout_ms: 6000", "timeout_ms: 7000"))
    w.check()
    w.check()  # (raised out of check before, and nothing was counted)
    w.check()
    assert w.take() is None and _reloads(registry, "refused") == 1

    monkeypatch.setattr("processor.contracts.watch.load_contracts", load_contracts)
    path.write_text(path.read_text().replace("timeout_ms: 7000", "timeout_ms: 8000"))
    w.check()
    w.check()
    loaded = w.take()
    assert loaded is not None and loaded.get("cancel_order", "1.0.0").timeout_ms == 8000
