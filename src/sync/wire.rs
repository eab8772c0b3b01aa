//! Every message of the sync, encoded and decoded in one place: the calls a node sends
//! (the round script's arguments, the hot-key script's, leaving the registry) and the
//! replies it reads. The node encodes with it and decodes its replies with it; the model
//! of Redis (`model::Server`, tests only) decodes the calls and encodes its replies with
//! it; the differential test runs the real scripts on what it encodes. Decoding is total:
//! any input, a reply from a server that is old, misconfigured or not Redis at all
//! included, gives a value or a [`WireError`], never a panic, and every field is read by
//! name.

use std::fmt;

use redis::Value;

use super::protocol::{Answer, Params, Request, SharedQuota};

/// Numbers per key in a round call's arguments (see [`RoundCall`]).
const REQUEST_LEN: usize = 14;
/// Arguments of a round call before its keys' (see [`RoundCall`]).
const HEAD_LEN: usize = 14;
/// Numbers per key in a round reply (see [`RoundReply`]).
const ANSWER_LEN: usize = 12;

/// A message that cannot be read: what was expected, where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct WireError {
    what: &'static str,
}

impl WireError {
    pub(crate) fn invalid(what: &'static str) -> Self {
        Self { what }
    }
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sync: unexpected message: {}", self.what)
    }
}

impl std::error::Error for WireError {}

/// The scripts and commands a node sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Script {
    /// `sync_round.lua`: a round over some keys, and the heartbeat.
    Round,
    /// `sync_hot_keys.lua`: announce keys turned hot, read the announcements.
    HotKeys,
    /// `sync_settings.lua`: write this node's terms, read every node's.
    Settings,
    /// `ZREM registry node`: a node that stops leaves the registry.
    Leave,
}

/// One command as it goes to Redis: a script's keys and arguments (or `ZREM`'s).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Command {
    pub(crate) script: Script,
    pub(crate) keys: Vec<Vec<u8>>,
    pub(crate) args: Args,
}

/// A command's arguments, in one buffer (a round call has 14 per key, each a number).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Args {
    bytes: Vec<u8>,
    /// Where each argument ends in `bytes`.
    ends: Vec<usize>,
}

impl Args {
    fn with_capacity(args: usize) -> Self {
        Self {
            bytes: Vec::with_capacity(args * 8),
            ends: Vec::with_capacity(args),
        }
    }

    fn push(&mut self, arg: &[u8]) {
        self.bytes.extend_from_slice(arg);
        self.ends.push(self.bytes.len());
    }

    /// A number as the scripts read it: decimal ASCII.
    fn push_num(&mut self, n: u64) {
        write_num(&mut self.bytes, n);
        self.ends.push(self.bytes.len());
    }

    /// A node id as the registry holds it: 16 hex digits.
    fn push_id(&mut self, id: u64) {
        write_id(&mut self.bytes, id);
        self.ends.push(self.bytes.len());
    }

    /// The arguments, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &[u8]> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts
            .zip(&self.ends)
            .map(|(start, &end)| &self.bytes[start..end])
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.ends.len()
    }
}

/// Each argument as one bulk string.
impl redis::ToRedisArgs for Args {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        for arg in self.iter() {
            out.write_arg(arg);
        }
    }
}

impl<'a> FromIterator<&'a [u8]> for Args {
    fn from_iter<I: IntoIterator<Item = &'a [u8]>>(iter: I) -> Self {
        let mut args = Self::default();
        for arg in iter {
            args.push(arg);
        }
        args
    }
}

/// Writes `n` in decimal.
fn write_num(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
}

/// Writes node id `id` as the registry holds it: 16 lowercase hex digits.
fn write_id(out: &mut Vec<u8>, id: u64) {
    for shift in (0..16).rev() {
        out.push(b"0123456789abcdef"[((id >> (shift * 4)) & 0xf) as usize]);
    }
}

/// A node id as the registry holds it (16 lowercase hex digits), as a number.
#[cfg(test)]
pub(crate) fn parse_id(bytes: &[u8]) -> Option<u64> {
    if bytes.len() != 16 {
        return None;
    }
    bytes.iter().try_fold(0u64, |id, &b| {
        let digit = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            _ => return None,
        };
        Some(id << 4 | u64::from(digit))
    })
}

