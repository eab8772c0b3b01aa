-- The penalty box's end, after the body of `decide` (`stride`, set just before, is 0
-- for the token bucket, whose replies are negative when denied, and the window
-- counters' reply stride, whose first element is 0 when denied): a deny of a positive cost is counted, and the count
-- reaching `after` within `within` µs of its first starts a block, whose reply is then
-- the block's. An error reply passes through.
local reply = decide()
if block_us == 0 or not penalized or penalized == 0
    or (type(reply) == 'table' and reply.err) then
  return reply
end
local denied = false
if type(reply) == 'number' then
  denied = reply < 0
elseif stride == 0 then
  for i = 1, #reply do
    if reply[i] < 0 then
      denied = true
    end
  end
else
  for i = 1, #reply, stride do
    if reply[i] == 0 then
      denied = true
    end
  end
end
if not denied then
  return reply
end
local held = redis.call('HMGET', box, 'd', 's')
local denies, since = tonumber(held[1]) or 0, tonumber(held[2]) or 0
if denies == 0 or now - since >= within then
  denies, since = 0, now
end
denies = denies + 1
if denies >= after then
  redis.call('HSET', box, 'u', now + block_us, 'd', 0, 's', 0)
  redis.call('PEXPIRE', box, math.ceil(block_us / 1000))
  return redis.status_reply(string.format('BLOCKED %d', block_us))
end
redis.call('HSET', box, 'd', denies, 's', since)
redis.call('PEXPIRE', box, math.max(math.ceil((since + within - now) / 1000), 1))
return reply
