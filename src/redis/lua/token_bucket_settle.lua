#!lua
-- tollgate token bucket: a cost settled after the fact, charged or refunded.
-- KEYS[1]: the limiter key (the token bucket script's). ARGV: T (emission interval),
-- tau ((burst - 1)·T), n (the units), the mode ('c': charge, 'r': refund), and now
-- (absent: the server's TIME); all in integer microseconds.
-- A charge moves the TAT n·T past max(TAT, now), however far: the key is in debt while
-- the TAT lies more than tau ahead, and its checks are denied until that is repaid at the
-- quota's rate. A refund moves it n·T back, but not before now (a full bucket).
-- Returns one integer, the µs until the bucket is full again (≥ 0); the caller derives
-- the decision a unit request would get from it, as for the check script.
local t, tau, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local mode = ARGV[4]
if not (t and tau and t >= 1 and tau >= 0 and t % 1 == 0 and tau % t == 0
    and tau < 4503599627370496) then
  return redis.error_reply('TOLLGATE invalid quota')
end
if not (n and n >= 0 and n % 1 == 0 and n * t < 4503599627370496
    and (mode == 'c' or mode == 'r')) then
  return redis.error_reply('TOLLGATE invalid settlement')
end
local now
if ARGV[5] == nil then
  local time = redis.call('TIME')
  now = time[1] * 1000000 + time[2]
else
  now = tonumber(ARGV[5])
  if not (now and now >= 0 and now % 1 == 0 and now < 4503599627370496) then
    return redis.error_reply('TOLLGATE invalid time')
  end
end

local tat = tonumber(redis.call('GET', KEYS[1])) or 0
local state
if mode == 'c' then
  state = math.max(tat, now) + n * t
  if state >= 9007199254740992 then
    return redis.error_reply('TOLLGATE debt too large')
  end
else
  if tat <= now then
    return 0
  end
  state = math.max(tat - n * t, now)
end
if state <= now then
  redis.call('DEL', KEYS[1])
  return 0
end
redis.call('SET', KEYS[1], string.format('%.0f', state), 'PX',
  string.format('%.0f', math.ceil((state - now) / 1000)))
return state - now
