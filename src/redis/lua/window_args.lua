-- tollgate's window counters, in integer microseconds: head.lua comes first (the
-- clock); this prelude reads and checks the arguments, then fixed_window.lua or
-- sliding_window.lua, appended to it, decides.
-- KEYS[1]: the limiter key. ARGV: limit, period, cost, now (empty: the server's TIME).
-- Several quotas (RedisBuilder::also): KEYS[i] holds quota i's state (all with one hash
-- tag, so one slot), and quota i ≥ 2 adds its limit and period at ARGV[2i + 1] and
-- ARGV[2i + 2]. The request is admitted only if every quota admits it, and then consumes
-- from each; a deny writes nothing.
-- Returns {allowed, limit, remaining, reset_after_us, retry_after_us} for each quota, one
-- after the other; when any quota denies, the others' are their state untouched.
-- A refund (RedisLimiter::refund) passes 'r<n>' as the cost: every quota gives back up to
-- n units (at most what it counts, so never beyond a full quota), and the reply is then
-- the decision a unit request would get right after, consuming nothing.
-- Every number stays an integer below 2^53, exact in Lua's doubles.
local cost = tonumber(ARGV[3])
local refund = nil
if cost == nil and string.sub(ARGV[3] or '', 1, 1) == 'r' then
  refund = tonumber(string.sub(ARGV[3], 2))
  if not (refund and refund >= 0 and refund % 1 == 0 and refund < 4503599627370496) then
    return redis.error_reply('TOLLGATE invalid settlement')
  end
  cost = 1
end
if #ARGV ~= 2 * #KEYS + 2 then
  return redis.error_reply('TOLLGATE invalid quota')
end
local limits, periods = {}, {}
for i = 1, #KEYS do
  local at = 2 * i + 1
  if i == 1 then
    at = 1
  end
  local limit, period = tonumber(ARGV[at]), tonumber(ARGV[at + 1])
  if not (limit and period and limit >= 1 and period >= 1 and limit % 1 == 0
      and period % 1 == 0 and limit * period < 9007199254740992) then
    return redis.error_reply('TOLLGATE invalid quota')
  end
  limits[i], periods[i] = limit, period
end
for i = 1, #KEYS do
  if not (cost and cost >= 0 and cost % 1 == 0 and cost <= limits[i]) then
    return redis.error_reply('TOLLGATE invalid cost')
  end
end
