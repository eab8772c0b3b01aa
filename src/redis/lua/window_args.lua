#!lua
-- (The shebang, Redis 7+, declares a script that writes: a replica refuses it before it
-- runs, with MOVED in a cluster, even on a READONLY connection, so a client whose slot
-- map is stale after a failover is redirected instead of failing on the first write.)
-- tollgate's window counters, in integer microseconds: this prelude reads and checks the
-- arguments, then fixed_window.lua or sliding_window.lua, appended to it, decides.
-- KEYS[1]: the limiter key. ARGV: limit, period, cost, now (empty: the server's TIME).
-- Returns {allowed, limit, remaining, reset_after_us, retry_after_us}.
-- Every number stays an integer below 2^53, exact in Lua's doubles.
local limit, period, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if not (limit and period and limit >= 1 and period >= 1 and limit % 1 == 0 and period % 1 == 0
    and limit * period < 9007199254740992) then
  return redis.error_reply('TOLLGATE invalid quota')
end
if not (cost and cost >= 0 and cost % 1 == 0 and cost <= limit) then
  return redis.error_reply('TOLLGATE invalid cost')
end
local now
if ARGV[4] == '' then
  local time = redis.call('TIME')
  now = time[1] * 1000000 + time[2]
else
  now = tonumber(ARGV[4])
  if not (now and now >= 0 and now % 1 == 0 and now < 4503599627370496) then
    return redis.error_reply('TOLLGATE invalid time')
  end
end
