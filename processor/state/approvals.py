"""Parked calls and spent approvals, in Redis, replay-safe.

Redis writes are not part of the Kafka transaction, so every effect is keyed
by the input record that caused it (``topic/partition/offset``). When a batch
is decided again after an aborted transaction or a crash, the script sees its
own earlier effect and answers as it did the first time, instead of calling
the approval "reused" or the call "already released". That is what lets a
release be re-emitted by the retried transaction, exactly once in the output.

Keys share the ``{tenant}`` hash tag and one script runs per tenant per
batch, so the whole thing works on Redis Cluster:

- ``<ns>:{T}:park:<request_id>``: the parked call and its approval state (JSON);
- ``<ns>:{T}:parkexp``: parked requests by expiry time, for the expiry sweeper;
- ``<ns>:{T}:apr:<approval_id>``: which input record spent that approval;
- ``<ns>:park:tenants``: tenants that have parked calls (the sweeper's index).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import orjson
import redis

logger = logging.getLogger(__name__)


def tenants_key(ns: str) -> str:
    return f"{ns}:park:tenants"


_RETAIN_MS = 24 * 3600 * 1000
"""How long an ended request stays readable (``approvals show``) after its expiry."""

_SCRIPT = r"""
local base = KEYS[1]
local ops = cjson.decode(ARGV[1])
local out = {}

local function load(rid)
  local raw = redis.call('GET', base .. ':park:' .. rid)
  if raw then return cjson.decode(raw) end
  return nil
end

local function save(rid, e)
  redis.call('SET', base .. ':park:' .. rid, cjson.encode(e), 'KEEPTTL')
end

local function spent_by_other(ids, pos)
  for _, id in ipairs(ids) do
    local by = redis.call('GET', base .. ':apr:' .. id)
    if by and by ~= pos then return id end
  end
  return nil
end

local function spend(ids, pos, ttl)
  for _, id in ipairs(ids) do
    redis.call('SET', base .. ':apr:' .. id, pos, 'PX', ttl)
  end
end

local function finish(rid, e, state, pos)
  e.state = state
  e.ended_by = pos
  save(rid, e)
  redis.call('ZREM', base .. ':parkexp', rid)
end

for i, op in ipairs(ops) do
  local kind = op.op
  if kind == 'consume' then
    local bad = spent_by_other(op.ids, op.pos)
    if bad then
      out[i] = {'reused', bad}
    else
      spend(op.ids, op.pos, op.ttl)
      out[i] = {'ok'}
    end
  elseif kind == 'park' then
    local e = load(op.rid)
    if e == nil then
      local entry = op.entry
      entry.state = 'parked'
      entry.parked_by = op.pos
      entry.approvers = {}
      redis.call('SET', base .. ':park:' .. op.rid, cjson.encode(entry), 'PX', op.ttl)
      redis.call('ZADD', base .. ':parkexp', entry.expires_at, op.rid)
      out[i] = {'parked'}
    elseif e.parked_by == op.pos then
      out[i] = {'parked'}
    else
      out[i] = {'exists', e.state}
    end
  elseif kind == 'decide' or kind == 'expire' then
    local e = load(op.rid)
    if e == nil then
      out[i] = {'unknown'}
    elseif e.state ~= 'parked' then
      if e.ended_by == op.pos then
        out[i] = {e.state, cjson.encode(e)}
      else
        out[i] = {'ended', cjson.encode(e)}
      end
    elseif kind == 'expire' then
      if op.now >= e.expires_at then
        finish(op.rid, e, 'expired', op.pos)
        out[i] = {'expired', cjson.encode(e)}
      else
        out[i] = {'pending', cjson.encode(e)}
      end
    elseif op.now > e.expires_at then
      finish(op.rid, e, 'expired', op.pos)
      out[i] = {'expired', cjson.encode(e)}
    else
      local seen, other = false, false
      for _, a in ipairs(e.approvers) do
        if a.id == op.approver then
          seen = true
          if a.pos ~= op.pos then other = true end
        end
      end
      local bad = spent_by_other({op.approval_id}, op.pos)
      if bad then
        out[i] = {'reused', cjson.encode(e)}
      elseif other and op.decision ~= 'rejected' then
        out[i] = {'duplicate_approver', cjson.encode(e)}
      else
        spend({op.approval_id}, op.pos, op.ttl)
        if op.decision == 'rejected' then
          e.rejected_by = op.approver
          e.reason = op.reason
          finish(op.rid, e, 'rejected', op.pos)
          out[i] = {'rejected', cjson.encode(e)}
        else
          if not seen then
            local a = {id = op.approver, pos = op.pos, approval_id = op.approval_id}
            table.insert(e.approvers, a)
          end
          if #e.approvers >= e.needed then
            finish(op.rid, e, 'released', op.pos)
            out[i] = {'released', cjson.encode(e)}
          else
            save(op.rid, e)
            out[i] = {'pending', cjson.encode(e)}
          end
        end
      end
    end
  else
    out[i] = {'bad_op'}
  end
