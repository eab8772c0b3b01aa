#!lua
-- A concurrency limit's release, and its leases' renewal (concurrency_acquire.lua has the
-- keys). ARGV[1]: 'r' to release, or a lease in µs to renew; ARGV[2..]: permit ids.
-- Release: gives back each id's slots if its lease is still held. Renew: extends each
-- id's lease to now + lease, if still held. Returns {held, ...} with, after the weight
-- held once done, 1 for each id still held (released or renewed) and 0 for each whose
-- lease had expired (its slots were given back already, and may be another's now).
local renew = ARGV[1] ~= 'r'
local lease
if renew then
  lease = tonumber(ARGV[1])
  if not (lease and lease >= 1000 and lease % 1 == 0 and lease < 4503599627370496) then
    return redis.error_reply('TOLLGATE invalid concurrency arguments')
  end
end
if #KEYS ~= 2 or #ARGV < 2 then
  return redis.error_reply('TOLLGATE invalid concurrency arguments')
end
local time = redis.call('TIME')
local now = time[1] * 1000000 + time[2]
local reply = {0}
local freed = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  local expiry = tonumber(redis.call('ZSCORE', KEYS[1], id))
  if expiry and expiry > now then
    reply[i] = 1
    if renew then
      redis.call('ZADD', KEYS[1], 'XX', now + lease, id)
    else
      freed = freed + (tonumber(redis.call('HGET', KEYS[2], id)) or 0)
      redis.call('ZREM', KEYS[1], id)
      redis.call('HDEL', KEYS[2], id)
    end
  else
    -- Expired (or never held): acquire gives expired slots back; nothing to do here
    -- but say so.
    reply[i] = 0
  end
end
local held = tonumber(redis.call('HGET', KEYS[2], '*')) or 0
if freed > 0 then
  held = redis.call('HINCRBY', KEYS[2], '*', -freed)
end
reply[1] = held
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2]
if last then
  local ttl = math.ceil((tonumber(last) - now) / 1000) + 1
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return reply
