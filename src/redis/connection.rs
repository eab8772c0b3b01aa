//! Where both Redis tiers connect: one server, a cluster, or the primary that Redis
//! Sentinel names, behind one connection type, with passwords kept out of every message.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};

use super::sentinel::Sentinels;
use crate::error::ConfigError;

/// What a [`Target`]'s URLs are.
#[derive(Clone, PartialEq, Eq)]
enum Kind {
    /// One server.
    Single,
    /// A cluster's seed nodes.
    Cluster,
    /// The sentinels that name the primary of `master`.
    Sentinel { master: String },
}

/// A Redis deployment to connect to: one server, the seed nodes of a cluster, or the
/// sentinels of a primary.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Target {
    urls: Vec<String>,
    kind: Kind,
    root_cert: Option<Vec<u8>>,
    /// Behind Sentinel, the data nodes' ACL user and password (the sentinels' own are
    /// in their URLs).
    data_user: Option<String>,
    data_password: Option<String>,
}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl Target {
    fn new(urls: Vec<String>, kind: Kind) -> Self {
        Self {
            urls,
            kind,
            root_cert: None,
            data_user: None,
            data_password: None,
        }
    }

    pub(crate) fn single(url: &str) -> Self {
        Self::new(vec![url.to_owned()], Kind::Single)
    }

    pub(crate) fn cluster(nodes: &[&str]) -> Self {
        Self::new(nodes.iter().map(|&n| n.to_owned()).collect(), Kind::Cluster)
    }

    /// The sentinels (URLs, or `host:port` for `redis://host:port/`) that name the
    /// primary of `master`.
    pub(crate) fn sentinel(sentinels: &[&str], master: &str) -> Self {
        let urls = sentinels
            .iter()
            .map(|&s| {
                if s.contains("://") {
                    s.to_owned()
                } else {
                    format!("redis://{s}/")
                }
            })
            .collect();
        Self::new(
            urls,
            Kind::Sentinel {
                master: master.to_owned(),
            },
        )
    }

    pub(crate) fn is_cluster(&self) -> bool {
        self.kind == Kind::Cluster
    }

    /// Behind Sentinel, the data nodes' password (and, with `user`, ACL user).
    pub(crate) fn set_data_auth(&mut self, user: Option<&str>, password: &str) {
        self.data_user = user.map(str::to_owned);
        self.data_password = Some(password.to_owned());
    }

    /// Trust only this CA (PEM) for `rediss://` instead of the system's roots.
    #[cfg(feature = "tls")]
    pub(crate) fn set_root_cert(&mut self, pem: Vec<u8>) {
        self.root_cert = Some(pem);
    }

    /// The URLs, comma-separated, each with its password replaced by `***`; `cluster:`
    /// in front for a cluster, and `sentinel:<master>@` for sentinels (with `+auth` after
    /// the master's name when the data nodes have a password).
    pub(crate) fn redacted(&self) -> String {
        let urls: Vec<String> = self.urls.iter().map(|u| redact_url(u)).collect();
        let urls = urls.join(",");
        match &self.kind {
            Kind::Single => urls,
            Kind::Cluster => format!("cluster:{urls}"),
            Kind::Sentinel { master } => {
                let auth = if self.data_password.is_some() {
                    "+auth"
                } else {
                    ""
                };
                format!("sentinel:{master}{auth}@{urls}")
            }
        }
    }

    /// `text` with every password of these URLs replaced by `***` (for error messages
    /// that quote what they were given).
    pub(crate) fn scrub(&self, text: &str) -> String {
        let mut text = text.to_owned();
        let passwords = self.urls.iter().filter_map(|url| password_of(url));
        for password in passwords.chain(self.data_password.as_deref()) {
            if !password.is_empty() {
                text = text.replace(password, "***");
            }
        }
        text
    }

    /// This cluster target with `nodes` (`host:port`, as the cluster reports them) added
    /// to its seeds, each with the first seed's scheme and credentials.
    fn with_nodes(&self, nodes: &[String]) -> Self {
        let Some(first) = self.urls.first() else {
            return self.clone();
        };
        let (scheme, user_info) = match split_user_info(first) {
            Some((scheme, user_info, _)) => (scheme, format!("{user_info}@")),
            None => (
                first.split_once("://").map_or("redis", |(s, _)| s),
                String::new(),
            ),
        };
        let mut urls = self.urls.clone();
        for node in nodes {
            let url = format!("{scheme}://{user_info}{node}/");
            if !urls.contains(&url) {
                urls.push(url);
            }
        }
        Self {
            urls,
            ..self.clone()
        }
    }

    /// One plain client per URL (a cluster's seeds, or the sentinels). Connects nothing.
    fn url_clients(&self) -> Result<Vec<redis::Client>, ConfigError> {
        self.urls
            .iter()
            .map(|url| {
                match &self.root_cert {
                    #[cfg(feature = "tls")]
                    Some(pem) => redis::Client::build_with_tls(
                        url.as_str(),
                        redis::TlsCertificates {
                            client_tls: None,
                            root_cert: Some(pem.clone()),
                        },
                    ),
                    _ => redis::Client::open(url.as_str()),
                }
                .map_err(|e| ConfigError::InvalidRedisUrl {
                    url: self.redacted(),
                    reason: self.scrub(&e.to_string()),
                })
            })
            .collect()
    }

    /// Parses the URLs into a client; connects nothing.
    pub(crate) fn client(&self, timeout: Duration) -> Result<Client, ConfigError> {
        let invalid = |e: redis::RedisError| ConfigError::InvalidRedisUrl {
            url: self.redacted(),
            reason: self.scrub(&e.to_string()),
        };
        if self.urls.is_empty() {
            return Err(ConfigError::InvalidRedisUrl {
                url: self.redacted(),
                reason: "no Redis URL was given".to_owned(),
            });
        }
        if self.data_password.is_some() && !matches!(self.kind, Kind::Sentinel { .. }) {
            return Err(ConfigError::InvalidRedisSetting {
                setting: "master_password",
                value: "(set)".to_owned(),
                expected: "a Sentinel deployment: elsewhere the password goes in the URL",
            });
        }
        if let Kind::Sentinel { master } = &self.kind {
            if master.is_empty() {
                return Err(ConfigError::InvalidRedisSetting {
                    setting: "master_name",
                    value: String::new(),
                    expected: "the name the sentinels monitor the primary by",
                });
            }
            let tls = self.urls[0].starts_with("rediss://");
            if self.urls.iter().any(|u| u.starts_with("rediss://") != tls) {
                return Err(ConfigError::InvalidRedisUrl {
                    url: self.redacted(),
                    reason: "every sentinel URL must use the same scheme".to_owned(),
                });
            }
            return Ok(Client::Sentinel(Sentinels::new(
                self.url_clients()?,
                master.clone(),
                tls,
                self.data_user.clone(),
                self.data_password.clone(),
                self.root_cert.clone(),
            )));
        }
        if self.kind == Kind::Single {
            let client = match &self.root_cert {
                #[cfg(feature = "tls")]
                Some(pem) => redis::Client::build_with_tls(
                    self.urls[0].as_str(),
                    redis::TlsCertificates {
                        client_tls: None,
                        root_cert: Some(pem.clone()),
                    },
                ),
                _ => redis::Client::open(self.urls[0].as_str()),
            }
            .map_err(invalid)?;
            return Ok(Client::Single(client));
        }
        #[cfg_attr(not(feature = "tls"), allow(unused_mut))]
        let mut builder = ClusterClientBuilder::new(self.urls.iter().map(String::as_str))
            .connection_timeout(timeout)
            .response_timeout(timeout)
            // A request that meets a failover retries (refreshing the slot map) until the
            // caller's timeout, which bounds it, runs out.
            .retries(20)
            .min_retry_wait(10)
            .max_retry_wait(500);
        #[cfg(feature = "tls")]
        if let Some(pem) = &self.root_cert {
            builder = builder.certs(redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(pem.clone()),
            });
        }
        // Every seed's credentials must agree: redis-rs takes the first one's.
        Ok(Client::Cluster(
            builder.build().map_err(invalid)?,
            Box::new(self.clone()),
        ))
    }
}

