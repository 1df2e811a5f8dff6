-- Admission of one tenant's proposals and results in one batch: idempotency,
-- rate limits, run and day budgets, the loop guard and the repair guard.
--
-- KEYS[1]  the tenant's key prefix, "<ns>:{<tenant>}"; every key below starts with
--          it, so all of them share the tenant's cluster slot
-- ARGV[1]  JSON header: what every item shares (see admission.py, _header)
-- ARGV[2]  JSON list of items, in the batch's order, each a positional list whose first
--          element is its kind (see admission.py, _WIRE):
--          1 call     a proposal every earlier gate accepted (routed or parked)
--          2 step     a proposal an earlier gate refused (it still is a step of its run)
--          3 result   an executor's result for a routed call
--          4 release  a parked call its approvers released
-- ARGV[3]  how long a run's counters live (ms)
--
-- Returns one verdict string per item: "ok|<attempt>", "no|<why>|<retry after ms>",
-- "hit|<state>|<call>|<cached answer>", or a result's "settled[|tok|<token>]",
-- "settled|compensated|<key>", "duplicate", "stale|<state>", "unknown". Short strings,
-- not JSON: decoding and encoding are most of a script's cost per item.
--
-- Replay safety: every verdict is kept in the tenant's 'done' hash under its input
-- record's position (topic/partition/offset) until the batch's Kafka transaction
-- commits. A batch applied again after an aborted transaction gets the verdicts it got
-- the first time, and no counter or record moves twice.

local base = KEYS[1]
local H = cjson.decode(ARGV[1])
local items = cjson.decode(ARGV[2])
local run_ttl = tonumber(ARGV[3])
local done_key = base .. ':done'
local out = {}

local function opt(v) if v == '' or v == -1 or v == cjson.null then return nil end return v end

-- Positional items to named fields, with what the header says for them.
local function unwire(a)
  local kind = a[1]
  if kind == 1 then
    local t = H.tools[a[4]]
    return {kind = 'call', pos = a[2], run = a[3], tool = a[4], group = a[5], sig = a[6],
            ikey = a[7], hash = a[8], call = a[9], deadline = a[10], park = a[11] == 1,
            tok = a[12], cost = t[1], rate = t[2] > 0 and {t[2], t[3]} or nil, ttl = t[4],
            exempt = t[5] == 1,
            class_budget = H.classes[a[5]] or 0, steps = H.steps, repeats = H.repeats,
            cost_cap = H.cost_cap, day_cap = opt(H.day_cap), day = H.day, now = H.now,
            grace = H.grace}
  elseif kind == 2 then
    return {kind = 'step', pos = a[2], run = a[3], sig = a[4], repair = a[5] == 1,
            ikey = opt(a[6]), hash = a[7], steps = H.steps, max_repairs = H.max_repairs}
  elseif kind == 3 then
    return {kind = 'result', pos = a[2], ikey = a[3], call = a[4], result_id = a[5],
            state = a[6], cached = a[7], ttl = a[8], compensation_key = opt(a[9]),
            compensates = opt(a[10])}
  end
  return {kind = 'release', pos = a[2], run = a[3], ikey = a[4], hash = a[5], call = a[6],
          deadline = a[7], ttl = a[8]}
end

local function encode(v)
  if v.status then
    if v.tok then return 'settled|tok|' .. v.tok end
    if v.compensated then return 'settled|compensated|' .. v.compensated end
    if v.state then return v.status .. '|' .. v.state end
    return v.status
  end
  if v.ok then return 'ok|' .. (v.attempt or 0) end
  if v.why == 'idempotent_hit' then
    return 'hit|' .. v.state .. '|' .. v.call .. '|' .. (v.cached or '')
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

-- A run's counters (steps, class:<group>, cost, sig:<signature>, repairs, bad:<signature>),
-- a tool's GCRA arrival time and a day's cost are read once per script call, kept here
-- while the batch is decided, and written back once at the end.
local runs, run_dirty = {}, {}
local tats, tat_ttl = {}, {}
local days, day_dirty = {}, {}

