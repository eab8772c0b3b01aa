#!lua
-- (The shebang, Redis 7+, declares a script that writes: a replica refuses it before it
-- runs, with MOVED in a cluster, even on a READONLY connection, so a client whose slot
-- map is stale after a failover is redirected instead of failing on the first write.)
-- tollgate background sync: one node's round over some keys. It computes exactly what
-- `serve` in src/sync/protocol.rs computes (a differential test checks it); every number
-- is an integer below 2^53, and every division is exact.
-- KEYS[1]: the node registry (a sorted set), then the limiter keys (hashes); with a
--   registry TTL of 0, no registry (Redis Cluster: a call's keys share one slot, so the
--   heartbeat is a call of its own) and every key is a limiter key.
-- ARGV: node id, registry TTL (ms; 0: none), shape ('tb' or 'sw'), a, b (tb: T, tau; sw: limit,
--   period), overdraft horizon (µs; 0 in lease mode), hold (µs), demand TTL (µs),
--   retain (ms), round number,
--   then per limiter key: epoch, floor, keep, known, demand, want, anchor, deadline, local.
-- Returns {nodes alive (0 without a registry), server time (µs), then per key: grant, overdraft, reserved, stale}.
local WEIGHT_ONE, MAX_DEMAND, MAX_ELAPSED = 1048576, 16777216, 4294967296

local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end

local function whole(x)
  return x and x >= 0 and x == math.floor(x) and x < 9007199254740992
end

local node, ttl, shape = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local first = 2
if ttl == 0 then first = 1 end
local a, b = tonumber(ARGV[4]), tonumber(ARGV[5])
local horizon, hold, demand_ttl = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local retain_ms, seq = tonumber(ARGV[9]), tonumber(ARGV[10])
if not (whole(ttl) and whole(a) and whole(b) and a >= 1 and whole(horizon) and whole(hold) and whole(demand_ttl)
    and whole(retain_ms) and whole(seq) and (shape == 'tb' or (shape == 'sw' and b >= 1))
    and #KEYS >= 1 and #ARGV == 10 + 9 * (#KEYS - first + 1)) then
  return redis.error_reply('TOLLGATE invalid sync arguments')
end
local ticks = a
if shape == 'sw' then ticks = math.max(1, idiv(b, a)) end

local time = redis.call('TIME')
local now = time[1] * 1000000 + time[2]
local now_ms = math.floor(now / 1000)
local out = {0, now}
if first == 2 then
  redis.call('ZADD', KEYS[1], now_ms, node)
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms - ttl)
  redis.call('PEXPIRE', KEYS[1], ttl)
  out[1] = redis.call('ZCARD', KEYS[1])
end

local function num(x)
  return string.format('%.0f', x)
end

