"""Hot reload of the contract folder: a change is loaded once it has settled and only if
it held still while it was read; a copy that keeps its mtime is still noticed. The
processor's first read, at start, is held to the same. The watcher's poll is driven by
calling ``check`` directly, and the first read's by the ``wait`` it is given (or a poll
of 0 s), so nothing here sleeps."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from processor.app import Processor
from processor.config import Settings
from processor.contracts import registry, watch
from processor.contracts.registry import ContractError, ContractSet, load_contracts
from processor.contracts.watch import ContractWatcher
from processor.metrics import Metrics
from processor.model import SideEffectClass
from tests.unit.helpers import CONTRACTS_DIR

CANCEL = "cancel_order/1.0.0.yaml"
LOOKUP = "lookup_order/1.0.0.yaml"


def _folder(tmp_path: Path) -> Path:
    """A contracts folder with cancel_order and lookup_order 1.0.0."""
    folder = tmp_path / "contracts"
    for rel in (CANCEL, LOOKUP):
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(CONTRACTS_DIR / rel, folder / rel)
    return folder


def _watcher(tmp_path: Path) -> tuple[ContractWatcher, Path, CollectorRegistry]:
    folder = _folder(tmp_path)
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


def test_a_reload_with_an_exponentially_backtracking_pattern_keeps_the_old_set(
    tmp_path: Path,
) -> None:
    w, folder, registry = _watcher(tmp_path)
    cancel = folder / CANCEL
    text = cancel.read_text()
    assert 'pattern: "^WO-[0-9]{5}-[A-Z]$"' in text
    cancel.write_text(text.replace('"^WO-[0-9]{5}-[A-Z]$"', r'"^(\\w+\\s?)*$"'))
    with pytest.raises(ContractError, match="exponentially many ways"):
        load_contracts(folder)
    w.check()
    w.check()
    assert w.take() is None and _reloads(registry, "refused") == 1
    assert _reloads(registry, "loaded") == 0


def _configmap_version(volume: Path, version: str, timeout_ms: int) -> None:
    """Publish the two contracts as the kubelet updates a ConfigMap volume: every file in
    a new hidden timestamped folder, then the ``..data`` link swapped to it by a rename.
    The visible names are links through ``..data``."""
    stamped = volume / f"..2024_01_01_{version}"
    stamped.mkdir()
    for rel in (CANCEL, LOOKUP):
        text = (CONTRACTS_DIR / rel).read_text()
        new = text.replace("timeout_ms: 6000", f"timeout_ms: {timeout_ms}")
        (stamped / rel.replace("/", "-")).write_text(new)
    (volume / "..data_tmp").symlink_to(stamped.name)
    os.replace(volume / "..data_tmp", volume / "..data")
    for rel in (CANCEL, LOOKUP):
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


def _new_version(folder: Path, rel: str) -> None:
    """Write version 1.1.0 of the tool of ``rel`` (1.0.0), as a deploy does."""
    text = (folder / rel).read_text().replace("version: 1.0.0", "version: 1.1.0", 1)
    (folder / rel).with_name("1.1.0.yaml").write_text(text)


def test_a_processor_started_while_a_deploy_writes_the_folder_takes_the_whole_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deploy of two versions that go together has written one when the processor
    starts, and writes the other while the processor reads the folder. The first read
    is held to what a reload is: read again, whole, rather than taken with one version
    and not the other. (``contracts_poll_s`` 0: each poll is one more read, no sleep.)"""
    folder = _folder(tmp_path)
    _new_version(folder, CANCEL)
    deploy = [lambda: _new_version(folder, LOOKUP)]
    read = registry.read_contract_file

    def read_while_deployed(path: Path) -> Any:
        if deploy:
            deploy.pop()()
        return read(path)

    monkeypatch.setattr(registry, "read_contract_file", read_while_deployed)
    settings = Settings(contracts_dir=folder, policy_file=None, metrics_port=0,
                        redis_url="redis://127.0.0.1:1/0", contracts_poll_s=0.0)  # fmt: skip
    proc = Processor(settings, metrics=Metrics(CollectorRegistry()))
    assert [c.version for c in proc.contracts.versions("cancel_order")] == ["1.1.0", "1.0.0"]
    assert [c.version for c in proc.contracts.versions("lookup_order")] == ["1.1.0", "1.0.0"]


