-- Admission of one tenant's proposals and results in one batch: idempotency,
-- rate limits, run and day budgets, the loop guard and the repair guard.
--
-- KEYS[1]  the tenant's key prefix, "<ns>:{<tenant>}"; every key below starts with
--          it, so all of them share the tenant's cluster slot
-- ARGV[1]  JSON list of items, in the batch's order (see admission.py for the fields):
--          kind "call"   a proposal every earlier gate accepted (routed or parked)
--          kind "step"   a proposal an earlier gate refused (it still is a step of its run)
--          kind "result" an executor's result for a routed call
--          kind "release" a parked call its approvers released
-- ARGV[2]  how long a run's counters live (ms)
--
-- Returns a JSON list of verdicts, one per item.
--
-- Replay safety: every verdict is kept in the tenant's 'done' hash under its input
-- record's position (topic/partition/offset) until the batch's Kafka transaction
-- commits. A batch applied again after an aborted transaction gets the verdicts it got
-- the first time, and no counter or record moves twice.

local base = KEYS[1]
local items = cjson.decode(ARGV[1])
local run_ttl = tonumber(ARGV[2])
local done_key = base .. ':done'
local out = {}

-- Lua's stack bounds unpack(): long lists go to Redis in chunks.
local CHUNK = 1000
local earlier = {}
for first = 1, #items, CHUNK do
  local positions = {}
  for i = first, math.min(first + CHUNK - 1, #items) do positions[#positions + 1] = items[i].pos end
  local got = redis.call('HMGET', done_key, unpack(positions))
  for k = 1, #positions do earlier[first + k - 1] = got[k] end
end

local FINAL = {COMPLETED = true, FAILED_FINAL = true, COMPENSATED = true}
local RETRYABLE = {FAILED_RETRYABLE = true, EXPIRED = true}
local touched = {}

local function refuse(why, retry_after)
  return {ok = false, why = why, retry_after_ms = retry_after or 0}
end

local function count_step(run_key)
  redis.call('HINCRBY', run_key, 'steps', 1)
  touched[run_key] = true
end

-- The budgets and the rate limit of an admissible call; nil when it may go.
-- `charged`: the call was charged when it was parked, and is only being released now.
local function limits(c, run_key, v, charged)
  local steps, in_class, cost, repeats = v.steps, v.in_class, v.cost, v.repeats
  if steps >= c.steps then return refuse('step_cap') end
  if repeats >= c.repeats then return refuse('loop') end
  if charged then return nil end
  if in_class >= c.class_budget then return refuse('class_budget') end
  if cost + c.cost > c.cost_cap then return refuse('cost_cap') end
  if c.day_cap ~= cjson.null then
    local spent = tonumber(redis.call('HGET', base .. ':day:' .. c.day, 'cost') or '0')
    if spent + c.cost > c.day_cap then return refuse('day_cost_cap') end
  end
  if c.rate ~= cjson.null then
    local interval, burst = c.rate[1], c.rate[2]
    local tat = tonumber(redis.call('GET', base .. ':rl:' .. c.tool) or '0')
    local new_tat = math.max(tat, c.now) + interval
    local allow_at = new_tat - interval * burst
    if c.now < allow_at then return refuse('rate_limited', allow_at - c.now) end
    v.new_tat = new_tat
  end
  return nil
end

local function admit_call(c)
  local run_key = base .. ':run:' .. c.run
  local class_field = 'class:' .. c.group
  local sig_field = 'sig:' .. c.sig
  local r = redis.call('HMGET', run_key, 'steps', class_field, 'cost', sig_field)
  local v = {steps = tonumber(r[1] or '0'), in_class = tonumber(r[2] or '0'),
             cost = tonumber(r[3] or '0'), repeats = tonumber(r[4] or '0')}
  local idem_key = base .. ':idem:' .. c.ikey
  local rec = redis.call('HMGET', idem_key, 'state', 'hash', 'call', 'deadline', 'awaiting',
                         'attempt', 'cached')
  local state, attempt, charged = rec[1], tonumber(rec[6] or '0'), false
  if state then
    if rec[2] ~= c.hash then
      count_step(run_key)
      return refuse('signature_mismatch')
    end
    if FINAL[state] then
      count_step(run_key)
      return {ok = false, why = 'idempotent_hit', state = state, call = rec[3], cached = rec[7]}
    end
    if state == 'PENDING' then
      local deadline = tonumber(rec[4])
      if rec[5] == '1' and not c.park then
        charged = true             -- the parked call, now resubmitted with its approvals
      elseif c.now < deadline + c.grace then
        count_step(run_key)
        return refuse('in_flight', deadline + c.grace - c.now)
      end
      -- else: the deadline and the grace period passed with no result; by rule the
      -- key is retryable, as if the call had expired
    elseif not RETRYABLE[state] then
      count_step(run_key)
      return refuse('signature_mismatch')
    end
  end
  local refusal = limits(c, run_key, v, charged)
  if refusal then
    count_step(run_key)
    return refusal
  end
  redis.call('HSET', run_key, 'steps', v.steps + 1, sig_field, v.repeats + 1)
  if not charged then
    redis.call('HSET', run_key, class_field, v.in_class + 1, 'cost', v.cost + c.cost)
    if c.day_cap ~= cjson.null and c.cost > 0 then
      local day_key = base .. ':day:' .. c.day
      redis.call('HINCRBYFLOAT', day_key, 'cost', c.cost)
      redis.call('PEXPIRE', day_key, 2 * 86400000)
    end
    if v.new_tat then
      redis.call('SET', base .. ':rl:' .. c.tool, v.new_tat, 'PX', c.rate[1] * c.rate[2] * 2)
    end
  end
  touched[run_key] = true
  local next_attempt = charged and math.max(attempt, 1) or attempt + 1
  redis.call('HSET', idem_key, 'state', 'PENDING', 'hash', c.hash, 'call', c.call,
             'deadline', c.deadline, 'awaiting', c.park and '1' or '0',
             'attempt', next_attempt, 'run', c.run, 'tok', c.tok or '')
  redis.call('HDEL', idem_key, 'cached', 'result')
  redis.call('PEXPIRE', idem_key, c.ttl)
  return {ok = true, attempt = next_attempt}
end

local function admit_step(c)
  local run_key = base .. ':run:' .. c.run
  local r = redis.call('HMGET', run_key, 'steps', 'repairs', 'bad:' .. c.sig)
  local steps, repairs, same = tonumber(r[1] or '0'), tonumber(r[2] or '0'), tonumber(r[3] or '0')
  touched[run_key] = true
  if not c.repair then
    redis.call('HSET', run_key, 'steps', steps + 1)
    if steps >= c.steps then return refuse('step_cap') end
    return {ok = true}
  end
  redis.call('HSET', run_key, 'steps', steps + 1, 'repairs', repairs + 1, 'bad:' .. c.sig, same + 1)
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
  if c.compensation_key ~= cjson.null then
    -- The compensating call is proposed under this key; the original is compensated
    -- once that call completes.
    redis.call('HSET', idem_key, 'compensation', c.compensation_key)
    verdict.tok = rec[4]
  end
  if c.compensates ~= cjson.null and c.state == 'COMPLETED' then
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
for i, c in ipairs(items) do
  if earlier[i] then
    out[i] = cjson.decode(earlier[i])
  else
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
    fresh[#fresh + 1] = c.pos
    fresh[#fresh + 1] = cjson.encode(verdict)
    out[i] = verdict
  end
end
for first = 1, #fresh, 2 * CHUNK do
  redis.call('HSET', done_key, unpack(fresh, first, math.min(first + 2 * CHUNK - 1, #fresh)))
end
for run_key in pairs(touched) do
  redis.call('PEXPIRE', run_key, run_ttl)
end
return cjson.encode(out)
