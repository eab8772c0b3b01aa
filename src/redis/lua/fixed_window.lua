-- tollgate fixed window counter: appended to window_args.lua, which sets limit, period,
-- cost and now.
-- State: a hash {w = window index, c = count, n = the period w counts in}. Admitted iff
-- c + cost ≤ limit. A deny writes nothing; an admission writes the count with a TTL of
-- exactly the time to the window's end. A clock behind the stored window is read as that
-- window's start. A change of period (n ≠ period) starts the windows afresh; a change
-- of limit alone keeps the count.

-- floor(now / period), the float quotient corrected to exact.
local window = math.floor(now / period)
if window * period > now then
  window = window - 1
elseif (window + 1) * period <= now then
  window = window + 1
end
local elapsed = now - window * period
local lead = 0
local count = 0
local stored = redis.call('HMGET', KEYS[1], 'w', 'c', 'n')
local sw = tonumber(stored[1])
local sn = tonumber(stored[3])
if sn ~= nil and sn ~= period then
  -- Counted in windows of another period (the quota changed): they start afresh.
  sw = nil
end
if sw ~= nil and sw >= window then
  if sw > window then
    lead = sw * period - now
    window, elapsed = sw, 0
  end
  count = tonumber(stored[2]) or 0
end

local to_end = period - elapsed + lead
if count + cost > limit then
  -- (A count above the limit is possible after the quota was lowered.)
  return {0, limit, math.max(limit - count, 0), to_end, to_end}
end
count = count + cost
if cost > 0 then
  redis.call('HSET', KEYS[1], 'w', string.format('%.0f', window), 'c', count, 'n',
    string.format('%.0f', period))
  redis.call('PEXPIRE', KEYS[1], string.format('%.0f', math.ceil(to_end / 1000)))
end
local reset = 0
if count > 0 then
  reset = to_end
end
return {1, limit, limit - count, reset, 0}
