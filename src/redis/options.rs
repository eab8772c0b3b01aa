//! `RedisOptions`: how both Redis tiers reach Redis and name their keys.

use std::fmt;
use std::time::Duration;

use super::connection::{Client, Target};
use super::keys::KeyHasher;
use crate::error::ConfigError;

/// The prefix of every key, unless set.
const DEFAULT_PREFIX: &str = "tollgate";
/// The range a timeout is checked against.
const MIN_TIMEOUT: Duration = Duration::from_millis(1);
const MAX_TIMEOUT: Duration = Duration::from_secs(3600);

/// How to reach Redis, shared by both tiers: one server's URL, a cluster's seed nodes or
/// the sentinels of a primary, the prefix of every key, the timeout of a call, the TLS
/// roots, and whether keys are stored hashed.
///
/// [`RedisLimiter::builder_with`](super::RedisLimiter::builder_with) and
/// [`RedisSync::with_options`](crate::sync::RedisSync::with_options) take one, so that a
/// service that runs both tiers against one Redis writes these settings once; the
/// builders' `prefix`, `timeout`, `hash_keys` and `tls_root_cert` set the same fields.
///
/// `Debug` shows the URLs with their passwords masked, and whether keys are hashed,
/// never the secret.
///
/// ```
/// use std::time::Duration;
/// use tollgate::redis::{RedisLimiter, RedisOptions};
/// use tollgate::sync::RedisSync;
/// use tollgate::Quota;
///
/// let redis = RedisOptions::new("redis://:secret@10.0.0.1:6379/")
///     .prefix("shop")
///     .timeout(Duration::from_millis(100))
///     .hash_keys(b"a secret shared by every node");
/// let exact = RedisLimiter::builder_with(redis.clone(), Quota::per_minute(5).unwrap());
/// let synced = RedisSync::with_options(redis);
/// assert!(!format!("{exact:?}{synced:?}").contains("secret"));
/// ```
#[derive(Clone)]
pub struct RedisOptions {
    pub(crate) target: Target,
    pub(crate) prefix: String,
    /// Unset: the tier's own default (50 ms for a check, 200 ms for a sync round).
    pub(crate) timeout: Option<Duration>,
    pub(crate) hasher: Option<KeyHasher>,
}

impl fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisOptions")
            .field("redis", &self.target)
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("hash_keys", &self.hasher.is_some())
            .finish()
    }
}

impl RedisOptions {
    /// The Redis server at `url` (`redis://`, or `rediss://` with the `tls` feature;
    /// a password or ACL user in the URL is used and never shown).
    pub fn new(url: &str) -> Self {
        Self::with_target(Target::single(url))
    }

    /// The Redis Cluster reached through the seed `nodes` (one live seed is enough;
    /// credentials are taken from the first URL).
    pub fn cluster(nodes: &[&str]) -> Self {
        Self::with_target(Target::cluster(nodes))
    }

    /// The primary that Redis Sentinel names `master_name`, found through the
    /// `sentinels` (URLs such as `redis://:sentinel-password@10.0.0.1:26379/`, or
    /// `host:port`). Sentinel URLs carry the sentinels' own password, if they have one;
    /// the data nodes' password is set with [`master_password`](Self::master_password)
    /// or [`master_user`](Self::master_user). `rediss://` sentinel URLs mean TLS to the
    /// sentinels and to the data nodes.
    ///
    /// Every connection asks the sentinels (all at once) and checks with `ROLE` that the
    /// node they name is a primary, trying each address they give until one is. Each
    /// tier listens to every sentinel's `+switch-master` and moves to the new primary as
    /// soon as one announces it; a call that fails for want of a server, or meets a
    /// demoted primary (`READONLY`), makes it ask again too (at most every 500 ms). A
    /// failover needs no restart, and one sentinel that answers is enough.
    pub fn sentinel(sentinels: &[&str], master_name: &str) -> Self {
        Self::with_target(Target::sentinel(sentinels, master_name))
    }

    /// Behind Sentinel ([`sentinel`](Self::sentinel)): the data nodes' password
    /// (`requirepass`, the default user's). Never shown.
    pub fn master_password(mut self, password: &str) -> Self {
        self.target.set_data_auth(None, password);
        self
    }

    /// Behind Sentinel: the data nodes' ACL user and its password. Never shown.
    pub fn master_user(mut self, user: &str, password: &str) -> Self {
        self.target.set_data_auth(Some(user), password);
        self
    }

    fn with_target(target: Target) -> Self {
        Self {
            target,
            prefix: DEFAULT_PREFIX.to_owned(),
            timeout: None,
            hasher: None,
        }
    }

    /// The prefix of every Redis key; `"tollgate"` by default. It may not contain `{`
    /// or `}` (the tiers put a key's hash tag in braces).
    pub fn prefix(mut self, prefix: &str) -> Self {
        self.prefix = prefix.to_owned();
        self
    }

    /// How long one call to Redis may take, from 1 ms to 1 h; by default 50 ms for a
    /// [`RedisLimiter`](super::RedisLimiter) check and 200 ms for a sync round.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Store a keyed hash of each key instead of the key itself (a 128-bit keyed BLAKE3
    /// digest, `{h:<32 hex digits>}` in the key's place). Use it when keys are API keys,
    /// tokens or anything else that must not be readable in Redis (by `KEYS`,
    /// `MONITOR`, a backup or a replica). Every node that shares a limit must use the
    /// same `secret`; the secret itself is kept by no one (only a key derived from it)
    /// and shows in no `Debug` output.
    pub fn hash_keys(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.hasher = Some(KeyHasher::new(secret.as_ref()));
        self
    }

