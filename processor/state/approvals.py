"""Parked calls and spent approvals, in Redis, replay-safe.

Redis writes are not part of the Kafka transaction, so every effect is keyed
by the input record that caused it (``topic/partition/offset``). When a batch
is decided again after an aborted transaction or a crash, the script sees its
own earlier effect and answers as it did the first time, instead of calling
the approval "reused" or the call "already released". That is what lets a
release be re-emitted by the retried transaction, exactly once in the output.

Keys share the ``{tenant}`` hash tag and one script runs per tenant per
batch, so the whole thing works on Redis Cluster:

- ``<ns>:{T}:parked``: one hash per tenant, request id -> the parked call's
  payload (JSON). A batch parks all its calls with one HSET per tenant;
- ``<ns>:{T}:park:<request_id>``: the call's approval state, created by the
  first decision about it (no key: still parked);
- ``<ns>:{T}:parkexp``: parked requests by expiry time, for the expiry sweeper;
- ``<ns>:{T}:ended``: ended requests by the time their payload may go, for the
  sweeper's clean-up (an ended request stays readable for a day);
- ``<ns>:{T}:apr:<approval_id>``: which input record spent that approval (a decision
  here, or a proposal carrying it, in admission.lua);
- ``<ns>:park:tenants``: tenants that have parked calls (the sweeper's index). One
  key, so one slot: the sweeper reads it with one SMEMBERS, then every tenant's keys
  in one pipeline, which a cluster client splits by node.

The scripts go through ``run_scripts``, which works on a cluster too (redis-py's
cluster pipeline refuses ``Script`` calls) and reloads a script a node has lost.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import orjson

from processor.state.connection import LuaScript, RedisClient, run_scripts, tenant_tag

logger = logging.getLogger(__name__)


_FIELDS = ("state", "approvers", "rejected_by", "reason")


def tenants_key(ns: str) -> str:
    return f"{ns}:park:tenants"


_RETAIN_MS = 24 * 3600 * 1000
"""How long a spent approval id is remembered after the approval's own expiry."""

_SCRIPT = LuaScript(r"""
local base = KEYS[1]
local ops = cjson.decode(ARGV[1])
local out = {}

-- A parked call: its payload in the tenant's 'parked' hash (written by a plain HSET
-- when the call is parked), its approval state in its own hash from the first
-- decision on (state, ended_by, approvers, rejected_by, reason).
local function park_key(rid) return base .. ':park:' .. rid end

local function state(rid)
  local raw = redis.call('HGET', base .. ':parked', rid)
  if not raw then return nil end
  local entry = cjson.decode(raw)
  local v = redis.call('HMGET', park_key(rid), 'state', 'ended_by', 'approvers')
  return {expires_at = tonumber(entry.expires_at), needed = tonumber(entry.needed),
          state = v[1] or 'parked', ended_by = v[2], approvers = cjson.decode(v[3] or '[]')}
end

local function answer(status, rid)
  local raw = redis.call('HGET', base .. ':parked', rid)
  local v = redis.call('HMGET', park_key(rid), 'state', 'approvers', 'rejected_by', 'reason')
  return {status, raw, v[1] or 'parked', v[2] or '[]', v[3] or '', v[4] or ''}
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

-- A verified decision that changes nothing (its request ended, or its approver counted
-- already) is spent all the same, unless something spent it first: an approval is good
-- for the one request it answers, and once that has ended it must not be attached to
-- another proposal of the same call and run it a second time.
local function burn(id, pos, ttl)
  redis.call('SET', base .. ':apr:' .. id, pos, 'NX', 'PX', ttl)
end

-- A parked call lives until it ends (the expiry sweeper ends the forgotten ones);
-- an ended one stays readable for a day, for audit and `approvals show`.
local function finish(rid, final, pos, now)
  redis.call('HSET', park_key(rid), 'state', final, 'ended_by', pos)
  redis.call('PEXPIRE', park_key(rid), 86400000)
  redis.call('ZREM', base .. ':parkexp', rid)
  redis.call('ZADD', base .. ':ended', now + 86400000, rid)
end

for i, op in ipairs(ops) do
  local kind = op.op
  if kind == 'decide' or kind == 'expire' then
    local e = state(op.rid)
    if e == nil then
      out[i] = {'unknown'}
    elseif e.state ~= 'parked' then
      if kind == 'expire' then
        redis.call('ZREM', base .. ':parkexp', op.rid)  -- re-added by a replayed park
      else
        burn(op.approval_id, op.pos, op.ttl)
      end
      if e.ended_by == op.pos then
        out[i] = answer(e.state, op.rid)
      else
        out[i] = answer('ended', op.rid)
      end
    elseif kind == 'expire' then
      if op.now >= e.expires_at then
        finish(op.rid, 'expired', op.pos, op.now)
        out[i] = answer('expired', op.rid)
      else
        out[i] = answer('pending', op.rid)
      end
    elseif op.now > e.expires_at then
      burn(op.approval_id, op.pos, op.ttl)
      finish(op.rid, 'expired', op.pos, op.now)
      out[i] = answer('expired', op.rid)
    else
      if op.drop and #op.drop > 0 then
        -- Votes (by approval id) the processor no longer trusts (their approver removed,
        -- no longer allowed this class or tenant, or holding another key now): they stop
        -- counting before this one is counted. Dropped again on a replay of this op,
        -- which changes nothing the second time.
        local gone, kept = {}, {}
        for _, id in ipairs(op.drop) do gone[id] = true end
        for _, a in ipairs(e.approvers) do
          if not gone[a.approval_id] then kept[#kept + 1] = a end
        end
        if #kept ~= #e.approvers then
          e.approvers = kept
          redis.call('HSET', park_key(op.rid), 'approvers',
                     #kept > 0 and cjson.encode(kept) or '[]')
        end
      end
      local seen, other = false, false
      for _, a in ipairs(e.approvers) do
        if a.id == op.approver then
          seen = true
          if a.pos ~= op.pos then other = true end
        end
      end
      local bad = spent_by_other({op.approval_id}, op.pos)
      if bad then
        out[i] = answer('reused', op.rid)
      elseif other and op.decision ~= 'rejected' then
        burn(op.approval_id, op.pos, op.ttl)
        out[i] = answer('duplicate_approver', op.rid)
      else
        spend({op.approval_id}, op.pos, op.ttl)
        if op.decision == 'rejected' then
          redis.call('HSET', park_key(op.rid), 'rejected_by', op.approver, 'reason', op.reason)
          finish(op.rid, 'rejected', op.pos, op.now)
          out[i] = answer('rejected', op.rid)
        else
          if not seen then
            table.insert(e.approvers, {id = op.approver, pos = op.pos,
                                       approval_id = op.approval_id, key = op.key})
            redis.call('HSET', park_key(op.rid), 'approvers', cjson.encode(e.approvers))
          end
          if #e.approvers >= e.needed then
            finish(op.rid, 'released', op.pos, op.now)
            out[i] = answer('released', op.rid)
          else
            out[i] = answer('pending', op.rid)
          end
        end
      end
    end
  elseif kind == 'void' then
    -- Parked for a proposal that then failed alone on a defect: it was answered
    -- UNKNOWN_ERROR, and its approval request was never sent. Forgotten, so that neither
    -- an expiry nor a stray decision answers that proposal a second time, and the same
    -- proposal sent again (the same request id) parks afresh.
    local e = state(op.rid)
    if e ~= nil and e.state == 'parked' then
      redis.call('HDEL', base .. ':parked', op.rid)
      redis.call('DEL', park_key(op.rid))
      redis.call('ZREM', base .. ':parkexp', op.rid)
      out[i] = {'voided'}
    else
      out[i] = {'unchanged'}
    end
  else
    out[i] = {'bad_op'}
  end
end
return cjson.encode(out)
""")


