//! Keeps the deny caches of every node that shares a prefix honest: a reset on any node
//! empties them all, and so does Redis coming back after a lost connection (it may have
//! restarted without its data).
//!
//! [`RedisLimiter::reset`](super::RedisLimiter::reset) publishes on the channel
//! `<prefix>:<algorithm>:reset` after deleting the key. Every limiter with a deny cache
//! subscribes to that channel while it is built (a connection of its own, to one node;
//! a cluster broadcasts `PUBLISH` to every node; behind Sentinel, to the primary of the
//! moment) and empties its cache on each message.
//! The message carries nothing (the key may be a secret): every cached deny goes, which
//! costs at most one call per key that is still denied. When the subscription's
//! connection breaks, the listener reconnects (trying each URL in turn, waiting 100 ms
//! doubling to 2 s) and empties the cache once subscribed again, since Redis may have
//! lost the state that the cached denies stood for, and resets may have gone unheard.

use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::watch;

use super::connection::Nodes;

/// The channel of resets for the limiters whose keys start with `prefix`
/// (`<prefix>:<algorithm>:`).
pub(crate) fn channel(prefix: &str) -> String {
    format!("{prefix}reset")
}

/// The message that empties every deny cache listening on `channel`: it carries
/// nothing, since the key may be a secret.
pub(crate) fn message(channel: &str) -> redis::Cmd {
    let mut publish = redis::cmd("PUBLISH");
    publish.arg(channel).arg("");
    publish
}

/// Subscribes to `channel` through `client`, within `timeout` (at least 500 ms).
pub(crate) async fn subscribe(
    client: &redis::Client,
    channel: &str,
    timeout: Duration,
) -> Option<redis::aio::PubSub> {
    let subscribe = async {
        let mut pubsub = client.get_async_pubsub().await?;
        pubsub.subscribe(channel).await?;
        Ok::<_, redis::RedisError>(pubsub)
    };
    tokio::time::timeout(timeout.max(Duration::from_millis(500)), subscribe)
        .await
        .ok()?
        .ok()
}

/// Listens on `channel` until `stop`'s sender is dropped, calling `flush` on every
/// message and every time it subscribes again. `first` is the subscription made while
/// the limiter was built, if that worked (then nothing was missed before it). Each
/// attempt to subscribe again takes the next of the nodes' current clients.
pub(crate) fn spawn(
    nodes: Nodes,
    channel: String,
    timeout: Duration,
    first: Option<redis::aio::PubSub>,
    mut stop: watch::Receiver<()>,
    flush: impl Fn() + Send + 'static,
) {
    tokio::spawn(async move {
        let mut wait = Duration::from_millis(100);
        let mut current = first;
        for turn in 0usize.. {
            if current.is_none() {
                current = tokio::select! {
                    _ = stop.changed() => return,
                    subscribed = async {
                        let clients = nodes.current().await;
                        match clients.get(turn % clients.len().max(1)) {
                            Some(client) => subscribe(client, &channel, timeout).await,
                            None => None,
                        }
                    } => subscribed,
                };
                if current.is_some() {
                    // Whatever happened while nobody listened is forgotten with the cache.
                    flush();
                } else {
                    nodes.forget();
                }
            }
            if let Some(mut pubsub) = current.take() {
                wait = Duration::from_millis(100);
                let mut messages = pubsub.on_message();
                loop {
                    tokio::select! {
                        _ = stop.changed() => return,
                        message = messages.next() => match message {
                            Some(_) => flush(),
                            // The connection broke.
                            None => {
                                nodes.forget();
                                break;
                            }
                        },
                    }
                }
            }
            tokio::select! {
                _ = stop.changed() => return,
                () = tokio::time::sleep(wait) => {}
            }
            wait = (wait * 2).min(Duration::from_secs(2));
        }
    });
}

/// How often the limiters sharing a prefix count each other.
const COUNT_EVERY: Duration = Duration::from_secs(1);

/// The subscribers of `channel`, summed over the nodes' current clients (a cluster's
/// subscriptions are each node's own); `None` if no node answered within `timeout`, or,
/// behind Sentinel, if the node is no longer the primary.
pub(crate) async fn count(nodes: &Nodes, channel: &str, timeout: Duration) -> Option<u64> {
    let clients = nodes.current().await;
    let primary_only = nodes.primary_only();
    let ask = |client: &redis::Client| {
        let client = client.clone();
        async move {
            let ask = async {
                let mut connection = client.get_multiplexed_async_connection().await?;
                if primary_only {
                    let role: redis::Value =
                        redis::cmd("ROLE").query_async(&mut connection).await?;
                    if !super::sentinel::is_primary(&role) {
                        return Err(redis::RedisError::from((
                            redis::ErrorKind::Client,
                            "not the primary",
                        )));
                    }
                }
                let reply: Vec<(String, u64)> = redis::cmd("PUBSUB")
                    .arg("NUMSUB")
                    .arg(channel)
                    .query_async(&mut connection)
                    .await?;
                Ok::<_, redis::RedisError>(reply.into_iter().map(|(_, n)| n).sum::<u64>())
            };
            tokio::time::timeout(timeout, ask).await.ok()?.ok()
        }
    };
    // Every node at once: one that does not answer costs the timeout once, not per node.
    let counts = futures_util::future::join_all(clients.iter().map(ask)).await;
    let total = counts
        .into_iter()
        .flatten()
        .fold(None, |total, n| Some(total.unwrap_or(0) + n));
    if total.is_none() {
        nodes.forget();
    }
    total
}

/// Counts the subscribers of `channel` every [`COUNT_EVERY`] and hands the count to
/// `counted`, until `stop`'s sender is dropped or `counted` returns false (its limiter
/// is gone). A round with no answer hands nothing: the last count stands.
pub(crate) fn spawn_counting(
    nodes: Nodes,
    channel: String,
    timeout: Duration,
    mut stop: watch::Receiver<()>,
    counted: impl Fn(u64) -> bool + Send + 'static,
) {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.changed() => return,
                () = tokio::time::sleep(COUNT_EVERY) => {}
            }
            let n = tokio::select! {
                _ = stop.changed() => return,
                n = count(&nodes, &channel, timeout) => n,
            };
            if let Some(n) = n {
                if !counted(n) {
                    return;
                }
            }
        }
    });
}