    /// Trust this CA certificate (PEM) for `rediss://` URLs, instead of the system's
    /// roots (cargo feature `tls`).
    #[cfg(feature = "tls")]
    pub fn tls_root_cert(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.target.set_root_cert(pem.into());
        self
    }

    /// Checks the prefix and the timeout (`default` when unset), and makes the client.
    /// `invalid` builds the tier's own error for a setting out of range.
    pub(crate) fn validate(
        &self,
        default: Duration,
        invalid: impl FnOnce(&'static str, String, &'static str) -> ConfigError,
    ) -> Result<(Client, Duration), ConfigError> {
        if self.prefix.contains(['{', '}']) {
            return Err(ConfigError::InvalidPrefix(self.prefix.clone()));
        }
        let timeout = self.timeout.unwrap_or(default);
        if !(MIN_TIMEOUT..=MAX_TIMEOUT).contains(&timeout) {
            return Err(invalid("timeout", format!("{timeout:?}"), "from 1ms to 1h"));
        }
        Ok((self.target.client(timeout)?, timeout))
    }
}

/// The builder methods that set a tier's [`RedisOptions`] (`prefix`, `timeout`,
/// `hash_keys` and, with `tls`, `tls_root_cert`), written once for both tiers' builders,
/// which keep theirs in a field named `options`. `keys` is the shape of the tier's Redis
/// keys; `timeout` documents what the tier's timeout bounds and its default.
macro_rules! option_setters {
    (keys: $keys:literal, timeout: $timeout:literal) => {
        /// The prefix of every Redis key; `"tollgate"` by default. It may not contain
        /// `{` or `}` (the key's hash tag stands in braces).
        #[doc = concat!("Keys are `", $keys, "`.")]
        pub fn prefix(mut self, prefix: &str) -> Self {
            self.options = self.options.prefix(prefix);
            self
        }

        #[doc = $timeout]
        pub fn timeout(mut self, timeout: std::time::Duration) -> Self {
            self.options = self.options.timeout(timeout);
            self
        }

        /// Store a keyed hash of each key instead of the key itself, as
        /// [`RedisOptions::hash_keys`](crate::redis::RedisOptions::hash_keys) describes:
        /// `{h:<32 hex digits>}` stands in the key's place. Every node that shares a
        /// limit must use the same secret.
        pub fn hash_keys(mut self, secret: impl AsRef<[u8]>) -> Self {
            self.options = self.options.hash_keys(secret);
            self
        }

        /// Trust this CA certificate (PEM) for `rediss://` URLs, instead of the system's
        /// roots (cargo feature `tls`).
        #[cfg(feature = "tls")]
        pub fn tls_root_cert(mut self, pem: impl Into<Vec<u8>>) -> Self {
            self.options = self.options.tls_root_cert(pem);
            self
        }

        /// Behind Sentinel: the data nodes' password, as
        /// [`RedisOptions::master_password`](crate::redis::RedisOptions::master_password)
        /// describes (the sentinels' own goes in their URLs). Never shown.
        pub fn master_password(mut self, password: &str) -> Self {
            self.options = self.options.master_password(password);
            self
        }

        /// Behind Sentinel: the data nodes' ACL user and its password, as
        /// [`RedisOptions::master_user`](crate::redis::RedisOptions::master_user)
        /// describes. Never shown.
        pub fn master_user(mut self, user: &str, password: &str) -> Self {
            self.options = self.options.master_user(user, password);
            self
        }
    };
}
pub(crate) use option_setters;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_masks_the_password_and_the_secret() {
        let single = RedisOptions::new("redis://u:hunter2@h/");
        let cluster = RedisOptions::cluster(&["redis://u:hunter2@h:1/", "redis://u:hunter2@h:2/"]);
        let quota = crate::Quota::per_second(1).unwrap();
        for options in [single, cluster] {
            let options = options.hash_keys("s3cret-key");
            // The options alone, and inside each tier's builder.
            for debug in [
                format!("{options:?}"),
                format!(
                    "{:?}",
                    super::super::RedisLimiter::builder_with(options.clone(), quota)
                ),
                format!(
                    "{:?}",
                    crate::sync::RedisSync::with_options(options.clone())
                ),
            ] {
                assert!(!debug.contains("hunter2"), "{debug}");
                assert!(!debug.contains("s3cret-key"), "{debug}");
                assert!(debug.contains("u:***@h"), "{debug}");
                assert!(debug.contains("hash_keys: true"), "{debug}");
            }
        }
    }

    #[test]
    fn prefix_timeout_and_url_are_checked() {
        let invalid = |setting, value, expected| ConfigError::InvalidRedisSetting {
            setting,
            value,
            expected,
        };
        let ok = RedisOptions::new("redis://127.0.0.1:1/");
        let default = Duration::from_millis(50);
        let (_, timeout) = ok.validate(default, invalid).unwrap();
        assert_eq!(timeout, default);
        let (_, timeout) = ok
            .clone()
            .timeout(Duration::from_secs(3600))
            .validate(default, invalid)
            .unwrap();
        assert_eq!(timeout, Duration::from_secs(3600));
        for (options, says) in [
            (ok.clone().prefix("a{b}"), "brace"),
            (ok.clone().timeout(Duration::ZERO), "from 1ms to 1h"),
            (
                ok.clone().timeout(Duration::from_secs(3601)),
                "from 1ms to 1h",
            ),
            (RedisOptions::new("not-a-url"), "not-a-url"),
        ] {
            let err = options.validate(default, invalid).err().expect("refused");
            assert!(err.to_string().contains(says), "{err}");
        }
    }
}