/// A parsed [`Target`], ready to connect.
#[derive(Clone)]
pub(crate) enum Client {
    Single(redis::Client),
    /// The client, and the target it was made from (to add the nodes a cluster reports
    /// to its seeds).
    Cluster(ClusterClient, Box<Target>),
    /// The sentinels, asked for the primary at every connection.
    Sentinel(Sentinels),
}

/// The data nodes a subscription (the reset channel, and the count of its subscribers)
/// may use: a fixed list (one server, or a cluster's seeds: a cluster broadcasts
/// `PUBLISH` to every node, so any one will do), or, behind Sentinel, the primary (a
/// replica would hear `PUBLISH` too, but the primary is the one node that every limiter
/// agrees on, so that the count is whole). The primary is asked of the sentinels once,
/// and again after a caller [`forget`](Self::forget)s it (its subscription broke, or it
/// failed to count).
#[derive(Clone)]
pub(crate) enum Nodes {
    Fixed(Vec<redis::Client>),
    Sentinel {
        sentinels: Sentinels,
        timeout: Duration,
        primary: Arc<Mutex<Option<redis::Client>>>,
    },
}

impl Nodes {
    /// The clients to use now; empty if the sentinels name no reachable primary.
    pub(crate) async fn current(&self) -> Vec<redis::Client> {
        match self {
            Self::Fixed(clients) => clients.clone(),
            Self::Sentinel {
                sentinels,
                timeout,
                primary,
            } => {
                if let Some(client) = primary.lock().clone() {
                    return vec![client];
                }
                let found = sentinels.primary(*timeout).await.ok();
                primary.lock().clone_from(&found);
                found.into_iter().collect()
            }
        }
    }

