#!lua
-- (The shebang, Redis 7+, declares a script that writes: a replica refuses it.)
-- tollgate background sync: the settings every node of a prefix must share (see
-- `sync::agree`). Each node writes its own, stamped with Redis's clock, and reads every
-- node's; an entry older than the staleness is dropped.
-- KEYS[1]: the prefix's settings, a hash: field `<node id>:<quota>`, value `<ms>|<settings>`.
-- ARGV: this node's field, its settings (empty: read only, as a build does before it
--   knows it will run), the staleness (ms).
-- Returns {field, settings} for every entry written within the staleness.
local stale = tonumber(ARGV[3])
if not (#KEYS == 1 and #ARGV == 3 and stale and stale >= 1 and stale == math.floor(stale)) then
  return redis.error_reply('TOLLGATE invalid settings arguments')
end
local time = redis.call('TIME')
local now = time[1] * 1000 + math.floor(time[2] / 1000)
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], ARGV[1], string.format('%.0f', now) .. '|' .. ARGV[2])
  redis.call('PEXPIRE', KEYS[1], stale)
end
local all = redis.call('HGETALL', KEYS[1])
local out = {}
for j = 1, #all, 2 do
  local at, settings = string.match(all[j + 1], '^(%d+)|(.*)$')
  if at and now - tonumber(at) <= stale then
    out[#out + 1] = all[j]
    out[#out + 1] = settings
  else
    redis.call('HDEL', KEYS[1], all[j])
  end
end
return out
