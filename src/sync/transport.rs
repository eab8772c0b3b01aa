//! The I/O of a transmit: its pipelines sent side by side over one connection (made
//! first if there is none), each within the transmit's deadline, and a failed call told
//! as a [`Failure`] with no password in it. No decision of the protocol is made here.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use redis::Value;

use super::config::Settings;
use super::node::{Failure, Replies, Transmit};
use super::wire::{Command, Script};
use crate::redis::connection::{Link, Target};
use crate::redis::scripts::{SYNC_HOT_KEYS, SYNC_ROUND, SYNC_SETTINGS};

/// A node's way to Redis: the client, the round's timeout and the scripts.
pub(super) struct Transport {
    pub(super) settings: Settings,
    /// Whom the client connects to: scrubbed out of every error message.
    target: Target,
    round: redis::Script,
    hot_keys: redis::Script,
    settings_script: redis::Script,
}

impl Transport {
    pub(super) fn new(settings: Settings, target: Target) -> Self {
        Self {
            settings,
            target,
            round: redis::Script::new(SYNC_ROUND),
            hot_keys: redis::Script::new(SYNC_HOT_KEYS),
            settings_script: redis::Script::new(SYNC_SETTINGS),
        }
    }
}

/// Sends a transmit's pipelines side by side over `link` (connecting first if there is
/// none), waiting at most `wait` for each, and returns the link with what each pipeline
/// got (a timeout for one that had no reply by then).
pub(super) fn send(
    transport: Arc<Transport>,
    link: Option<Arc<Link>>,
    transmit: Transmit,
    wait: Duration,
) -> (
    u64,
    impl Future<Output = (Option<Arc<Link>>, Replies)> + Send,
) {
    let id = transmit.id;
    let replies = async move {
        let deadline = tokio::time::Instant::now() + wait;
        let timed_out = |n| vec![Err(Failure::timeout()); n];
        let link = match link {
            Some(link) => link,
            None => {
                let connect = Link::connect(
                    transport.settings.client.clone(),
                    transport.settings.timeout,
                );
                match tokio::time::timeout_at(deadline, connect).await {
                    Ok(Ok(link)) => link,
                    Ok(Err(e)) => {
                        return (
                            None,
                            vec![Err(transport.failure(&e)); transmit.pipelines.len()],
                        );
                    }
                    Err(_) => return (None, timed_out(transmit.pipelines.len())),
                }
            }
        };
        let replies: Replies =
            futures_util::future::join_all(transmit.pipelines.iter().map(|pipeline| async {
                tokio::time::timeout_at(deadline, transport.query(&link, pipeline))
                    .await
                    .unwrap_or_else(|_| Err(Failure::timeout()))
            }))
            .await;
        if replies.iter().any(Result::is_err) {
            // On a cluster, a fresh connection is made in the background and replaces
            // this one once it connects (see `Link`).
            link.failed();
        }
        (Some(link), replies)
    };
    (id, replies)
}

impl Transport {
    /// Sends one pipeline (`EVALSHA`, or `EVAL` with the source, which also caches the
    /// script on the node, if Redis lost it).
    async fn query(&self, link: &Link, commands: &[Command]) -> Result<Vec<Value>, Failure> {
        let pipeline = |eval: bool| {
            let mut pipe = redis::pipe();
            for command in commands {
                let cmd = match (command.script, eval) {
                    (Script::Leave, _) => pipe.cmd("ZREM"),
                    (Script::Round, true) => pipe.cmd("EVAL").arg(SYNC_ROUND),
                    (Script::HotKeys, true) => pipe.cmd("EVAL").arg(SYNC_HOT_KEYS),
                    (Script::Settings, true) => pipe.cmd("EVAL").arg(SYNC_SETTINGS),
                    (Script::Settings, false) => {
                        pipe.cmd("EVALSHA").arg(self.settings_script.get_hash())
                    }
                    (Script::Round, false) => pipe.cmd("EVALSHA").arg(self.round.get_hash()),
                    (Script::HotKeys, false) => pipe.cmd("EVALSHA").arg(self.hot_keys.get_hash()),
                };
                if command.script != Script::Leave {
                    cmd.arg(command.keys.len());
                }
                cmd.arg(&command.keys).arg(&command.args);
            }
            pipe
        };
        let mut connection = link.get();
        let replies = match pipeline(false)
            .query_async::<Vec<Value>>(&mut connection)
            .await
        {
            // After a restart or a failover the node lacks the script: `EVAL` goes to the
            // node of these keys only, as the limiter's checks do (a `SCRIPT LOAD` goes
            // to every node of a cluster, and fails while one is down). Replaying the
            // pipeline is safe: a call Redis applied answers `stale`.
            Err(e) if e.code() == Some("NOSCRIPT") => {
                pipeline(true).query_async(&mut connection).await
            }
            other => other,
        };
        replies.map_err(|e| self.failure(&e))
    }

    /// A failed call, with no password in its message.
    fn failure(&self, e: &redis::RedisError) -> Failure {
        Failure {
            kind: error_kind(e),
            message: self.target.scrub(&e.to_string()),
        }
    }
}

/// The [`SyncStats::last_error`](super::SyncStats::last_error) of a failed call.
fn error_kind(e: &redis::RedisError) -> &'static str {
    // A pipeline's failure carries its calls' error codes in its message only.
    let text = e.to_string();
    let coded = |codes: &[&str]| {
        codes.iter().any(|code| {
            e.code() == Some(code)
                || text.contains(&format!("\"{code}\""))
                || text.starts_with(code)
        })
    };
    // Without a password, Redis refuses the round's large request before any code:
    // "Protocol error: unauthenticated multibulk length".
    if crate::redis::sentinel::master_unknown(e).is_some() {
        "unknown_master"
    } else if e.kind() == redis::ErrorKind::AuthenticationFailed
        || coded(&["NOAUTH", "WRONGPASS"])
        || text.contains("unauthenticated")
    {
        "authentication"
    } else if e.is_timeout() {
        "timeout"
    } else if e.kind() == redis::ErrorKind::Parse {
        "reply"
    } else if e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || coded(&crate::redis::error::UNAVAILABLE_CODES)
    {
        "unavailable"
    } else if coded(&["NOSCRIPT"]) || text.contains("script") {
        "script"
    } else {
        "redis"
    }
}