-- Max-min fair shares among `demands` (see `Shares` in protocol.rs): returns the
-- level, whether every demand fits, the spare each gets then, and the equal share.
local function shares(demands)
  table.sort(demands)
  local equal = idiv(WEIGHT_ONE, math.max(#demands, 1))
  local remaining, left = WEIGHT_ONE, #demands
  for _, d in ipairs(demands) do
    local level = idiv(remaining, left)
    if d > level then return level, false, 0, equal end
    remaining = remaining - d
    left = left - 1
  end
  return 0, true, idiv(remaining, math.max(#demands, 1)), equal
end

local function share_of(level, fits, spare, equal, d)
  if fits then return math.max(d + spare, equal) end
  return math.min(math.max(d, equal), level)
end

-- floor(x * weight / WEIGHT_ONE), exact for x below 2^52 (see `scale` in protocol.rs).
local function scale(x, weight)
  local high = math.floor(x / WEIGHT_ONE)
  return high * weight + math.floor((x - high * WEIGHT_ONE) * weight / WEIGHT_ONE)
end

local capacity_ticks = b + a
if shape == 'sw' then capacity_ticks = a * ticks end

local function credit_cap(weight)
  return math.max(ticks, scale(math.max(capacity_ticks, hold), weight))
end

local function accrued(r, weight, cap)
  local since = math.min(math.max(0, now - r.credit_at), MAX_ELAPSED)
  return math.min(cap, r.credit + scale(since, weight))
end

local function serve(key, epoch, floor, keep, known, demand, want, anchor, deadline, loc)
  local raw = redis.call('HGETALL', key)
  local tat, gw, prev, cur = 0, nil, 0, 0
  local records = {}
  for j = 1, #raw, 2 do
    local f, v = raw[j], raw[j + 1]
    if f == 't' then tat = tonumber(v)
    elseif f == 'w' then gw = tonumber(v)
    elseif f == 'p' then prev = tonumber(v)
    elseif f == 'c' then cur = tonumber(v)
    else
      local s, r, cr, ca, d, da, w, e, u, o =
        string.match(v, '^(%d+):(%d+):(%d+):(%d+):(%d+):(%d+):(%d+):(%d+):(%d+):(%d+)$')
      if s then
        records[f] = {seq = tonumber(s), reserved = tonumber(r), credit = tonumber(cr),
          credit_at = tonumber(ca), demand = tonumber(d), demand_at = tonumber(da), window = tonumber(w),
          epoch = tonumber(e), unmet = tonumber(u), overdraft = tonumber(o)}
      end
    end
  end
  local cutoff = math.max(0, now - retain_ms * 1000)
  for id, r in pairs(records) do
    if math.max(r.demand_at, r.credit_at) < cutoff then
      records[id] = nil
      redis.call('HDEL', key, id)
    end
  end
  local stored = records[node]
  if stored and seq <= stored.seq then
    return 0, 0, stored.reserved, 1
  end
  local existing = nil
  if stored and stored.epoch == epoch then existing = stored end

  local elapsed, window = 0, 0
  if shape == 'sw' then
    window = idiv(now, b)
    elapsed = now - window * b
    if gw == window then
    elseif gw ~= nil and gw + 1 == window then prev, cur = cur, 0
    elseif gw ~= nil and gw > window then elapsed = 0
    else prev, cur = 0, 0 end
    if gw == nil or gw < window then gw = window end
    window = gw
  end
  local rec = existing or {seq = 0, reserved = known + math.min(loc, math.max(0, floor - known)),
    credit = 0, credit_at = 0, demand = 0,
    demand_at = 0, window = window, epoch = epoch, unmet = 0, overdraft = 0}

  local charged = 0
  if floor > rec.reserved then
    local charge = floor - rec.reserved
    charged = charge
    local from = now
    if anchor > 0 then from = math.min(anchor, now) end
    if shape == 'tb' then tat = math.max(tat, from) + charge * a
    else cur = cur + charge end
  elseif floor < rec.reserved then
    local refund = rec.reserved - floor
    if shape == 'tb' then
      if tat > now then tat = math.max(now, tat - refund * a) end
    elseif rec.window == window then cur = math.max(0, cur - refund)
    elseif rec.window + 1 == window then prev = math.max(0, prev - refund) end
  end

  rec.demand = math.min(demand, MAX_DEMAND)
  rec.demand_at = now
  local dcut = math.max(0, now - demand_ttl)
  local demands, others = {}, {}
  for id, r in pairs(records) do
    if id ~= node and r.demand_at >= dcut then
      demands[#demands + 1] = r.demand
      others[#others + 1] = r
    end
  end
  demands[#demands + 1] = rec.demand
  local level, fits, spare, equal = shares(demands)
  local weight = share_of(level, fits, spare, equal, rec.demand)
  local cap = credit_cap(weight)
  if existing then
    rec.credit = accrued(rec, weight, cap)
  else
    rec.credit = ticks
  end
  rec.credit = math.max(0, rec.credit - charged * ticks)
  rec.credit_at = now
  local contended, owed = false, 0
  for _, r in ipairs(others) do
    local w = share_of(level, fits, spare, equal, r.demand)
    local credit = accrued(r, w, credit_cap(w))
    if r.unmet > 0 and credit >= ticks then
      contended = true
      owed = owed + math.max(0, credit - math.floor(rec.credit * w / weight))
    end
  end

  local avail = 0
  if shape == 'tb' then
    local t = math.max(tat, now)
    local left = b + a
    if t - now < left then avail = idiv(left - (t - now), a) end
  else
    local weighted = idiv(prev * (b - elapsed) + b - 1, b)
    avail = math.max(0, a - (cur + weighted))
  end
  local hold_cap = 2 + idiv(scale(hold, weight), ticks)
  local by_credit = avail
  if contended then
    by_credit = math.min(idiv(rec.credit, ticks), math.max(0, avail - idiv(owed, ticks)))
  end
  local late = deadline ~= 0 and now > deadline
  local grant = 0
  if not late then grant = math.min(want, avail, by_credit, math.max(0, hold_cap - keep)) end
  rec.credit = math.max(0, rec.credit - grant * ticks)
  rec.unmet = want - grant
  local ttl_ms
  if shape == 'tb' then
    if grant > 0 then tat = math.max(tat, now) + grant * a end
    redis.call('HSET', key, 't', num(tat))
    ttl_ms = math.ceil(math.max(0, tat - now) / 1000)
  else
    cur = cur + grant
    redis.call('HSET', key, 'w', num(gw), 'p', num(prev), 'c', num(cur))
    ttl_ms = math.ceil((b - elapsed) / 1000)
    if cur > 0 then ttl_ms = ttl_ms + math.ceil(b / 1000) end
  end
  local overdraft = 0
  if horizon > 0 and not late then
    local room
    if shape == 'tb' then
      room = idiv(math.max(0, b + a + horizon - (math.max(tat, now) - now)), a)
    else
      local weighted = idiv(prev * (b - elapsed) + b - 1, b)
      room = math.max(0, a - (cur + weighted)) + idiv(a * math.min(horizon, b), b)
    end
    if contended then
      overdraft = math.min(room, idiv(rec.credit + scale(horizon, weight), ticks))
    else
      local lent = 0
      for _, r in ipairs(others) do lent = lent + r.overdraft end
      overdraft = math.max(0, room - lent)
    end
  end
  rec.reserved = floor + grant
  redis.call('HSET', key, node, num(seq) .. ':' .. num(rec.reserved) .. ':' .. num(rec.credit) .. ':'
    .. num(rec.credit_at) .. ':' .. num(rec.demand) .. ':' .. num(rec.demand_at) .. ':' .. num(window) .. ':' .. num(epoch)
    .. ':' .. num(rec.unmet) .. ':' .. num(overdraft))
  redis.call('PEXPIRE', key, num(ttl_ms + retain_ms))
  return grant, overdraft, rec.reserved, 0
end

for i = first, #KEYS do
  local base = 10 + 9 * (i - first)
  local epoch, floor, keep = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  local known, demand = tonumber(ARGV[base + 4]), tonumber(ARGV[base + 5])
  local want, anchor = tonumber(ARGV[base + 6]), tonumber(ARGV[base + 7])
  local deadline, loc = tonumber(ARGV[base + 8]), tonumber(ARGV[base + 9])
  if not (whole(epoch) and whole(floor) and whole(keep) and whole(known) and whole(demand)
      and whole(want) and whole(anchor) and whole(deadline) and whole(loc) and keep <= floor) then
    return redis.error_reply('TOLLGATE invalid sync counts')
  end
  local grant, overdraft, reserved, stale =
    serve(KEYS[i], epoch, floor, keep, known, demand, want, anchor, deadline, loc)
  out[#out + 1] = grant
  out[#out + 1] = overdraft
  out[#out + 1] = reserved
  out[#out + 1] = stale
end
return out