/// A decimal number the scripts wrote (or a node sent), at most `u64::MAX`.
fn parse(bytes: &[u8], what: &'static str) -> Result<u64, WireError> {
    if bytes.is_empty() || bytes.len() > 20 || !bytes.iter().all(u8::is_ascii_digit) {
        return Err(WireError::invalid(what));
    }
    bytes.iter().try_fold(0u64, |n, &b| {
        n.checked_mul(10)
            .and_then(|n| n.checked_add(u64::from(b - b'0')))
            .ok_or_else(|| WireError::invalid(what))
    })
}

/// A reply's integer, as redis-rs reads numbers: an integer, or a string of digits.
fn int(value: &Value, what: &'static str) -> Result<u64, WireError> {
    match value {
        Value::Int(n) => u64::try_from(*n).map_err(|_| WireError::invalid(what)),
        Value::BulkString(bytes) => parse(bytes, what),
        Value::SimpleString(s) => parse(s.as_bytes(), what),
        _ => Err(WireError::invalid(what)),
    }
}

fn array<'a>(value: &'a Value, what: &'static str) -> Result<&'a [Value], WireError> {
    match value {
        Value::Array(items) => Ok(items),
        _ => Err(WireError::invalid(what)),
    }
}

/// One call of the round script: the node, the heartbeat's TTL, what every round of the
/// limiter shares, the registry as the node last read it, the round's number, the clock,
/// then each key's request.
///
/// Its arguments, in the order the script reads them: the node id, the registry's TTL
/// (ms; 0: no registry key, as a cluster's per-slot calls send), the shape's tag and two
/// numbers, the overdraft horizon, the hold, the demand TTL, the retention (ms), the share
/// TTL, the silence (all µs otherwise), the registry (`id:ms,id:ms…`), the round number,
/// the clock (µs; 0, as every node sends: the server's `TIME`), then per key: epoch,
/// floor, keep, known, demand, want, anchor, deadline, local, beyond, and the key's quota
/// (version, limit, period, burst).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RoundCall {
    /// The node's id (sent as 16 hex digits).
    pub(crate) node: u64,
    pub(crate) registry_ttl_ms: u64,
    pub(crate) params: Params,
    /// Each node's id and last heartbeat (ms of Redis's clock), as the node last read
    /// them.
    pub(crate) heard: Vec<(u64, u64)>,
    pub(crate) seq: u64,
    pub(crate) clock_us: u64,
    /// The keys' requests (their `seq` is the call's).
    pub(crate) requests: Vec<Request>,
}

impl RoundCall {
    /// The script's `ARGV`.
    pub(crate) fn encode(&self) -> Args {
        let (tag, a, b) = self.params.shape.script_args();
        let p = &self.params;
        let mut args = Args::with_capacity(HEAD_LEN + REQUEST_LEN * self.requests.len());
        args.push_id(self.node);
        args.push_num(self.registry_ttl_ms);
        args.push(tag.as_bytes());
        for n in [
            a,
            b,
            p.overdraft_horizon,
            p.hold,
            p.demand_ttl,
            p.retain_ms,
            p.share_ttl,
            p.silent_after,
        ] {
            args.push_num(n);
        }
        for (i, &(id, ms)) in self.heard.iter().enumerate() {
            if i > 0 {
                args.bytes.push(b',');
            }
            write_id(&mut args.bytes, id);
            args.bytes.push(b':');
            write_num(&mut args.bytes, ms);
        }
        args.ends.push(args.bytes.len());
        args.push_num(self.seq);
        args.push_num(self.clock_us);
        for r in &self.requests {
            let q = r.quota;
            for n in [
                r.epoch, r.floor, r.keep, r.known, r.demand, r.want, r.anchor, r.deadline, r.local,
                r.beyond, q.version, q.limit, q.period, q.burst,
            ] {
                args.push_num(n);
            }
        }
        args
    }

