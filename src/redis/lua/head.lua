-- The head of every Redis tier script (the token bucket's and the window counters'
-- preludes follow it): the clock, ARGV[4] in integer µs, or the server's TIME when it is
-- absent or empty (a limiter without its own clock).
local now
if ARGV[4] == nil or ARGV[4] == '' then
  local time = redis.call('TIME')
  now = time[1] * 1000000 + time[2]
else
  now = tonumber(ARGV[4])
  if not (now and now >= 0 and now % 1 == 0 and now < 4503599627370496) then
    return redis.error_reply('TOLLGATE invalid time')
  end
end