    /// The current clients failed: behind Sentinel, ask the sentinels again next time.
    pub(crate) fn forget(&self) {
        if let Self::Sentinel { primary, .. } = self {
            *primary.lock() = None;
        }
    }

    /// Whether the nodes must be primaries (a demoted one, back after a failover, has
    /// no subscriber: its count of them is no count).
    pub(crate) fn primary_only(&self) -> bool {
        matches!(self, Self::Sentinel { .. })
    }
}

impl Client {
    /// The data nodes a subscription may use (see [`Nodes`]): this client's own, a
    /// cluster's seeds, or the sentinels' primary. Connects nothing.
    pub(crate) fn nodes(&self, timeout: Duration) -> Result<Nodes, ConfigError> {
        match self {
            Self::Single(client) => Ok(Nodes::Fixed(vec![client.clone()])),
            Self::Cluster(_, target) => Ok(Nodes::Fixed(target.url_clients()?)),
            Self::Sentinel(sentinels) => Ok(Nodes::Sentinel {
                sentinels: sentinels.clone(),
                timeout,
                primary: Arc::default(),
            }),
        }
    }

    /// Connects, each connection attempt bounded by `timeout`. The connection
    /// reconnects by itself, and a cluster connection follows failovers and slot moves.
    ///
    /// On one server (or Sentinel's primary) a reply is bounded only by its caller's
    /// deadline, which every request carries (a check's, a sync round's), not by a
    /// second timer per request in the connection: redis-rs's would only abandon the
    /// reply, as the caller's does, and each timer costs a check a registration and a
    /// removal in tokio's timer wheel. A cluster connection keeps its per-node timeout,
    /// which its own retries and redirections rely on.
    pub(crate) async fn connect(&self, timeout: Duration) -> redis::RedisResult<Connection> {
        let manager = |client: redis::Client| async move {
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(None)
                .set_number_of_retries(1);
            let manager = ConnectionManager::new_with_config(client, config).await?;
            Ok(Connection::Single(manager))
        };
        match self {
            Self::Single(client) => manager(client.clone()).await,
            Self::Cluster(client, _) => {
                Ok(Connection::Cluster(client.get_async_connection().await?))
            }
            // The primary the sentinels name, checked to be one.
            Self::Sentinel(sentinels) => manager(sentinels.primary(timeout).await?).await,
        }
    }

    /// Connects, pings once (behind Sentinel: checks that the server is the primary),
    /// then runs `cmd`, blocking for at most about `timeout` a step.
    pub(crate) fn query_blocking(
        &self,
        timeout: Duration,
        cmd: &redis::Cmd,
    ) -> redis::RedisResult<Value> {
        match self {
            Self::Single(client) => {
                let mut connection = client.get_connection_with_timeout(timeout)?;
                connection.set_read_timeout(Some(timeout))?;
                redis::cmd("PING").query::<String>(&mut connection)?;
                cmd.query(&mut connection)
            }
            Self::Cluster(client, _) => {
                let mut connection = client.get_connection()?;
                connection.set_read_timeout(Some(timeout))?;
                redis::cmd("PING").query::<String>(&mut connection)?;
                cmd.query(&mut connection)
            }
            Self::Sentinel(sentinels) => sentinels.query_blocking(timeout, cmd),
        }
    }

    /// This client with `nodes` added to a cluster's seeds (itself if it is not a
    /// cluster's, if there are none, or if the new seeds do not parse).
    fn with_nodes(&self, nodes: &[String], timeout: Duration) -> Self {
        match self {
            Self::Cluster(_, target) if !nodes.is_empty() => target
                .with_nodes(nodes)
                .client(timeout)
                .unwrap_or_else(|_| self.clone()),
            _ => self.clone(),
        }
    }
}

