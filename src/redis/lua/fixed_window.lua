-- tollgate fixed window counter: appended to window_args.lua, which sets limits,
-- periods (and calendars), cost and now, and reads windows (frame, window_at).
-- State: a hash {w = window index, c = count, n = the period w counts in}. Admitted iff
-- c + cost ≤ limit. A deny writes nothing; an admission writes the count with a TTL of
-- exactly the time to the window's end. A clock behind the stored window is read as that
-- window's start. A change of period (n ≠ period) starts the windows afresh; a change
-- of limit alone keeps the count. A refund lowers the count (to no less than 0) and
-- writes it back with the same TTL, or deletes the state once it counts nothing.

-- Every quota's window and count first, then all written or none.
local windows, counts, ends = {}, {}, {}
local admitted = true
for i = 1, #KEYS do
  local period = periods[i]
  local window, elapsed, len = frame(i)
  local lead = 0
  local count = 0
  local stored = redis.call('HMGET', KEYS[i], 'w', 'c', 'n')
  local sw = tonumber(stored[1])
  local sn = tonumber(stored[3])
  if sn ~= nil and sn ~= period then
    -- Counted in windows of another period (the quota changed): they start afresh.
    sw = nil
  end
  if sw ~= nil and sw >= window then
    if sw > window then
      local start
      start, len = window_at(i, sw)
      lead = start - now
      window, elapsed = sw, 0
    end
    count = tonumber(stored[2]) or 0
  end
  local to_end = len - elapsed + lead
  if refund ~= nil and count > 0 then
    count = count - math.min(refund, count)
    if count > 0 then
      redis.call('HSET', KEYS[i], 'w', window, 'c', count, 'n', period)
      redis.call('PEXPIRE', KEYS[i], math.ceil(to_end / 1000))
    else
      redis.call('DEL', KEYS[i])
    end
  end
  windows[i], counts[i], ends[i] = window, count, to_end
  if count + cost > limits[i] then
    admitted = false
  end
end

local reply = {}
for i = 1, #KEYS do
  local limit, count, to_end = limits[i], counts[i], ends[i]
  local at = 5 * (i - 1)
  if count + cost > limit then
    -- (A count above the limit is possible after the quota was lowered.)
    reply[at + 1], reply[at + 2], reply[at + 3] = 0, limit, math.max(limit - count, 0)
    reply[at + 4], reply[at + 5] = to_end, to_end
  else
    if admitted and cost > 0 and refund == nil then
      count = count + cost
      redis.call('HSET', KEYS[i], 'w', windows[i], 'c', count, 'n', periods[i])
      redis.call('PEXPIRE', KEYS[i], math.ceil(to_end / 1000))
    end
    local reset = 0
    if count > 0 then
      reset = to_end
    end
    reply[at + 1], reply[at + 2], reply[at + 3] = 1, limit, limit - count
    reply[at + 4], reply[at + 5] = reset, 0
  end
end
return reply
