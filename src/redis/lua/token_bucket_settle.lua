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
-- Several quotas (RedisBuilder::also): KEYS[i] holds quota i's state, ARGV[5] is present
-- (empty for TIME), and quota i ≥ 2 adds its T and tau at ARGV[2i + 2] and ARGV[2i + 3].
-- Every quota is settled by n, and the reply is one integer per quota.
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
if ARGV[5] == nil or ARGV[5] == '' then
  local time = redis.call('TIME')
  now = time[1] * 1000000 + time[2]
else
  now = tonumber(ARGV[5])
  if not (now and now >= 0 and now % 1 == 0 and now < 4503599627370496) then
    return redis.error_reply('TOLLGATE invalid time')
  end
end
if #KEYS > 1 and #ARGV ~= 2 * #KEYS + 3 then
  return redis.error_reply('TOLLGATE invalid quota')
end
local ts, taus = {t}, {tau}
for i = 2, #KEYS do
  local ti, taui = tonumber(ARGV[2 * i + 2]), tonumber(ARGV[2 * i + 3])
  if not (ti and taui and ti >= 1 and taui >= 0 and ti % 1 == 0 and taui % ti == 0
      and taui < 4503599627370496) then
    return redis.error_reply('TOLLGATE invalid quota')
  end
  if n * ti >= 4503599627370496 then
    return redis.error_reply('TOLLGATE invalid settlement')
  end
  ts[i], taus[i] = ti, taui
end

-- Every new state first, so that a debt too large for one quota writes nothing at all
-- (a script is not rolled back by an error).
local tats = redis.call('MGET', unpack(KEYS))
local states = {}
for i = 1, #KEYS do
  local tat = tonumber(tats[i]) or 0
  if mode == 'c' then
    states[i] = math.max(tat, now) + n * ts[i]
    if states[i] >= 9007199254740992 then
      return redis.error_reply('TOLLGATE debt too large')
    end
  else
    states[i] = math.max(tat - n * ts[i], now)
  end
end
local reply = {}
for i = 1, #KEYS do
  local state = states[i]
  if state <= now then
    redis.call('DEL', KEYS[i])
    reply[i] = 0
  else
    redis.call('SET', KEYS[i], state, 'PX', math.ceil((state - now) / 1000))
    reply[i] = state - now
  end
end
if #KEYS == 1 then
  return reply[1]
end
return reply
