-- Admission of one tenant's proposals and results in one batch: idempotency,
-- rate limits, run and day budgets, the loop guard and the repair guard.
--
-- KEYS[1]  the tenant's key prefix, "<ns>:{<tenant>}"; every key below starts with
--          it, so all of them share the tenant's cluster slot
-- ARGV[1]  JSON header: what every item shares (see admission.py, _header)
-- ARGV[2]  JSON list of items, in the batch's order, each a positional list whose first
--          element is its kind (see admission.py, _WIRE):
--          1 call     a proposal every earlier gate accepted (routed or parked), with
--                     the approvals it carries, which it spends when admitted
--          2 step     a proposal an earlier gate refused (it still is a step of its run)
--          3 result   an executor's result for a routed call, with the tool, its version,
--                     the payload hash and run it claims (checked against the call's
--                     record, see settle), whether it failed after committed steps, and
--                     for such a failure the record itself (kept should it be held, see
--                     redeliver_held)
--          4 release  a parked call its approvers released (with the deadline its request
--                     parked it until, and the request it names, see holds)
--          5 void     a call whose record failed alone on a defect after it was admitted
--                     (answered UNKNOWN_ERROR, never routed), or, flagged released, a
--                     parked call whose approval record failed so after its release was
--                     admitted (see void_release)
--          6 comp_failed  the compensating call the processor proposed under a key was
--                     refused by a gate: it will not be proposed again
--          7 lapse    a parked call's approval request ended without it going (declined,
--                     expired, or refused when released): it never ran
--          8 withdraw a proposal that asks nothing of admission this time (its token no
--                     longer verifies, or it no longer reads, say): a call admitted at its
--                     position before, whose transaction aborted, never ran
-- ARGV[3]  how long a run's counters live after the day of their last use (ms)
--
-- Returns one verdict string per item: "ok|<attempt>", "no|<why>|<retry after ms>",
-- "hit|<state>|#<length of call>|<call>|<cached answer>" (a call id may hold a '|'),
-- or a result's "settled[|grant|<claims>]", "settled|held", "superseded", "held",
-- "settled|unsigned", "settled|compensated|<key>", "duplicate", "stale|<state>",
-- "unknown", "mismatch" (its tool, version, payload or run is not its call's), "unrouted"
-- (its call was never routed), "unrouted_attempt" (an attempt after the record's),
-- "conflict|<state>|<result id>" (its attempt's first result, that id, reported another
-- outcome; the record stands in that state); a void's "voided" or "unchanged"; a
-- comp_failed's "marked" or "unchanged"; a lapse's "lapsed", "moved_on", "superseded",
-- "given_back" or "unchanged"; a withdraw's "withdrawn" or "none". Short strings, not
-- JSON: decoding and encoding are most of a script's cost per item. One more element
-- follows the verdicts: the held failures to deliver again (see redeliver_held), JSON,
-- [[<position that gave their attempt back>, [{"s": <state>, "r": <record>}, ...]], ...].
--
-- Storage: an idempotency record is JSON (s state, h payload hash, n tool and nv the
-- version its call was routed as (records written before either was kept have none), c
-- call, d deadline, w awaiting approval, a attempt, r run, t the principal's claims a
-- compensation would act for (never a token), x result id, g the digest of what that
-- result reported and xa its attempt, where an earlier attempt's result settled the key
-- (see settle), k compensation key, kh and kt the compensation's payload hash and tool,
-- kf 1 once that compensation failed, v cached answer, p and q what a parked call took
-- and the position it was parked at, given back if it lapses, pd the deadline a
-- resubmission's call was parked until, e 1 once that request ended after the
-- resubmission took the key over: a lapse, or a release come too late; rp and rq a
-- released call's p and q, see unrelease; i the approval request a parked call waits
-- for, see holds (records written before it was kept have none); l the requests whose
-- park a later attempt replaced before their end was seen, see take_unseen; u 1 once
-- the call c is known never to have been routed though it waits for no approval, see
-- settle; o the ids of results answered for the calls it held before, see settle; ua
-- the attempts of call c routed before whose result had not come when the key moved on,
-- see admit_call, each {a attempt, v version, f, fs and g the id, state and digest of
-- its failure after committed steps, held while a later attempt was in flight, fa 1
-- once a result answered the proposal after it was held, see settle, rd 1 once it was
-- delivered again, see redeliver_held}); a run's counters
-- are JSON too. Every record and run the batch names is read before anything is
-- decided, kept in this script while the batch is decided, and written once at the end,
-- a hash at a time (see idem_bucket): a Redis command costs a few microseconds from
-- Lua, and this makes the commands per batch a handful, not a few per item.
--
-- Replay safety: every verdict is kept in the tenant's 'done' hash under its input
-- record's position (topic/partition/offset) until the batch's Kafka transaction
-- commits. A batch applied again after an aborted transaction gets the verdicts it got
-- the first time, and no counter or record moves twice. A call's marker also names its
-- idempotency key, payload hash, tool and its version, whether it was parked, and what it
-- took (see marker_of): a position decided again as another call (contracts or policy
-- reloaded meanwhile: another derived key, another tool or version, a call now parked or
-- no longer) must not take the first call's "ok", which would route it with no record of
-- its own (or under a record that names another version than it runs as), or leave a
-- parked call under a record that waits for no approval; and the first call, which never
-- ran, gives back what it took (see give_back).
--
-- Held failures: the record of a failure held for a later attempt (see settle) is kept at
-- "held:<attempt>:<key>" while it is held, and the held failures a decision delivers
-- again are kept under that decision's position in the 'redeliver' hash, beside its
-- verdict: a replay of the position delivers them again, and both go when its batch
-- commits (see admission.py, forget).

local base = KEYS[1]
local H = cjson.decode(ARGV[1])
local items = cjson.decode(ARGV[2])
local run_ttl = tonumber(ARGV[3])
local done_key = base .. ':done'
local redeliver_key = base .. ':redeliver'
local out = {}

local function opt(v) if v == '' or v == -1 or v == cjson.null then return nil end return v end

-- Positional items to named fields, with what the header says for them.
local function unwire(a)
  local kind = a[1]
  if kind == 1 then
    local t = H.tools[a[4]]
    return {kind = 'call', pos = a[2], run = a[3], tool = a[4], group = a[5], sig = a[6],
            ikey = a[7], hash = a[8], call = a[9], deadline = a[10], park = a[11] == 1,
            grant = a[12], approvals = opt(a[13]), approvals_ttl = a[14], rid = opt(a[15]),
            version = opt(a[16]), cost = t[1], rate = t[2] > 0 and {t[2], t[3]} or nil,
            ttl = t[4], exempt = t[5] == 1,
            class_budget = H.classes[a[5]] or 0, steps = H.steps, repeats = H.repeats,
            cost_cap = H.cost_cap, day_cap = opt(H.day_cap), day = H.day, now = H.now,
            grace = H.grace}
  elseif kind == 2 then
    return {kind = 'step', pos = a[2], run = a[3], sig = a[4], repair = a[5] == 1,
            ikey = opt(a[6]), hash = a[7], comp = opt(a[8]), comp_hash = a[9], tool = a[10],
            steps = H.steps, max_repairs = H.max_repairs}
  elseif kind == 3 then
    return {kind = 'result', pos = a[2], ikey = a[3], call = a[4], result_id = a[5],
            state = a[6], cached = a[7], ttl = a[8], compensation_key = opt(a[9]),
            compensates = opt(a[10]), compensation_hash = opt(a[11]),
            compensation_tool = opt(a[12]), unsigned = opt(a[13]), attempt = tonumber(a[14]) or 0,
            tool = opt(a[15]), hash = opt(a[16]), run = opt(a[17]),
            version = opt(a[18]), committed = a[19] == 1, cached_held = opt(a[20]),
            digest = opt(a[21]), record = opt(a[22])}
  elseif kind == 5 then
    return {kind = 'void', pos = a[2], ikey = a[3], call = a[4], ttl = a[5], of = a[6],
            released = a[7] == 1}
  elseif kind == 6 then
    return {kind = 'comp_failed', pos = a[2], comp = a[3]}
  elseif kind == 7 then
    return {kind = 'lapse', pos = a[2], ikey = a[3], hash = a[4], deadline = a[5],
            rid = opt(a[6]), attempt = opt(a[7]), call = opt(a[8])}
  end
  return {kind = 'release', pos = a[2], run = a[3], ikey = a[4], hash = a[5], call = a[6],
          deadline = a[7], ttl = a[8], parked_until = opt(a[9]), rid = opt(a[10]),
          attempt = opt(a[11]), version = opt(a[12])}
end

local function encode(v)
  if v.status then
    if v.grant then return 'settled|grant|' .. v.grant end
    if v.unsigned then return 'settled|unsigned' end
    if v.compensated then return 'settled|compensated|' .. v.compensated end
    if v.held then return 'settled|held' end
    if v.result then return v.status .. '|' .. v.state .. '|' .. v.result end
    if v.state then return v.status .. '|' .. v.state end
    return v.status
  end
  if v.ok then return 'ok|' .. (v.attempt or 0) end
  if v.why == 'idempotent_hit' then
    return 'hit|' .. v.state .. '|#' .. #v.call .. '|' .. v.call .. '|' .. (v.cached or '')
  end
  return 'no|' .. v.why .. '|' .. string.format('%d', v.retry_after_ms or 0)
end

-- Lua's stack bounds unpack(): long lists go to Redis in chunks.
local CHUNK = 1000
local earlier = {}
for first = 1, #items, CHUNK do
  local positions = {}
  for i = first, math.min(first + CHUNK - 1, #items) do positions[#positions + 1] = items[i][2] end
  local got = redis.call('HMGET', done_key, unpack(positions))
  for k = 1, #positions do earlier[first + k - 1] = got[k] end
end

local FINAL = {COMPLETED = true, FAILED_FINAL = true, COMPENSATED = true}
local RETRYABLE = {FAILED_RETRYABLE = true, EXPIRED = true}

local DAY = 86400000
local today = math.floor(H.now / DAY)
local HORIZON = H.horizon_days
-- Idempotency records live in one hash per tenant and expiry day (field: the key), a
-- run's counters in one hash per tenant and day of last use (field: the run): a batch
-- reads each hash once with HMGET and writes each once with HSET, whatever its size,
-- and a whole day's hash expires at once. A record is kept at least its TTL, at most a
-- day longer; a run's counters at least a day after its last proposal.
local function idem_bucket(day) return base .. ':idem:' .. day end
local function run_bucket(day) return base .. ':runs:' .. day end

-- HMGET `fields` of `key` into `into` (field -> decoded value) where not found yet;
-- `where` records the day a value was found under.
local function gather(key, day, fields, into, where)
  for first = 1, #fields, CHUNK do
    local last = math.min(first + CHUNK - 1, #fields)
    local values = redis.call('HMGET', key, unpack(fields, first, last))
    for k = first, last do
      local v = values[k - first + 1]
      if v and not into[fields[k]] then
        into[fields[k]] = cjson.decode(v)
        where[fields[k]] = day
      end
    end
  end
end

-- The idempotency key a positional item names (see unwire), if any.
local function ikey_of(a)
  local kind = a[1]
  if kind == 1 then return a[7] end
  if kind == 2 then return opt(a[6]) end
  if kind == 3 or kind == 5 or kind == 7 then return a[3] end
  if kind == 6 or kind == 8 then return nil end  -- (6 names the original's key only
  -- through its own; 8 finds its call's key in its position's marker)
  return a[4]
end

local ikeys, run_ids, seen = {}, {}, {}
for i, a in ipairs(items) do
  if not earlier[i] then
    local ikey = ikey_of(a)
    if ikey and not seen['i' .. ikey] then
      seen['i' .. ikey] = true
      ikeys[#ikeys + 1] = ikey
    end
    if (a[1] == 1 or a[1] == 2) and not seen['r' .. a[3]] then
      seen['r' .. a[3]] = true
      run_ids[#run_ids + 1] = a[3]
    end
  end
end
local records, record_day = {}, {}
if #ikeys > 0 then
  for day = today, today + HORIZON do gather(idem_bucket(day), day, ikeys, records, record_day) end
end
local runs, run_day, run_read = {}, {}, {}
if #run_ids > 0 then
  for day = today, today - 1, -1 do gather(run_bucket(day), day, run_ids, runs, run_day) end
end
for _, id in ipairs(run_ids) do run_read[id] = true end
for _, ikey in ipairs(ikeys) do records[ikey] = records[ikey] or false end
local record_dirty, run_dirty = {}, {}

local function record_of(ikey)
  if records[ikey] == nil then  -- not named by the batch (a compensated original)
    for day = today, today + HORIZON do gather(idem_bucket(day), day, {ikey}, records, record_day) end
    records[ikey] = records[ikey] or false
  end
  return records[ikey]
end

local function put_record(ikey, rec, ttl)
  records[ikey] = rec
  record_dirty[ikey] = math.min(today + HORIZON, math.floor((H.now + ttl) / DAY))
end

-- A record changed in place, kept in the day's hash it was found in (its expiry stands).
local function keep_record(ikey, rec)
  records[ikey] = rec
  record_dirty[ikey] = record_dirty[ikey] or record_day[ikey]
end

-- A run's counters (steps, class:<group>, cost, sig:<signature>, repairs, bad:<signature>),
-- a tool's GCRA arrival time and a day's cost live here while the batch is decided.
local function run_of(id)
  if not run_read[id] then  -- not named by the batch's new items (a call given back)
    run_read[id] = true
    for day = today, today - 1, -1 do gather(run_bucket(day), day, {id}, runs, run_day) end
  end
  local counters = runs[id]
  if not counters then
    counters = {}
    runs[id] = counters
  end
  return counters
end

local function bump(id, field, by)
  local counters = run_of(id)
  counters[field] = (counters[field] or 0) + by
  run_dirty[id] = true
end

local tats, tat_ttl = {}, {}
local days, day_dirty = {}, {}

local function day_cost(day)
  if days[day] == nil then
    days[day] = tonumber(redis.call('HGET', base .. ':day:' .. day, 'cost') or '0')
  end
  return days[day]
end

local function tat_of(tool)
  if tats[tool] == nil then tats[tool] = tonumber(redis.call('GET', base .. ':rl:' .. tool) or '0') end
  return tats[tool]
end

local function refuse(why, retry_after)
  return {ok = false, why = why, retry_after_ms = retry_after or 0}
end

-- The budgets and the rate limit of an admissible call; nil when it may go.
-- `charged`: the call was charged when it was parked, and is only being released now.
-- `exempt`: the hand-off tool, which a run out of steps or budget is told to call.
local function limits(c, counters, charged)
  -- A charged call took its step, its budgets and its loop-guard count when it was
  -- parked, and goes on them: it is not a step past the cap (parked at its run's last
  -- step, it would be), nor a repeat of itself (parked as the last identical call the
  -- guard allows, it would be).
  if charged then return nil end
  if not c.exempt and (counters.steps or 0) >= c.steps then return refuse('step_cap') end
  if (counters['sig:' .. c.sig] or 0) >= c.repeats then return refuse('loop') end
  if not c.exempt then
    if (counters['class:' .. c.group] or 0) >= c.class_budget then return refuse('class_budget') end
    if (counters.cost or 0) + c.cost > c.cost_cap + 1e-9 then return refuse('cost_cap') end
    if c.day_cap and day_cost(c.day) + c.cost > c.day_cap + 1e-9 then
      return refuse('day_cost_cap')
    end
  end
  if c.rate then
    local interval, burst = c.rate[1], c.rate[2]
    local new_tat = math.max(tat_of(c.tool), c.now) + interval
    local allow_at = new_tat - interval * burst
    if c.now < allow_at then return refuse('rate_limited', allow_at - c.now) end
  end
  return nil
end

local function charge(c)
  bump(c.run, 'class:' .. c.group, 1)
  bump(c.run, 'cost', c.cost)
  if c.day_cap and c.cost > 0 then
    days[c.day] = day_cost(c.day) + c.cost
    day_dirty[c.day] = true
  end
  if c.rate then
    tats[c.tool] = math.max(tat_of(c.tool), c.now) + c.rate[1]
    tat_ttl[c.tool] = math.max(tat_ttl[c.tool] or 0, c.rate[1] * c.rate[2] * 2)
  end
end

-- A retry of a call that already has its answer. A call whose compensation failed (its
-- result, or a gate refusing it: kf) answers with that, not with the "wait for the
-- compensation" its record cached when it failed.
local function hit(rec)
  local state = rec.s
  if rec.kf == 1 and state ~= 'COMPENSATED' then state = 'COMPENSATION_FAILED' end
  return {ok = false, why = 'idempotent_hit', state = state, call = rec.c, cached = rec.v}
end

local COMPENSATION = 'compensate:'

-- A compensation key is the processor's: a call is admitted under one, or refused as a
-- compensation that failed, only when the original's record names that key, this very
-- tool and this very payload (see settle).
local function unrequested(ikey, hash, tool)
  -- (the first byte first: most keys are derived ones, 'ik:...')
  if string.byte(ikey, 1) ~= 99 or string.sub(ikey, 1, #COMPENSATION) ~= COMPENSATION then
    return false
  end
  local orig = record_of(string.sub(ikey, #COMPENSATION + 1))
  return not (orig and orig.k == ikey and orig.kh == hash and orig.kt == tool)
end

-- An attached approval is good for one execution: the record that spent it holds it
-- (its position, kept in '<base>:apr:<approval id>', shared with the approval store's
-- decisions on tool.approvals). Checked here, before anything is charged, so a call
-- stopped by a spent approval takes a step and nothing else.
local function spent_elsewhere(ids, pos)
  for _, id in ipairs(ids) do
    local by = redis.call('GET', base .. ':apr:' .. id)
    if by and by ~= pos then return true end
  end
  return false
end

-- What an admitted call took, for its position's marker (see give_back):
-- "<resubmitted 0|1>;<cost>;<signature>;<day, when its cost counted for the day's cap>;
-- <rate interval, when it is rate limited>;<budget group>;<approvals' ids (JSON), if any>";
-- a resubmitted parked call took nothing but its approvals, and keeps in the cost's place
-- the deadline it was parked until (its record waits until then again if given back).
-- A budget group is one of a fixed few names, and JSON escapes every control character.
local function took(c, charged, parked_until)
  local approvals = c.approvals and cjson.encode(c.approvals) or ''
  if charged then
    return '1;' .. string.format('%.17g', parked_until or 0) .. ';;;;;' .. approvals
  end
  return '0;' .. string.format('%.17g', c.cost) .. ';' .. c.sig .. ';'
    .. ((c.day_cap and c.cost > 0) and c.day or '') .. ';'
    .. (c.rate and string.format('%.17g', c.rate[1]) or '') .. ';' .. c.group .. ';' .. approvals
end

-- A parked call's record names its approval request (i: the id the call was first parked
-- under, before a later attempt's reissue; with a, the attempt it was parked as, that names
-- one request), kept while the record is that park's: resubmitted, released, given back;
-- '' on the record of a call this version admitted unparked, which waits for no request).
-- Whether `rec` is request c's park; nil when one side predates request ids (a record or
-- a request of an earlier version): then the deadline the call was parked until tells, as
-- it did (it cannot tell a park given back from a later park of the key).
local function holds(rec, c)
  if rec.i == nil or not c.rid then return nil end
  return rec.i == c.rid and rec.a == c.attempt
end

-- Requests whose park a later attempt replaced before their end was seen (l: a list of
-- {i, a, d, c}, see remember_unseen): a parked call past its deadline and the grace with
-- its expiry check late, or a resubmission that went ahead and then let its key go. Their
-- end comes later, and must still answer its proposal (or not, for the resubmission),
-- where any other request the record no longer holds was answered already (given back).
-- An entry goes when its request's end is seen; the oldest go past UNSEEN_KEPT, and their
-- end then reads as given back.
local UNSEEN_KEPT = 16

-- `list` (or nil) with `item` at its end and the oldest past `most` gone: a copy, since
-- the record `list` comes from may stay as it is (a new attempt refused after all).
local function appended(list, item, most)
  local out = {}
  for k, kept in ipairs(list or {}) do out[k] = kept end
  out[#out + 1] = item
  while #out > most do table.remove(out, 1) end
  return out
end

local function remember_unseen(into, rec)
  local seen = {i = rec.i, a = rec.a}
  if rec.w == 1 then
    seen.d = rec.d
  else  -- (a resubmission: its call answered whichever proposal it was)
    seen.d, seen.c = rec.pd, rec.c
  end
  into.l = appended(into.l, seen, UNSEEN_KEPT)
end

-- The entry of request c in rec's unseen list, removed (its end is seen now), or nil.
-- `expiry`: the request's, which names it where no request id does.
local function take_unseen(ikey, rec, c, expiry)
  if not rec.l then return nil end
  for k, seen in ipairs(rec.l) do
    local match = holds(seen, c)
    if match == nil then match = expiry ~= nil and seen.d == expiry end
    if match then
      table.remove(rec.l, k)
      if #rec.l == 0 then rec.l = nil end
      keep_record(ikey, rec)
      return seen
    end
  end
  return nil
end

-- How the end of request c answers when its call went ahead as a resubmission carrying
-- approvals (its call id `call`): "moved_on" when that resubmission was c's own proposal
-- sent again, which its own observations answered; "superseded" when it was another
-- proposal, so c's proposal has had no final answer yet and gets one now (see app.py,
-- _end_requests and _admit_releases: a rejection, an expiry and a release all answer it
-- alike, once).
local function went_ahead(call, c)
  if c.call and call ~= c.call then return 'superseded' end
  return 'moved_on'
end

-- How the end of request c answers (its lapse, or its release refused) where the record
-- names requests (`mine`, see holds): nil while the record is c's park, still waiting;
-- else "given_back", "lapsed" (its park replaced before its end was seen, see
-- take_unseen), "moved_on" or "superseded" (see went_ahead; a resubmission given back
-- after it waits for nobody now), or "moved_on" for a park released already (it went).
-- `expiry`: the request's, which names it where no request id does.
local function gone_from(rec, c, mine, expiry)
  if not mine then
    local seen = take_unseen(c.ikey, rec, c, expiry)
    if seen and seen.c then return went_ahead(seen.c, c) end
    return seen and 'lapsed' or 'given_back'
  end
  if rec.s == 'PENDING' and rec.w == 1 then return nil end
  if rec.pd then
    if rec.s == 'PENDING' and rec.e ~= 1 then
      rec.e = 1
      keep_record(c.ikey, rec)
    end
    return went_ahead(rec.c, c)
  end
  -- (retryable with a result of its own: an earlier attempt's failure settled the key
  -- while this park was its record's, see settle, and the key went ahead without it)
  if RETRYABLE[rec.s] and not rec.x then return 'given_back' end
  return 'moved_on'
end

-- `fresh`: the replay markers this batch writes (position, marker, ...). `emptied`: the
-- positions whose take was given back, or became a call that goes, by other means (a
-- parked call's, when its request ended, or when it was resubmitted or released): their
-- markers keep their verdict, and no replay of their position gives the take back.
local emptied, fresh = {}, {}
local empty_take, give_back_park  -- (defined below, with the markers they read)

-- How many answered results' ids a record keeps for the calls it held before (o): a
-- result of one of them is stale, and answered once (see settle). Copies come close
-- together, and the list is written with the record every time.
local STALE_KEPT = 8

-- Whether the call the record holds was never routed: parked and waiting for its
-- approvers (w), or its park ended without it going (u). The version before u marked
-- neither: on its records, a park (one that names its request, i, and its tool) that was
-- not released (rp) and no longer holds what parking took (p: given back when its request
-- ended, its release was undone, or its resubmission was given back after that end;
-- kept by a resubmission that went) never went either. (A record written before requests
-- were named says nothing: it was routed, as that version took it.)
local function unrouted(rec)
  if rec.w == 1 or rec.u == 1 then return true end
  return rec.u == nil and rec.i ~= nil and rec.i ~= '' and rec.n ~= nil and rec.p == nil
    and rec.rp == nil
end

local function admit_call(c)
  local counters = run_of(c.run)
  if unrequested(c.ikey, c.hash, c.tool) then
    bump(c.run, 'steps', 1)
    return refuse('compensation_unrequested')
  end
  local rec = record_of(c.ikey)
  local attempt, charged = 0, false
  if rec then
    attempt = rec.a or 0
    if rec.h ~= c.hash or (rec.n and rec.n ~= c.tool) then
      bump(c.run, 'steps', 1)
      return refuse('signature_mismatch')
    end
    if FINAL[rec.s] then
      bump(c.run, 'steps', 1)
      return hit(rec)
    end
    if rec.s == 'PENDING' then
      if rec.w == 1 and not c.park and (rec.r == nil or rec.r == c.run) then
        -- The parked call, now resubmitted with its approvals, by its own run (another
        -- run naming its key would go on a park that run did not pay for: in flight).
        charged = true
      elseif c.now < rec.d + c.grace then
        bump(c.run, 'steps', 1)
        return refuse('in_flight', rec.d + c.grace - c.now)
      end
      -- else: the deadline and the grace period passed with no result; by rule the
      -- key is retryable, as if the call had expired
    elseif not RETRYABLE[rec.s] then
      bump(c.run, 'steps', 1)
      return refuse('signature_mismatch')
    end
  end
  if c.approvals and spent_elsewhere(c.approvals, c.pos) then
    bump(c.run, 'steps', 1)
    return refuse('approval_reused')
  end
  local refusal = limits(c, counters, charged)
  if refusal then
    -- Refused before anything is given back: a parked call this attempt would have
    -- replaced keeps its park, and its request's end gives the take back, once. (Given
    -- back here, the park's record, which a refused attempt does not write, would still
    -- hold the take, and the end would give it back a second time.) A refusal the
    -- give-back would have spared (the park's run, or the tenant's day, at its limit) is
    -- the conservative answer, and lasts until that end.
    bump(c.run, 'steps', 1)
    return refusal
  end
  local unseen = {l = rec and rec.l or nil}
  if rec and rec.w == 1 and not charged then
    -- A parked call whose request lapsed with its end not decided yet (past its deadline
    -- and the grace): it never ran, and this new attempt replaces its record. Its
    -- proposal has had no final answer: its request's end, when it comes, gives it.
    give_back_park(rec)
    remember_unseen(unseen, rec)
  elseif rec and rec.pd and rec.e ~= 1 and not charged then
    -- A resubmission that went ahead and let its key go (failed retryably, or past its
    -- deadline): its request's end has not come yet either.
    remember_unseen(unseen, rec)
  end
  if not charged then
    -- (a parked call resubmitted with its approvals was counted when it was parked, its
    -- step included: it takes nothing again)
    bump(c.run, 'steps', 1)
    bump(c.run, 'sig:' .. c.sig, 1)
    charge(c)
  end
  if c.approvals then
    for _, id in ipairs(c.approvals) do
      redis.call('SET', base .. ':apr:' .. id, c.pos, 'PX', c.approvals_ttl)
    end
  end
  local next_attempt = charged and math.max(attempt, 1) or attempt + 1
  local parked_until = rec and rec.d
  local took_ = took(c, charged, parked_until)
  -- The results answered so far stay answered: the call this one replaces, and those
  -- before it, are stale from now on, and a copy of their result is not answered again.
  local answered = rec and rec.o or nil
  if rec and rec.x then answered = appended(answered, rec.x, STALE_KEPT) end
  -- The attempts of this very call that were routed and whose result had not come when
  -- the key moved on from them (their deadline and the grace passed first): each ran, or
  -- may have, and its result, when it comes, may say the call completed (see settle).
  local missed = rec and rec.c == c.call and rec.ua or nil
  if rec and rec.c == c.call and rec.s == 'PENDING' and not unrouted(rec) then
    missed = appended(missed, {a = rec.a or 1, v = rec.nv}, STALE_KEPT)
  end
  local fresh_rec = {s = 'PENDING', h = c.hash, n = c.tool, nv = c.version, c = c.call,
                     d = c.deadline, w = c.park and 1 or 0, a = next_attempt, r = c.run,
                     t = c.grant, l = unseen.l, o = answered, ua = missed}
  if c.park then
    -- What a parked call took, given back should its request end without it (see lapse),
    -- and the request it waits for, which only that request's end may end.
    fresh_rec.p, fresh_rec.q, fresh_rec.i = took_, c.pos, c.rid
  elseif not charged then
    fresh_rec.i = ''  -- (it waits for no request: any request's end finds it not theirs)
  elseif charged then
    -- The parked call goes: no replay of the position it was parked at gives its take
    -- back from now on. Its record keeps the take (and the deadline it was parked until),
    -- should this resubmission be given back and the call wait for approval again.
    if rec.q then empty_take(rec.q) end
    fresh_rec.p, fresh_rec.q, fresh_rec.pd, fresh_rec.i = rec.p, rec.q, rec.d, rec.i
  end
  put_record(c.ikey, fresh_rec, c.ttl)
  return {ok = true, attempt = next_attempt, took = took_}
end

-- `counted`: a call was admitted at this position the first time (its transaction
-- aborted): its step was counted then, within the cap, and is not counted again.
local function admit_step(c, counted)
  local counters = run_of(c.run)
  local step = counted and 0 or 1
  if c.comp and unrequested(c.comp, c.comp_hash, c.tool) then
    bump(c.run, 'steps', step)
    return refuse('compensation_unrequested')
  end
  if c.ikey then
    -- Refused on the world's state, but maybe because this very call already ran.
    local rec = record_of(c.ikey)
    if rec and FINAL[rec.s] and rec.h == c.hash and (not rec.n or rec.n == c.tool) then
      bump(c.run, 'steps', step)
      return hit(rec)
    end
  end
  local steps = counters.steps or 0
  bump(c.run, 'steps', step)
  if not counted and steps >= c.steps then return refuse('step_cap') end
  if not c.repair then return {ok = true} end
  local same = counters['bad:' .. c.sig] or 0
  local repairs = counters.repairs or 0
  -- Once the run is out of steps or repairs, every repair is refused whatever was counted
  -- before: nothing more is, or a looping agent would grow its run's counters (decoded
  -- and written whole by every batch that names the run) without end.
  if repairs >= c.max_repairs then
    return refuse(same >= 1 and 'repair_loop' or 'repair_cap')
  end
  bump(c.run, 'repairs', 1)
  bump(c.run, 'bad:' .. c.sig, 1)
  if same >= 1 then return refuse('repair_loop') end
  return {ok = true}
end

-- Where attempt `attempt` is in rec's missed attempts (ua, see admit_call), if it is.
local function missed_at(rec, attempt)
  for k, missed in ipairs(rec.ua or {}) do
    if missed.a == attempt then return k end
  end
  return nil
end

-- A result of an attempt whose result the record already has: `kept`, the digest of what
-- that result `id` reported (see results.py, outcome_digest), which settled the record
-- (now in state `state`) or was held with it. A copy when it reports the same outcome
-- (redelivered, or named afresh by an executor that ran the call again): answered once.
-- A conflict when it reports another: the executor said two things of one attempt, and
-- one of them is false. The first stands, and only an operator can tell which is true
-- (see app.py). A result with no digest, or one an earlier version kept without one, is
-- a copy, as it was.
local function again(kept, c, state, id)
  if kept and c.digest and kept ~= c.digest then
    return {status = 'conflict', state = state, result = id}
  end
  return {status = 'duplicate'}
end

-- Whether a failure after committed steps that a retry does not finish (a compensation
-- asked for, or a hand-off) is held among rec's missed attempts (see settle).
local function held_final(rec)
  for _, missed in ipairs(rec.ua or {}) do
    if missed.f and missed.fs == 'FAILED_FINAL' then return true end
  end
  return false
end

-- Where the record of the failure of attempt `attempt` of key `ikey` is kept while it is
-- held for a later attempt (see settle).
local function held_key(ikey, attempt) return base .. ':held:' .. attempt .. ':' .. ikey end

-- The held failures this batch delivers again: position -> list of '{"s":..,"r":..}'.
local redelivered = {}

-- The later attempt a failure was held for was given back without running, by the
-- decision at position `pos`: voided, its position decided again as something else or
-- as nothing, waiting for its approvers again, or its release undone; or its park ended.
-- Nothing in flight can meet the held failure's committed steps now, and nothing has
-- answered its proposal. Its record, kept when it was held, goes back on tool.results
-- (see app.py) in the same transaction, where it settles the key as any copy of it does
-- now (see settle): the proposal answered once, the compensation it asks for proposed.
-- Once per held failure (rd); a replay of `pos` delivers it again. (A failure held by an
-- earlier version kept no record: a copy of it, redelivered, still settles the key.)
local function redeliver_held(ikey, rec, pos)
  for _, missed in ipairs(rec.ua or {}) do
    if missed.f and not missed.fa and not missed.rd then
      local kept = redis.call('GET', held_key(ikey, missed.a))
      if kept then
        local list = redelivered[pos] or {}
        list[#list + 1] = '{"s":' .. cjson.encode(missed.fs or '') .. ',"r":' .. kept .. '}'
        redelivered[pos] = list
        missed.rd = 1
      end
    end
  end
end

-- The held failures among missed attempts `ua` (see settle), or nil if there are none.
local function held_only(ua)
  local held = {}
  for _, missed in ipairs(ua or {}) do
    if missed.f then held[#held + 1] = missed end
  end
  if #held == 0 then return nil end  -- (cjson writes an empty table as an object)
  return held
end

-- An executor's result settles the call's record. Only the attempt the record is
-- waiting for settles it, or an earlier attempt of the same call that completed after
-- the key moved on from it; a result for another older attempt (the key was retried
-- since) or a second copy of the same result changes nothing.
local function settle(c)
  local rec = record_of(c.ikey)
  if not rec then return {status = 'unknown'} end
  local mine = rec.c == c.call
  -- The call id alone is not enough: a proposal sent again under its own id after its
  -- key became retryable is a new attempt of the same call id.
  local earlier = mine and c.attempt > 0 and (rec.a or 1) ~= c.attempt
  -- A result is its call's only if it names the call's tool, version, payload and run: the
  -- executor's word picks the output schema its data is checked against and the
  -- compensation its contract names, the run its answer goes to, and whether a
  -- compensation is proposed in the caller's name. A key keeps its tool and payload
  -- whatever call holds it (admit_call refuses any other), so a stale result is held to
  -- them too; its run and version are its own call's, which the record no longer names
  -- (an earlier attempt's version is kept with it while its result may still settle the
  -- key, see below). (A record written before tools, or versions, were kept names none.)
  if (rec.n and rec.n ~= c.tool) or rec.h ~= c.hash
      or (mine and rec.r and rec.r ~= c.run)
      or (mine and not earlier and rec.nv and rec.nv ~= c.version) then
    return {status = 'mismatch'}
  end
  if rec.x == c.result_id then return again(rec.g, c, rec.s, rec.x) end
  if earlier then
    -- The result of an attempt the key moved on from is superseded: the later attempt's
    -- result answers that proposal (the handler, idempotent under the key, gives the
    -- same answer). Unless the later attempt never gets that far: parked again, its
    -- approvers may decline it; it may time out unstarted, or fail before the handler
    -- looks the key up. An earlier attempt that was routed and had no result when the key
    -- moved on (see admit_call) ran, and its result, while the key has no final answer of
    -- its own, may still be the call's: one that completed settles the key (the later
    -- attempt, and a retry, get this one; a later attempt still parked never goes). One
    -- that failed after committing steps left the world half changed, and settles the key
    -- only where no later attempt can meet those steps: parked (it never goes now), its
    -- park ended, or the key retryable (answered, or given back: nothing in flight). A
    -- later attempt routed and in flight may finish the call, idempotent under the key,
    -- and a compensation proposed meanwhile would undo what it completes: the failure is
    -- held ("held", once: the attempt stays among the missed ones, naming it), left to the
    -- later attempt. Held, it settles the key later only if nothing answers the proposal
    -- first (see below, fa): a copy of it that comes after an answer is superseded by that
    -- answer, not a second one. Any other result of an earlier attempt changes nothing: a
    -- copy, one of an attempt answered already, or a failure that committed nothing.
    -- Another result of the attempt that settled the key, or of one whose failure is held,
    -- is held to what that one reported (see again).
    -- An attempt later than the one the record is at was never routed: no executor was
    -- handed it, so its result is not one (a forged or garbled record, or Redis lost the
    -- record's later writes). It settles nothing, and the DLQ keeps it.
    if c.attempt > (rec.a or 1) then return {status = 'unrouted_attempt'} end
    if rec.xa == c.attempt then return again(rec.g, c, rec.s, rec.x) end
    local k = missed_at(rec, c.attempt)
    local missed = k and rec.ua[k]
    if missed and missed.f and missed.g then
      local other = again(missed.g, c, missed.fs, missed.f)
      if other.status == 'conflict' then return other end
    end
    -- (a record an earlier version wrote marks no fa: a result of the attempt it holds,
    -- x, answered the proposal after the failure was held, which needed it in flight)
    if FINAL[rec.s] or (missed and (missed.fa or (missed.f and rec.x))) then k = nil end
    if not (k and (c.state == 'COMPLETED' or c.committed)) then return {status = 'superseded'} end
    local routed_as = missed.v
    if routed_as and routed_as ~= c.version then return {status = 'mismatch'} end
    if c.state ~= 'COMPLETED' and rec.s == 'PENDING' and not unrouted(rec) then
      if missed.f == c.result_id or (missed.g and missed.g == c.digest) then
        -- (held again, for the attempt in flight now: one given back later delivers it
        -- again, see redeliver_held)
        if missed.rd then
          missed.rd = nil
          keep_record(c.ikey, rec)
        end
        return {status = 'duplicate'}
      end
      missed.f, missed.fs, missed.g = c.result_id, c.state, c.digest
      if c.record then
        redis.call('SET', held_key(c.ikey, c.attempt), c.record, 'PX', c.ttl)
      end
      keep_record(c.ikey, rec)
      return {status = 'held'}
    end
    if missed.f then redis.call('DEL', held_key(c.ikey, c.attempt)) end
    table.remove(rec.ua, k)
    if #rec.ua == 0 then rec.ua = nil end
    -- (a later attempt still parked gives back what parking took, as its request's end
    -- would: it never goes, and that end finds its key gone ahead)
    if rec.w == 1 then give_back_park(rec) end
    rec.u = nil
  else
    -- Another result of this very attempt (another result id: an executor that ran it
    -- again and named its result afresh) settled it first: a copy, answered once, or a
    -- conflict (see again). One of an earlier attempt that settled it (xa) is not this
    -- attempt's: this one's own result is a copy, as the handler, idempotent under the
    -- key, answers (or it did not start), and the proposal has its answer.
    if mine and rec.s ~= 'PENDING' then
      if rec.x and not rec.xa then return again(rec.g, c, rec.s, rec.x) end
      return {status = 'duplicate'}
    end
    -- A call that was never routed (see unrouted). Nothing ran, so nothing it says
    -- settles the record or asks for a compensation.
    if mine and unrouted(rec) then return {status = 'unrouted'} end
    -- Stale: the key moved on to another call (retried under another id once its
    -- deadline passed); this result answers nothing the record waits for. Its proposal is
    -- answered once: a copy of it (redelivered, or twice in one batch) finds its id kept.
    -- Kept on the first decision only: a replay of its position reads the verdict it got.
    if not mine then
      for _, id in ipairs(rec.o or {}) do
        if id == c.result_id then return {status = 'duplicate'} end
      end
      rec.o = appended(rec.o, c.result_id, STALE_KEPT)
      keep_record(c.ikey, rec)
      return {status = 'stale', state = rec.s}
    end
  end
  local grant = rec.t
  rec.s, rec.x, rec.v, rec.w = c.state, c.result_id, c.cached, 0
  -- What the result reported, and its attempt where the key had moved on from it: another
  -- result of that attempt is held to it (see again).
  rec.g, rec.xa = c.digest, earlier and c.attempt or nil
  local verdict = {status = 'settled'}
  if c.cached_held and held_final(rec) then
    -- This attempt ended without completing or committing a step (timed out unstarted,
    -- say), after an earlier attempt's failure after committed steps was held for it (see
    -- above): those steps stand, and its answer, "nothing ran", would leave them unseen.
    -- The call is final and escalates; a failure held for a resumable call is not, since
    -- a retry under the key finishes it as this attempt would have.
    -- The held failures stay with their digests (the attempts that had none are gone): a
    -- result of their attempt that says otherwise (it completed, say) is a conflict an
    -- operator needs beside this escalation, not a copy.
    rec.s, rec.v, rec.ua = 'FAILED_FINAL', c.cached_held, held_only(rec.ua)
    verdict.held = true
  end
  -- The proposal has its answer now. A failure still held (a resumable call's, which this
  -- answer leaves as it is: a retry under the key finishes the call) is answered for: a
  -- copy of it, redelivered from now on, is superseded by this answer rather than settle
  -- the key a second time and answer again (fa). Its digest stays, so that a result of its
  -- attempt that reports something else is still a conflict.
  for _, missed in ipairs(rec.ua or {}) do
    if missed.f and not missed.fa then
      missed.fa = 1
      redis.call('DEL', held_key(c.ikey, missed.a))  -- (a copy is superseded from now on)
    end
  end
  -- (the claims stay while an earlier attempt's failure after committed steps may still
  -- settle the key and ask for a compensation in their name: see above)
  if FINAL[rec.s] or not rec.ua then rec.t = nil end
  if c.compensation_key and c.unsigned and string.sub(grant or '', 1, 1) ~= '{' then
    -- It must be signed in the caller's name, and the record keeps no claims to sign
    -- with (an earlier version kept a token): nothing is proposed, it escalates, and a
    -- retry of the original gets that answer.
    rec.v = c.unsigned
    verdict.unsigned = true
  elseif c.compensation_key then
    -- The compensating call is proposed under this key; the original is compensated
    -- once that call completes.
    rec.k, rec.kh, rec.kt = c.compensation_key, c.compensation_hash, c.compensation_tool
    if grant and grant ~= '' then verdict.grant = grant end
  end
  put_record(c.ikey, rec, c.ttl)
  if c.compensates then
    local orig = record_of(c.compensates)
    if orig and orig.k == c.ikey and c.state == 'COMPLETED' then
      orig.s, orig.kf = 'COMPENSATED', nil
      put_record(c.compensates, orig, c.ttl)
      verdict.compensated = c.compensates
    elseif orig and orig.k == c.ikey and orig.s ~= 'COMPENSATED' then
      orig.kf = 1  -- the compensation did not complete: nobody proposes it again
      put_record(c.compensates, orig, c.ttl)
    end
  end
  return verdict
end

-- The compensating call proposed under `comp` was refused by a gate (see the processor's
-- refused_compensation): the original's record says so, for whoever retries it.
local function comp_failed(c)
  local key = string.sub(c.comp, #COMPENSATION + 1)
  local orig = record_of(key)
  if string.sub(c.comp, 1, #COMPENSATION) ~= COMPENSATION
      or not (orig and orig.k == c.comp and orig.s ~= 'COMPENSATED') then
    return {status = 'unchanged'}
  end
  orig.kf = 1
  keep_record(key, orig)
  return {status = 'marked'}
end

-- A parked call released by its approvers. It goes only if its record still waits for
-- approval, for this very request: a resubmission that carried approvals may have taken
-- the key over already, or the park been given back and the key parked again since under
-- another request. Refused, it answers as a lapse of its request would (see lapse): its
-- proposal answered already ("given_back", "moved_on": no second answer) or not
-- ("superseded": the key went ahead without this request; answered so, once). A
-- resubmission that took the key over from this request, should it be given back, waits
-- for nobody.
local function release(c)
  local rec = record_of(c.ikey)
  local mine
  if rec and rec.h == c.hash then mine = holds(rec, c) end
  if mine ~= nil then
    local gone = gone_from(rec, c, mine, c.parked_until)
    -- (lapsed unseen: approved only past its expiry and the grace, its key moved on to
    -- a later attempt, and its proposal has had no answer: superseded)
    if gone then return refuse(gone == 'lapsed' and 'superseded' or gone) end
  elseif rec and rec.h == c.hash and take_unseen(c.ikey, rec, c, c.parked_until) then
    -- A request of an earlier version, whose park a later attempt replaced before its
    -- end was seen (see lapse): its key has moved on without it.
    return refuse('superseded')
  elseif rec and not (rec.s == 'PENDING' and rec.w == 1 and rec.h == c.hash) then
    -- A record or a request of an earlier version: the deadline tells.
    if rec.h == c.hash and not rec.pd and c.parked_until and rec.d == c.parked_until
        and RETRYABLE[rec.s] then
      -- The parked call was given back before its approvers released it (see lapse,
      -- "given_back"): it never ran, and its proposal was answered otherwise.
      return refuse('given_back')
    end
    if rec.s == 'PENDING' and rec.h == c.hash and rec.pd and rec.pd == c.parked_until
        and rec.e ~= 1 then
      rec.e = 1
      keep_record(c.ikey, rec)
    end
    if rec.h == c.hash and rec.pd and rec.pd == c.parked_until then
      return refuse(went_ahead(rec.c, c))
    end
    return refuse('superseded')
  end
  rec = rec or {h = c.hash, a = c.attempt or 1, r = c.run, i = c.rid}
  if rec.q then empty_take(rec.q) end  -- it goes: its take stays taken
  -- (kept, should this release's position be decided again as its request's end: see
  -- unrelease)
  rec.rp, rec.rq = rec.p, rec.q
  rec.s, rec.w, rec.c, rec.d, rec.p, rec.q = 'PENDING', 0, c.call, c.deadline, nil, nil
  rec.u = nil  -- (routed now)
  rec.nv = c.version or rec.nv  -- (the version it is routed as, which its result must name)
  put_record(c.ikey, rec, c.ttl)
  -- The attempt the parked call was admitted as: its result must say the same.
  return {ok = true, attempt = rec.a or 1}
end

-- A call's marker: "\2<key>\2<hash>\2<tool>[\3<version>]\2<parked 0|1>\2<what it
-- took>\2<verdict>" (what it took: see took; empty unless admitted; the version, where the
-- call names one: markers written before it was kept hold none). Markers an earlier
-- version wrote lead with "\1" and hold no "what it took". Anything else is a verdict
-- alone. Returns the key, hash, tool, parked, what it took, the verdict and the version
-- ('' or nil where none is kept).
local function marker_of(was)
  local lead = string.byte(was, 1)
  if lead == 2 then
    local ikey, hash, named, parked, took_, verdict =
      string.match(was, '^\2([^\2]*)\2([^\2]*)\2([^\2]*)\2([01])\2([^\2]*)\2(.*)$')
    if not ikey then return nil end
    local tool, version = string.match(named, '^([^\3]*)\3?(.*)$')
    return ikey, hash, tool, parked, took_, verdict, version
  elseif lead == 1 then
    local ikey, hash, tool, parked, verdict =
      string.match(was, '^\1([^\1]*)\1([^\1]*)\1([^\1]*)\1([01])\1(.*)$')
    return ikey, hash, tool, parked, '', verdict
  end
  return nil, nil, nil, nil, '', was
end

local function refund(id, field, by)
  local counters = run_of(id)
  local left = (counters[field] or 0) - by
  counters[field] = left > 1e-9 and left or nil
  run_dirty[id] = true
end

-- Give back what the call admitted at `pos` took from its run, its tenant's day and its
-- tool's rate, and the approvals it spent. Only for a call that never ran: its batch's
-- transaction aborted and the position was then decided as something else, or it failed
-- alone on a defect (void). Its step stays counted: the position is still a proposal of
-- its run. Returns whether it was a resubmitted parked call (which took nothing then, not
-- even a step: a caller that goes on counting the position counts its step), and the
-- deadline it was parked until. `run` nil: the run is not known, and keeps its counters.
local function give_back(pos, run, tool, took_, keep_rate)
  local again, cost, sig, day, interval, group, approvals =
    string.match(took_, '^([01]);([^;]*);([^;]*);([^;]*);([^;]*);([^;]*);(.*)$')
  if not again then return false, nil end
  if approvals ~= '' then
    for _, id in ipairs(cjson.decode(approvals)) do
      local key = base .. ':apr:' .. id
      if redis.call('GET', key) == pos then redis.call('DEL', key) end
    end
  end
  if again == '1' then return true, tonumber(cost) end
  if run then
    refund(run, 'sig:' .. sig, 1)
    refund(run, 'class:' .. group, 1)
    refund(run, 'cost', tonumber(cost))
  end
  if day ~= '' then
    days[day] = math.max(0, day_cost(day) - tonumber(cost))
    day_dirty[day] = true
  end
  if interval ~= '' and not keep_rate then
    local key = base .. ':rl:' .. tool
    local left = redis.call('PTTL', key)
    if left > 0 then
      -- (never below now: what has drained since is not given back a second time)
      tats[tool] = math.max(tat_of(tool) - tonumber(interval), H.now)
      tat_ttl[tool] = math.max(tat_ttl[tool] or 0, left)
    end
  end
  return false, nil
end

-- A marker's tool field: the tool, and the version its call names, if any.
local function named(tool, version)
  if not version or version == '' then return tool end
  return tool .. '\3' .. version
end

local function without_take(m)
  local ikey, hash, tool, parked, took_, verdict, version = marker_of(m)
  if not ikey or took_ == '' then return m end
  return '\2' .. ikey .. '\2' .. hash .. '\2' .. named(tool, version) .. '\2' .. parked
    .. '\2\2' .. verdict
end

-- (a marker this batch writes itself is emptied as it is written, at the end)
empty_take = function(pos)
  emptied[pos] = true
  local was = redis.call('HGET', done_key, pos)
  if was then redis.call('HSET', done_key, pos, without_take(was)) end
end

-- What a parked call took when it was parked (its record's p, taken at position q), given
-- back once: the position's marker no longer holds it. Its rate-limit arrival stays taken:
-- a request ends minutes after the call arrived, and GCRA cannot tell that arrival's share
-- of the tool's arrival time from later calls' (given back, it would let them through
-- faster than the rate).
give_back_park = function(rec)
  if not rec.p then return end
  give_back(rec.q or '', rec.r, rec.n, rec.p, true)
  if rec.q then empty_take(rec.q) end
  rec.p, rec.q = nil, nil
end

-- The record a call admitted at attempt `attempt` took, if it still holds it: back to
-- retryable (nothing ran), or, for a resubmitted parked call, back to waiting for approval
-- until the deadline it was parked until (in flight till then, as it was).
local function release_record(ikey, attempt, hash, call, resubmitted, parked_until, pos)
  local rec = record_of(ikey)
  if not (attempt and attempt >= 1 and rec and rec.s == 'PENDING' and rec.a == attempt
          and rec.h == hash and (call == nil or rec.c == call)) then
    return false
  end
  if resubmitted then
    if parked_until and parked_until > 0 then rec.d = parked_until end
    if rec.e == 1 then
      -- Its request ended while it went ahead (see lapse, "moved_on", and release,
      -- "superseded"): nobody can approve it now. It waits for nothing, and what parking
      -- it took comes back.
      give_back_park(rec)
      rec.w, rec.e, rec.u = 0, nil, 1  -- (and its call never ran: see settle)
    else
      rec.w = 1
    end
  else
    -- (a parked call's record keeps no deadline of a resubmission, and its own: a lapse
    -- of its request then finds it given back, see lapse)
    rec.s, rec.w = 'FAILED_RETRYABLE', 0
  end
  redeliver_held(ikey, rec, pos)
  keep_record(ikey, rec)
  return true
end

-- A call admitted for a record that then failed alone on a defect: it was answered
-- UNKNOWN_ERROR and never routed, so its record must not wait for a result that will not
-- come (a retry under its key would meet IDEMPOTENCY_CONFLICT until its deadline), nor
-- keep what it took from the budgets. Only what this very position took is undone: its
-- verdict must be "ok" with the attempt the record is at (a copy refused as in flight
-- holds nothing). Its verdict becomes a refusal, so a replay of its batch refuses it too,
-- even should the defect not recur. Nothing ran: a retry under the key is not blocked.
-- Idempotent: a position voided before says so.
local function void(c)
  local marker = redis.call('HGET', done_key, c.of)
  if not marker then return {status = 'unchanged'} end
  local ikey, hash, tool, _, took_, was = marker_of(marker)
  if was == 'no|voided|0' then return {status = 'voided'} end
  local attempt = was and tonumber(string.match(was, '^ok|(%d+)$'))
  local rec = record_of(c.ikey)
  if not (attempt and attempt >= 1 and rec and rec.c == c.call and rec.a == attempt
          and rec.s == 'PENDING') then
    return {status = 'unchanged'}
  end
  if ikey == c.ikey and took_ ~= '' then
    -- (a parked call resubmitted with its approvals waits for them again: its request
    -- was never ended, and its approvals are unspent)
    local resubmitted, parked_until = give_back(c.of, rec.r, tool, took_)
    release_record(c.ikey, attempt, hash, c.call, resubmitted, parked_until, c.of)
    -- (a resubmission took no step of its own; not going, it is a proposal like any other)
    if resubmitted then bump(rec.r, 'steps', 1) end
  else  -- a marker an earlier version wrote: the record alone
    rec.s, rec.w = 'FAILED_RETRYABLE', 0
    redeliver_held(c.ikey, rec, c.of)
    put_record(c.ikey, rec, c.ttl)
  end
  redis.call('HSET', done_key, c.of, 'no|voided|0')
  return {status = 'voided'}
end

-- A parked call whose approval request ended without it going: declined, expired, or
-- refused when its approvers released it. It never ran, so what it took when it was parked
-- (its class budget, cost, the day's cost and loop-guard count; not its rate-limit
-- arrival, see give_back_park) is given back, as for any call that never ran; its step
-- stays. Its record stops waiting
-- for approval and stays in flight until its deadline plus the grace period, as before:
-- the same call proposed after that is a new attempt, charged as one. "moved_on": a
-- resubmission carrying approvals took the key over (it ran, or runs). "given_back": the
-- parked call's own position was decided again as something else (its batch's transaction
-- aborted) or failed alone on a defect, which gave back what it took, made its record
-- retryable and answered its proposal: it never went ahead, and nothing comes back twice.
-- Only this request's park is given back (the record names its request, see holds): a
-- later one, parked afresh, is not. A request whose park is no longer the record's was
-- given back already, or replaced before its end was seen (see take_unseen): its end is
-- "lapsed" then (its proposal has had no answer; nothing is given back twice), or, for a
-- resubmission that went ahead, "moved_on" or "superseded" (see went_ahead).
-- The park `rec` holds ends without its call going: what parking took comes back, and the
-- record waits for nobody (and its call never ran: see settle).
local function end_park(ikey, rec, pos)
  give_back_park(rec)
  rec.w, rec.u = 0, 1
  redeliver_held(ikey, rec, pos)
  keep_record(ikey, rec)
  return {status = 'lapsed'}
end

local function lapse(c)
  local rec = record_of(c.ikey)
  if not rec or rec.h ~= c.hash then return {status = 'unchanged'} end
  local mine = holds(rec, c)
  if mine ~= nil then
    local gone = gone_from(rec, c, mine, c.deadline)
    if gone then return {status = gone} end
    return end_park(c.ikey, rec, c.pos)
  end
  -- A record or a request of an earlier version, which name no request: the deadline
  -- tells, as it did.
  local seen = take_unseen(c.ikey, rec, c, c.deadline)
  if seen then return {status = seen.c and went_ahead(seen.c, c) or 'lapsed'} end
  if not (rec.s == 'PENDING' and rec.w == 1) then
    if not rec.pd and rec.d == c.deadline and RETRYABLE[rec.s] then
      return {status = 'given_back'}  -- (see release_record: the park's own record)
    end
    -- A resubmission took the key over; only this request's end concerns it (an older
    -- request of the key, ended late, names another deadline).
    if rec.pd and rec.pd ~= c.deadline then return {status = 'unchanged'} end
    if rec.s == 'PENDING' and rec.pd and rec.e ~= 1 then
      rec.e = 1  -- given back, it waits for nobody
      keep_record(c.ikey, rec)
    end
    return {status = rec.pd and went_ahead(rec.c, c) or 'moved_on'}
  end
  if rec.d ~= c.deadline then return {status = 'unchanged'} end
  return end_park(c.ikey, rec, c.pos)
end

-- A release that went the first time, its batch then aborted (the call never ran), and
-- refused at its recheck on the replay: its request has ended after all, and what parking
-- took comes back, as the lapse it now is would have given it. "unchanged" where the
-- record is no longer that release's (written by an earlier version, which kept no take).
-- The release `rec` holds, undone by the decision at `pos`: the released call never ran.
-- What parking it took comes back (rp, taken at rq), the record knows its call was never
-- routed (see settle), and a failure held for it is delivered again.
local function undo_release(ikey, rec, pos)
  if rec.rp then give_back(rec.rq or '', rec.r, rec.n, rec.rp, true) end
  rec.rp, rec.rq, rec.u = nil, nil, 1
  redeliver_held(ikey, rec, pos)
  keep_record(ikey, rec)
end

local function unrelease(c)
  local rec = record_of(c.ikey)
  if not (rec and rec.h == c.hash and rec.s == 'PENDING' and rec.w == 0 and rec.rp) then
    return {status = 'unchanged'}
  end
  undo_release(c.ikey, rec, c.pos)
  return {status = 'lapsed'}
end

-- A parked call released by its approvers whose approval record then failed alone on a
-- defect (see app.py, _void): the call was never routed, and its proposal is answered
-- UNKNOWN_ERROR, so its record must not stay in flight as routed (a retry would meet
-- IDEMPOTENCY_CONFLICT until its deadline, and a retry after that would be charged again),
-- nor keep what parking took. The release is undone as unrelease undoes it, and the record
-- becomes retryable, as a voided call's does: nothing ran, and a retry under the key parks
-- afresh (its request has ended). Only the release this position admitted is undone: its
-- verdict "ok" with the attempt the record is at, the record still that release's. Its
-- verdict becomes a refusal, so a replay of its batch refuses the release too, even should
-- the defect not recur. Idempotent: a position voided before says so.
local function void_release(c)
  local was = redis.call('HGET', done_key, c.of)
  if was == 'no|voided|0' then return {status = 'voided'} end
  local attempt = was and tonumber(string.match(was, '^ok|(%d+)$'))
  local rec = record_of(c.ikey)
  if not (attempt and attempt >= 1 and rec and rec.c == c.call and (rec.a or 1) == attempt
          and rec.s == 'PENDING' and rec.w == 0 and not rec.pd) then
    return {status = 'unchanged'}
  end
  rec.s = 'FAILED_RETRYABLE'
  undo_release(c.ikey, rec, c.of)
  redis.call('HSET', done_key, c.of, 'no|voided|0')
  return {status = 'voided'}
end

-- A position decided this time as nothing admission counts (a proposal whose token has
-- expired since, say) after a call was admitted there and its transaction aborted: that
-- call never ran, and gives back what it took, once, as a call decided again as another
-- does (below). Nothing is written for a position that holds no call's marker: most such
-- proposals were never admitted, and their batches must not grow the replay markers.
--
-- Its run is the proposal's, or '' where the proposal no longer reads (a processor whose
-- limits changed meanwhile, say): the call's own record names it then, while it is still
-- that attempt's. A record that went on to another attempt names another call's run;
-- that run's counters are kept, and this one's stay spent, which refuses more, never less.
local function withdraw(a, was)
  if not was then return 'none' end
  local ikey, hash, tool, _, took_, verdict = marker_of(was)
  if not ikey or took_ == '' then return 'none' end
  local attempt = tonumber(string.match(verdict or '', '^ok|(%d+)$'))
  local run = a[3]
  if run == '' then
    local rec = record_of(ikey)
    run = rec and attempt and rec.a == attempt and rec.h == hash and rec.r or nil
  end
  local resubmitted, parked_until = give_back(a[2], run, tool, took_)
  release_record(ikey, attempt, hash, nil, resubmitted, parked_until, a[2])
  -- (decided again as a call, it is refused as changed; as a refused proposal, it passes)
  fresh[#fresh + 1] = a[2]
  fresh[#fresh + 1] = 'ok|0'
  return 'withdrawn'
end

-- A release and a lapse share the approval record's position (see app.py, _end_requests):
-- which one a replay sends depends on the release's recheck, which the world can change in
-- between. Each reads the other's verdict as the answer it would have given.
local LAPSE_AS_RELEASE = {
  lapsed = 'no|replay_changed|0', unchanged = 'no|replay_changed|0',
  given_back = 'no|given_back|0', moved_on = 'no|moved_on|0', superseded = 'no|superseded|0',
}
local RELEASE_AS_LAPSE = {
  ['no|given_back|0'] = 'given_back', ['no|moved_on|0'] = 'moved_on',
  ['no|superseded|0'] = 'superseded',
}

-- The held failures a decision delivered again before (see redeliver_held), delivered
-- again by its replay: '[<position>, [...]]' each.
local replayed, replayed_at = {}, {}
local any_kept  -- (whether the tenant has any: read once, at the first replayed position)
local function replay_redelivery(pos)
  if replayed_at[pos] then return end
  replayed_at[pos] = true
  if any_kept == nil then any_kept = redis.call('EXISTS', redeliver_key) == 1 end
  if not any_kept then return end
  local kept = redis.call('HGET', redeliver_key, pos)
  if kept then replayed[#replayed + 1] = '[' .. cjson.encode(pos) .. ',' .. kept .. ']' end
end

for i, a in ipairs(items) do
  local was = earlier[i]
  if was then replay_redelivery(a[2]) end
  if was and emptied[a[2]] then was = without_take(was) end
  if a[1] == 8 then
    out[i] = withdraw(a, was)
  elseif was then
    -- The verdict of this very position, unless the record was decided as something
    -- else this time (the world changed between the two: a refused proposal is now a
    -- call, or a call is another call or refused). A call never takes a refusal's or a
    -- release's "ok" (written 'ok|0'; a call's own names its attempt, 1 or more), nor
    -- another call's: it would go with no record and no charge of its own. A call
    -- admitted the first time and decided as anything else now never ran (its
    -- transaction aborted): what it took is given back (its record, budgets, rate and
    -- approvals), once, and the position answers as a refusal from then on.
    local ikey, hash, tool, parked, took_, verdict, version = marker_of(was)
    -- (a marker that keeps no version was written before versions were kept, as its
    -- record was, which names none: the version its result names is not checked)
    local same = ikey and a[1] == 1 and ikey == a[7] and hash == a[8] and tool == a[4]
      and parked == (a[11] == 1 and '1' or '0')
      and (version == nil or version == '' or version == (opt(a[16]) or ''))
    -- A call admitted here (its take already given back or kept, if it was parked and
    -- its request ended or it went) that is a refused proposal now.
    local now_step = ikey and a[1] == 2 and string.sub(verdict or '', 1, 3) == 'ok|'
    if a[1] == 4 and not ikey and LAPSE_AS_RELEASE[verdict] then
      -- A release at the approval record's position, which was decided the first time as
      -- the end of its request (refused at its recheck). It answers as that end did: a
      -- call given back or gone ahead without it as such; one whose take the lapse gave
      -- back must not go on it: refused as changed, and proposed again it is decided
      -- afresh.
      out[i] = LAPSE_AS_RELEASE[verdict]
    elseif a[1] == 7 and not ikey and RELEASE_AS_LAPSE[verdict] then
      -- The other way round: released the first time, refused at its recheck now.
      out[i] = RELEASE_AS_LAPSE[verdict]
    elseif a[1] == 7 and not ikey and string.match(verdict, '^ok|%d+$') then
      -- Released and gone the first time: undone, once (the position answers as the
      -- lapse from now on).
      out[i] = encode(unrelease(unwire(a)))
      fresh[#fresh + 1] = a[2]
      fresh[#fresh + 1] = out[i]
    elseif ikey and not same and (took_ ~= '' or now_step) then
      local resubmitted = false
      if took_ ~= '' then
        local attempt = tonumber(string.match(verdict or '', '^ok|(%d+)$'))
        local parked_until
        resubmitted, parked_until = give_back(a[2], a[3], tool, took_)
        release_record(ikey, attempt, hash, nil, resubmitted, parked_until, a[2])
      end
      if a[1] == 2 then
        -- Decided as any refused proposal is (a repair counts, once: this verdict is the
        -- position's from now on), on the step the call counted within the cap (a
        -- resubmission took none: it counts one now).
        out[i] = encode(admit_step(unwire(a), not resubmitted))
      else
        if resubmitted then bump(a[3], 'steps', 1) end
        out[i] = 'no|replay_changed|0'
      end
      fresh[#fresh + 1] = a[2]
      fresh[#fresh + 1] = out[i]
    elseif verdict == nil or (a[1] == 1 and (verdict == 'ok|0' or not same and ikey)) then
      out[i] = 'no|replay_changed|0'
    else
      out[i] = verdict
    end
  else
    local c = unwire(a)
    local verdict
    if c.kind == 'call' then
      verdict = admit_call(c)
    elseif c.kind == 'step' then
      verdict = admit_step(c)
    elseif c.kind == 'release' then
      verdict = release(c)
    elseif c.kind == 'void' and c.released then
      verdict = void_release(c)
    elseif c.kind == 'void' then
      verdict = void(c)
    elseif c.kind == 'comp_failed' then
      verdict = comp_failed(c)
    elseif c.kind == 'lapse' then
      verdict = lapse(c)
    else
      verdict = settle(c)
    end
    local text = encode(verdict)
    if c.kind == 'call' then
      fresh[#fresh + 1] = c.pos
      fresh[#fresh + 1] = '\2' .. c.ikey .. '\2' .. c.hash .. '\2' .. named(c.tool, c.version)
        .. '\2' .. (c.park and '1' or '0') .. '\2' .. (verdict.took or '') .. '\2' .. text
    elseif c.kind ~= 'void' and c.kind ~= 'comp_failed' then  -- (both idempotent)
      fresh[#fresh + 1] = c.pos
      fresh[#fresh + 1] = text
    end
    out[i] = text
  end
end
if next(emptied) then
  for k = 1, #fresh, 2 do
    if emptied[fresh[k]] then fresh[k + 1] = without_take(fresh[k + 1]) end
  end
end
for first = 1, #fresh, 2 * CHUNK do
  redis.call('HSET', done_key, unpack(fresh, first, math.min(first + 2 * CHUNK - 1, #fresh)))
end
local delivered = replayed
for pos, list in pairs(redelivered) do
  local new = table.concat(list, ',')
  local kept = redis.call('HGET', redeliver_key, pos)
  kept = kept and (string.sub(kept, 1, -2) .. ',' .. new .. ']') or ('[' .. new .. ']')
  redis.call('HSET', redeliver_key, pos, kept)
  delivered[#delivered + 1] = '[' .. cjson.encode(pos) .. ',[' .. new .. ']]'
end
out[#items + 1] = '[' .. table.concat(delivered, ',') .. ']'
-- Each written record or run goes to its day's hash, and leaves the one it came from.
local function write_back(dirty, values, found_in, bucket, expire_at)
  local puts, drops = {}, {}
  for id, day in pairs(dirty) do
    puts[day] = puts[day] or {}
    local flat = puts[day]
    flat[#flat + 1] = id
    flat[#flat + 1] = cjson.encode(values[id])
    local was = found_in[id]
    if was and was ~= day then
      drops[was] = drops[was] or {}
      drops[was][#drops[was] + 1] = id
    end
  end
  for day, flat in pairs(puts) do
    for first = 1, #flat, 2 * CHUNK do
      redis.call('HSET', bucket(day), unpack(flat, first, math.min(first + 2 * CHUNK - 1, #flat)))
    end
    redis.call('PEXPIREAT', bucket(day), expire_at(day))
  end
  for day, ids in pairs(drops) do
    for first = 1, #ids, CHUNK do
      redis.call('HDEL', bucket(day), unpack(ids, first, math.min(first + CHUNK - 1, #ids)))
    end
  end
end
for id in pairs(run_dirty) do run_dirty[id] = today end
write_back(record_dirty, records, record_day, idem_bucket, function(day) return (day + 1) * DAY end)
write_back(run_dirty, runs, run_day, run_bucket, function(day) return (day + 1) * DAY + run_ttl end)
for tool, ttl in pairs(tat_ttl) do
  redis.call('SET', base .. ':rl:' .. tool, tats[tool], 'PX', ttl)
end
for day in pairs(day_dirty) do
  redis.call('HSET', base .. ':day:' .. day, 'cost', days[day])
  redis.call('PEXPIRE', base .. ':day:' .. day, 2 * 86400000)
end
return out
