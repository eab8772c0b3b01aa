#!lua
-- (The shebang, Redis 7+, declares a script that writes: a replica refuses it before it
-- runs, with MOVED in a cluster, even on a READONLY connection, so a client whose slot
-- map is stale after a failover is redirected instead of failing on the first write.)
-- tollgate token bucket, as GCRA in integer microseconds.
-- KEYS[1]: the limiter key. ARGV: T (emission interval), tau ((burst - 1)·T), burst,
-- cost, now (empty: the server's TIME).
-- State: the theoretical arrival time (TAT), a string; it never moves backwards, so a
-- clock that steps back mints nothing. A deny writes nothing; an admission sets the TAT
-- with a TTL of exactly the time until the bucket is full again.
-- Returns {allowed, limit, remaining, reset_after_us, retry_after_us}.
-- Every number stays an integer below 2^53, exact in Lua's doubles; the script defines
-- no helper closures, which would be rebuilt on every call.
local t, tau, burst, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if not (t and tau and burst and t >= 1 and burst >= 1 and t % 1 == 0 and burst % 1 == 0
    and tau == t * (burst - 1) and tau < 4503599627370496) then
  return redis.error_reply('TOLLGATE invalid quota')
end
if not (cost and cost >= 0 and cost % 1 == 0 and cost <= burst) then
  return redis.error_reply('TOLLGATE invalid cost')
end
local now
if ARGV[5] == '' then
  local time = redis.call('TIME')
  now = time[1] * 1000000 + time[2]
else
  now = tonumber(ARGV[5])
  if not (now and now >= 0 and now % 1 == 0 and now < 4503599627370496) then
    return redis.error_reply('TOLLGATE invalid time')
  end
end

local tat = tonumber(redis.call('GET', KEYS[1])) or 0
local allowed, retry, state = 1, 0, tat
if cost > 0 then
  local extra = t * (cost - 1)
  local earliest = tat + extra - tau
  if now < earliest then
    allowed, retry = 0, earliest - now
  else
    state = math.max(tat, now) + t + extra
    redis.call('SET', KEYS[1], string.format('%.0f', state), 'PX',
      string.format('%.0f', math.ceil((state - now) / 1000)))
  end
end
-- remaining = floor((tau + T − debt) / T), with the float quotient corrected to exact.
local left = tau + t - math.max(state - now, 0)
local remaining = 0
if left > 0 then
  remaining = math.floor(left / t)
  if remaining * t > left then
    remaining = remaining - 1
  elseif (remaining + 1) * t <= left then
    remaining = remaining + 1
  end
end
return {allowed, burst, remaining, math.max(state - now, 0), retry}
