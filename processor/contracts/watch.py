"""Hot reload: notice changed contract files and load the new set off the hot path.

A background thread polls the folder's file stamps (and wakes at once on a
reload request, e.g. SIGHUP). A changed folder is loaded whole by
``load_contracts`` once it has held still for a whole poll, and only if it
held still while it was read (see ``Settling``); a refused set is logged and
counted and the processor keeps deciding with the set it has. The processor's
loop takes a loaded set between batches, so no proposal is ever decided by
half of one set and half of another. The processor's first read, at start, is
held to the same (``load_settled``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from processor.contracts.registry import (
    ContractError,
    ContractSet,
    Problem,
    contract_files,
    contract_tree,
    load_contracts,
)
from processor.metrics import Metrics

logger = logging.getLogger(__name__)

T = TypeVar("T")

Stamp = tuple[tuple[str, int, int, int, int], ...]
"""(name, inode, size, mtime, ctime) of each file. The inode changes when a file is
replaced by a rename, and the ctime on every write: a copy that keeps its mtime
(``cp -p``, ``rsync -a``, ``tar``) still changes the stamp."""

MISSING = (-1, -1, -1, -1)
UNLISTABLE = (-2, -2, -2, -2)
"""The stamp of a folder that cannot be listed: its files are not known, but the folder
is, so that it is read (and refused) once, and read again once it can be listed."""
UNREAD: Stamp = (("", *MISSING),)
"""What is taken before the first read: no folder's stamp (no file's name is empty), so
the first read waits for the files to hold still as a change does."""
FIRST_READ_POLLS = 15
"""How many polls the first read waits, at most, for the files to hold still (30 s at
the default ``contracts_poll_s``). A deploy is done writing within a few; files still
changing after that are written by something that does not stop, and the processor
refuses to start rather than decide with whatever it caught of them (its orchestrator
starts it again, as after any refused start)."""


def file_stamps(files: Iterable[tuple[str, Path]]) -> Stamp:
    """The stamp of each (name, path); a file that is gone or cannot be looked at is
    ``MISSING``."""
    out = []
    for name, path in files:
        try:
            st = path.stat()
        except OSError:
            out.append((name, *MISSING))
        else:
            out.append((name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)


def folder_stamp(directory: Path) -> Stamp:
    """The stamp of every contract file ``load_contracts`` would read: changes whenever a
    file does."""
    files, unlisted = contract_files(directory)
    stamps = file_stamps((str(p.relative_to(directory)), p) for p in files)
    kept = tuple(s for s in stamps if s[1:] != MISSING)  # a file removed while we looked
    return kept + tuple((p.file + "/", *UNLISTABLE) for p in unlisted)


class Settling:
    """When changed files may be read, and whether a read saw one version of them.

    A writer that is not done (a copy, ``git checkout``, ``rsync --inplace``) can
    leave a prefix that still parses: a contract without its ``semantics``, a policy
    cut after ``tenants:``. So a change is read only once the stamp has stayed the
    same from one poll to the next, and what was read counts only if the stamp after
    reading is the one before it; otherwise the files are read again at a later poll.
    """

    def __init__(self, stamp: Callable[[], Stamp], taken: Stamp | None = None) -> None:
        self._stamp = stamp
        self.taken = stamp() if taken is None else taken
        """The stamp of what the processor decides with, or of what it last refused."""
        self._changed: Stamp | None = None
        """A new stamp seen at the last poll, waiting to be seen again."""

    def due(self, force: bool = False) -> Stamp | None:
        """The stamp to read the files at, or None: nothing changed, or a change is
        still settling. ``force`` (SIGHUP) reads at once."""
        now = self._stamp()
        if not force:
            if now == self.taken:
                self._changed = None
                return None
            if now != self._changed:
                self._changed = now
                return None
        return now

    def held(self, before: Stamp) -> bool:
        """Whether the files kept stamp ``before`` while they were read. If so, what
        was read is taken (loaded or refused) and not read again until it changes;
        if not, it is read again once the files have settled."""
        after = self._stamp()
        if after != before:
            self._changed = after
            return False
        self.taken, self._changed = before, None
        return True


def quiet_for(seconds: float, stamp: Stamp, now_s: float, directory: Path | None = None) -> bool:
    """Whether nothing has changed for ``seconds`` before ``now_s``: no file of ``stamp``
    was written or replaced since (its mtime and ctime), and no folder under
    ``directory`` had a name added, removed or renamed (its ctime). A file that is
    missing or a folder that cannot be listed is not quiet, nor is a time ahead of
    ``now_s`` (a clock that disagrees with the file server's)."""
    since = int((now_s - seconds) * 1e9)
    if any(s[1] < 0 or max(s[3], s[4]) > since for s in stamp):
        return False
    if directory is None:
        return True
    folders, _, unlisted = contract_tree(directory)
    if unlisted:
        return False
    try:
        return all(folder.stat().st_ctime_ns <= since for folder in folders)
    except OSError:
        return False


class StillChanging(OSError):
    """Files that did not hold still for a poll within ``FIRST_READ_POLLS`` polls."""


def read_settled(
    stamp: Callable[[], Stamp],
    load: Callable[[], T],
    poll_s: float,
    quiet: Callable[[Stamp], bool],
    wait: Callable[[float], object],
    give_up: Callable[[], Exception],
) -> tuple[T, Stamp]:
    """A process's first read of files it reloads later, held to what a reload is (see
    ``Settling``): read once the files have stayed the same for a whole poll, and taken
    only if they held while they were read, otherwise read again. Without it, a process
    started while a deploy writes them could run with half of the new files: a version's
    file there and the one that goes with it not yet, a file cut short where it still
    parses. Files that have not changed for a poll already (``quiet``, the usual start)
    are read at once. Returns what ``load`` returned and the stamp it was read at (where
    reloads start from). Raises what ``load`` raised for files that held still, and
    ``give_up()`` if they have not held still within ``FIRST_READ_POLLS`` polls;
    ``wait(poll_s)`` is one poll."""
    settling = Settling(stamp, UNREAD)
    due = settling.due(force=quiet(stamp()))
    polls = 0
    while True:
        if due is not None:
            try:
                loaded: T | Exception = load()
            except Exception as exc:
                # What a read found wrong is known only of files that held still (a file
                # cut short fails to parse as often as not).
                loaded = exc
            if settling.held(due):
                if isinstance(loaded, Exception):
                    raise loaded
                return loaded, due
            logger.info("files changed while being read; reading them again")
        if polls == FIRST_READ_POLLS:
            raise give_up()
        wait(poll_s)
        polls += 1
        due = settling.due()


def load_settled(
    directory: Path,
    poll_s: float,
    wait: Callable[[float], object] = time.sleep,
    clock: Callable[[], float] = time.time,
) -> tuple[ContractSet, Stamp]:
    """The processor's first read of the contract folder (see ``read_settled``): a
    processor started while a deploy writes the folder does not decide with half of the
    new set. Files still changing after ``FIRST_READ_POLLS`` polls are a refused set
    (``ContractError``)."""
    directory = Path(directory)

    def give_up() -> Exception:
        problem = (f"the files did not hold still for a poll ({poll_s:g} s) within "
                   f"{FIRST_READ_POLLS} polls: still being written")  # fmt: skip
        return ContractError([Problem(str(directory), "/", problem)])

    return read_settled(
        lambda: folder_stamp(directory),
        lambda: load_contracts(directory),
        poll_s,
        lambda stamp: quiet_for(poll_s, stamp, clock(), directory),
        wait,
        give_up,
    )


class ContractWatcher:
    def __init__(
        self,
        directory: Path,
        current: ContractSet,
        metrics: Metrics,
        poll_s: float,
        requested: threading.Event | None = None,
        stamp: Stamp | None = None,
    ) -> None:
        """``stamp``: the folder's stamp from before ``current`` was read (default: now),
        so that a change made while it was read is noticed."""
        self.directory = Path(directory)
        self.current_fingerprint = current.fingerprint
        self.metrics = metrics
        self.poll_s = poll_s
        self.requested = requested or threading.Event()
        self._settling = Settling(lambda: folder_stamp(self.directory), stamp)
        self._pending: ContractSet | None = None
        self.forced = 0
        """How many forced checks (SIGHUP) the watcher has made: the processor reads its
        keys, policy and approvers at once after each too, since it is the one signal an
        operator who revoked a key has to say "now"."""
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
        """Load the folder again once a change has settled (or at once if ``force``)."""
        if force:
            self.forced += 1
        stamp = self._settling.due(force)
        if stamp is None:
            return
        try:
            loaded: ContractSet | ContractError = load_contracts(self.directory)
        except ContractError as exc:
            loaded = exc
        except Exception as exc:
            # A defect met on some file rather than a problem found in it: refused as a bad
            # set is (counted, and not read again until the files change), instead of
            # escaping to the watch loop, which retried it at every poll and counted nothing.
            logger.exception("contract reload failed on an unexpected error")
            loaded = ContractError([Problem("", "/", f"unexpected {type(exc).__name__}: {exc}")])
        if not self._settling.held(stamp):
            if force:
                self.metrics.contract_reloads.labels("refused").inc()
                logger.error("contract reload refused: files changed while being read; "
                             "still deciding with %s", self.current_fingerprint)  # fmt: skip
            else:
                logger.info("contract files changed while being read; reading them again")
            return
        if isinstance(loaded, ContractError):
            self.metrics.contract_reloads.labels("refused").inc()
            logger.error("contract reload refused; still deciding with %s\n%s",
                         self.current_fingerprint, loaded)  # fmt: skip
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
