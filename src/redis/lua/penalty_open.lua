-- The penalty box (RedisBuilder::block_for, block_after, penalty_box), opening a check
-- script before head.lua: the caller appends the key's box to KEYS and the penalty to
-- ARGV, and this takes both off, so that the algorithm's part reads its keys and
-- arguments as it does without a box.
-- The box: a hash {u = the block's end, d = denies counted, s = the first of them's
-- time}, in µs of the script's clock, with the same hash tag as the key's state.
-- The penalty: 'p<block>,<after>,<within>': a block of <block> µs once <after> denies
-- fall within <within> µs of the first of them; a block of 0 only reads manual blocks.
local box = table.remove(KEYS)
local block_us, after, within = string.match(table.remove(ARGV) or '', '^p(%d+),(%d+),(%d+)$')
block_us, after, within = tonumber(block_us), tonumber(after), tonumber(within)
if not (box and block_us and after and within and after >= 1
    and block_us < 4503599627370496 and within < 4503599627370496) then
  return redis.error_reply('TOLLGATE invalid penalty')
end