end
return cjson.encode(out)
"""


def base_key(ns: str, tenant: str) -> str:
    return f"{ns}:{{{tenant}}}"


@dataclass(frozen=True, slots=True)
class OpResult:
    status: str
    detail: str | None = None
    entry: dict[str, Any] | None = None


def _result(raw: list[Any]) -> OpResult:
    status = str(raw[0])
    detail: str | None = None
    entry: dict[str, Any] | None = None
    if len(raw) > 1:
        text = str(raw[1])
        if text.startswith("{"):
            entry = orjson.loads(text)
            if isinstance(entry.get("approvers"), dict):  # cjson writes an empty list as {}
                entry["approvers"] = []
        else:
            detail = text
    return OpResult(status, detail, entry)


class ApprovalStore:
    def __init__(self, client: redis.Redis[bytes], ns: str = "ts") -> None:
        self.client = client
        self.ns = ns
        self._script = client.register_script(_SCRIPT)

    def apply(self, ops: list[tuple[str, dict[str, Any]]]) -> list[OpResult]:
        """Run (tenant, op) pairs: one script call per tenant, all in one round trip.

        Ops of one tenant run in their given order; answers come back in input order."""
        if not ops:
            return []
        by_tenant: dict[str, list[int]] = defaultdict(list)
        for i, (tenant, _) in enumerate(ops):
            by_tenant[tenant].append(i)
        pipe = self.client.pipeline(transaction=False)
        tenants = list(by_tenant)
        for tenant in tenants:
            body = orjson.dumps([ops[i][1] for i in by_tenant[tenant]])
            self._script(keys=[base_key(self.ns, tenant)], args=[body], client=pipe)
        parks = [t for t, op in ops if op["op"] == "park"]
        if parks:
            pipe.sadd(tenants_key(self.ns), *set(parks))
        replies = pipe.execute()
        results: list[OpResult | None] = [None] * len(ops)
        for tenant, reply in zip(tenants, replies, strict=False):
            decoded = orjson.loads(reply)
            if isinstance(decoded, dict):  # cjson: an empty list
                decoded = []
            for i, raw in zip(by_tenant[tenant], decoded, strict=True):
                results[i] = _result(raw)
        return [r if r is not None else OpResult("missing") for r in results]

    def entries(self, keys: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any] | None]:
        """Parked entries by (tenant, request_id), one round trip."""
        if not keys:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for tenant, rid in keys:
            pipe.get(f"{base_key(self.ns, tenant)}:park:{rid}")
        out: dict[tuple[str, str], dict[str, Any] | None] = {}
        for key, raw in zip(keys, pipe.execute(), strict=True):
            entry = orjson.loads(raw) if raw is not None else None
            if entry is not None and isinstance(entry.get("approvers"), dict):
                entry["approvers"] = []
            out[key] = entry
        return out

    def due(self, now_ms: int, limit: int = 200) -> list[tuple[str, str]]:
        """(tenant, request_id) of parked calls past their expiry."""
        out: list[tuple[str, str]] = []
        for raw in self.client.smembers(tenants_key(self.ns)):
            tenant = raw.decode()
            rids = self.client.zrangebyscore(
                f"{base_key(self.ns, tenant)}:parkexp", "-inf", now_ms, start=0, num=limit
            )
            out.extend((tenant, r.decode()) for r in rids)
        return out

    def postpone(self, tenant: str, rid: str, until_ms: int) -> None:
        self.client.zadd(f"{base_key(self.ns, tenant)}:parkexp", {rid: until_ms}, xx=True)

    def list_parked(self, include_ended: bool = False) -> list[dict[str, Any]]:
        """Every parked request (for ``toolsentry approvals list``)."""
        out: list[dict[str, Any]] = []
        for raw in sorted(self.client.smembers(tenants_key(self.ns))):
            tenant = raw.decode()
            for key in self.client.scan_iter(
                match=f"{base_key(self.ns, tenant)}:park:*", count=500
            ):
                value = self.client.get(key)
                if value is None:
                    continue
                entry = orjson.loads(value)
                if include_ended or entry.get("state") == "parked":
                    out.append(entry)
        return sorted(out, key=lambda e: e.get("created_at", 0))

    def find(self, request_id: str) -> dict[str, Any] | None:
        for raw in self.client.smembers(tenants_key(self.ns)):
            value = self.client.get(f"{base_key(self.ns, raw.decode())}:park:{request_id}")
            if value is not None:
                entry: dict[str, Any] = orjson.loads(value)
                if isinstance(entry.get("approvers"), dict):
                    entry["approvers"] = []
                return entry
        return None


def retain_ms(expires_at: int, now_ms: int) -> int:
    return max(expires_at - now_ms, 0) + _RETAIN_MS
