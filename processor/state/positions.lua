-- A reference loader's positions, moved forward with each batch it writes, unless Redis
-- lost some of what the loader wrote before (a failover to a replica that missed the
-- latest writes, a restore from an older snapshot, a flushed database): a plain write
-- would cover that up, and the records in the lost range would never be loaded again.
--
-- KEYS[1]  the loader's position hash (field "<topic>/<partition>"; a partition being
--          loaded again also has ":loading:<topic>/<partition>", the position it must
--          reach before lookups read it, see references.py)
-- ARGV     triples: a field, the position the loader last wrote there (-1: none yet),
--          and the batch's new position
--
-- Returns a flat list of field, position Redis holds (0 for none) for each field that
-- stands behind what the loader wrote; nothing is written for those, and the loader
-- reads them again from there. A position written that reaches its partition's
-- ":loading:" mark removes the mark.
local behind = {}
for i = 1, #ARGV, 3 do
  local field, mine, new = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local there = tonumber(redis.call('HGET', KEYS[1], field) or '0')
  if mine >= 0 and there < mine then
    behind[#behind + 1] = field
    behind[#behind + 1] = tostring(there)
  else
    redis.call('HSET', KEYS[1], field, ARGV[i + 2])
    local mark = redis.call('HGET', KEYS[1], ':loading:' .. field)
    if mark and new >= tonumber(mark) then
      redis.call('HDEL', KEYS[1], ':loading:' .. field)
    end
  end
end
return behind