local function run_of(id)
  local counters = runs[id]
  if not counters then
    counters = {}
    local flat = redis.call('HGETALL', base .. ':run:' .. id)
    for i = 1, #flat, 2 do counters[flat[i]] = tonumber(flat[i + 1]) end
    runs[id] = counters
    run_dirty[id] = {}
  end
  return counters
end

local function bump(id, field, by)
  local counters = run_of(id)
  counters[field] = (counters[field] or 0) + by
  run_dirty[id][field] = true
end

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
  if not c.exempt and (counters.steps or 0) >= c.steps then return refuse('step_cap') end
  if (counters['sig:' .. c.sig] or 0) >= c.repeats then return refuse('loop') end
  if charged then return nil end
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

local function admit_call(c)
  local counters = run_of(c.run)
  local idem_key = base .. ':idem:' .. c.ikey
  local rec = redis.call('HMGET', idem_key, 'state', 'hash', 'call', 'deadline', 'awaiting',
                         'attempt', 'cached')
  local state, attempt, charged = rec[1], tonumber(rec[6] or '0'), false
  if state then
    if rec[2] ~= c.hash then
      bump(c.run, 'steps', 1)
      return refuse('signature_mismatch')
    end
    if FINAL[state] then
      bump(c.run, 'steps', 1)
      return {ok = false, why = 'idempotent_hit', state = state, call = rec[3], cached = rec[7]}
    end
    if state == 'PENDING' then
      local deadline = tonumber(rec[4])
      if rec[5] == '1' and not c.park then
        charged = true             -- the parked call, now resubmitted with its approvals
      elseif c.now < deadline + c.grace then
        bump(c.run, 'steps', 1)
        return refuse('in_flight', deadline + c.grace - c.now)
      end
      -- else: the deadline and the grace period passed with no result; by rule the
      -- key is retryable, as if the call had expired
    elseif not RETRYABLE[state] then
      bump(c.run, 'steps', 1)
      return refuse('signature_mismatch')
    end
  end
  local refusal = limits(c, counters, charged)
  bump(c.run, 'steps', 1)
  if refusal then return refusal end
  bump(c.run, 'sig:' .. c.sig, 1)
  if not charged then charge(c) end
  local next_attempt = charged and math.max(attempt, 1) or attempt + 1
  redis.call('HSET', idem_key, 'state', 'PENDING', 'hash', c.hash, 'call', c.call,
             'deadline', c.deadline, 'awaiting', c.park and '1' or '0',
             'attempt', next_attempt, 'run', c.run, 'tok', c.tok)
  if state then redis.call('HDEL', idem_key, 'cached', 'result') end
  redis.call('PEXPIRE', idem_key, c.ttl)
  return {ok = true, attempt = next_attempt}
end

local function admit_step(c)
  local counters = run_of(c.run)
  if c.ikey then
    -- Refused on the world's state, but maybe because this very call already ran.
    local rec = redis.call('HMGET', base .. ':idem:' .. c.ikey, 'state', 'hash', 'call', 'cached')
    if rec[1] and FINAL[rec[1]] and rec[2] == c.hash then
      bump(c.run, 'steps', 1)
      return {ok = false, why = 'idempotent_hit', state = rec[1], call = rec[3], cached = rec[4]}
    end
  end
  local steps = counters.steps or 0
  bump(c.run, 'steps', 1)
  if not c.repair then
    if steps >= c.steps then return refuse('step_cap') end
    return {ok = true}
  end
  local same = counters['bad:' .. c.sig] or 0
  local repairs = counters.repairs or 0
  bump(c.run, 'repairs', 1)
  bump(c.run, 'bad:' .. c.sig, 1)
  if steps >= c.steps then return refuse('step_cap') end
  if same >= 1 then return refuse('repair_loop') end
  if repairs >= c.max_repairs then return refuse('repair_cap') end
  return {ok = true}