    /// Reads a call's `ARGV` back (the model of Redis does, as the script does).
    #[cfg(test)]
    pub(crate) fn decode(args: &Args) -> Result<Self, WireError> {
        let count = args.len();
        if count < HEAD_LEN || (count - HEAD_LEN) % REQUEST_LEN != 0 {
            return Err(WireError::invalid("round call: argument count"));
        }
        let mut args = args.iter();
        let mut next = || args.next().unwrap_or_default();
        let n = |bytes: &[u8]| parse(bytes, "round call: a number");
        let node = parse_id(next()).ok_or_else(|| WireError::invalid("round call: node id"))?;
        let registry_ttl_ms = n(next())?;
        let tag = next();
        let (a, b) = (n(next())?, n(next())?);
        let shape = super::protocol::Shape::from_script_args(tag, a, b)
            .ok_or_else(|| WireError::invalid("round call: shape"))?;
        let params = Params {
            shape,
            overdraft_horizon: n(next())?,
            hold: n(next())?,
            demand_ttl: n(next())?,
            retain_ms: n(next())?,
            share_ttl: n(next())?,
            silent_after: n(next())?,
        };
        let heard_bytes = next();
        let mut heard = Vec::new();
        if !heard_bytes.is_empty() {
            for entry in heard_bytes.split(|&b| b == b',') {
                let bad = || WireError::invalid("round call: registry");
                let at = entry.iter().position(|&b| b == b':').ok_or_else(bad)?;
                heard.push((
                    parse_id(&entry[..at]).ok_or_else(bad)?,
                    n(&entry[at + 1..])?,
                ));
            }
        }
        let seq = n(next())?;
        let clock_us = n(next())?;
        let mut requests = Vec::with_capacity((count - HEAD_LEN) / REQUEST_LEN);
        for _ in 0..(count - HEAD_LEN) / REQUEST_LEN {
            let mut field = || n(next());
            requests.push(Request {
                seq,
                epoch: field()?,
                floor: field()?,
                keep: field()?,
                known: field()?,
                demand: field()?,
                want: field()?,
                anchor: field()?,
                deadline: field()?,
                local: field()?,
                beyond: field()?,
                quota: SharedQuota {
                    version: field()?,
                    limit: field()?,
                    period: field()?,
                    burst: field()?,
                },
            });
        }
        Ok(Self {
            node,
            registry_ttl_ms,
            params,
            heard,
            seq,
            clock_us,
            requests,
        })
    }
}

/// What a round call answers: the live nodes and the server's clock (from the heartbeat;
/// 0 nodes from a call without the registry), the registry, and each key's answer.
///
/// As the script returns it: the nodes alive, the server's time (µs), `k`, then `k`
/// registry entries as (the high and the low 32 bits of the 16-digit id, its last
/// heartbeat in ms), then per key: grant, overdraft, reserved, stale, share, until, owes,
/// void, and the key's quota as Redis holds it (version, limit, period, burst).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct RoundReply {
    pub(crate) nodes: u64,
    pub(crate) server_us: u64,
    /// Each node id with its last heartbeat (ms).
    pub(crate) registry: Vec<(u64, u64)>,
    pub(crate) answers: Vec<Answer>,
}

impl RoundReply {
    /// The script's reply.
    #[cfg(test)]
    pub(crate) fn encode(&self) -> Value {
        let mut out = vec![self.nodes, self.server_us, self.registry.len() as u64];
        for &(id, ms) in &self.registry {
            out.extend([id >> 32, id & 0xffff_ffff, ms]);
        }
        for a in &self.answers {
            let q = a.quota;
            out.extend([
                a.grant,
                a.overdraft,
                a.reserved,
                u64::from(a.stale),
                a.share,
                a.until,
                a.owes,
                a.void,
                q.version,
                q.limit,
                q.period,
                q.burst,
            ]);
        }
        Value::Array(
            out.into_iter()
                .map(|n| Value::Int(i64::try_from(n).unwrap_or(i64::MAX)))
                .collect(),
        )
    }

