-- tollgate's window counters, in integer microseconds: head.lua comes first (the
-- clock); this prelude reads and checks the arguments, then fixed_window.lua or
-- sliding_window.lua, appended to it, decides.
-- KEYS[1]: the limiter key. ARGV: limit, period, cost, now (empty: the server's TIME).
-- Several quotas (RedisBuilder::also): KEYS[i] holds quota i's state (all with one hash
-- tag, so one slot), and quota i ≥ 2 adds its limit and period at ARGV[2i + 1] and
-- ARGV[2i + 2]. The request is admitted only if every quota admits it, and then consumes
-- from each; a deny writes nothing.
-- Returns {allowed, limit, remaining, reset_after_us, retry_after_us} for each quota, one
-- after the other; when any quota denies, the others' are their state untouched.
-- A refund (RedisLimiter::refund) passes 'r<n>' as the cost: every quota gives back up to
-- n units (at most what it counts, so never beyond a full quota), and the reply is then
-- the decision a unit request would get right after, consuming nothing.
-- Every number stays an integer below 2^53, exact in Lua's doubles.
local cost = tonumber(ARGV[3])
local refund = nil
if cost == nil and string.sub(ARGV[3] or '', 1, 1) == 'r' then
  refund = tonumber(string.sub(ARGV[3], 2))
  if not (refund and refund >= 0 and refund % 1 == 0 and refund < 4503599627370496) then
    return redis.error_reply('TOLLGATE invalid settlement')
  end
  cost = 1
end
if #ARGV ~= 2 * #KEYS + 2 then
  return redis.error_reply('TOLLGATE invalid quota')
end
-- A calendar quota's period is 'c<id>,<index>,<s0>,<s1>,<s2>,<s3>,<s4>': the calendar's
-- id (negative, stored where a rolling quota stores its period), the index of the
-- period holding the caller's wall time, and the starts (Unix µs) of the periods of
-- index − 1 to index + 3, computed by the caller from the zone's rules. The period
-- holding `now` is one of the first three; windows are numbered by their index.
local limits, periods, calendars = {}, {}, {}
for i = 1, #KEYS do
  local at = 2 * i + 1
  if i == 1 then
    at = 1
  end
  local limit, period = tonumber(ARGV[at]), tonumber(ARGV[at + 1])
  local calendar = nil
  if period == nil then
    local id, index, s0, s1, s2, s3, s4 = string.match(ARGV[at + 1] or '',
      '^c(%-%d+),(%d+),(%d+),(%d+),(%d+),(%d+),(%d+)$')
    calendar = {index = tonumber(index), starts = {tonumber(s0), tonumber(s1),
      tonumber(s2), tonumber(s3), tonumber(s4)}}
    period = tonumber(id)
    local s = calendar.starts
    if not (period and calendar.index and s[5] and s[5] < 9007199254740992
        and s[1] <= s[2] and s[2] <= s[3] and s[3] <= s[4] and s[4] <= s[5]) then
      return redis.error_reply('TOLLGATE invalid quota')
    end
  end
  if not (limit and period and limit >= 1 and limit % 1 == 0 and period % 1 == 0
      and (calendar or (period >= 1 and limit * period < 9007199254740992))) then
    return redis.error_reply('TOLLGATE invalid quota')
  end
  limits[i], periods[i], calendars[i] = limit, period, calendar
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

-- Quota i's window at `now`: its index, the µs into it, its length and the next
-- window's length.
local function frame(i)
  local c = calendars[i]
  if c == nil then
    local period = periods[i]
    local window = floordiv(now, period)
    return window, now - window * period, period, period
  end
  local s = c.starts
  for k = 1, 3 do
    if now >= s[k] and now < s[k + 1] then
      return c.index - 2 + k, now - s[k], s[k + 1] - s[k], math.max(s[k + 2] - s[k + 1], 1)
    end
  end
  return nil
end

-- The start and length of quota i's window `w` (ahead of `now`'s): for a calendar, as
-- far as the caller's starts reach (the last known period beyond them).
local function window_at(i, w)
  local c = calendars[i]
  if c == nil then
    return w * periods[i], periods[i]
  end
  local k = math.min(w - c.index + 2, 4)
  return c.starts[k], math.max(c.starts[k + 1] - c.starts[k], 1)
end
for i = 1, #KEYS do
  if frame(i) == nil then
    return redis.error_reply('TOLLGATE calendar skew: the server\'s time is more than a period from the caller\'s')
  end
end
for i = 1, #KEYS do
  if not (cost and cost >= 0 and cost % 1 == 0 and cost <= limits[i]) then
    return redis.error_reply('TOLLGATE invalid cost')
  end
end
