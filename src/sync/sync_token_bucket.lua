-- tollgate background sync, token bucket (GCRA in integer microseconds, server time).
-- KEYS[1]: the node registry (a sorted set); KEYS[2..]: the limiter keys.
-- ARGV: node id, registry TTL (ms), T, tau, burst, 0 (unused), then per limiter key:
--   charged  — units admitted beyond any lease: charged to the bucket even past its
--              capacity, so that the global view stays true;
--   returned — unused lease tokens: given back, never filling the bucket past capacity;
--   wanted   — lease tokens asked for: reserved if the bucket has them.
-- Returns {nodes alive, server time (µs), then per key: tokens leased, tokens left}.
local node, ttl = ARGV[1], tonumber(ARGV[2])
local t, tau, burst = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if not (t and tau and burst and ttl and t >= 1 and burst >= 1 and tau == t * (burst - 1)
    and #ARGV == 6 + 3 * (#KEYS - 1)) then
  return redis.error_reply('TOLLGATE invalid sync arguments')
end
local time = redis.call('TIME')
local now = time[1] * 1000000 + time[2]
local now_ms = math.floor(now / 1000)
redis.call('ZADD', KEYS[1], now_ms, node)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms - ttl)
redis.call('PEXPIRE', KEYS[1], ttl)
local out = {redis.call('ZCARD', KEYS[1]), now}
for i = 2, #KEYS do
  local base = 6 + 3 * (i - 2)
  local charged, returned, wanted = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  if not (charged and returned and wanted and charged >= 0 and returned >= 0 and wanted >= 0) then
    return redis.error_reply('TOLLGATE invalid sync counts')
  end
  local tat = math.max(tonumber(redis.call('GET', KEYS[i])) or 0, now) + charged * t
  if returned > 0 then
    tat = math.max(now, tat - returned * t)
  end
  -- Tokens available: floor((tau + T − (tat − now)) / T), corrected to exact.
  local left = tau + t - (tat - now)
  local avail = 0
  if left > 0 then
    avail = math.floor(left / t)
    if avail * t > left then avail = avail - 1 elseif (avail + 1) * t <= left then avail = avail + 1 end
  end
  local lease = math.min(wanted, avail)
  tat = tat + lease * t
  if tat > now then
    redis.call('SET', KEYS[i], string.format('%.0f', tat), 'PX', string.format('%.0f', math.ceil((tat - now) / 1000)))
  end
  out[#out + 1] = lease
  out[#out + 1] = avail - lease
end
return out
