//! The server's flags: `--name value` or `--name=value`, as `--help` lists them.
//!
//! A hand-written parser rather than clap: nineteen flags need a loop and a table, and the
//! README's main command then builds no argument-parsing crates at all. Every mistake is
//! one line naming the flag and what to write instead; the server exits with status 2.

use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

use tollgate::http::Cidr;
use tollgate::{Algorithm, Quota};

pub const HELP: &str = "\
An HTTP server rate-limited by tollgate

Usage: server [OPTIONS]

Options:
      --listen <ADDR>          Address to listen on [default: 127.0.0.1:3000]
      --quota <QUOTA>          The quota, e.g. \"10/s\", \"600/min\", \"10/s burst 20\" [default: 10/s];
                               repeat it to hold each key to every quota, all or nothing
                               (\"--quota '10/s burst 20' --quota 1000/day\")
      --algorithm <NAME>       token-bucket, sliding-window, fixed-window, sliding-log or
                               leaky-bucket [default: token-bucket]
      --key <KEY>              What to key requests by: \"ip\" or \"header:NAME\" [default: ip]
      --trusted-proxy <CIDR>   A trusted proxy network (repeatable); with none, forwarding
                               headers are ignored
      --headers <STYLE>        Which rate-limit headers to send: legacy, ietf or both
                               [default: both]
      --redis <URL>            Redis URL: one global limit across servers, through this Redis
      --redis-cluster <URLS>   Seed nodes of a Redis Cluster, comma-separated: as --redis, on
                               a cluster
      --redis-sentinel <ADDRS> Sentinels, comma-separated (HOST:PORT, or URLs with the
                               sentinels' password): as --redis, on the primary they name
                               --redis-master; the data nodes' password is read from the
                               TOLLGATE_REDIS_MASTER_PASSWORD environment variable, if set
      --redis-master <NAME>    With --redis-sentinel: the master name the sentinels monitor
      --sync <MODE>            With Redis: reconcile or lease (local checks, background sync),
                               or off (the Redis script on every request) [default: reconcile]
      --on-redis-failure <M>   With --sync off: when Redis fails (or its circuit breaker is
                               open), admit (open), deny (closed), or limit each key in this
                               process by --quota (local) or by this server's share of it,
                               --quota divided by the servers counted live (local-share)
                               [default: open]
      --concurrency <N>        Also hold each key to at most N requests in flight at once (in
                               this server process), each holding its slot until its
                               response has been sent; beyond it, 429 with Retry-After
      --expected-keys <N>      Size the limiter's tables for this many keys at start, so that
                               none of them grows a table [default: 0, grown as keys come]
      --shadow                 Shadow mode: decide, send the headers and count denies as
                               shadow_denied, but never deny a request
      --hash-keys              Store a keyed hash of each key in Redis instead of the key (for
                               API keys and tokens); the secret is read from the
                               TOLLGATE_KEY_SECRET environment variable
      --sync-interval <TIME>   How often to sync, e.g. \"50ms\" or \"1s\" [default: 50ms]
      --share-ttl <TIME>       How long Redis keeps this node's share of each key reserved
                               should it be cut off (its fallback admits at that share
                               meanwhile), e.g. \"10s\"; 0s: not at all [default: 10s]
      --cold-keys <BOOL>       Whether keys far from their limit stay cold (each node admits
                               its share locally, no Redis traffic) until one node runs out of
                               its share: true by default with --sync reconcile, false with
                               --sync lease
  -h, --help                   Print help
";

#[derive(Debug)]
pub struct Args {
    pub listen: SocketAddr,
    pub quota: Quota,
    /// The quotas of `--quota` given after the first.
    pub also: Vec<Quota>,
    pub algorithm: Algorithm,
    pub key: String,
    pub trusted_proxy: Vec<Cidr>,
    pub headers: Headers,
    pub redis: Option<String>,
    pub redis_cluster: Vec<String>,
    pub redis_sentinel: Vec<String>,
    pub redis_master: Option<String>,
    pub sync: Sync,
    pub on_redis_failure: OnFailure,
    pub hash_keys: bool,
    pub shadow: bool,
    pub sync_interval: Duration,
    pub share_ttl: Duration,
    pub cold_keys: Option<bool>,
    /// Keys the local tables are sized for at start (`Builder::expected_keys`).
    pub expected_keys: usize,
    /// At most this many requests in flight per key (`--concurrency`).
    pub concurrency: Option<u32>,
}

#[derive(Clone, Copy, Debug)]
pub enum Headers {
    Legacy,
    Ietf,
    Both,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sync {
    Reconcile,
    Lease,
    Off,
}

#[derive(Clone, Copy, Debug)]
pub enum OnFailure {
    Open,
    Closed,
    Local,
    LocalShare,
}

/// What the command line asks for.
pub enum Command {
    Run(Box<Args>),
    Help,
}

impl Args {
    /// Parses the flags after the program's name.
    ///
    /// # Errors
    /// One line for the first flag that is unknown, lacks its value or has a wrong one.
    pub fn parse(mut flags: impl Iterator<Item = String>) -> Result<Command, String> {
        let mut args = Args {
            listen: SocketAddr::from(([127, 0, 0, 1], 3000)),
            quota: Quota::per_second(10).map_err(|e| e.to_string())?,
            also: Vec::new(),
            algorithm: Algorithm::TokenBucket,
            key: "ip".to_owned(),
            trusted_proxy: Vec::new(),
            headers: Headers::Both,
            redis: None,
            redis_cluster: Vec::new(),
            redis_sentinel: Vec::new(),
            redis_master: None,
            sync: Sync::Reconcile,
            on_redis_failure: OnFailure::Open,
            hash_keys: false,
            shadow: false,
            sync_interval: Duration::from_millis(50),
            share_ttl: Duration::from_secs(10),
            cold_keys: None,
            expected_keys: 0,
            concurrency: None,
        };
        let mut quota_given = false;
        while let Some(flag) = flags.next() {
            let (name, inline) = match flag.split_once('=') {
                Some((name, value)) if name.starts_with("--") => (name.to_owned(), Some(value)),
                _ => (flag.clone(), None),
            };
            match name.as_str() {
                "-h" | "--help" => return Ok(Command::Help),
                "--hash-keys" if inline.is_none() => {
                    args.hash_keys = true;
                    continue;
                }
                "--shadow" if inline.is_none() => {
                    args.shadow = true;
                    continue;
                }
                _ => {}
            }
            let value = match inline {
                Some(value) => value.to_owned(),
                None if is_flag(&name) => flags
                    .next()
                    .ok_or_else(|| format!("a value is required for '{name}'"))?,
                None => return Err(format!("unexpected argument '{flag}' (see --help)")),
            };
            match name.as_str() {
                "--listen" => args.listen = parsed(&name, &value, SocketAddr::from_str)?,
                "--quota" => {
                    let quota = parsed(&name, &value, Quota::from_str)?;
                    if quota_given {
                        args.also.push(quota);
                    } else {
                        args.quota = quota;
                        quota_given = true;
                    }
                }
                "--algorithm" => args.algorithm = parsed(&name, &value, Algorithm::from_str)?,
                "--key" => args.key = value,
                "--trusted-proxy" => {
                    args.trusted_proxy
                        .push(parsed(&name, &value, Cidr::from_str)?)
                }
                "--headers" => {
                    args.headers = choice(
                        &name,
                        &value,
                        &[
                            ("legacy", Headers::Legacy),
                            ("ietf", Headers::Ietf),
                            ("both", Headers::Both),
                        ],
                    )?;
                }
                "--redis" => args.redis = Some(value),
                "--redis-cluster" => args
                    .redis_cluster
                    .extend(value.split(',').map(str::to_owned)),
                "--redis-sentinel" => args
                    .redis_sentinel
                    .extend(value.split(',').map(str::to_owned)),
                "--redis-master" => args.redis_master = Some(value),
                "--sync" => {
                    args.sync = choice(
                        &name,
                        &value,
                        &[
                            ("reconcile", Sync::Reconcile),
                            ("lease", Sync::Lease),
                            ("off", Sync::Off),
                        ],
                    )?;
                }
                "--on-redis-failure" => {
                    args.on_redis_failure = choice(
                        &name,
                        &value,
                        &[
                            ("open", OnFailure::Open),
                            ("closed", OnFailure::Closed),
                            ("local", OnFailure::Local),
                            ("local-share", OnFailure::LocalShare),
                        ],
                    )?;
                }
                "--hash-keys" => args.hash_keys = parsed(&name, &value, bool::from_str)?,
                "--shadow" => args.shadow = parsed(&name, &value, bool::from_str)?,
                "--sync-interval" => args.sync_interval = parsed(&name, &value, parse_interval)?,
                "--share-ttl" => args.share_ttl = parsed(&name, &value, parse_duration)?,
                "--cold-keys" => args.cold_keys = Some(parsed(&name, &value, bool::from_str)?),
                "--expected-keys" => args.expected_keys = parsed(&name, &value, usize::from_str)?,
                "--concurrency" => {
                    args.concurrency = Some(parsed(&name, &value, |v| match u32::from_str(v) {
                        Ok(0) => Err("at least 1 request must be let in".to_owned()),
                        Ok(n) => Ok(n),
                        Err(e) => Err(e.to_string()),
                    })?)
                }
                _ => unreachable!("is_flag lists every flag with a value"),
            }
        }
        let given = [
            args.redis.is_some(),
            !args.redis_cluster.is_empty(),
            !args.redis_sentinel.is_empty(),
        ];
        if given.iter().filter(|&&g| g).count() > 1 {
            return Err(
                "give one of '--redis', '--redis-cluster' and '--redis-sentinel'".to_owned(),
            );
        }
        if args.redis_sentinel.is_empty() != args.redis_master.is_none() {
            return Err("'--redis-sentinel' and '--redis-master' go together".to_owned());
        }
        Ok(Command::Run(Box::new(args)))
    }
}

/// Whether `name` is a flag that takes a value.
fn is_flag(name: &str) -> bool {
    matches!(
        name,
        "--listen"
            | "--quota"
            | "--algorithm"
            | "--key"
            | "--trusted-proxy"
            | "--headers"
            | "--redis"
            | "--redis-cluster"
            | "--redis-sentinel"
            | "--redis-master"
            | "--sync"
            | "--on-redis-failure"
            | "--hash-keys"
            | "--shadow"
            | "--sync-interval"
            | "--share-ttl"
            | "--cold-keys"
            | "--expected-keys"
            | "--concurrency"
    )
}

fn parsed<T, E: std::fmt::Display>(
    name: &str,
    value: &str,
    parse: impl FnOnce(&str) -> Result<T, E>,
) -> Result<T, String> {
    parse(value).map_err(|e| format!("invalid value '{value}' for '{name}': {e}"))
}

fn choice<T: Copy>(name: &str, value: &str, choices: &[(&str, T)]) -> Result<T, String> {
    choices
        .iter()
        .find(|(spelling, _)| *spelling == value)
        .map(|&(_, choice)| choice)
        .ok_or_else(|| {
            let names: Vec<&str> = choices.iter().map(|&(spelling, _)| spelling).collect();
            format!(
                "invalid value '{value}' for '{name}': use one of {}",
                names.join(", ")
            )
        })
}

fn parse_interval(s: &str) -> Result<Duration, String> {
    let interval = parse_duration(s)?;
    if interval.is_zero() {
        return Err("the sync interval must be above zero".into());
    }
    Ok(interval)
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (count, unit) = s.split_at(digits);
    let count: u64 = count
        .parse()
        .map_err(|_| format!("{s:?} is not a duration such as 50ms or 1s"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(count)),
        "s" => Ok(Duration::from_secs(count)),
        _ => Err(format!("unknown unit {unit:?} in {s:?}: use ms or s")),
    }
}
