-- The penalty box's check, after head.lua (the clock): a request of a positive cost (a
-- settlement's 'c<n>' or 'r<n>', or a cost of 0, reads past a block) for a blocked key is
-- denied with nothing read or written but the box: the reply is the status
-- 'BLOCKED <µs to the block's end>'.
-- (One HGET: the denies counted are read only when a deny counts.)
local penalized = tonumber(ARGV[3])
local blocked_until = tonumber(redis.call('HGET', box, 'u')) or 0
if penalized and penalized > 0 and now < blocked_until then
  return redis.status_reply(string.format('BLOCKED %d', blocked_until - now))
end
-- The algorithm's part follows, as the body of `decide`, then penalty_close.lua.
local function decide()