    /// Reads the reply to a call that carried `keys` keys.
    pub(crate) fn decode(value: &Value, keys: usize) -> Result<Self, WireError> {
        let items = array(value, "round reply: not an array")?;
        let [nodes, server_us, listed, rest @ ..] = items else {
            return Err(WireError::invalid("round reply: too short"));
        };
        let listed = usize::try_from(int(listed, "round reply: registry length")?)
            .map_err(|_| WireError::invalid("round reply: registry length"))?;
        let registry_len = listed
            .checked_mul(3)
            .filter(|&n| n <= rest.len())
            .ok_or_else(|| WireError::invalid("round reply: registry length"))?;
        if rest.len() - registry_len != keys.saturating_mul(ANSWER_LEN) {
            return Err(WireError::invalid("round reply: answer count"));
        }
        let (registry, answers) = rest.split_at(registry_len);
        let mut entries = Vec::with_capacity(listed);
        for entry in registry.chunks_exact(3) {
            let [high, low, ms] = entry else {
                return Err(WireError::invalid("round reply: registry entry"));
            };
            let half = |v: &Value| {
                int(v, "round reply: node id").and_then(|n| {
                    u32::try_from(n).map_err(|_| WireError::invalid("round reply: node id"))
                })
            };
            entries.push((
                u64::from(half(high)?) << 32 | u64::from(half(low)?),
                int(ms, "round reply: heartbeat")?,
            ));
        }
        let mut decoded = Vec::with_capacity(keys);
        for answer in answers.chunks_exact(ANSWER_LEN) {
            let [
                grant,
                overdraft,
                reserved,
                stale,
                share,
                until,
                owes,
                void,
                version,
                limit,
                period,
                burst,
            ] = answer
            else {
                return Err(WireError::invalid("round reply: an answer"));
            };
            let n = |v: &Value| int(v, "round reply: an answer's number");
            decoded.push(Answer {
                grant: n(grant)?,
                overdraft: n(overdraft)?,
                reserved: n(reserved)?,
                stale: match n(stale)? {
                    0 => false,
                    1 => true,
                    _ => return Err(WireError::invalid("round reply: stale is 0 or 1")),
                },
                share: n(share)?,
                until: n(until)?,
                owes: n(owes)?,
                void: n(void)?,
                quota: SharedQuota {
                    version: n(version)?,
                    limit: n(limit)?,
                    period: n(period)?,
                    burst: n(burst)?,
                },
            });
        }
        Ok(Self {
            nodes: int(nodes, "round reply: nodes")?,
            server_us: int(server_us, "round reply: clock")?,
            registry: entries,
            answers: decoded,
        })
    }
}

/// One call of the hot-key script: announce (or renew) `announce` for `lifetime_ms`, and
/// read every announcement lasting to `from_ms` or later.
///
/// Its arguments: the lifetime (ms), the score to read from (ms), then the Redis keys
/// announced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HotCall {
    pub(crate) lifetime_ms: u64,
    pub(crate) from_ms: u64,
    pub(crate) announce: Vec<Vec<u8>>,
}

impl HotCall {
    pub(crate) fn encode(&self) -> Args {
        let mut args = Args::with_capacity(2 + self.announce.len());
        args.push_num(self.lifetime_ms);
        args.push_num(self.from_ms);
        for member in &self.announce {
            args.push(member);
        }
        args
    }

    #[cfg(test)]
    pub(crate) fn decode(args: &Args) -> Result<Self, WireError> {
        let mut args = args.iter();
        let (Some(lifetime_ms), Some(from_ms)) = (args.next(), args.next()) else {
            return Err(WireError::invalid("hot-key call: argument count"));
        };
        let n = |bytes: &[u8]| parse(bytes, "hot-key call: a number");
        Ok(Self {
            lifetime_ms: n(lifetime_ms)?,
            from_ms: n(from_ms)?,
            announce: args.map(<[u8]>::to_vec).collect(),
        })
    }
}

/// What the hot-key script answers: Redis's clock (ms), then each announcement read, as
/// (member, until when it lasts, ms).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct HotReply {
    pub(crate) now_ms: u64,
    pub(crate) read: Vec<(Vec<u8>, u64)>,
}

impl HotReply {
    #[cfg(test)]
    pub(crate) fn encode(&self) -> Value {
        let mut out = Vec::with_capacity(1 + 2 * self.read.len());
        out.push(Value::Int(i64::try_from(self.now_ms).unwrap_or(i64::MAX)));
        for (member, until) in &self.read {
            out.push(Value::BulkString(member.clone()));
            out.push(Value::Int(i64::try_from(*until).unwrap_or(i64::MAX)));
        }
        Value::Array(out)
    }

    pub(crate) fn decode(value: &Value) -> Result<Self, WireError> {
        let items = array(value, "hot-key reply: not an array")?;
        let [now, rest @ ..] = items else {
            return Err(WireError::invalid("hot-key reply: empty"));
        };
        if rest.len() % 2 != 0 {
            return Err(WireError::invalid(
                "hot-key reply: a member without its score",
            ));
        }
        let mut read = Vec::with_capacity(rest.len() / 2);
        for pair in rest.chunks_exact(2) {
            let [Value::BulkString(member), until] = pair else {
                return Err(WireError::invalid("hot-key reply: a member"));
            };
            read.push((member.clone(), int(until, "hot-key reply: a score")?));
        }
        Ok(Self {
            now_ms: int(now, "hot-key reply: clock")?,
            read,
        })
    }
}

