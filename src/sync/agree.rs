//! What every node of a prefix must sync by, and how a node finds one that differs.
//!
//! Nodes that share a prefix share its keys' global state, so they must agree on what it
//! means: the algorithm (the leaky bucket's and the token bucket's keys differ, and a
//! window's state is not a bucket's), the mode (a strict lease and an overdraft are not
//! the same promise), the cold tier (a node admitting at its cold share beside one that
//! syncs every key exceeds the quota by that share), and the default quota. A node that
//! differs in any of them breaks the bound silently. So each node writes its terms to a
//! hash of the prefix's, `{prefix}:sync:settings` (one field per node and quota, stamped
//! with Redis's clock, dropped once stale), with its first round and every
//! [`EVERY`] after, and reads the others': a build that requires the connection fails
//! with [`ConfigError::SyncSettingsDiffer`](crate::ConfigError::SyncSettingsDiffer); a
//! running node says so (a `warn` event, [`SyncStats::settings_differ`](super::SyncStats)).

use std::time::Duration;

use super::config::{RedisSync, SyncMode};
use crate::algorithm::Algorithm;
use crate::quota::Quota;

/// How often a node writes its terms and reads the others'.
pub(crate) const EVERY: Duration = Duration::from_secs(10);
/// An entry not written for this long (a node gone) is dropped: three times [`EVERY`].
pub(crate) const STALE_MS: u64 = 30_000;

/// What one quota of a synced limiter syncs by, as every node of its prefix must.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Terms {
    /// Which of the limiter's quotas (0: its own; `i`: its `i`-th `also` quota).
    quota_index: usize,
    /// Each setting's name and value, in the order they are compared.
    settings: [(&'static str, String); 4],
}

/// A setting on which another node of the prefix differs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Disagreement {
    pub(crate) setting: &'static str,
    pub(crate) ours: String,
    pub(crate) theirs: String,
}

impl Terms {
    /// The terms of a limiter of `algorithm` and `quota`, synced by `config`.
    pub(crate) fn new(config: &RedisSync, algorithm: Algorithm, quota: Quota) -> Self {
        let mode = match config.mode {
            SyncMode::Reconcile => "reconcile",
            SyncMode::Lease => "lease",
        };
        let cold = config
            .cold_keys
            .unwrap_or(config.mode == SyncMode::Reconcile);
        Self {
            quota_index: config.quota_index,
            settings: [
                ("algorithm", algorithm.name().to_owned()),
                ("mode", mode.to_owned()),
                ("cold_keys", if cold { "on" } else { "off" }.to_owned()),
                ("quota", quota.to_string()),
            ],
        }
    }

    /// This node's field in the prefix's hash.
    pub(crate) fn field(&self, node: u64) -> String {
        format!("{node:016x}:{}", self.quota_index)
    }

    /// The terms as the hash holds them: `name=value;name=value…`.
    pub(crate) fn encode(&self) -> String {
        let pairs: Vec<String> = self
            .settings
            .iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect();
        pairs.join(";")
    }

    /// The first setting on which another node's entry for the same quota differs from
    /// these terms, reading `read` (field, terms) as the hash returned it; entries of
    /// other quotas, this node's own, and what does not parse are passed over.
    pub(crate) fn differ(&self, node: u64, read: &[(Vec<u8>, Vec<u8>)]) -> Option<Disagreement> {
        let own = self.field(node);
        let suffix = format!(":{}", self.quota_index);
        for (field, terms) in read {
            let (Ok(field), Ok(terms)) = (std::str::from_utf8(field), std::str::from_utf8(terms))
            else {
                continue;
            };
            if field == own || !field.ends_with(&suffix) {
                continue;
            }
            for (name, ours) in &self.settings {
                let theirs = terms
                    .split(';')
                    .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='));
                if let Some(theirs) = theirs.filter(|theirs| theirs != ours) {
                    return Some(Disagreement {
                        setting: name,
                        ours: ours.clone(),
                        theirs: theirs.to_owned(),
                    });
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn terms(config: RedisSync, algorithm: Algorithm, quota: &str) -> Terms {
        Terms::new(&config, algorithm, quota.parse().unwrap())
    }

    #[test]
    fn the_first_setting_that_differs_is_named() {
        let config = RedisSync::new("redis://127.0.0.1:1/");
        let ours = terms(config.clone(), Algorithm::TokenBucket, "100/s");
        let entry = |node: u64, t: &Terms| (t.field(node).into_bytes(), t.encode().into_bytes());
        // The same terms, this node's own entry, and garbage: no disagreement.
        let same = terms(config.clone(), Algorithm::TokenBucket, "100/s");
        let read = vec![
            entry(1, &same),
            entry(7, &terms(config.clone(), Algorithm::SlidingWindow, "5/s")),
            (b"junk".to_vec(), vec![0xff]),
        ];
        assert_eq!(ours.differ(7, &read), None);
        for (other, setting) in [
            (
                terms(config.clone(), Algorithm::SlidingWindow, "100/s"),
                "algorithm",
            ),
            (
                terms(
                    config.clone().mode(SyncMode::Lease),
                    Algorithm::TokenBucket,
                    "100/s",
                ),
                "mode",
            ),
            (
                terms(
                    config.clone().cold_keys(false),
                    Algorithm::TokenBucket,
                    "100/s",
                ),
                "cold_keys",
            ),
            (
                terms(config.clone(), Algorithm::TokenBucket, "100/s burst 50"),
                "quota",
            ),
        ] {
            let found = ours.differ(7, &[entry(2, &other)]).unwrap();
            assert_eq!(found.setting, setting, "{found:?}");
            assert_ne!(found.ours, found.theirs);
        }
        // Another quota of the limiter (an `also` quota) is compared with its own kind.
        let also = RedisSync {
            quota_index: 1,
            ..config
        };
        let daily = terms(also, Algorithm::TokenBucket, "1000/day");
        assert_eq!(ours.differ(7, &[entry(2, &daily)]), None);
    }
}