/// The `host:port` of every node, master or replica, that a cluster's `CLUSTER SLOTS`
/// lists; empty if the command fails or `connection` is not a cluster's.
async fn discover(connection: &Connection, timeout: Duration) -> Vec<String> {
    let Connection::Cluster(_) = connection else {
        return Vec::new();
    };
    let mut connection = connection.clone();
    let reply = tokio::time::timeout(
        timeout,
        redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async::<Value>(&mut connection),
    )
    .await;
    let Ok(Ok(Value::Array(ranges))) = reply else {
        return Vec::new();
    };
    let mut nodes = Vec::new();
    for range in ranges {
        let Value::Array(fields) = range else {
            continue;
        };
        // start, end, then one [host, port, id, …] per node serving the range.
        for node in fields.into_iter().skip(2) {
            let Value::Array(node) = node else { continue };
            let host = match node.first() {
                Some(Value::BulkString(host)) => String::from_utf8_lossy(host).into_owned(),
                Some(Value::SimpleString(host)) => host.clone(),
                _ => continue,
            };
            let Some(Value::Int(port)) = node.get(1) else {
                continue;
            };
            // An empty or "?" host means the node does not know its own address.
            if host.is_empty() || host == "?" {
                continue;
            }
            let address = if host.contains(':') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            };
            if !nodes.contains(&address) {
                nodes.push(address);
            }
        }
    }
    nodes
}

/// How often a failing connection (a cluster's, or behind Sentinel) is rebuilt, at most.
const REBUILD_EVERY: Duration = Duration::from_millis(500);

/// A connection that heals itself. On one server the connection manager reconnects.
/// Behind Sentinel, a connection whose requests fail for want of a server (refused,
/// dropped, timed out, or `READONLY` from a demoted primary) is rebuilt as on a cluster:
/// the sentinels are asked for the primary anew, since the manager would only ever
/// reconnect to the old address; and so is one whose sentinels announce a new primary
/// ([`watch_switches`](Link::watch_switches)).
///
/// On a cluster, a connection whose requests fail is rebuilt (at most every 500 ms, in
/// the background): redis-rs retries a dead master's address and learns the new slot
/// map from a `MOVED`, which a client whose every request for those slots goes to the
/// dead address may never get (a CI run saw a sync connection stay on it for 12 s after
/// a failover that another connection had followed in 4 s). A fresh connection reads
/// the slot map anew. It starts from the seeds and from every node the cluster listed
/// when this link last connected: a node given one seed, which then died, would
/// otherwise never reach the cluster again.
pub(crate) struct Link {
    client: Client,
    timeout: Duration,
    current: RwLock<Connection>,
    rebuild: Mutex<Rebuild>,
    /// Told each time a rebuilt connection replaces the current one, and how many times
    /// that happened.
    rebuilt: tokio::sync::Notify,
    generation: std::sync::atomic::AtomicU64,
    /// The cluster's nodes (`host:port`) as `CLUSTER SLOTS` listed them at the last
    /// connection; empty for one server.
    known: Mutex<Vec<String>>,
}

/// Whether a [`Link`] is being rebuilt, when that last started, and whether another
/// rebuild must follow the one under way (the sentinels named a new primary meanwhile,
/// which the running one may have asked too early to see).
#[derive(Default)]
struct Rebuild {
    last: Option<Instant>,
    running: bool,
    again: bool,
}

impl Link {
    /// Connects, each step bounded by `timeout`; behind Sentinel, starts listening for
    /// switches ([`watch_switches`](Self::watch_switches)).
    pub(crate) async fn connect(
        client: Client,
        timeout: Duration,
    ) -> redis::RedisResult<Arc<Self>> {
        let current = client.connect(timeout).await?;
        let known = discover(&current, timeout).await;
        let link = Arc::new(Self {
            client,
            timeout,
            current: RwLock::new(current),
            rebuild: Mutex::new(Rebuild::default()),
            rebuilt: tokio::sync::Notify::new(),
            generation: std::sync::atomic::AtomicU64::new(0),
            known: Mutex::new(known),
        });
        link.watch_switches();
        Ok(link)
    }

    /// The connection to use now (a cheap clone).
    pub(crate) fn get(&self) -> Connection {
        self.current.read().clone()
    }