/// One call of the settings script: this node's field and terms (none: read only), and
/// the staleness.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SettingsCall {
    pub(crate) field: String,
    pub(crate) terms: String,
    pub(crate) stale_ms: u64,
}

impl SettingsCall {
    pub(crate) fn encode(&self) -> Args {
        let mut args = Args::with_capacity(3);
        args.push(self.field.as_bytes());
        args.push(self.terms.as_bytes());
        args.push_num(self.stale_ms);
        args
    }

    #[cfg(test)]
    pub(crate) fn decode(args: &Args) -> Result<Self, WireError> {
        let invalid = || WireError::invalid("settings call: arguments");
        let mut args = args.iter();
        let (Some(field), Some(terms), Some(stale), None) =
            (args.next(), args.next(), args.next(), args.next())
        else {
            return Err(invalid());
        };
        let text = |b: &[u8]| String::from_utf8(b.to_vec()).map_err(|_| invalid());
        Ok(Self {
            field: text(field)?,
            terms: text(terms)?,
            stale_ms: parse(stale, "settings call: staleness")?,
        })
    }
}

/// What the settings script answers: each entry within the staleness, as (field, terms).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct SettingsReply {
    pub(crate) entries: Vec<(Vec<u8>, Vec<u8>)>,
}

impl SettingsReply {
    #[cfg(test)]
    pub(crate) fn encode(&self) -> Value {
        Value::Array(
            self.entries
                .iter()
                .flat_map(|(f, t)| [Value::BulkString(f.clone()), Value::BulkString(t.clone())])
                .collect(),
        )
    }

    pub(crate) fn decode(value: &Value) -> Result<Self, WireError> {
        let items = array(value, "settings reply: not an array")?;
        if items.len() % 2 != 0 {
            return Err(WireError::invalid(
                "settings reply: a field without its terms",
            ));
        }
        let mut entries = Vec::with_capacity(items.len() / 2);
        for pair in items.chunks_exact(2) {
            let [Value::BulkString(field), Value::BulkString(terms)] = pair else {
                return Err(WireError::invalid("settings reply: an entry"));
            };
            entries.push((field.clone(), terms.clone()));
        }
        Ok(Self { entries })
    }
}

/// The command of a settings call on the prefix's settings hash.
pub(crate) fn settings_command(key: &[u8], call: &SettingsCall) -> Command {
    Command {
        script: Script::Settings,
        keys: vec![key.to_vec()],
        args: call.encode(),
    }
}

/// The commands of a round call on `keys` (the registry first when it heartbeats).
pub(crate) fn round_command(
    registry: Option<&[u8]>,
    keys: Vec<Vec<u8>>,
    call: &RoundCall,
) -> Command {
    let mut all = Vec::with_capacity(keys.len() + 1);
    if let Some(registry) = registry {
        all.push(registry.to_vec());
    }
    all.extend(keys);
    Command {
        script: Script::Round,
        keys: all,
        args: call.encode(),
    }
}

/// The command of a hot-key call on the announcements' key.
pub(crate) fn hot_command(key: &[u8], call: &HotCall) -> Command {
    Command {
        script: Script::HotKeys,
        keys: vec![key.to_vec()],
        args: call.encode(),
    }
}

