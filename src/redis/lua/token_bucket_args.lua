-- tollgate's token bucket, as GCRA in integer microseconds: head.lua comes first (the
-- clock); this prelude reads and checks the arguments its check and its settlement
-- share, then token_bucket.lua (a check) or token_bucket_settle.lua (a settlement),
-- appended to it, decides.
-- KEYS[1]: the limiter key. ARGV: T (emission interval), tau ((burst - 1)·T), the
-- request (a check's cost, or a settlement's 'c<n>' or 'r<n>'), and now (absent or empty:
-- the server's TIME). The burst is tau / T + 1: passing it too would only cost the server
-- another argument to parse.
-- Several quotas (RedisBuilder::also): KEYS[i] holds quota i's state (all with one hash
-- tag, so one slot), ARGV[4] is present (empty for TIME), and quota i ≥ 2 adds its T and
-- tau at ARGV[2i + 1] and ARGV[2i + 2]; `ts` and `taus` then hold every quota's (nil for
-- one quota: the one-key path builds no table).
-- Every number stays an integer below 2^53, exact in Lua's doubles, and goes to Redis as
-- a Lua number: Redis writes an integral one as an integer (`%.17g` before 7.2, which
-- prints these without an exponent), in C, cheaper than a `string.format` in the script.
-- The scripts define no helper closures, which would be rebuilt on every call.
local t, tau = tonumber(ARGV[1]), tonumber(ARGV[2])
if not (t and tau and t >= 1 and tau >= 0 and t % 1 == 0 and tau % t == 0
    and tau < 4503599627370496) then
  return redis.error_reply('TOLLGATE invalid quota')
end
local ts, taus
if #KEYS > 1 then
  -- Every argument is checked before anything is read or written: a script is not
  -- rolled back by an error.
  if #ARGV ~= 2 * #KEYS + 2 then
    return redis.error_reply('TOLLGATE invalid quota')
  end
  ts, taus = {t}, {tau}
  for i = 2, #KEYS do
    local ti, taui = tonumber(ARGV[2 * i + 1]), tonumber(ARGV[2 * i + 2])
    if not (ti and taui and ti >= 1 and taui >= 0 and ti % 1 == 0 and taui % ti == 0
        and taui < 4503599627370496) then
      return redis.error_reply('TOLLGATE invalid quota')
    end
    ts[i], taus[i] = ti, taui
  end
end