    /// Returns once a rebuilt connection replaces the current one (a rebuild that
    /// ends before this is awaited is not seen: compare [`generation`](Self::generation)).
    pub(crate) async fn rebuilt(&self) {
        self.rebuilt.notified().await;
    }

    /// How many rebuilt connections have replaced the current one.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Acquire)
    }

    /// A request failed for want of a server: on a cluster or behind Sentinel, rebuild
    /// the connection in the background, unless that began less than 500 ms ago or is
    /// under way.
    pub(crate) fn failed(self: &Arc<Self>) {
        self.rebuild(false);
    }

    /// Behind Sentinel, listens (in the background, while this link lives) for the
    /// sentinels' `+switch-master` about its master, and rebuilds the connection as soon
    /// as one comes, failing or not: a primary that the sentinels demoted may still be
    /// up and answering (cut off from them, not from this node), and what it accepts
    /// now is lost when it rejoins as a replica. Every sentinel is listened to (one
    /// subscription each): they switch at different times, the leader first.
    fn watch_switches(self: &Arc<Self>) {
        let Client::Sentinel(sentinels) = &self.client else {
            return;
        };
        for which in 0..sentinels.len() {
            let sentinels = sentinels.clone();
            let weak = Arc::downgrade(self);
            let timeout = self.timeout;
            tokio::spawn(async move {
                while weak.strong_count() > 0 {
                    let Some(mut pubsub) = sentinels.switches(which, timeout).await else {
                        tokio::time::sleep(REBUILD_EVERY).await;
                        continue;
                    };
                    let mut messages = pubsub.on_message();
                    loop {
                        let message = tokio::select! {
                            message = futures_util::StreamExt::next(&mut messages) => message,
                            // Ends with the link, even when the sentinel says nothing.
                            () = tokio::time::sleep(Duration::from_secs(1)) => {
                                if weak.strong_count() == 0 {
                                    return;
                                }
                                continue;
                            }
                        };
                        let Some(message) = message else { break };
                        let payload: String = message.get_payload().unwrap_or_default();
                        if sentinels.names_master(&payload) {
                            match weak.upgrade() {
                                Some(link) => link.rebuild(true),
                                None => return,
                            }
                        }
                    }
                }
            });
        }
    }

    /// Rebuilds the connection in the background (see [`Link`]); unless `now`, not
    /// within 500 ms of the last start. One rebuild runs at a time: asked `now` while
    /// one runs, another follows it.
    fn rebuild(self: &Arc<Self>, now: bool) {
        if matches!(self.client, Client::Single(_)) {
            return;
        }
        {
            let mut rebuild = self.rebuild.lock();
            if rebuild.running {
                rebuild.again |= now;
                return;
            }
            if !now && rebuild.last.is_some_and(|at| at.elapsed() < REBUILD_EVERY) {
                return;
            }
            rebuild.running = true;
            rebuild.last = Some(Instant::now());
        }
        let link = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                let within = link.timeout.max(Duration::from_secs(1));
                let known = link.known.lock().clone();
                let client = link.client.with_nodes(&known, link.timeout);
                let fresh = tokio::time::timeout(within, client.connect(link.timeout)).await;
                if let Ok(Ok(fresh)) = fresh {
                    let nodes = discover(&fresh, link.timeout).await;
                    if !nodes.is_empty() {
                        *link.known.lock() = nodes;
                    }
                    *link.current.write() = fresh;
                    link.generation
                        .fetch_add(1, std::sync::atomic::Ordering::Release);
                    link.rebuilt.notify_waiters();
                }
                let mut rebuild = link.rebuild.lock();
                if !rebuild.again {
                    rebuild.running = false;
                    return;
                }
                rebuild.again = false;
                rebuild.last = Some(Instant::now());
            }
        });
    }
}

/// A connection to one server or a cluster. Clones share it.
#[derive(Clone)]
pub(crate) enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl redis::aio::ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(cmd, offset, count),
            Self::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// Runs a script by `EVALSHA` (`call(false)`), or by `EVAL` (`call(true)`) after a
/// `SCRIPT FLUSH`, a restart or a failover (or on a cluster node's first call), which runs
/// the script and caches it on that node.
pub(crate) async fn eval<T: redis::FromRedisValue>(
    connection: &mut Connection,
    call: impl Fn(bool) -> redis::Cmd,
) -> redis::RedisResult<T> {
    match call(false).query_async::<T>(connection).await {
        Err(e) if e.code() == Some("NOSCRIPT") => call(true).query_async(connection).await,
        reply => reply,
    }
}

