-- tollgate sliding window counter: appended to window_args.lua, which sets limit,
-- period, cost and now.
-- State: a hash {w = window index, p = previous count, c = current count, n = the period
-- w counts in}. A change of period (n ≠ period) starts the windows afresh; a change of
-- limit alone keeps the counts. Admitted iff
-- p·(period − elapsed) + (c + cost)·period ≤ limit·period. A deny writes nothing; an
-- admission writes the counts with a TTL of exactly the time until both are zero. Time
-- never goes backwards in the state: a clock behind the stored window is read as that
-- window's start.

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
