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
-- ARGV: node id, registry TTL (ms; 0: none), shape ('tb', 'sw' or 'fw'), a, b (tb: T, tau; sw,
--   fw: limit, period), overdraft horizon (µs; 0 in lease mode), hold (µs), demand TTL (µs),
--   retain (ms), share TTL (µs), silent after (µs), the registry as the node last read
--   it ("id:ms,id:ms…": each node's last heartbeat), round number, the clock (µs; 0, as
--   every node sends: the server's TIME, the one clock all nodes share; the differential
--   test fixes it, so that its cases do not depend on when they run),
--   then per limiter key: epoch, floor, keep, known, demand, want, anchor, deadline, local,
--   beyond, and the key's quota as the node knows it: version, limit, period (µs), burst
--   (0, 0, 0, 0: the default; a version with limit 0: back to the default).
-- Returns {nodes alive (0 without a registry), server time (µs), k, then k nodes of the
--   registry as (the high and low 32 bits of the id as a number, last heartbeat ms), then
--   per key: grant, overdraft, reserved, stale, share, until, owes (whole tokens), void,
--   and the key's quota as Redis holds it: version, limit, period, burst}.
local WEIGHT_ONE, MAX_DEMAND, MAX_ELAPSED = 1048576, 16777216, 4294967296
-- The most a quota change carries over, in µs of the new quota (`AHEAD` in model.rs).
local AHEAD = 2251799813685248

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
local retain_ms, share_ttl, silent_after = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
local seq, clock = tonumber(ARGV[13]), tonumber(ARGV[14])
local heard = {}
for id, ms in string.gmatch(ARGV[12], '([^:,]+):(%d+)') do heard[id] = tonumber(ms) end
if not (whole(ttl) and whole(a) and whole(b) and a >= 1 and whole(horizon) and whole(hold) and whole(demand_ttl)
    and whole(retain_ms) and whole(share_ttl) and whole(silent_after) and whole(seq) and whole(clock)
    and (shape == 'tb' or ((shape == 'sw' or shape == 'fw') and b >= 1))
    and #KEYS >= 1 and #ARGV == 14 + 14 * (#KEYS - first + 1)) then
  return redis.error_reply('TOLLGATE invalid sync arguments')
end
-- The default quota's numbers; a key with its own quota serves with its own (see `use`).
local default_a, default_b = a, b
local ticks, capacity_ticks
-- Serves the next key with the quota (a, b).
local function use(qa, qb)
  a, b = qa, qb
  if shape == 'tb' then
    ticks = a
    capacity_ticks = b + a
  else
    ticks = math.max(1, idiv(b, a))
    capacity_ticks = a * ticks
  end
end
use(a, b)

local now = clock
if clock == 0 then
  local time = redis.call('TIME')
  now = time[1] * 1000000 + time[2]
end
local now_ms = math.floor(now / 1000)
local out = {0, now, 0}
if first == 2 then
  redis.call('ZADD', KEYS[1], now_ms, node)
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms - ttl)
  redis.call('PEXPIRE', KEYS[1], ttl)
  local registry = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
  out[1] = #registry / 2
  for j = 1, #registry, 2 do
    local id = registry[j]
    local hi, lo = tonumber(string.sub(id, 1, 8), 16), tonumber(string.sub(id, 9, 16), 16)
    if #id == 16 and hi and lo then
      out[3] = out[3] + 1
      out[#out + 1] = hi
      out[#out + 1] = lo
      out[#out + 1] = tonumber(registry[j + 1])
    end
  end
end

local function num(x)
  return string.format('%.0f', x)
end

-- Max-min fair shares of `total` among `demands` (see `Shares` in protocol.rs): returns
-- the level, whether every demand fits, the spare each gets then, and the equal share.
local function shares(demands, total)
  table.sort(demands)
  local equal = idiv(total, math.max(#demands, 1))
  local remaining, left = total, #demands
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


local function credit_cap(weight)
  return math.max(ticks, scale(math.max(capacity_ticks, hold), weight))
end

local function accrued(r, weight, cap)
  local since = math.min(math.max(0, now - r.credit_at), MAX_ELAPSED)
  return math.min(cap, r.credit + scale(since, weight))
end

-- A node's record: its 18 numbers as little-endian doubles (exact: every one is an
-- integer below 2^53), which `struct` packs and unpacks in C (`Record` in model.rs).
local RECORD = '<dddddddddddddddddd'
local RECORD_LEN = 144

local function encode(r)
  return struct.pack(RECORD, r.seq, r.reserved, r.credit, r.credit_at, r.demand, r.demand_at,
    r.window, r.epoch, r.unmet, r.overdraft, r.share, r.till, r.charged_to, r.prepaid, r.landed,
    r.landed_end, r.owes, r.fallback)
end

local function decode(v)
  local seq, reserved, credit, credit_at, demand, demand_at, window, epoch, unmet, overdraft,
    share, till, charged_to, prepaid, landed, landed_end, owes, fallback = struct.unpack(RECORD, v)
  return {seq = seq, reserved = reserved, credit = credit, credit_at = credit_at, demand = demand,
    demand_at = demand_at, window = window, epoch = epoch, unmet = unmet, overdraft = overdraft,
    share = share, till = till, charged_to = charged_to, prepaid = prepaid, landed = landed,
    landed_end = landed_end, owes = owes, fallback = fallback}
end

-- Whether quota q is above quota r ({version, limit, period, burst}), as the
-- specification orders them.
local function above(q, r)
  for j = 1, 4 do
    if q[j] ~= r[j] then return q[j] > r[j] end
  end
  return false
end

-- The script's numbers (a, b) of quota q: the default's for limit 0.
local function numbers(q)
  if q[2] == 0 then return default_a, default_b end
  if shape == 'tb' then
    local t = idiv(q[3], q[2])
    return t, t * (q[4] - 1)
  end
  return q[2], q[3]
end

local function serve(key, epoch, floor, keep, known, demand, want, anchor, deadline, loc, beyond,
    quota)
  local raw = redis.call('HGETALL', key)
  local tat, gw, prev, cur = 0, nil, 0, 0
  local held = {0, 0, 0, 0}
  local records = {}
  for j = 1, #raw, 2 do
    local f, v = raw[j], raw[j + 1]
    if f == 't' then tat = tonumber(v)
    elseif f == 'w' then gw = tonumber(v)
    elseif f == 'p' then prev = tonumber(v)
    elseif f == 'c' then cur = tonumber(v)
    elseif f == 'q' then
      local n = {}
      for x in string.gmatch(v, '[^:]+') do n[#n + 1] = tonumber(x) end
      if #n == 4 then held = n end
    elseif #v == RECORD_LEN then
      records[f] = decode(v)
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
    return 0, 0, stored.reserved, 1, 0, 0, 0, 0, {0, 0, 0, 0}
  end
  -- The key's quota: the higher of Redis's and the node's; a change converts the state
  -- (see `convert` in model.rs).
  use(numbers(held))
  if above(quota, held) then
    local fa, fb, ft = a, b, ticks
    local ta, tb_ = numbers(quota)
    if fa ~= ta or fb ~= tb_ then
      use(ta, tb_)
      if shape == 'tb' then
        if tat > now then tat = now + math.min(idiv(tat - now + fa - 1, fa), idiv(AHEAD, a)) * a end
      end
      local renumbered = shape ~= 'tb' and fb ~= b
      if renumbered and gw ~= nil then
        gw = idiv(now, b)
        cur = cur + prev
        prev = 0
      end
      local most = idiv(math.max(capacity_ticks, hold), ticks)
      for _, r in pairs(records) do
        if renumbered then r.window = gw or 0 end
        r.credit = math.min(idiv(r.credit, ft), most) * ticks
        r.owes = math.min(idiv(r.owes + ft - 1, ft), idiv(AHEAD, ticks)) * ticks
        r.prepaid, r.landed, r.landed_end = 0, 0, 0
      end
      for id, _ in pairs(records) do
        if id ~= node then redis.call('HSET', key, id, encode(records[id])) end
      end
    end
    held = quota
    redis.call('HSET', key, 'q', num(held[1]) .. ':' .. num(held[2]) .. ':' .. num(held[3]) .. ':'
      .. num(held[4]))
  end
  local existing = nil
  if stored and stored.epoch == epoch then existing = stored end

  local elapsed, window = 0, 0
  if shape ~= 'tb' then
    window = idiv(now, b)
    elapsed = now - window * b
    if gw == window then
    elseif gw ~= nil and gw + 1 == window then prev, cur = cur, 0
    elseif gw ~= nil and gw > window then elapsed = 0
    else prev, cur = 0, 0 end
    if gw == nil or gw < window then gw = window end
    window = gw
  end
  -- The shares reserved for silent nodes, charged up to now (or their end), in the
  -- order of their ids (as the specification's map).
  local dcut = math.max(0, now - demand_ttl)
  local scut = math.max(0, now - silent_after)
  local ids = {}
  for id, _ in pairs(records) do ids[#ids + 1] = id end
  table.sort(ids)
  local function last_heard(id, r)
    return math.max(r.demand_at, (heard[id] or 0) * 1000)
  end
  local changed = {}
  for _, id in ipairs(ids) do
    local r = records[id]
    local last = last_heard(id, r)
    local quiet = last < scut
    if id ~= node and (quiet or r.fallback == 1) then
      local from = r.charged_to
      if quiet then from = math.max(r.charged_to, last + silent_after) end
      local to = math.min(now, r.till)
      if to > from and r.share > 0 then
        local charge = scale(to - from, r.share)
        if shape == 'tb' then
          local before = math.max(tat, now)
          tat = math.max(tat, from) + charge
          r.landed = r.landed + math.max(0, tat - before)
          r.landed_end = tat
        else cur = cur + idiv(r.prepaid + charge, ticks) - idiv(r.prepaid, ticks) end
        r.prepaid = r.prepaid + charge
        r.charged_to = to
        changed[#changed + 1] = id
      end
    end
  end

  local rec = existing or {seq = 0, reserved = known + math.min(loc, math.max(0, floor - known)),
    credit = 0, credit_at = 0, demand = 0,
    demand_at = 0, window = window, epoch = epoch, unmet = 0, overdraft = 0,
    share = 0, till = 0, charged_to = 0, prepaid = 0, landed = 0, landed_end = 0, owes = 0,
    fallback = 0}
  -- A node back from silence, or whose share was charged on its behalf since its last
  -- round, accrued no credit meanwhile.
  local away = existing ~= nil and last_heard(node, existing) < scut
  local returning = away or (existing ~= nil and existing.charged_to > existing.demand_at)

  -- A window counter's lease (lease mode) is void once its window ends: what the node
  -- kept of one reserved in an earlier window goes back to that window.
  local void = 0
  if horizon == 0 and shape ~= 'tb' and existing and existing.window < window then void = keep end
  floor, keep, want = floor - void, keep - void, want + void
  local late = deadline ~= 0 and now > deadline
  local charged = 0
  if floor > rec.reserved then
    local extra = floor - rec.reserved
    local prepaid = math.min(extra, idiv(rec.prepaid, ticks))
    rec.prepaid = rec.prepaid - prepaid * ticks
    local rest = extra - prepaid
    local own = math.min(rest, beyond)
    rec.owes = rec.owes + own * ticks
    charged = rest - own
    local from = now
    if anchor > 0 then from = math.min(anchor, now) end
    if not late and existing then from = math.max(from, math.min(existing.demand_at, now)) end
    if shape == 'tb' then
      if charged > 0 then tat = math.max(tat, from) + charged * a end
    else cur = cur + charged end
  elseif floor < rec.reserved then
    local refund = rec.reserved - floor
    if shape == 'tb' then
      if tat > now then tat = math.max(now, tat - refund * a) end
    elseif rec.window == window then cur = math.max(0, cur - refund)
    elseif rec.window + 1 == window then prev = math.max(0, prev - refund) end
  end
  if not late then
    local unused = math.min(rec.prepaid, rec.landed, math.max(0, rec.landed_end - now))
    if shape == 'tb' and unused > 0 and tat > now then tat = math.max(now, tat - unused) end
    rec.prepaid = 0
    rec.landed = 0
    rec.landed_end = 0
  end
  rec.charged_to = now

  rec.demand = math.min(demand, MAX_DEMAND)
  rec.demand_at = now
  local demands, others = {}, {}
  local reserved_shares = 0
  for id, r in pairs(records) do
    if id ~= node then
      if r.demand_at >= dcut then
        demands[#demands + 1] = r.demand
        others[#others + 1] = r
      elseif r.till > now and (last_heard(id, r) < scut or r.fallback == 1) then
        reserved_shares = reserved_shares + r.share
      end
    end
  end
  demands[#demands + 1] = rec.demand
  local level, fits, spare, equal = shares(demands, math.max(0, WEIGHT_ONE - reserved_shares))
  local weight = share_of(level, fits, spare, equal, rec.demand)
  local cap = credit_cap(weight)
  if returning then rec.credit_at = now end
  local since = math.min(math.max(0, now - rec.credit_at), MAX_ELAPSED)
  if existing then
    rec.credit = accrued(rec, weight, cap)
  else
    rec.credit = ticks
  end
  rec.credit = math.max(0, rec.credit - charged * ticks)
  rec.credit_at = now
  -- Debt is repaid out of the node's own credit at an eighth of its share's pace.
  local repaid = math.min(rec.owes, idiv(scale(since, weight), 8))
  if repaid > 0 then
    local tokens = idiv(rec.owes + ticks - 1, ticks) - idiv(rec.owes - repaid + ticks - 1, ticks)
    rec.owes = rec.owes - repaid
    rec.credit = math.max(0, rec.credit - repaid)
    if shape == 'tb' then tat = math.max(tat, now) + repaid else cur = cur + tokens end
  end
  local contended, owed = false, 0
  for _, r in ipairs(others) do
    local w = share_of(level, fits, spare, equal, r.demand)
    local credit = accrued(r, w, credit_cap(w))
    if r.unmet > 0 and credit >= ticks then
      contended = true
      owed = owed + math.max(0, credit - math.floor(rec.credit * w / math.max(weight, 1)))
    end
  end

  local avail = 0
  if shape == 'tb' then
    local t = math.max(tat, now)
    local left = b + a
    if t - now < left then avail = idiv(left - (t - now), a) end
  elseif shape == 'sw' then
    local weighted = idiv(prev * (b - elapsed) + b - 1, b)
    avail = math.max(0, a - (cur + weighted))
  else
    avail = math.max(0, a - cur)
  end
  local hold_cap = 2 + idiv(scale(hold, weight), ticks)
  local by_credit = avail
  if contended then
    by_credit = math.min(idiv(rec.credit, ticks), math.max(0, avail - idiv(owed, ticks)))
  end
  local grant = 0
  if not late then
    grant = math.min(want, avail, by_credit, math.max(0, hold_cap - keep))
  end
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
    elseif shape == 'sw' then
      local weighted = idiv(prev * (b - elapsed) + b - 1, b)
      room = math.max(0, a - (cur + weighted)) + idiv(a * math.min(horizon, b), b)
    else
      room = math.max(0, a - cur)
    end
    -- Shared with the overdrafts already out; contended, at least the node's share of
    -- the room, and no more than its credit covers by then.
    local lent = 0
    for _, r in ipairs(others) do lent = lent + r.overdraft end
    overdraft = math.max(0, room - lent)
    if contended then
      overdraft = math.min(math.max(overdraft, scale(room, weight)),
        idiv(rec.credit + scale(horizon, weight), ticks))
    end
  end
  local holds = demand > 0 or keep > 0 or grant > 0
  local others_reserved, nodes = 0, 0
  for id, r in pairs(records) do
    if id ~= node and r.till > now then others_reserved = others_reserved + r.share end
  end
  for _, _ in pairs(heard) do nodes = nodes + 1 end
  -- A node in its fallback goes by the share of the last answer it received.
  if not (loc > 0 and existing ~= nil) then
    rec.share = 0
    rec.till = now
    if holds then
      rec.share = math.min(idiv(WEIGHT_ONE, math.max(nodes, 1)), math.max(0, WEIGHT_ONE - others_reserved))
      rec.till = now + share_ttl
    end
  end
  if loc > 0 then rec.fallback = 1 else rec.fallback = 0 end
  rec.overdraft = overdraft
  rec.seq = seq
  rec.reserved = floor + grant
  rec.window = window
  rec.epoch = epoch
  for _, id in ipairs(changed) do redis.call('HSET', key, id, encode(records[id])) end
  redis.call('HSET', key, node, encode(rec))
  redis.call('PEXPIRE', key, num(ttl_ms + retain_ms))
  return grant, overdraft, rec.reserved, 0, rec.share, rec.till, idiv(rec.owes + ticks - 1, ticks), void,
    held
end

for i = first, #KEYS do
  local base = 14 + 14 * (i - first)
  local epoch, floor, keep = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  local known, demand = tonumber(ARGV[base + 4]), tonumber(ARGV[base + 5])
  local want, anchor = tonumber(ARGV[base + 6]), tonumber(ARGV[base + 7])
  local deadline, loc = tonumber(ARGV[base + 8]), tonumber(ARGV[base + 9])
  local beyond = tonumber(ARGV[base + 10])
  local quota = {tonumber(ARGV[base + 11]), tonumber(ARGV[base + 12]), tonumber(ARGV[base + 13]),
    tonumber(ARGV[base + 14])}
  local qv, ql, qp, qb = quota[1], quota[2], quota[3], quota[4]
  if not (whole(epoch) and whole(floor) and whole(keep) and whole(known) and whole(demand)
      and whole(want) and whole(anchor) and whole(deadline) and whole(loc) and whole(beyond)
      and keep <= floor and whole(qv) and whole(ql) and whole(qp) and whole(qb)
      and (qv > 0 or ql + qp + qb == 0)
      and (ql == 0 or (qb >= 1 and qp >= 1 and ((shape == 'tb' and qp >= ql
        and qp * qb < 4503599627370496) or (shape ~= 'tb' and ql * qp < 9007199254740992))))) then
    return redis.error_reply('TOLLGATE invalid sync counts')
  end
  local grant, overdraft, reserved, stale, share, till, owes, void, held =
    serve(KEYS[i], epoch, floor, keep, known, demand, want, anchor, deadline, loc, beyond, quota)
  out[#out + 1] = grant
  out[#out + 1] = overdraft
  out[#out + 1] = reserved
  out[#out + 1] = stale
  out[#out + 1] = share
  out[#out + 1] = till
  out[#out + 1] = owes
  out[#out + 1] = void
  for j = 1, 4 do out[#out + 1] = held[j] end
end
return out
