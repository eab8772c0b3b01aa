//! What can go wrong talking to the Redis tier.

use std::fmt;
use std::time::Duration;

use crate::error::{ConfigError, InsufficientCapacity};

/// An error from [`RedisLimiter`](super::RedisLimiter). Every failure is typed; none
/// panics or hangs past the configured timeout.
#[derive(Debug)]
#[non_exhaustive]
pub enum RedisError {
    /// The configuration cannot be run on Redis (see the message).
    Config(ConfigError),
    /// The algorithm has no Redis script: use `TokenBucket`, `SlidingWindow` or
    /// `FixedWindow`.
    UnsupportedAlgorithm(crate::Algorithm),
    /// The cost exceeds what the quota can ever admit at once.
    InsufficientCapacity(InsufficientCapacity),
    /// Redis did not answer within the timeout.
    Timeout(Duration),
    /// Redis could not be reached, the connection broke, or (Redis Cluster) the key's
    /// slot has no master that serves it right now: a failover or a slot move is under
    /// way (`MOVED`, `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`, `READONLY`, `LOADING`).
    Unavailable(RedisCause),
    /// The limiter's key holds a value of another type (something else wrote it).
    WrongType {
        /// The Redis key.
        key: String,
    },
    /// The script refused its arguments (it validates them itself, too).
    Rejected(String),
    /// Any other error reply from Redis.
    Redis(RedisCause),
    /// Redis answered with something the limiter cannot read.
    UnexpectedReply(String),
    /// The circuit breaker is open after consecutive failures: no call was made. Its
    /// background probe next calls Redis in `retry_in`.
    CircuitOpen {
        /// Time left in the breaker's open period.
        retry_in: Duration,
    },
}

impl RedisError {
    /// A short, stable name of the error's kind, for metrics and logs: `config`,
    /// `unsupported_algorithm`, `insufficient_capacity`, `timeout`, `unavailable`,
    /// `wrong_type`, `rejected`, `redis`, `unexpected_reply` or `circuit_open`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Config(_) => "config",
            Self::UnsupportedAlgorithm(_) => "unsupported_algorithm",
            Self::InsufficientCapacity(_) => "insufficient_capacity",
            Self::Timeout(_) => "timeout",
            Self::Unavailable(_) => "unavailable",
            Self::WrongType { .. } => "wrong_type",
            Self::Rejected(_) => "rejected",
            Self::Redis(_) => "redis",
            Self::UnexpectedReply(_) => "unexpected_reply",
            Self::CircuitOpen { .. } => "circuit_open",
        }
    }

    /// Whether the error says Redis cannot serve (it timed out, is unreachable, or
    /// answered with a server-side error such as `BUSY` or `OOM`): what the circuit
    /// breaker counts. A reply about the call itself (`WRONGTYPE`, a rejected argument)
    /// shows Redis up.
    pub fn is_outage(&self) -> bool {
        matches!(
            self,
            Self::Timeout(_) | Self::Unavailable(_) | Self::Redis(_) | Self::CircuitOpen { .. }
        )
    }
}

impl fmt::Display for RedisError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Config(e) => write!(f, "redis limiter configuration: {e}"),
            Self::UnsupportedAlgorithm(a) => write!(
                f,
                "the Redis tier has no script for {a}: use token-bucket, sliding-window or fixed-window"
            ),
            Self::InsufficientCapacity(e) => e.fmt(f),
            Self::Timeout(t) => write!(f, "redis did not answer within {t:?}"),
            Self::Unavailable(e) => write!(f, "redis is unavailable: {e}"),
            Self::WrongType { key } => write!(
                f,
                "redis key {key:?} holds a value of another type: another writer uses this prefix"
            ),
            Self::Rejected(why) => write!(f, "the rate-limit script rejected its arguments: {why}"),
            Self::Redis(e) => write!(f, "redis error: {e}"),
            Self::UnexpectedReply(what) => write!(f, "unexpected reply from redis: {what}"),
            Self::CircuitOpen { retry_in } => write!(
                f,
                "redis failed repeatedly: the circuit breaker is open and probes again in {retry_in:?}"
            ),
        }
    }
}

impl std::error::Error for RedisError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Config(e) => Some(e),
            Self::InsufficientCapacity(e) => Some(e),
            Self::Unavailable(e) | Self::Redis(e) => Some(e),
            _ => None,
        }
    }
}

/// What the Redis client reported for an [`Unavailable`](RedisError::Unavailable) or
/// [`Redis`](RedisError::Redis) error: the server's error code and message, or the
/// connection's failure. tollgate's API does not expose its Redis client's types; the
/// client's own error is this one's [`source`](std::error::Error::source).
pub struct RedisCause(redis::RedisError);

impl RedisCause {
    /// The server's error code (`MOVED`, `CLUSTERDOWN`, `BUSY`, `OOM`, ...), if Redis
    /// answered with an error reply.
    pub fn code(&self) -> Option<&str> {
        self.0.code()
    }

    /// The error reply's text after its code, if any.
    pub fn detail(&self) -> Option<&str> {
        self.0.detail()
    }

    /// Whether the connection failed (refused, dropped, or an I/O error) rather than
    /// Redis answering with an error.
    pub fn is_connection_failure(&self) -> bool {
        self.0.is_io_error() || self.0.is_connection_dropped() || self.0.is_connection_refusal()
    }
}

impl fmt::Debug for RedisCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for RedisCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for RedisCause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

impl From<ConfigError> for RedisError {
    fn from(e: ConfigError) -> Self {
        Self::Config(e)
    }
}

impl From<InsufficientCapacity> for RedisError {
    fn from(e: InsufficientCapacity) -> Self {
        Self::InsufficientCapacity(e)
    }
}

/// The error replies that mean the key's slot has no master serving it right now (a
/// failover or a slot move under way) or the server is not ready: Redis is unavailable
/// for the call, not refusing it.
pub(crate) const UNAVAILABLE_CODES: [&str; 7] = [
    "MOVED",
    "ASK",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "MASTERDOWN",
    "READONLY",
    "LOADING",
];

impl RedisError {
    /// Classifies an error from redis-rs about `key`.
    pub(crate) fn from_redis(e: redis::RedisError, key: &[u8]) -> Self {
        if let Some(config) = super::sentinel::master_unknown(&e) {
            return Self::Config(config);
        }
        match e.code() {
            Some("WRONGTYPE") => Self::WrongType {
                key: String::from_utf8_lossy(key).into_owned(),
            },
            Some("TOLLGATE") => Self::Rejected(e.detail().unwrap_or_default().to_owned()),
            Some(code) if UNAVAILABLE_CODES.contains(&code) => Self::Unavailable(RedisCause(e)),
            _ => {
                let cause = RedisCause(e);
                if cause.is_connection_failure() || cause.0.is_timeout() {
                    Self::Unavailable(cause)
                } else {
                    Self::Redis(cause)
                }
            }
        }
    }
}
