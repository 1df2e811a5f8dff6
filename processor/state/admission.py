"""Idempotency, rate limits, budgets and the loop guard, decided in Redis a batch at a time.

A batch's items go to Redis as one script call per tenant (``admission.lua``), all
in one pipeline: one round trip per batch, whatever its size, and every key under
the tenant's ``{tenant}`` hash tag, so a Redis Cluster can serve it.

- **Rate limits** are GCRA (the generic cell rate algorithm) per tenant and tool:
  one theoretical-arrival time per key instead of a window of timestamps, so a
  check is O(1) in time and memory, bursts up to the contract's ``max_requests``
  pass at once, and a refusal carries an exact retry-after. A sliding-window log
  would keep one entry per call in the window.
- **Budgets** per run: a step cap (every proposal of a verified principal counts,
  refused ones included; an unverified one spends nothing; a parked call resubmitted
  with its approvals goes on the step its park took),
  calls per budget group, a cost cap; per tenant and UTC day: a cost cap.
- **The loop guard**: the same signature (tool and canonical arguments) may be
  allowed ``repeats`` times per run. **The repair guard**: a run that proposes the
  same invalid call twice, or needs more than ``repairs`` repairs, is stopped.
- **Idempotency records**: PENDING → COMPLETED, FAILED_RETRYABLE, FAILED_FINAL,
  EXPIRED, COMPENSATED. The same key with another payload is a signature mismatch
  (fail closed); a PENDING key is in flight until its deadline plus a grace period,
  after which it may be retried (the executor never starts a call past its
  deadline, so by then nothing can still be running it); a final key answers with
  its cached result and nothing is routed again.

Storage: records live in one hash per tenant and expiry day
(``<ns>:{T}:idem:<day>``, field: the key), a run's counters in one hash per tenant
and day of last use (``<ns>:{T}:runs:<day>``), so a batch costs a handful of Redis
commands, not a few per call. A record is kept at least its TTL (at most
``HORIZON_DAYS``) and at most a day longer.

Replay safety: each verdict is stored under its input record's position, in one
hash per tenant, until the batch's Kafka transaction commits (``forget`` then
removes them, so memory stays flat); a batch applied again after an aborted
transaction gets the same verdicts and nothing moves twice.
"""

from __future__ import annotations

import base64
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from processor.state.connection import LuaScript, RedisClient, run_scripts, tenant_tag

_SCRIPT = LuaScript((Path(__file__).with_name("admission.lua")).read_text())
RUN_TTL_MS = 24 * 3600 * 1000
"""How long a run's counters outlive its last proposal."""

Item = dict[str, Any]
"""One script input: ``kind`` (call, step, result, release, void), ``pos`` and the kind's
fields."""
Verdict = dict[str, Any]

# Every optional field is always sent: a missing one would read as nil in Lua, not null.
_CALL_FIELDS = ("pos", "run", "tool", "group", "cost", "sig", "now", "rate", "steps",
                "class_budget", "cost_cap", "day_cap", "day", "repeats", "ikey", "hash",
                "call", "deadline", "grace", "ttl", "park", "grant", "exempt")  # fmt: skip


