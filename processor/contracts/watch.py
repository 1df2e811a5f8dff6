"""Hot reload: notice changed contract files and load the new set off the hot path.

A background thread polls the folder's file stamps (and wakes at once on a
reload request, e.g. SIGHUP). A changed folder is loaded whole by
``load_contracts``; a refused set is logged and counted and the processor
keeps deciding with the set it has. The processor's loop takes a loaded set
between batches, so no proposal is ever decided by half of one set and half
of another.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from processor.contracts.registry import (
    CONTRACT_SUFFIXES,
    ContractError,
    ContractSet,
    load_contracts,
)
from processor.metrics import Metrics

logger = logging.getLogger(__name__)

Stamp = tuple[tuple[str, int, int], ...]


def folder_stamp(directory: Path) -> Stamp:
    """(path, mtime, size) of every contract file: changes whenever a file does."""
    out = []
    for p in sorted(directory.rglob("*")):
        if p.suffix in CONTRACT_SUFFIXES:
            try:
                st = p.stat()
            except FileNotFoundError:  # removed while we looked
                continue
            out.append((str(p.relative_to(directory)), st.st_mtime_ns, st.st_size))
    return tuple(out)


class ContractWatcher:
    def __init__(
        self,
        directory: Path,
        current: ContractSet,
        metrics: Metrics,
        poll_s: float,
        requested: threading.Event | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.current_fingerprint = current.fingerprint
        self.metrics = metrics
        self.poll_s = poll_s
        self.requested = requested or threading.Event()
        self._stamp = folder_stamp(self.directory)
        self._pending: ContractSet | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="contract-watch", daemon=True)

    def start(self) -> ContractWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.requested.set()
        self._thread.join(5)

    def has_pending(self) -> bool:
        """Whether a newly loaded set waits to be taken."""
        with self._lock:
            return self._pending is not None

    def take(self) -> ContractSet | None:
        """The newly loaded set, once; called by the processor loop between batches."""
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def check(self, force: bool = False) -> None:
        """Load the folder again if it changed (or if ``force``)."""
        stamp = folder_stamp(self.directory)
        if stamp == self._stamp and not force:
            return
        self._stamp = stamp
        try:
            loaded = load_contracts(self.directory)
        except ContractError as exc:
            self.metrics.contract_reloads.labels("refused").inc()
            logger.error("contract reload refused; still deciding with %s\n%s",
                         self.current_fingerprint, exc)  # fmt: skip
            return
        if loaded.fingerprint == self.current_fingerprint:
            return
        self.metrics.contract_reloads.labels("loaded").inc()
        logger.info("contracts %s loaded (%d versions); replacing %s between batches",
                    loaded.fingerprint, len(loaded), self.current_fingerprint)  # fmt: skip
        self.current_fingerprint = loaded.fingerprint
        with self._lock:
            self._pending = loaded

    def _run(self) -> None:
        while not self._stop.is_set():
            forced = self.requested.wait(self.poll_s)
            self.requested.clear()
            if self._stop.is_set():
                return
            try:
                self.check(force=forced)
            except Exception:  # the watcher must outlive a bad file system moment
                logger.exception("contract watch failed; retrying")
