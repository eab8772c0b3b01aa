#!lua
-- (The shebang, Redis 7+, declares a script that writes: a replica refuses it before it
-- runs, with MOVED in a cluster, even on a READONLY connection, so a client whose slot
-- map is stale after a failover is redirected instead of failing on the first write.)
-- tollgate token bucket, as GCRA in integer microseconds.
-- KEYS[1]: the limiter key. ARGV: T (emission interval), tau ((burst - 1)·T), cost,
-- and now (absent or empty: the server's TIME). The burst is tau / T + 1: passing it too
-- would only cost the server another argument to parse.
-- Several quotas (RedisBuilder::also): KEYS[i] holds quota i's state (all with one hash
-- tag, so one slot), ARGV[4] is present (empty for TIME), and quota i ≥ 2 adds its T and
-- tau at ARGV[2i + 1] and ARGV[2i + 2]. The request is admitted only if every quota
-- admits it, and then consumes from each; a deny writes nothing.
-- State: the theoretical arrival time (TAT), a string; it never moves backwards, so a
-- clock that steps back mints nothing. A deny writes nothing; an admission sets the TAT
-- with a TTL of exactly the time until the bucket is full again.
-- Returns one integer, the µs until the bucket is full again: as is (≥ 0) when the
-- request is admitted, negated (≤ −1: a denied bucket is never full) when it is denied.
-- With several quotas, one such integer per quota: negated for each quota that denies;
-- when any denies, the others' are their state untouched (not consumed).
-- The caller derives the rest from its own arguments: remaining = floor((tau + T −
-- reset) / T), and a deny's retry-after = reset + T·(cost − 1) − tau. One integer is the
-- cheapest reply Redis builds (a 5-element reply cost about 1 µs of server time a call).
-- Every number stays an integer below 2^53, exact in Lua's doubles, and goes to Redis as
-- a Lua number: Redis writes an integral one as an integer (`%.17g` before 7.2, which
-- prints these without an exponent), in C, cheaper than a `string.format` in the script.
-- The script defines no helper closures, which would be rebuilt on every call.
local t, tau, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if not (t and tau and t >= 1 and tau >= 0 and t % 1 == 0 and tau % t == 0
    and tau < 4503599627370496) then
  return redis.error_reply('TOLLGATE invalid quota')
end
-- cost <= burst, that is T·(cost − 1) <= tau.
if not (cost and cost >= 0 and cost % 1 == 0 and t * (cost - 1) <= tau) then
  return redis.error_reply('TOLLGATE invalid cost')
end
local now
if ARGV[4] == nil or ARGV[4] == '' then
  local time = redis.call('TIME')
  now = time[1] * 1000000 + time[2]
else
  now = tonumber(ARGV[4])
  if not (now and now >= 0 and now % 1 == 0 and now < 4503599627370496) then
    return redis.error_reply('TOLLGATE invalid time')
  end
end

if #KEYS > 1 then
  -- Several quotas: every argument checked before anything is read or written (a script
  -- is not rolled back by an error), then every state read, then all written or none.
  if #ARGV ~= 2 * #KEYS + 2 then
    return redis.error_reply('TOLLGATE invalid quota')
  end
  local ts, taus = {t}, {tau}
  for i = 2, #KEYS do
    local ti, taui = tonumber(ARGV[2 * i + 1]), tonumber(ARGV[2 * i + 2])
    if not (ti and taui and ti >= 1 and taui >= 0 and ti % 1 == 0 and taui % ti == 0
        and taui < 4503599627370496) then
      return redis.error_reply('TOLLGATE invalid quota')
    end
    if ti * (cost - 1) > taui then
      return redis.error_reply('TOLLGATE invalid cost')
    end
    ts[i], taus[i] = ti, taui
  end
  local tats = redis.call('MGET', unpack(KEYS))
  local admitted = true
  for i = 1, #KEYS do
    tats[i] = tonumber(tats[i]) or 0
    if cost > 0 and now < tats[i] + ts[i] * (cost - 1) - taus[i] then
      admitted = false
    end
  end
  local reply = {}
  for i = 1, #KEYS do
    local tat = tats[i]
    if cost > 0 and admitted then
      local state = math.max(tat, now) + ts[i] * cost
      redis.call('SET', KEYS[i], state, 'PX', math.ceil((state - now) / 1000))
      reply[i] = state - now
    elseif cost > 0 and now < tat + ts[i] * (cost - 1) - taus[i] then
      reply[i] = now - tat
    else
      reply[i] = math.max(tat - now, 0)
    end
  end
  return reply
end

local tat = tonumber(redis.call('GET', KEYS[1])) or 0
if cost > 0 then
  local extra = t * (cost - 1)
  if now < tat + extra - tau then
    -- Denied (now < tat, as extra <= tau): the bucket is full again in tat - now >= 1 µs.
    return now - tat
  end
  local state = math.max(tat, now) + t + extra
  redis.call('SET', KEYS[1], state, 'PX', math.ceil((state - now) / 1000))
  return state - now
end
return math.max(tat - now, 0)