def rate_of(window_sec: int, max_requests: int) -> tuple[int, int] | None:
    """A contract's ``max_requests`` per ``window_sec`` as GCRA (interval_ms, burst)."""
    if max_requests <= 0 or window_sec <= 0:
        return None
    return max(1, window_sec * 1000 // max_requests), max_requests


class TenantTag(str):
    """A tenant known by its ``{hash tag}`` alone (a predecessor's replay marker names no
    tenant id): stands for a tenant id in the items ``AdmissionStore.apply`` takes."""


def _tag_of(tenant: str) -> str:
    return tenant if type(tenant) is TenantTag else tenant_tag(tenant)


@dataclass(frozen=True, slots=True)
class Redelivery:
    """A failure after committed steps held for a later attempt of its call, which was
    then given back without running (see admission.lua, redeliver_held): its record goes
    back on ``tool.results`` as it came, where it settles the key and answers its proposal."""

    tenant: str
    at: str
    """The position whose decision gave the later attempt back."""
    state: str
    """The state the held failure reported."""
    of: str
    """The held result's own position."""
    key: bytes | None
    value: bytes


def held_record(topic: str, partition: int, offset: int, key: bytes | None, value: bytes) -> str:
    """A result's record as admission keeps it while its failure is held (see
    ``Redelivery``): JSON, which the script embeds as it is."""
    return orjson.dumps({
        "of": f"{topic}/{partition}/{offset}",
        "k": None if key is None else base64.b64encode(key).decode(),
        "v": base64.b64encode(value).decode(),
    }).decode()  # fmt: skip


def _redeliveries(tenant: str, raw: bytes | str) -> list[Redelivery]:
    out = []
    for at, held in orjson.loads(raw):
        for h in held:
            r = h["r"]
            key = None if r["k"] is None else base64.b64decode(r["k"])
            out.append(Redelivery(tenant, at, h["s"], r["of"], key, base64.b64decode(r["v"])))
    return out


class AdmissionStore:
    def __init__(self, client: RedisClient, ns: str = "ts", run_ttl_ms: int = RUN_TTL_MS) -> None:
        self.client = client
        self.ns = ns
        self.run_ttl_ms = run_ttl_ms
        self._redeliveries: list[Redelivery] = []
        self._redelivered_at: dict[str, set[str]] = defaultdict(set)
        """Positions whose replay markers include held failures delivered again, by
        tenant tag: forgotten with them."""
        self._replaying: dict[str, str] = {}
        """The position of every call this store was asked to admit in a batch not known
        to have committed, and of every marker a predecessor left above its partition's
        committed offset (see ``forget_committed``), with its tenant's tag: where a call
        may have been admitted in a transaction that aborted (see ``call_waiting_at``)."""

    def take_redeliveries(self) -> list[Redelivery]:
        """The held failures the calls since the last take delivered again (see
        ``Redelivery``), each once: a decision's replay delivers its own again."""
        taken, self._redeliveries = self._redeliveries, []
        seen: set[tuple[str, str, str]] = set()
        out = []
        for r in taken:
            if (r.tenant, r.at, r.of) not in seen:
                seen.add((r.tenant, r.at, r.of))
                out.append(r)
        return out

    def _base(self, tenant: str) -> str:
        return f"{self.ns}:{_tag_of(tenant)}"

    def apply(
        self, items: list[tuple[str, Item]], forget: list[tuple[str, Item]] | None = None
    ) -> list[Verdict]:
        """Verdicts in input order; one script call per tenant, one round trip in all.

        ``forget``: items of batches that have committed since; their replay markers are
        dropped in the same round trip."""
        if not items:
            if forget:
                self.forget(forget)
            return []
        segments = _segments(items)
        now_ms = int(time.time() * 1000)
        for _, header, _ in segments:
            header.setdefault("now", now_ms)  # a segment of results only
            header.setdefault("max_repairs", 0)  # a segment without refused proposals
            if header.get("day_cap") is None:
                header["day_cap"] = -1  # JSON null would read as a table in Lua
            header["horizon_days"] = HORIZON_DAYS
        for tenant, item in items:
            if item["kind"] == "call":  # (before the round trip: its answer may be lost)
                self._replaying[item["pos"]] = _tag_of(tenant)
        pipe = self.client.pipeline(transaction=False)
        n_forget = self._queue_forget(pipe, forget or [])
        calls = [
            (
                [self._base(tenant)],
                [
                    orjson.dumps(header),
                    orjson.dumps([_wire(items[i][1]) for i in owners]),
                    self.run_ttl_ms,
                ],
            )
            for tenant, header, owners in segments
        ]
        out: list[Verdict] = [{} for _ in items]
        replies = run_scripts(self.client, _SCRIPT, calls, pipe)[n_forget:]
        self._forgotten(forget or [])
        for (tenant, _, owners), reply in zip(segments, replies, strict=True):
            # (the verdicts, then the held failures delivered again: see admission.lua)
            for i, text in zip(owners, reply[:-1], strict=True):
                out[i] = parse_verdict(text)
            again = _redeliveries(tenant, reply[-1])
            if again:
                self._redeliveries += again
                self._redelivered_at[_tag_of(tenant)].update(r.at for r in again)
        return out

    def apply_one_by_one(self, items: list[tuple[str, Item]]) -> list[Verdict]:
        """The same decisions, one round trip per item: the baseline the batched path
        is measured against."""
        verdicts: list[Verdict] = []
        for item in items:
            verdicts.extend(self.apply([item]))
        return verdicts

    def forget(self, items: list[tuple[str, Item]]) -> None:
        """Drop the replay markers of a batch whose transaction committed."""
        if not items:
            return
        pipe = self.client.pipeline(transaction=False)
        self._queue_forget(pipe, items)
        pipe.execute()
        self._forgotten(items)

    def call_waiting_at(self, pos: str) -> TenantTag | None:
        """The tenant of a call that may have been admitted at input position ``pos`` in a
        batch whose transaction then aborted (this store admitted one there and has not
        seen its batch commit, or a predecessor's marker waits there), known by its tag;
        None where none may be. A record decided there again that asks nothing of
        admission (its token no longer verifies, or it no longer reads as a proposal)
        withdraws under that tenant (see ``withdraw_item``); elsewhere it costs Redis
        nothing, so unverified traffic does not."""
        tag = self._replaying.get(pos)
        return None if tag is None else TenantTag(tag)

    def forget_committed(self, committed: dict[tuple[str, int], int]) -> int:
        """Drop every replay marker of a position below its partition's committed offset.

        ``committed``: every partition assigned, with its committed offset (negative where
        none is). Markers normally go with the round trip after their batch commits; a
        processor that dies between its commit and its next batch leaves them behind.
        Whoever is assigned the partition next calls this: those batches have committed
        and will never be decided again. Returns how many markers went. Those at or above
        the committed offset are of batches that did not commit, decided again now: their
        positions are noted (see ``may_hold_call``), and nothing else is.

        What this store kept of the positions of its deliveries again (see
        ``_queue_forget``) goes too. A rebalance revokes every partition, and a batch in
        flight commits or aborts, before any is assigned: those of a batch that committed
        go from Redis here, or where their partition is assigned now; those of one that
        did not are decided again, and their replay returns them again. Otherwise a batch
        that aborted, then was committed by whoever took its partition, would leave its
        positions here for as long as this processor runs."""
        removed = 0
        replaying: dict[str, str] = {}
        for key in [
            *self.client.scan_iter(match=f"{self.ns}:{{*}}:done", count=1000),
            *self.client.scan_iter(match=f"{self.ns}:{{*}}:redeliver", count=1000),
        ]:
            name = key.decode()
            tag = name[len(self.ns) + 1 : name.rindex(":")]
            stale = []
            for field in self.client.hkeys(key):
                pos = field.decode()
                topic, partition, offset = pos.rsplit("/", 2)
                upto = committed.get((topic, int(partition)))
                if upto is None:
                    continue  # (a partition not assigned here)
                if int(offset) < upto:
                    stale.append(field)
                elif name.endswith(":done"):
                    replaying[pos] = tag
            for first in range(0, len(stale), 1000):
                removed += int(self.client.hdel(key, *stale[first : first + 1000]))
        self._redelivered_at.clear()
        self._replaying = replaying
        return removed

    def _queue_forget(self, pipe: Any, items: list[tuple[str, Item]]) -> int:
        by_tenant: dict[str, list[str]] = defaultdict(list)
        for tenant, item in items:
            by_tenant[tenant].append(item["pos"])
        by_tag: dict[str, list[str]] = defaultdict(list)
        for tenant, positions in by_tenant.items():  # (a tag once per tenant, not per item)
            by_tag[_tag_of(tenant)] += positions
        queued = 0
        for tag, positions in by_tag.items():
            pipe.hdel(f"{self.ns}:{tag}:done", *positions)
            queued += 1
            redelivered = self._redelivered_at.get(tag)
            if redelivered and (gone := redelivered.intersection(positions)):
                pipe.hdel(f"{self.ns}:{tag}:redeliver", *gone)
                queued += 1
        return queued

    def _forgotten(self, items: list[tuple[str, Item]]) -> None:
        """Let go of ``items``' positions as holding deliveries again, once the round trip
        that dropped their markers has answered: one that failed is made again with the
        same items, and must drop their deliveries too. Their batches committed: they will
        not be decided again."""
        if self._replaying:
            for tenant, item in items:
                if self._replaying.get(item["pos"]) == _tag_of(tenant):
                    del self._replaying[item["pos"]]
        if not self._redelivered_at:
            return
        for tenant, item in items:
            tag = _tag_of(tenant)
            redelivered = self._redelivered_at.get(tag)
            if redelivered is not None:
                redelivered.discard(item["pos"])
                if not redelivered:
                    del self._redelivered_at[tag]

    def run_counters(self, tenant: str, run: str, now_ms: int | None = None) -> dict[str, float]:
        """steps, class:<group>, cost, sig:<signature>, repairs, bad:<signature> of a run."""
        today = _day(now_ms)
        for day in (today, today - 1):
            raw = self.client.hget(f"{self._base(tenant)}:runs:{day}", run)
            if raw:
                return {k: float(v) for k, v in orjson.loads(raw).items()}
        return {}

    def record(self, tenant: str, key: str, now_ms: int | None = None) -> dict[str, str]:
        """An idempotency record's fields (empty when there is none), values as text."""
        [raw] = self._records([(tenant, key)], now_ms)
        return {_RECORD_FIELDS[k]: str(v) for k, v in (raw or {}).items() if v != ""}

    def _records(
        self, keys: list[tuple[str, str]], now_ms: int | None
    ) -> list[dict[str, Any] | None]:
        """The stored records of (tenant, idempotency key) pairs, in one round trip: each
        from the first day's hash that holds it (see admission.lua, idem_bucket)."""
        today, span = _day(now_ms), HORIZON_DAYS + 1
        pipe = self.client.pipeline(transaction=False)
        for tenant, key in keys:
            for day in range(today, today + span):
                pipe.hget(f"{self._base(tenant)}:idem:{day}", key)
        replies = pipe.execute()
        out: list[dict[str, Any] | None] = []
        for n in range(len(keys)):
            raw = next((r for r in replies[n * span : (n + 1) * span] if r), None)
            out.append(orjson.loads(raw) if raw is not None else None)
        return out

    def day_cost(self, tenant: str, day: str) -> float:
        return float(self.client.hget(f"{self._base(tenant)}:day:{day}", "cost") or 0)


HORIZON_DAYS = 8
"""Idempotency records are kept at most this many days (contracts' TTLs are clamped)."""

SETTLED_TTL_MS = 7 * 86_400_000
"""A record is kept at least this long, settled or waiting for its result (longer if its
contract's TTL says so; admission.lua caps every record at its horizon). A short TTL only
shortens how long a completed call's answer is replayed, never loses a result: one that
comes late (an executor or Redis down for hours) still finds its call's record."""


def _day(now_ms: int | None) -> int:
    return int((time.time() * 1000 if now_ms is None else now_ms) // 86_400_000)


_RECORD_FIELDS = {
    "s": "state", "h": "hash", "n": "tool", "nv": "version", "c": "call", "d": "deadline",
    "w": "awaiting", "a": "attempt", "r": "run", "t": "grant", "x": "result",
    "g": "digest", "xa": "result_attempt", "k": "compensation", "kh": "compensation_hash",
    "kt": "compensation_tool", "kf": "compensation_failed", "v": "cached",
    "p": "parked_took", "q": "parked_at", "pd": "parked_until", "e": "request_ended",
    "rp": "released_took", "rq": "released_at", "i": "request", "l": "unseen_ends",
    "u": "unrouted", "o": "stale_results", "ua": "missed_attempts",
}  # fmt: skip
"""An idempotency record's JSON keys (short: one is written per call) and their names."""

_CONSTANTS = ("now", "day", "steps", "repeats", "grace", "cost_cap", "day_cap")
"""What every call of a tenant's batch shares (one policy, one clock): sent once."""


def _segments(items: list[tuple[str, Item]]) -> list[tuple[str, dict[str, Any], list[int]]]:
    """Items grouped by tenant, in order, with the header their script call shares.

    A tenant's items whose shared values differ (never in the processor: one policy and
    one clock per batch) start a new segment, in order, so nothing is decided with
    another item's limits."""
    segments: list[tuple[str, dict[str, Any], list[int]]] = []
    current: dict[str, tuple[str, dict[str, Any], list[int]]] = {}
    for i, (tenant, item) in enumerate(items):
        seg = current.get(tenant)
        if seg is None or not _fits(seg[1], item):
            seg = (tenant, {"classes": {}, "tools": {}}, [])
            segments.append(seg)
            current[tenant] = seg
        _absorb(seg[1], item)
        seg[2].append(i)
    return segments


def _fits(header: dict[str, Any], item: Item) -> bool:
    kind = item["kind"]
    if kind == "call":
        if any(k in header and header[k] != item[k] for k in _CONSTANTS):
            return False
        if header["classes"].get(item["group"], item["class_budget"]) != item["class_budget"]:
            return False
        tool = header["tools"].get(item["tool"])
        return tool is None or tool == _tool(item)
    if kind == "step" and not all(
        header.get(k, item[k]) == item[k] for k in ("steps", "max_repairs")
    ):
        return False
    return "now" not in item or header.get("now", item["now"]) == item["now"]


def _tool(item: Item) -> list[Any]:
    interval, burst = item["rate"] or (0, 0)
    return [item["cost"], interval, burst, item["ttl"], 1 if item["exempt"] else 0]


def _absorb(header: dict[str, Any], item: Item) -> None:
    kind = item["kind"]
    if kind == "call":
        for k in _CONSTANTS:
            header[k] = item[k]
        header["classes"][item["group"]] = item["class_budget"]
        header["tools"][item["tool"]] = _tool(item)
    elif kind == "step":
        header["steps"] = item["steps"]
        header["max_repairs"] = item["max_repairs"]
    if "now" in item:
        header["now"] = item["now"]


def _wire(item: Item) -> list[Any]:
    """An item as the positional list the script reads (see admission.lua, unwire)."""
    kind = item["kind"]
    if kind == "call":
        return [1, item["pos"], item["run"], item["tool"], item["group"], item["sig"],
                item["ikey"], item["hash"], item["call"], item["deadline"],
                1 if item["park"] else 0, item["grant"], item.get("approvals") or "",
                item.get("approvals_ttl", 0), item.get("rid") or "",
                item.get("version") or ""]  # fmt: skip
    if kind == "step":
        return [2, item["pos"], item["run"], item["sig"], 1 if item["repair"] else 0,
                item.get("ikey", ""), item.get("hash", ""), item.get("comp", ""),
                item.get("comp_hash", ""), item.get("tool", "")]  # fmt: skip
    if kind == "result":
        return [3, item["pos"], item["ikey"], item["call"], item["result_id"], item["state"],
                item["cached"], item["ttl"], item["compensation_key"] or "",
                item["compensates"] or "", item.get("compensation_hash") or "",
                item.get("compensation_tool") or "", item.get("cached_unsigned") or "",
                item.get("attempt", 0), item.get("tool") or "", item.get("hash") or "",
                item.get("run") or "", item.get("version") or "",
                1 if item.get("committed") else 0, item.get("cached_held") or "",
                item.get("digest") or "", item.get("record") or ""]  # fmt: skip
    if kind == "void":
        return [5, item["pos"], item["ikey"], item["call"], item["ttl"], item["of"],
                1 if item.get("released") else 0]  # fmt: skip
    if kind == "comp_failed":
        return [6, item["pos"], item["comp"]]
    if kind == "lapse":
        return [7, item["pos"], item["ikey"], item["hash"], item["deadline"],
                item.get("rid") or "", item.get("attempt") or "",
                item.get("call") or ""]  # fmt: skip
    if kind == "withdraw":
        return [8, item["pos"], item["run"]]
    return [4, item["pos"], item["run"], item["ikey"], item["hash"], item["call"],
            item["deadline"], item["ttl"], item.get("parked_until") or "",
            item.get("rid") or "", item.get("attempt") or "",
            item.get("version") or ""]  # fmt: skip


def parse_verdict(raw: bytes | str) -> Verdict:
    """A verdict string from the script (see admission.lua, encode) as a dict."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    head, _, rest = text.partition("|")
    if head == "ok":
        return {"ok": True, "attempt": int(rest)} if rest and rest != "0" else {"ok": True}
    if head == "no":
        why, _, wait = rest.partition("|")
        return {"ok": False, "why": why, "retry_after_ms": int(wait or 0)}
    if head == "hit":
        state, length, tail = rest.split("|", 2)
        if length.startswith("#") and length[1:].isdigit():
            n = int(length[1:])  # Lua's # counts bytes
            data = tail.encode()
            raw_call, cached = data[:n].decode(), data[n + 1 :].decode()
        else:  # a replay marker an earlier version wrote: hit|<state>|<call>|<cached>
            raw_call, _, cached = f"{length}|{tail}".partition("|")
        return {"ok": False, "why": "idempotent_hit", "state": state, "call": raw_call,
                "cached": cached}  # fmt: skip
    if head == "settled":
        what, _, value = rest.partition("|")
        if what == "grant":
            return {"status": "settled", "grant": value}
        if what == "unsigned":
            return {"status": "settled", "unsigned": True}
        if what == "compensated":
            return {"status": "settled", "compensated": value}
        if what == "held":
            return {"status": "settled", "held": True}
        return {"status": "settled"}
    if head == "stale":
        return {"status": "stale", "state": rest}
    if head == "conflict":
        state, _, first = rest.partition("|")
        return {"status": "conflict", "state": state, "result": first}
    return {"status": head}


def call_item(**fields: Any) -> Item:
    """A ``call`` item; raises if a field is missing, so Lua never sees a nil."""
    if not fields.keys() >= _CALL_FIELD_SET:  # one set comparison per call on the hot path
        raise ValueError(f"call item without {sorted(_CALL_FIELD_SET - fields.keys())}")
    return {"kind": "call", **fields}


_CALL_FIELD_SET = frozenset(_CALL_FIELDS)


def comp_failed_item(compensation_key: str, pos: str) -> Item:
    """The compensating call proposed under ``compensation_key`` was refused by a gate
    (decided at input position ``pos``): its original's record says so from now on, so a
    retry of the original is answered COMPENSATION_FAILED (see admission.lua, hit).
    Idempotent, so it keeps no replay marker."""
    return {"kind": "comp_failed", "pos": "compfail:" + pos, "comp": compensation_key}


def lapse_item(entry: dict[str, Any], pos: str, now_ms: int) -> tuple[str, Item]:
    """A parked call whose approval request ended without it going (declined, expired, or
    refused when released), from its request's ``entry``, decided at input position
    ``pos`` at ``now_ms``: what it took when it was parked is given back, once, unless a
    resubmission carrying approvals took its key over ("moved_on" when it was this very
    proposal sent again, "superseded" when another), or the parked call was given back
    already, its position decided again as something else ("given_back"; see
    admission.lua, lapse). Only this request's park is ended: the key may hold another
    request's since."""
    first, attempt = park_identity(entry)
    return str(entry["tenant_id"]), {
        "kind": "lapse",
        # (the approval record's own position: it ends one request or releases one call,
        # never both, and forget_committed reads plain positions)
        "pos": pos,
        "now": now_ms,
        "ikey": str(entry["idempotency_key"]),
        "hash": str(entry["payload_hash"]),
        "deadline": entry["expires_at"],
        "rid": first,
        "attempt": attempt,
        "call": str(entry.get("proposal_id") or ""),
    }


FIRST_REQUEST_ID = "first_request_id"
ATTEMPT = "attempt"
"""Keys of a parked entry (see approval_flow.parked_entry): the request id its call was
first parked under, and the attempt it was parked as. Together they name the request
in the idempotency record (admission.lua, holds): the request id itself follows from
the attempt (confirmation.reissue), which the script decides."""


def park_identity(entry: dict[str, Any]) -> tuple[str, int]:
    """The (first request id, attempt) a parked ``entry`` names; ("", 0) for one parked
    by an earlier version, which kept neither: its end is matched by its deadline, as it
    was."""
    first, attempt = entry.get(FIRST_REQUEST_ID), entry.get(ATTEMPT)
    if isinstance(first, str) and first and isinstance(attempt, int) and attempt >= 1:
        return first, attempt
    return "", 0


def withdraw_item(tenant: str, pos: str, run: str, now_ms: int) -> tuple[str, Item]:
    """The record at input position ``pos`` (a proposal of ``run``; "" where it no longer
    reads as one) asks nothing of admission this time: a call admitted there before, in a
    transaction that aborted, gives back what it took (see admission.lua, withdraw). Cheap
    where there is none: the script reads every item's marker in one command, and writes
    nothing for such a position."""
    return tenant, {"kind": "withdraw", "pos": pos, "run": run, "now": now_ms}


def void_item(item: Item) -> Item | None:
    """Undo what admitting the call ``item`` left waiting, for a record that then failed
    alone on a defect: its key's record, if this position took it and it is still PENDING,
    becomes FAILED_RETRYABLE (nothing ran), and the position's verdict a refusal (see
    admission.lua, void). So for a ``release`` item, whose approval record failed so: the
    call it released was never routed, and what parking it took is given back (see
    admission.lua, void_release). None for other kinds."""
    if item["kind"] not in ("call", "release"):
        return None
    void = {"kind": "void", "pos": "void:" + item["pos"], "ikey": item["ikey"],
            "call": item["call"], "ttl": item["ttl"], "of": item["pos"]}  # fmt: skip
    if item["kind"] == "release":
        void["released"] = True
    if "now" in item:  # the clock its record was written under
        void["now"] = item["now"]
    return void
