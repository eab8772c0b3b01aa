-- The check (token_bucket_args.lua comes first): a request of ARGV[3] units, admitted only
-- if every quota admits it, and then consumed from each; a deny writes nothing.
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
local cost = tonumber(ARGV[3])
-- cost <= burst, that is T·(cost − 1) <= tau, under every quota.
if not (cost and cost >= 0 and cost % 1 == 0 and t * (cost - 1) <= tau) then
  return redis.error_reply('TOLLGATE invalid cost')
end

if ts then
  for i = 2, #KEYS do
    if ts[i] * (cost - 1) > taus[i] then
      return redis.error_reply('TOLLGATE invalid cost')
    end
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
