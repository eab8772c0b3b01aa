#!lua
-- (The shebang, Redis 7+, declares a script that writes: a replica, or a primary that
-- Sentinel demoted, refuses it before it runs, with READONLY or MOVED.)
-- tollgate background sync: the keys turned hot (see the cold tier in src/sync/mod.rs).
-- KEYS[1]: the announcements, a sorted set: each member a limiter key's Redis key, its
--   score until when (ms of Redis's clock) the key counts as hot.
-- ARGV: the announcements' lifetime (ms), the score to read from (ms; every member at or
--   above it is returned), then the Redis keys this node announces (or renews).
-- Returns {now (ms), then (member, until) for each member read}.
local lifetime, from = tonumber(ARGV[1]), tonumber(ARGV[2])
if not (lifetime and lifetime >= 1 and lifetime == math.floor(lifetime) and from
    and from == math.floor(from) and #KEYS == 1) then
  return redis.error_reply('TOLLGATE invalid hot-key arguments')
end
local time = redis.call('TIME')
local now = time[1] * 1000 + math.floor(time[2] / 1000)
local expires = now + lifetime
for i = 3, #ARGV do
  redis.call('ZADD', KEYS[1], expires, ARGV[i])
end
if #ARGV > 2 then
  redis.call('PEXPIRE', KEYS[1], lifetime)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local out = {now}
local read = redis.call('ZRANGEBYSCORE', KEYS[1], math.max(from, now + 1), '+inf', 'WITHSCORES')
for j = 1, #read, 2 do
  out[#out + 1] = read[j]
  out[#out + 1] = tonumber(read[j + 1])
end
return out
