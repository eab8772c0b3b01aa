#!lua
-- A concurrency limit's acquire: at most `max` slots held per key across every process,
-- each held slot a lease that expires unless renewed, so that a holder that dies gives
-- its slots back after its lease, never later. Optionally with a token-bucket rate on the
-- same key, decided all or nothing: a request one of them refuses consumes nothing of the
-- other.
-- KEYS[1]: the leases, a sorted set of permit ids scored by their expiry (µs of the
-- server's TIME). KEYS[2]: a hash of each permit id's weight, with '*' the weight held and
-- '^' the most ever held at once. KEYS[3] (with a rate): the token bucket's TAT, the key
-- of the Redis tier's token bucket (RedisLimiter with the same prefix shares it).
-- ARGV: max, weight, lease (µs), the permit id; with a rate, its T and tau (µs).
-- Returns {code, held, wait, rate}: code 1 admitted, 0 full, 2 denied by the rate; held
-- the weight held after the call; wait (full) the µs until the earliest lease expires;
-- rate the token bucket's reply as token_bucket.lua's (0 without a rate).
-- Every argument is checked before anything is written: a script is not rolled back.
local max, weight, lease = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local id = ARGV[4]
if not (max and weight and lease and id and max >= 0 and weight >= 1 and lease >= 1000
    and max % 1 == 0 and weight % 1 == 0 and lease % 1 == 0 and lease < 4503599627370496
    and max < 4294967296 and weight < 4294967296 and #id > 0 and id ~= '*' and id ~= '^') then
  return redis.error_reply('TOLLGATE invalid concurrency arguments')
end
local t, tau
if #KEYS == 3 then
  t, tau = tonumber(ARGV[5]), tonumber(ARGV[6])
  if not (t and tau and t >= 1 and tau >= 0 and t % 1 == 0 and tau % t == 0
      and tau < 4503599627370496) then
    return redis.error_reply('TOLLGATE invalid quota')
  end
elseif #KEYS ~= 2 then
  return redis.error_reply('TOLLGATE invalid concurrency arguments')
end
local time = redis.call('TIME')
local now = time[1] * 1000000 + time[2]

-- Leases past their expiry give their slots back first.
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #expired > 0 then
  local weights = redis.call('HMGET', KEYS[2], unpack(expired))
  local freed = 0
  for i = 1, #expired do
    freed = freed + (tonumber(weights[i]) or 0)
  end
  redis.call('HDEL', KEYS[2], unpack(expired))
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  redis.call('HINCRBY', KEYS[2], '*', -freed)
end
local held = tonumber(redis.call('HGET', KEYS[2], '*')) or 0

if held + weight > max then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  local wait = 1
  if first[2] then
    wait = math.max(tonumber(first[2]) - now, 1)
  end
  return {0, held, wait, 0}
end

local rate = 0
if t then
  local tat = tonumber(redis.call('GET', KEYS[3])) or 0
  local extra = t * (weight - 1)
  if extra > tau then
    return redis.error_reply('TOLLGATE invalid cost')
  end
  if now < tat + extra - tau then
    return {2, held, 0, now - tat}
  end
  local state = math.max(tat, now) + t + extra
  redis.call('SET', KEYS[3], state, 'PX', math.ceil((state - now) / 1000))
  rate = state - now
end

local expiry = now + lease
redis.call('ZADD', KEYS[1], expiry, id)
redis.call('HSET', KEYS[2], id, weight)
held = redis.call('HINCRBY', KEYS[2], '*', weight)
local peak = tonumber(redis.call('HGET', KEYS[2], '^')) or 0
if held > peak then
  redis.call('HSET', KEYS[2], '^', held)
end
-- Both keys live as long as their last lease.
local last = tonumber(redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2])
local ttl = math.ceil((last - now) / 1000) + 1
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
return {1, held, 0, rate}