def base_key(ns: str, tenant: str) -> str:
    return f"{ns}:{tenant_tag(tenant)}"


@dataclass(frozen=True, slots=True)
class OpResult:
    status: str
    detail: str | None = None
    entry: dict[str, Any] | None = None


def _approvers(raw: Any) -> list[dict[str, Any]]:
    value = orjson.loads(raw) if raw else []
    return value if isinstance(value, list) else []  # cjson writes an empty list as {}


def _merge(
    entry_json: Any, state: Any, approvers: Any, rejected_by: Any, reason: Any
) -> dict[str, Any]:
    """The parked call as one dict: its payload plus where its approval stands."""
    entry: dict[str, Any] = orjson.loads(entry_json)
    entry["state"] = _text(state) if state else "parked"
    entry["approvers"] = _approvers(approvers)
    if rejected_by:
        entry["rejected_by"] = _text(rejected_by)
    if reason:
        entry["reason"] = _text(reason)
    return entry


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _result(raw: list[Any]) -> OpResult:
    status = str(raw[0])
    if len(raw) >= 6 and raw[1]:
        return OpResult(status, None, _merge(*raw[1:6]))
    return OpResult(status, str(raw[1]) if len(raw) > 1 else None, None)


class ApprovalStore:
    def __init__(self, client: RedisClient, ns: str = "ts") -> None:
        self.client = client
        self.ns = ns

    def apply(self, ops: list[tuple[str, dict[str, Any]]]) -> list[OpResult]:
        """Run (tenant, op) pairs: one script call per tenant, all in one round trip.

        Ops of one tenant run in their given order; answers come back in input order."""
        if not ops:
            return []
        by_tenant: dict[str, list[int]] = defaultdict(list)
        for i, (tenant, _) in enumerate(ops):
            by_tenant[tenant].append(i)
        pipe = self.client.pipeline(transaction=False)
        # Parking is plain commands, no script: per tenant, one HSET of every parked
        # call's payload and one ZADD for the expiry sweeper. Every later change goes
        # through the script. A request id names one call (see request_id_for), so a write
        # that finds its entry there is that call's: a replay of the same record (its first
        # transaction aborted, its request was never read: the replay's is the one kept).
        payloads: dict[str, dict[str | bytes, bytes]] = defaultdict(dict)
        expiring: dict[str, dict[str | bytes, int]] = defaultdict(dict)
        scripted: dict[str, list[int]] = defaultdict(list)
        for tenant, idxs in by_tenant.items():
            for i in idxs:
                op = ops[i][1]
                if op["op"] != "park":
                    scripted[tenant].append(i)
                    continue
                payloads[tenant][op["rid"]] = orjson.dumps(op["entry"])
                expiring[tenant][op["rid"]] = op["expires_at"]
        for tenant, members in expiring.items():
            base = base_key(self.ns, tenant)
            pipe.hset(f"{base}:parked", mapping=payloads[tenant])
            pipe.zadd(f"{base}:parkexp", members, nx=True)
        if expiring:
            pipe.sadd(tenants_key(self.ns), *expiring)
        plain = len(pipe)
        tenants = list(scripted)
        calls = [
            ([base_key(self.ns, t)], [orjson.dumps([ops[i][1] for i in scripted[t]])])
            for t in tenants
        ]
        replies = run_scripts(self.client, _SCRIPT, calls, pipe)
        results: list[OpResult | None] = [
            OpResult("parked") if op["op"] == "park" else None for _, op in ops
        ]
        for tenant, reply in zip(tenants, replies[plain:], strict=True):
            decoded = orjson.loads(reply)
            if isinstance(decoded, dict):  # cjson: an empty list
                decoded = []
            for i, raw in zip(scripted[tenant], decoded, strict=True):
                results[i] = _result(raw)
        return [r if r is not None else OpResult("missing") for r in results]

    def entries(self, keys: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any] | None]:
        """Parked entries by (tenant, request_id), one round trip."""
        if not keys:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for tenant, rid in keys:
            base = base_key(self.ns, tenant)
            pipe.hget(f"{base}:parked", rid)
            pipe.hmget(f"{base}:park:{rid}", *_FIELDS)
        replies = pipe.execute()
        out: dict[tuple[str, str], dict[str, Any] | None] = {}
        for n, key in enumerate(keys):
            payload, fields = replies[2 * n], replies[2 * n + 1]
            out[key] = _merge(payload, *fields) if payload is not None else None
        return out

    def _until(self, index: str, now_ms: int, limit: int) -> list[tuple[str, list[bytes]]]:
        """Per tenant, the members of its ``index`` sorted set scored up to ``now_ms``:
        every tenant in one round trip, however many there are."""
        tenants = [raw.decode() for raw in self.client.smembers(tenants_key(self.ns))]
        pipe = self.client.pipeline(transaction=False)
        for tenant in tenants:
            key = f"{base_key(self.ns, tenant)}:{index}"
            pipe.zrangebyscore(key, "-inf", now_ms, start=0, num=limit)
        return [(t, rids) for t, rids in zip(tenants, pipe.execute(), strict=True) if rids]

    def due(self, now_ms: int, limit: int = 200) -> list[tuple[str, str]]:
        """(tenant, request_id) of parked calls past their expiry."""
        return [(t, r.decode()) for t, rids in self._until("parkexp", now_ms, limit) for r in rids]

    def postpone(self, due: list[tuple[str, str]], until_ms: int) -> None:
        """Check these again at ``until_ms`` (if still parked), in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for tenant, rid in due:
            pipe.zadd(f"{base_key(self.ns, tenant)}:parkexp", {rid: until_ms}, xx=True)
        pipe.execute()

    def forget_ended(self, now_ms: int, limit: int = 1000) -> int:
        """Drop the payloads of requests that ended more than a day ago."""
        ended = self._until("ended", now_ms, limit)
        if not ended:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for tenant, rids in ended:
            base = base_key(self.ns, tenant)
            pipe.hdel(f"{base}:parked", *rids)
            pipe.zrem(f"{base}:ended", *rids)
        pipe.execute()
        return sum(len(rids) for _, rids in ended)

    def list_parked(self, include_ended: bool = False) -> list[dict[str, Any]]:
        """Every parked request (for ``toolsentry approvals list``)."""
        out: list[dict[str, Any]] = []
        for raw in sorted(self.client.smembers(tenants_key(self.ns))):
            tenant = raw.decode()
            rids = [r.decode() for r in self.client.hkeys(f"{base_key(self.ns, tenant)}:parked")]
            for entry in self.entries([(tenant, rid) for rid in rids]).values():
                if entry is not None and (include_ended or entry["state"] == "parked"):
                    out.append(entry)
        return sorted(out, key=lambda e: e.get("created_at", 0))

    def find(self, request_id: str) -> dict[str, Any] | None:
        """A request by its id alone, whichever tenant it belongs to."""
        tenants = [raw.decode() for raw in self.client.smembers(tenants_key(self.ns))]
        found = self.entries([(t, request_id) for t in tenants])
        return next((e for e in found.values() if e is not None), None)


def retain_ms(expires_at: int, now_ms: int) -> int:
    return max(expires_at - now_ms, 0) + _RETAIN_MS
