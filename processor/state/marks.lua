-- Mark reference partitions as loading, where their position still stands behind the end
-- given: a loader may have reached that end since the end and the position were read, and
-- a mark set then would wait for a write that may never come (positions.lua removes a mark
-- only with a position written after it).
--
-- KEYS[1]  the loaders' position hash (see positions.lua)
-- ARGV     pairs: a field ("<topic>/<partition>") and the end its partition must reach
--
-- Returns how many partitions it marked. A partition with no position is not marked: it
-- is not loaded anyway until a loader has placed it.
local marked = 0
for i = 1, #ARGV, 2 do
  local field, target = ARGV[i], tonumber(ARGV[i + 1])
  local here = redis.call('HGET', KEYS[1], field)
  if here and tonumber(here) < target then
    redis.call('HSET', KEYS[1], ':loading:' .. field, target)
    marked = marked + 1
  end
end
return marked
