-- tollgate sliding window counter: appended to window_args.lua, which sets limits,
-- periods (and calendars), cost and now, and reads windows (frame, window_at).
-- State: a hash {w = window index, p = previous count, c = current count, n = the period
-- w counts in}. A change of period (n ≠ period) starts the windows afresh; a change of
-- limit alone keeps the counts. Admitted iff
-- p·(period − elapsed) + (c + cost)·period ≤ limit·period. A deny writes nothing; an
-- admission writes the counts with a TTL of exactly the time until both are zero. Time
-- never goes backwards in the state: a clock behind the stored window is read as that
-- window's start. A refund of n lowers the current count first, then the previous one
-- (whose weight is what remains of its decay), never below 0, and writes them back with
-- their TTL, or deletes the state once both are 0.

-- Every quota's counts and verdict first, then all written or none.
local windows, prevs, curs, weighteds, ends, retries, nexts = {}, {}, {}, {}, {}, {}, {}
local admitted = true
for i = 1, #KEYS do
  local limit, period = limits[i], periods[i]
  -- A window's length (`len`: the period, or a calendar period's own) and the next's.
  local window, elapsed, len, next_len = frame(i)
  local lead = 0
  local prev, cur = 0, 0
  local stored = redis.call('HMGET', KEYS[i], 'w', 'p', 'c', 'n')
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
      local start
      start, len = window_at(i, sw)
      next_len = len
      lead = start - now
      window, elapsed = sw, 0
      prev, cur = sp, sc
    end
  end
  if refund ~= nil and (prev > 0 or cur > 0) then
    local from_cur = math.min(refund, cur)
    cur, prev = cur - from_cur, prev - math.min(refund - from_cur, prev)
    local until_zero = 0
    if cur > 0 then
      until_zero = len - elapsed + lead + next_len
    elseif prev > 0 then
      until_zero = len - elapsed + lead
    end
    if until_zero > 0 then
      redis.call('HSET', KEYS[i], 'w', window, 'p', prev, 'c', cur, 'n', period)
      redis.call('PEXPIRE', KEYS[i], math.ceil(until_zero / 1000))
    else
      redis.call('DEL', KEYS[i])
    end
  end
  local weight = prev * (len - elapsed)
  -- The wait of a deny, at least 1 µs; 0 for an admission.
  local retry = 0
  if cur + cost <= limit and weight <= (limit - cur - cost) * len then
    retry = 0
  elseif cur + cost <= limit then
    -- Later in this window, once prev's weight has decayed enough.
    retry = len - floordiv((limit - cur - cost) * len, prev) - elapsed + lead
  else
    -- In the next window (of length next_len), where prev' = cur.
    retry = len - elapsed + next_len - floordiv((limit - cost) * next_len, cur) + lead
  end
  if retry > 0 then
    admitted = false
  end
  windows[i], prevs[i], curs[i], retries[i] = window, prev, cur, retry
  -- The weighted previous count, rounded up, and the time to the window's end.
  weighteds[i], ends[i] = floordiv(weight + len - 1, len), len - elapsed + lead
  nexts[i] = next_len
end

local reply = {}
for i = 1, #KEYS do
  local limit, prev, cur = limits[i], prevs[i], curs[i]
  local weighted, to_end = weighteds[i], ends[i]
  local at = 5 * (i - 1)
  local consumes = admitted and cost > 0 and refund == nil
  if consumes then
    cur = cur + cost
  end
  local reset = 0
  if cur > 0 then
    reset = to_end + nexts[i]
  elseif prev > 0 then
    reset = to_end
  end
  if consumes then
    redis.call('HSET', KEYS[i], 'w', windows[i], 'p', prev, 'c', cur,
      'n', periods[i])
    redis.call('PEXPIRE', KEYS[i], math.ceil(reset / 1000))
  end
  if retries[i] == 0 then
    reply[at + 1], reply[at + 2], reply[at + 3] = 1, limit, limit - cur - weighted
    reply[at + 4], reply[at + 5] = reset, 0
  else
    reply[at + 1], reply[at + 2], reply[at + 3] = 0, limit, math.max(limit - cur - weighted, 0)
    reply[at + 4], reply[at + 5] = reset, retries[i]
  end
end
return reply
