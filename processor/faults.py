"""Fault injection for crash tests: kill the process at a named point of the loop.

``TOOLSENTRY_FAULT_POINT=<point>:<probability>`` (read once, at import) makes
``point(<point>)`` send SIGKILL to this process with that probability. Points:
``after_redis`` (the batch's Redis effects are applied, nothing produced yet) and
``before_commit`` (outputs produced, transaction not committed). Unset, ``point``
is a dictionary lookup and nothing else.

Before the kill, ``fault point <point>: SIGKILL`` is written straight to stderr
(unbuffered, so it survives the kill): a crash test can tell which point killed the
process, which its exit status (-9, as for any SIGKILL) does not say.

``TOOLSENTRY_FAULT_POISON=<marker>`` makes ``poison(values)`` raise, as a defect would,
when one of the batch's record values contains the marker: a test of what the loop
does with a record it cannot decide. Unset, ``poison`` returns at once.
``TOOLSENTRY_FAULT_POISON_ENCODING=<marker>`` does the same for ``poison_encoding(value)``,
called while a decided record's outputs are encoded.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterable

_SPEC = os.environ.get("TOOLSENTRY_FAULT_POINT", "")
_POINTS: dict[str, float] = {}
for part in filter(None, _SPEC.split(",")):
    name, _, chance = part.partition(":")
    _POINTS[name.strip()] = float(chance or 1.0)
_POISON = os.environ.get("TOOLSENTRY_FAULT_POISON", "").encode()
POISON_ENCODING = os.environ.get("TOOLSENTRY_FAULT_POISON_ENCODING", "").encode()
"""The encoding marker; empty (false) when unset, so callers skip the call per record."""


class Poisoned(RuntimeError):
    """Raised by ``poison``: stands for any defect a record triggers."""


def point(name: str) -> None:
    chance = _POINTS.get(name)
    if chance is not None and random.random() < chance:
        os.write(2, f"fault point {name}: SIGKILL\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)


def poison(values: Iterable[bytes | None]) -> None:
    if _POISON and any(v is not None and _POISON in v for v in values):
        raise Poisoned("fault poison: a record carries the marker")


def poison_encoding(value: bytes | None) -> None:
    if POISON_ENCODING and value is not None and POISON_ENCODING in value:
        raise Poisoned("fault poison: a record carries the encoding marker")
