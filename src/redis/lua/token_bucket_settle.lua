-- The settlement (token_bucket_args.lua comes first): a cost settled after the fact,
-- on the check's keys. ARGV[3] is 'c<n>' (charge n units) or 'r<n>' (refund n).
-- A charge moves the TAT n·T past max(TAT, now), however far: the key is in debt while
-- the TAT lies more than tau ahead, and its checks are denied until that is repaid at the
-- quota's rate. A refund moves it n·T back, but not before now (a full bucket).
-- Returns one integer, the µs until the bucket is full again (≥ 0); the caller derives
-- the decision a unit request would get from it, as for the check. With several quotas,
-- every quota is settled by n, and the reply is one integer per quota.
local mode, n = string.sub(ARGV[3] or '', 1, 1), tonumber(string.sub(ARGV[3] or '', 2))
if not (n and n >= 0 and n % 1 == 0 and n * t < 4503599627370496
    and (mode == 'c' or mode == 'r')) then
  return redis.error_reply('TOLLGATE invalid settlement')
end
ts, taus = ts or {t}, taus or {tau}
for i = 2, #KEYS do
  if n * ts[i] >= 4503599627370496 then
    return redis.error_reply('TOLLGATE invalid settlement')
  end
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