def test_the_first_read_waits_for_the_files_to_hold_still_for_a_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deploy between two files when the processor starts: read only once nothing has
    changed for a whole poll, as a reload is, and then once."""
    folder = _folder(tmp_path)
    deploy = [lambda: _new_version(folder, CANCEL), lambda: _new_version(folder, LOOKUP)]
    polls: list[float] = []

    def poll(seconds: float) -> None:
        polls.append(seconds)
        if deploy:
            deploy.pop(0)()

    loads: list[Path] = []

    def load(directory: Path) -> ContractSet:
        loads.append(directory)
        return load_contracts(directory)

    monkeypatch.setattr(watch, "load_contracts", load)
    loaded, stamp = watch.load_settled(folder, 2.0, poll)
    assert polls == [2.0] * 3 and loads == [folder]
    assert len(loaded) == 4 and loaded.get("lookup_order", "1.1.0") is not None
    assert stamp == watch.folder_stamp(folder)


def test_a_file_cut_short_at_start_is_read_again_once_written_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a read of files that changed under it found wrong says nothing of the files:
    the processor does not refuse to start on a file a writer had not finished."""
    folder = _folder(tmp_path)
    path = folder / CANCEL
    full = path.read_text()
    path.write_text(full[: full.index("\naffordance:")] + "\naffordance: {model_desc")
    with pytest.raises(ContractError):
        load_contracts(folder)  # refused, read as it is

    def load_while_written(directory: Path) -> ContractSet:
        try:
            return load_contracts(directory)
        finally:
            if path.read_text() != full:
                path.write_text(full)

    monkeypatch.setattr(watch, "load_contracts", load_while_written)
    loaded, _ = watch.load_settled(folder, 0.0)
    assert _references(loaded) == ["order_id"]


def test_a_refused_set_that_holds_still_refuses_the_start(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "broken.yaml").write_text("identity: [not, a, contract\n")
    polls: list[float] = []
    with pytest.raises(ContractError, match=r"broken\.yaml: /: cannot be parsed"):
        watch.load_settled(folder, 2.0, polls.append)
    assert polls == [2.0]


def test_files_that_never_hold_still_refuse_the_start_after_a_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a start that waits for ever, nor one with whatever was caught of the files."""
    folder = _folder(tmp_path)
    path = folder / CANCEL

    def write() -> None:
        with path.open("a") as f:  # a line more each time: a stamp of its own
            f.write("# still being written\n")

    polls: list[float] = []

    def poll(seconds: float) -> None:
        polls.append(seconds)
        if len(polls) % 2:
            write()  # changed from one poll to the next

    def load(directory: Path) -> ContractSet:
        loaded = load_contracts(directory)
        write()  # held still for a poll, then changed while read
        return loaded

    monkeypatch.setattr(watch, "load_contracts", load)
    with pytest.raises(ContractError, match="did not hold still"):
        watch.load_settled(folder, 2.0, poll)
    assert polls == [2.0] * watch.FIRST_READ_POLLS


def test_files_that_have_not_changed_for_a_poll_are_read_at_once(tmp_path: Path) -> None:
    """The usual start: the folder was deployed before the processor started, and is
    read without waiting a poll."""
    folder = _folder(tmp_path)
    polls: list[float] = []
    later = time.time() + 5.0
    loaded, stamp = watch.load_settled(folder, 2.0, polls.append, clock=lambda: later)
    assert polls == [] and len(loaded) == 2 and stamp == watch.folder_stamp(folder)


def test_a_file_removed_within_the_last_poll_is_waited_out(tmp_path: Path) -> None:
    """A removal leaves no file to look at: its folder's change time tells it (a deploy
    that removes a version before it writes its successor)."""
    folder = _folder(tmp_path)
    time.sleep(0.05)  # the files age past the 30 ms looked at below; the removal does not
    (folder / LOOKUP).unlink()
    stamp = watch.folder_stamp(folder)
    assert all(max(s[3], s[4]) < time.time_ns() - 30_000_000 for s in stamp)
    assert not watch.quiet_for(0.03, stamp, time.time(), folder)
    polls: list[float] = []
    loaded, _ = watch.load_settled(folder, 2.0, polls.append, clock=lambda: time.time() + 1.0)
    assert polls == [2.0] and len(loaded) == 1