/// The command a stopping node leaves the registry with.
pub(crate) fn leave_command(registry: &[u8], node: u64) -> Command {
    let mut args = Args::with_capacity(1);
    args.push_id(node);
    Command {
        script: Script::Leave,
        keys: vec![registry.to_vec()],
        args,
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::sync::protocol::Shape;

    fn params() -> Params {
        Params {
            shape: Shape::TokenBucket {
                t: 10_000,
                tau: 990_000,
            },
            overdraft_horizon: 100_000,
            hold: 100_000,
            demand_ttl: 150_000,
            retain_ms: 40_000,
            share_ttl: 10_000_000,
            silent_after: 700_000,
        }
    }

    fn request(seq: u64, x: u64) -> Request {
        Request {
            seq,
            epoch: x,
            floor: x + 1,
            keep: x + 2,
            known: x + 3,
            demand: x + 4,
            want: x + 5,
            anchor: x + 6,
            deadline: x + 7,
            local: x + 8,
            beyond: x + 9,
            quota: SharedQuota {
                version: x + 10,
                limit: x + 11,
                period: x + 12,
                burst: x + 13,
            },
        }
    }

    /// The script reads its arguments by position: this pins the order it expects
    /// (`sync_round.lua`'s header), so that the encoding and the script cannot drift.
    #[test]
    fn a_round_call_is_in_the_order_the_script_reads() {
        let call = RoundCall {
            node: 0xab,
            registry_ttl_ms: 1_000,
            params: params(),
            heard: vec![(0xa, 5), (0xab, 7)],
            seq: 9,
            clock_us: 0,
            requests: vec![request(9, 100)],
        };
        let args: Vec<String> = call
            .encode()
            .iter()
            .map(|a| String::from_utf8(a.to_vec()).unwrap())
            .collect();
        assert_eq!(
            args,
            [
                "00000000000000ab",
                "1000",
                "tb",
                "10000",
                "990000",
                "100000",
                "100000",
                "150000",
                "40000",
                "10000000",
                "700000",
                "000000000000000a:5,00000000000000ab:7",
                "9",
                "0",
                "100",
                "101",
                "102",
                "103",
                "104",
                "105",
                "106",
                "107",
                "108",
                "109",
                "110",
                "111",
                "112",
                "113",
            ]
        );
        assert_eq!(RoundCall::decode(&call.encode()), Ok(call));
    }

    #[test]
    fn a_round_reply_is_read_by_name() {
        let reply = Value::Array(
            [
                2, 7_000, 1, 0, 0xab, 6, 1, 2, 3, 0, 5, 6, 7, 8, 9, 10, 11, 12,
            ]
            .into_iter()
            .map(Value::Int)
            .collect(),
        );
        let read = RoundReply::decode(&reply, 1).unwrap();
        assert_eq!(read.registry, [(0xab, 6)]);
        assert_eq!((read.nodes, read.server_us), (2, 7_000));
        let a = read.answers[0];
        assert_eq!(
            (a.grant, a.overdraft, a.reserved, a.stale),
            (1, 2, 3, false)
        );
        assert_eq!((a.share, a.until, a.owes, a.void), (5, 6, 7, 8));
        assert_eq!(
            a.quota,
            SharedQuota {
                version: 9,
                limit: 10,
                period: 11,
                burst: 12
            }
        );
        assert_eq!(RoundReply::decode(&read.encode(), 1), Ok(read));
    }

    #[test]
    fn replies_that_do_not_fit_are_errors() {
        let ints = |v: &[i64]| Value::Array(v.iter().copied().map(Value::Int).collect());
        for (value, keys) in [
            (Value::Nil, 0),
            (Value::Okay, 0),
            (ints(&[1, 2]), 0),
            // The registry says 1 entry, none follows.
            (ints(&[1, 2, 1]), 0),
            (ints(&[1, 2, i64::MAX]), 0),
            // An answer short.
            (ints(&[1, 2, 0, 1, 2, 3]), 1),
            // Negative numbers.
            (ints(&[-1, 2, 0]), 0),
            // Stale is 0 or 1.
            (ints(&[1, 2, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0]), 1),
            // A node id's half beyond 32 bits.
            (ints(&[1, 2, 1, 1 << 40, 0, 0]), 0),
        ] {
            assert!(RoundReply::decode(&value, keys).is_err(), "{value:?}");
        }
        for value in [
            Value::Nil,
            Value::Array(vec![]),
            Value::Array(vec![Value::Int(1), Value::BulkString(b"k".to_vec())]),
            Value::Array(vec![Value::Int(1), Value::Int(2), Value::Int(3)]),
        ] {
            assert!(HotReply::decode(&value).is_err(), "{value:?}");
        }
    }

    proptest! {
        /// Any round call encodes to arguments that decode to it.
        #[test]
        fn round_calls_round_trip(
            seq: u64,
            xs in prop::collection::vec(0u64..u64::MAX - 20, 0..5),
            heard in prop::collection::vec(any::<u64>(), 0..4),
        ) {
            let call = RoundCall {
                node: seq,
                registry_ttl_ms: seq % 7,
                params: params(),
                heard: heard.iter().map(|&ms| (ms.rotate_left(7), ms)).collect(),
                seq,
                clock_us: seq / 3,
                requests: xs.iter().map(|&x| request(seq, x)).collect(),
            };
            prop_assert_eq!(RoundCall::decode(&call.encode()), Ok(call));
        }

        /// Decoding never panics, whatever the bytes.
        #[test]
        fn any_bytes_decode_or_fail(args in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..8), 0..40)) {
            let args: Args = args.iter().map(Vec::as_slice).collect();
            let _ = RoundCall::decode(&args);
            let _ = HotCall::decode(&args);
        }
    }
}
