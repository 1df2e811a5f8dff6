-- Rate limits, run budgets and the loop guard for one tenant's calls in one batch.
--
-- KEYS[1]  the tenant's key prefix, "<ns>:{<tenant>}" (every key below shares its slot)
-- ARGV[1]  JSON list of checks, in the batch's order:
--   {pos, run, tool, class, cost, sig, now,
--    rate = [interval_ms, burst] | null,       -- GCRA: one call per interval, bursts of burst
--    steps = max proposals per run,
--    class_budget = max calls of this class per run,
--    cost_cap = max cost per run,
--    repeats = how many identical calls a run may make}
-- ARGV[2]  how long a run's counters live (ms)
--
-- Returns a JSON list of verdicts: {ok = true} or {ok = false, why = ..., retry_after_ms = ...}.
--
-- Replay safety: each verdict is kept in the tenant's 'done' hash under its input
-- record's position (topic/partition/offset) until the batch's Kafka transaction
-- commits. A batch checked again after an aborted transaction gets the verdicts it
-- got the first time, and no counter moves twice.
--
-- A run's counters live in one hash (steps, class:<C>, cost, sig:<signature>), read
-- once and written once per check; a tool's GCRA arrival time in one string.

local base = KEYS[1]
local checks = cjson.decode(ARGV[1])
local ttl = tonumber(ARGV[2])
local done_key = base .. ':done'
local out = {}

-- Lua's stack bounds unpack(): long lists go to Redis in chunks.
local CHUNK = 1000
local earlier = {}
for first = 1, #checks, CHUNK do
  local positions = {}
  for i = first, math.min(first + CHUNK - 1, #checks) do positions[#positions + 1] = checks[i].pos end
  local got = redis.call('HMGET', done_key, unpack(positions))
  for k = 1, #positions do earlier[first + k - 1] = got[k] end
end

local fresh = {}
local touched = {}
for i, c in ipairs(checks) do
  if earlier[i] then
    out[i] = cjson.decode(earlier[i])
  else
    local run_key = base .. ':run:' .. c.run
    local class_field = 'class:' .. c.class
    local sig_field = 'sig:' .. c.sig
    local v = redis.call('HMGET', run_key, 'steps', class_field, 'cost', sig_field)
    local steps = tonumber(v[1] or '0')
    local in_class = tonumber(v[2] or '0')
    local cost = tonumber(v[3] or '0')
    local repeats = tonumber(v[4] or '0')
    local verdict
    local rl_key, new_tat
    if steps >= c.steps then
      verdict = {ok = false, why = 'step_cap', retry_after_ms = 0}
    elseif repeats >= c.repeats then
      verdict = {ok = false, why = 'loop', retry_after_ms = 0}
    elseif in_class >= c.class_budget then
      verdict = {ok = false, why = 'class_budget', retry_after_ms = 0}
    elseif cost + c.cost > c.cost_cap then
      verdict = {ok = false, why = 'cost_cap', retry_after_ms = 0}
    else
      verdict = {ok = true}
      if c.rate ~= cjson.null then
        local interval, burst = c.rate[1], c.rate[2]
        rl_key = base .. ':rl:' .. c.tool
        local tat = tonumber(redis.call('GET', rl_key) or '0')
        new_tat = math.max(tat, c.now) + interval
        local allow_at = new_tat - interval * burst
        if c.now < allow_at then
          verdict = {ok = false, why = 'rate_limited', retry_after_ms = allow_at - c.now}
        end
      end
    end
    -- Every proposal that reaches the gate is a step of its run, allowed or not: a run
    -- that keeps proposing refused calls still runs out of steps.
    if verdict.ok then
      redis.call('HSET', run_key, 'steps', steps + 1, class_field, in_class + 1,
                 'cost', cost + c.cost, sig_field, repeats + 1)
      if rl_key then
        redis.call('SET', rl_key, new_tat, 'PX', c.rate[1] * c.rate[2] * 2)
      end
    else
      redis.call('HSET', run_key, 'steps', steps + 1)
    end
    touched[run_key] = true
    fresh[#fresh + 1] = c.pos
    fresh[#fresh + 1] = cjson.encode(verdict)
    out[i] = verdict
  end
end
for first = 1, #fresh, 2 * CHUNK do
  redis.call('HSET', done_key, unpack(fresh, first, math.min(first + 2 * CHUNK - 1, #fresh)))
end
for run_key in pairs(touched) do
  redis.call('PEXPIRE', run_key, ttl)
end
return cjson.encode(out)
