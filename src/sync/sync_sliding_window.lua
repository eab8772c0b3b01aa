-- tollgate background sync, sliding window counter (integer microseconds, server time).
-- KEYS[1]: the node registry (a sorted set); KEYS[2..]: the limiter keys.
-- ARGV: node id, registry TTL (ms), limit, period, 0 (unused), the window the returned
-- tokens were leased in, then per limiter key: charged, returned, wanted (see
-- sync_token_bucket.lua). Returned tokens are taken off the count of the window they
-- were leased in (now the current or the previous one); older ones have expired anyway.
-- Returns {nodes alive, server time (µs), then per key: tokens leased, tokens left}.
local node, ttl = ARGV[1], tonumber(ARGV[2])
local limit, period, lease_window = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[6])
if not (limit and period and ttl and lease_window and limit >= 1 and period >= 1
    and limit * period < 9007199254740992 and #ARGV == 6 + 3 * (#KEYS - 1)) then
  return redis.error_reply('TOLLGATE invalid sync arguments')
end
local time = redis.call('TIME')
local now = time[1] * 1000000 + time[2]
local now_ms = math.floor(now / 1000)
redis.call('ZADD', KEYS[1], now_ms, node)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms - ttl)
redis.call('PEXPIRE', KEYS[1], ttl)
local out = {redis.call('ZCARD', KEYS[1]), now}
local window = math.floor(now / period)
if window * period > now then window = window - 1 elseif (window + 1) * period <= now then window = window + 1 end
for i = 2, #KEYS do
  local base = 6 + 3 * (i - 2)
  local charged, returned, wanted = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  if not (charged and returned and wanted and charged >= 0 and returned >= 0 and wanted >= 0) then
    return redis.error_reply('TOLLGATE invalid sync counts')
  end
  local w, elapsed = window, now - window * period
  local prev, cur = 0, 0
  local stored = redis.call('HMGET', KEYS[i], 'w', 'p', 'c')
  local sw = tonumber(stored[1])
  if sw ~= nil then
    local sp, sc = tonumber(stored[2]) or 0, tonumber(stored[3]) or 0
    if sw == w then
      prev, cur = sp, sc
    elseif sw == w - 1 then
      prev, cur = sc, 0
    elseif sw > w then
      w, elapsed, prev, cur = sw, 0, sp, sc
    end
  end
  cur = cur + charged
  if lease_window == w then
    cur = math.max(0, cur - returned)
  elseif lease_window == w - 1 then
    prev = math.max(0, prev - returned)
  end
  -- ⌈prev·(period − elapsed) / period⌉, corrected to exact.
  local weight = prev * (period - elapsed)
  local weighted = math.floor(weight / period)
  if weighted * period > weight then weighted = weighted - 1 elseif (weighted + 1) * period <= weight then weighted = weighted + 1 end
  if weighted * period < weight then weighted = weighted + 1 end
  local avail = math.max(0, limit - cur - weighted)
  local lease = math.min(wanted, avail)
  cur = cur + lease
  if cur > 0 or prev > 0 then
    local reset = period - elapsed
    if cur > 0 then reset = reset + period end
    redis.call('HSET', KEYS[i], 'w', string.format('%.0f', w), 'p', prev, 'c', cur)
    redis.call('PEXPIRE', KEYS[i], string.format('%.0f', math.ceil(reset / 1000)))
  end
  out[#out + 1] = lease
  out[#out + 1] = avail - lease
end
return out