/// A URL's scheme, its user info (before the `@` of the authority) and what follows that
/// `@`; `None` without user info.
fn split_user_info(url: &str) -> Option<(&str, &str, &str)> {
    let (scheme, rest) = url.split_once("://")?;
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (user_info, _) = rest[..authority_end].rsplit_once('@')?;
    Some((scheme, user_info, &rest[user_info.len() + 1..]))
}

/// The password in `url`'s user info, if any (`redis://password@host` has one too).
fn password_of(url: &str) -> Option<&str> {
    let (_, user_info, _) = split_user_info(url)?;
    Some(user_info.split_once(':').map_or(user_info, |(_, p)| p))
}

/// `url` with any password replaced by `***`.
pub(crate) fn redact_url(url: &str) -> String {
    match split_user_info(url) {
        Some((scheme, user_info, after)) => match user_info.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{after}"),
            // `redis://password@host` carries a password with no user.
            None => format!("{scheme}://***@{after}"),
        },
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_a_cluster_lists_join_the_seeds_with_their_credentials() {
        let target = Target::cluster(&["redis://app:s3cret@10.0.0.1:7000/"]);
        let grown = target.with_nodes(&[
            "10.0.0.2:7001".to_owned(),
            "[::1]:7002".to_owned(),
            "10.0.0.1:7000".to_owned(),
        ]);
        assert_eq!(
            grown.urls,
            [
                "redis://app:s3cret@10.0.0.1:7000/",
                "redis://app:s3cret@10.0.0.2:7001/",
                "redis://app:s3cret@[::1]:7002/",
            ]
        );
        assert!(grown.is_cluster());
        // The password stays out of what is printed.
        let shown = format!("{grown:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("10.0.0.2:7001"), "{shown}");
        // Without credentials, none are invented.
        let plain =
            Target::cluster(&["redis://10.0.0.1:7000"]).with_nodes(&["10.0.0.3:7003".to_owned()]);
        assert_eq!(plain.urls[1], "redis://10.0.0.3:7003/");
        // A client made from the grown target parses every seed.
        assert!(grown.client(Duration::from_millis(100)).is_ok());
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("redis://app:s3cret@10.0.0.1:6379/0"),
            "redis://app:***@10.0.0.1:6379/0"
        );
        assert_eq!(redact_url("redis://:s3cret@host/"), "redis://:***@host/");
        assert_eq!(redact_url("redis://s3cret@host"), "redis://***@host");
        assert_eq!(redact_url("redis://host:6379/"), "redis://host:6379/");
        assert_eq!(redact_url("rediss://u:p@h:1"), "rediss://u:***@h:1");
        let target = Target::cluster(&["redis://a:pw1@h:1/", "redis://:pw2@h:2/"]);
        assert_eq!(
            target.redacted(),
            "cluster:redis://a:***@h:1/,redis://:***@h:2/"
        );
        assert_eq!(target.scrub("bad pw1 and pw2"), "bad *** and ***");
        assert_eq!(format!("{target:?}"), target.redacted());
    }

    #[test]
    fn sentinel_targets_take_addresses_or_urls_and_hide_both_passwords() {
        let mut target =
            Target::sentinel(&["10.0.0.1:26379", "redis://:s-pw@10.0.0.2:26379/"], "m");
        assert_eq!(
            target.urls,
            ["redis://10.0.0.1:26379/", "redis://:s-pw@10.0.0.2:26379/"]
        );
        target.set_data_auth(Some("app"), "d-pw");
        let shown = format!("{target:?}");
        assert_eq!(
            shown,
            "sentinel:m+auth@redis://10.0.0.1:26379/,redis://:***@10.0.0.2:26379/"
        );
        assert_eq!(target.scrub("s-pw then d-pw"), "*** then ***");
        assert!(!target.is_cluster());
        assert!(matches!(
            target.client(Duration::from_millis(10)),
            Ok(Client::Sentinel(_))
        ));
    }

    #[test]
    fn a_url_that_does_not_parse_is_a_config_error_without_its_password() {
        for target in [
            Target::single("redis://u:hunter2@h:notaport/"),
            Target::cluster(&["redis://u:hunter2@h:notaport/"]),
            Target::cluster(&[]),
        ] {
            let err = target
                .client(Duration::from_millis(10))
                .err()
                .expect("refused");
            assert!(matches!(err, ConfigError::InvalidRedisUrl { .. }), "{err}");
            assert!(!err.to_string().contains("hunter2"), "{err}");
            assert!(!format!("{err:?}").contains("hunter2"), "{err:?}");
        }
    }
}