end

-- An executor's result settles the call's record. Only the attempt the record is
-- waiting for settles it; a result for an older attempt (the key was retried since)
-- or a second copy of the same result changes nothing.
local function settle(c)
  local idem_key = base .. ':idem:' .. c.ikey
  local rec = redis.call('HMGET', idem_key, 'state', 'call', 'result', 'tok')
  if not rec[1] then return {status = 'unknown'} end
  if rec[3] == c.result_id then return {status = 'duplicate'} end
  if rec[2] ~= c.call or rec[1] ~= 'PENDING' then return {status = 'stale', state = rec[1]} end
  redis.call('HSET', idem_key, 'state', c.state, 'result', c.result_id, 'cached', c.cached,
             'awaiting', '0')
  redis.call('HDEL', idem_key, 'tok')
  redis.call('PEXPIRE', idem_key, c.ttl)
  local verdict = {status = 'settled'}
  if c.compensation_key then
    -- The compensating call is proposed under this key; the original is compensated
    -- once that call completes.
    redis.call('HSET', idem_key, 'compensation', c.compensation_key)
    verdict.tok = rec[4]
  end
  if c.compensates and c.state == 'COMPLETED' then
    local orig_key = base .. ':idem:' .. c.compensates
    if redis.call('HGET', orig_key, 'compensation') == c.ikey then
      redis.call('HSET', orig_key, 'state', 'COMPENSATED')
      verdict.compensated = c.compensates
    end
  end
  return verdict
end

-- A parked call released by its approvers. It goes only if its record still waits for
-- approval: a resubmission that carried approvals may have taken the key over already.
local function release(c)
  local idem_key = base .. ':idem:' .. c.ikey
  local rec = redis.call('HMGET', idem_key, 'state', 'hash', 'awaiting')
  if rec[1] and not (rec[1] == 'PENDING' and rec[3] == '1' and rec[2] == c.hash) then
    return refuse('superseded')
  end
  if not rec[1] then
    redis.call('HSET', idem_key, 'hash', c.hash, 'attempt', 1, 'run', c.run)
    redis.call('PEXPIRE', idem_key, c.ttl)
  end
  redis.call('HSET', idem_key, 'state', 'PENDING', 'awaiting', '0', 'call', c.call,
             'deadline', c.deadline)
  return {ok = true}
end

local fresh = {}
for i, a in ipairs(items) do
  if earlier[i] then
    out[i] = earlier[i]
  else
    local c = unwire(a)
    local verdict
    if c.kind == 'call' then
      verdict = admit_call(c)
    elseif c.kind == 'step' then
      verdict = admit_step(c)
    elseif c.kind == 'release' then
      verdict = release(c)
    else
      verdict = settle(c)
    end
    local text = encode(verdict)
    fresh[#fresh + 1] = c.pos
    fresh[#fresh + 1] = text
    out[i] = text
  end
end
for first = 1, #fresh, 2 * CHUNK do
  redis.call('HSET', done_key, unpack(fresh, first, math.min(first + 2 * CHUNK - 1, #fresh)))
end
for id, fields in pairs(run_dirty) do
  local flat = {}
  for field in pairs(fields) do
    flat[#flat + 1] = field
    flat[#flat + 1] = runs[id][field]
  end
  local run_key = base .. ':run:' .. id
  if #flat > 0 then redis.call('HSET', run_key, unpack(flat)) end
  redis.call('PEXPIRE', run_key, run_ttl)
end
for tool, ttl in pairs(tat_ttl) do
  redis.call('SET', base .. ':rl:' .. tool, tats[tool], 'PX', ttl)
end
for day in pairs(day_dirty) do
  redis.call('HSET', base .. ':day:' .. day, 'cost', days[day])
  redis.call('PEXPIRE', base .. ':day:' .. day, 2 * 86400000)
end
return out
