-- The penalty box's manual side (RedisLimiter::block, unblock, blocked_for), after
-- head.lua (the clock, ARGV[4]; ARGV[2] and ARGV[3] are empty).
-- KEYS[1]: the key's box (see penalty_open.lua). ARGV[1]: 'b<µs>' blocks for that long
-- (a block that ends later stays), 'u' unblocks (and forgets the denies counted), 'r'
-- reads. Returns the µs left of the key's block (0: not blocked), before an unblock.
local op = ARGV[1] or ''
local left = math.max((tonumber(redis.call('HGET', KEYS[1], 'u')) or 0) - now, 0)
if op == 'u' then
  redis.call('DEL', KEYS[1])
elseif string.sub(op, 1, 1) == 'b' then
  local us = tonumber(string.sub(op, 2))
  if not (us and us >= 1 and us % 1 == 0 and us < 4503599627370496) then
    return redis.error_reply('TOLLGATE invalid penalty')
  end
  if us > left then
    -- The denies counted so far stay, and so does the box while they count.
    left = us
    redis.call('HSET', KEYS[1], 'u', now + us)
    redis.call('PEXPIRE', KEYS[1], math.max(math.ceil(us / 1000), redis.call('PTTL', KEYS[1])))
  end
elseif op ~= 'r' then
  return redis.error_reply('TOLLGATE invalid penalty')
end
return left
