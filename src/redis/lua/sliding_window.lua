#!lua
-- (The shebang, Redis 7+, declares a script that writes: a replica refuses it before it
-- runs, with MOVED in a cluster, even on a READONLY connection, so a client whose slot
-- map is stale after a failover is redirected instead of failing on the first write.)
-- tollgate sliding window counter, in integer microseconds.
-- KEYS[1]: the limiter key. ARGV: limit, period, cost, now (empty: the server's TIME).
-- State: a hash {w = window index, p = previous count, c = current count, n = the period
-- w counts in}. A change of period (n ≠ period) starts the windows afresh; a change of
-- limit alone keeps the counts. Admitted iff
-- p·(period − elapsed) + (c + cost)·period ≤ limit·period. A deny writes nothing; an
-- admission writes the counts with a TTL of exactly the time until both are zero. Time
-- never goes backwards in the state: a clock behind the stored window is read as that
-- window's start.
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

-- Exact floor(a / b) for 0 <= a < 2^53: the float quotient, corrected.
local function floordiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    return q - 1
  elseif (q + 1) * b <= a then
    return q + 1
  end
  return q
end

local window = floordiv(now, period)
local elapsed = now - window * period
local lead = 0
local prev, cur = 0, 0
local stored = redis.call('HMGET', KEYS[1], 'w', 'p', 'c', 'n')
local sw = tonumber(stored[1])
local sn = tonumber(stored[4])
if sn ~= nil and sn ~= period then
  -- Counted in windows of another period (the quota changed): they start afresh.
  sw = nil
end
if sw ~= nil then
  local sp, sc = tonumber(stored[2]) or 0, tonumber(stored[3]) or 0
  if sw == window then
    prev, cur = sp, sc
  elseif sw == window - 1 then
    prev, cur = sc, 0
  elseif sw > window then
    lead = sw * period - now
    window, elapsed = sw, 0
    prev, cur = sp, sc
  end
end

local weight = prev * (period - elapsed)
local weighted = floordiv(weight + period - 1, period)
local allowed, retry = 0, 0
if cur + cost <= limit and weight <= (limit - cur - cost) * period then
  allowed, cur = 1, cur + cost
elseif cur + cost <= limit then
  -- Later in this window, once prev's weight has decayed enough.
  retry = period - floordiv((limit - cur - cost) * period, prev) - elapsed + lead
else
  -- In the next window, where prev' = cur.
  retry = period - elapsed + period - floordiv((limit - cost) * period, cur) + lead
end
local reset = 0
if cur > 0 then
  reset = period - elapsed + period + lead
elseif prev > 0 then
  reset = period - elapsed + lead
end
if allowed == 1 and cost > 0 then
  redis.call('HSET', KEYS[1], 'w', string.format('%.0f', window), 'p', prev, 'c', cur, 'n',
    string.format('%.0f', period))
  redis.call('PEXPIRE', KEYS[1], string.format('%.0f', math.ceil(reset / 1000)))
end
if allowed == 1 then
  return {1, limit, limit - cur - weighted, reset, 0}
end
return {0, limit, math.max(limit - cur - weighted, 0), reset, retry}
