//! A throwaway Redis Cluster on loopback, for tests and benchmarks.

use std::io;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::local_redis::{LocalRedis, redact};

/// A Redis Cluster of `redis-server` processes on ephemeral loopback ports, which this
/// value owns: created with `redis-cli --cluster create`, every process stopped (and its
/// directory removed) on drop.
///
/// Meant for tests and benchmarks; it needs `redis-server` and `redis-cli` on `PATH`.
/// Its `Debug` output shows no password.
pub struct LocalCluster {
    nodes: Vec<LocalRedis>,
    password: Option<String>,
}

impl std::fmt::Debug for LocalCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalCluster")
            .field("nodes", &self.nodes)
            .field("password", &redact(self.password.as_ref()))
            .finish()
    }
}

/// One line of `CLUSTER NODES`, as far as a test needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterNode {
    /// The node's port.
    pub port: u16,
    /// Whether it is a master.
    pub master: bool,
    /// Whether it owns slots.
    pub has_slots: bool,
    /// Whether the cluster marks it failed (`fail` or `fail?`).
    pub failed: bool,
}

impl LocalCluster {
    /// Starts `masters × (1 + replicas)` servers with a node timeout of `node_timeout`,
    /// creates the cluster and waits until every node says `cluster_state:ok`.
    ///
    /// # Errors
    /// When a server does not start, `redis-cli` fails, or the cluster is not ready
    /// within 30 seconds.
    pub fn start(masters: usize, replicas: usize, node_timeout: Duration) -> io::Result<Self> {
        Self::launch(masters, replicas, node_timeout, None)
    }

    /// [`start`](Self::start), with every node requiring `password` (`requirepass`,
    /// and `masterauth` for its replication).
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub fn start_with_password(
        masters: usize,
        replicas: usize,
        node_timeout: Duration,
        password: &str,
    ) -> io::Result<Self> {
        Self::launch(masters, replicas, node_timeout, Some(password))
    }

    fn launch(
        masters: usize,
        replicas: usize,
        node_timeout: Duration,
        password: Option<&str>,
    ) -> io::Result<Self> {
        let timeout = node_timeout.as_millis().to_string();
        let count = masters * (1 + replicas);
        let mut args = vec![
            "--cluster-enabled",
            "yes",
            "--cluster-node-timeout",
            &timeout,
            // The cluster stays up for the slots it still has while others fail.
            "--cluster-require-full-coverage",
            "no",
            // A replica syncs at once (not after the default 5 s wait for others): a
            // replica that never synced does not take over from its master.
            "--repl-diskless-sync-delay",
            "0",
        ];
        if let Some(password) = password {
            args.extend(["--requirepass", password, "--masterauth", password]);
        }
        let mut nodes = Vec::with_capacity(count);
        for _ in 0..count {
            // Each node's bus port is picked like its client port, on every attempt: the
            // default (port + 10,000) may be another test's server.
            nodes.push(LocalRedis::start_cluster_node(&args)?);
        }
        let cluster = Self {
            nodes,
            password: password.map(str::to_owned),
        };
        let mut create = Command::new("redis-cli");
        if let Some(password) = password {
            create.args(["-a", password, "--no-auth-warning"]);
        }
        create.arg("--cluster").arg("create");
        for node in &cluster.nodes {
            create.arg(format!("127.0.0.1:{}", node.port()));
        }
        create
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null());
        let output = create.output().map_err(crate::local_redis::cli_missing)?;
        if !output.status.success() {
            return Err(io::Error::other(format!(
                "redis-cli --cluster create failed: {}",
                String::from_utf8_lossy(&output.stdout)
            )));
        }
        cluster.wait_ok(Duration::from_secs(30))?;
        cluster.wait_replicas_synced(Duration::from_secs(30))?;
        Ok(cluster)
    }

    /// The seed URLs: every node's `redis://` URL (without the password).
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(LocalRedis::url).collect()
    }

    /// Runs one `redis-cli` command against the node on `port` (1 s timeout), and
    /// returns its output.
    ///
    /// # Errors
    /// When `redis-cli` fails or the node does not answer in time.
    pub fn cli(&self, port: u16, args: &[&str]) -> io::Result<String> {
        crate::local_redis::redis_cli(port, self.password.as_deref(), None, args)
    }

    /// Every node's port, in start order.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(LocalRedis::port).collect()
    }

    /// The node on `port`, to kill, pause or restart it.
    ///
    /// # Panics
    /// If no node of this cluster listens on `port`.
    pub fn node(&mut self, port: u16) -> &mut LocalRedis {
        self.nodes
            .iter_mut()
            .find(|n| n.port() == port)
            .expect("a port of this cluster")
    }

    /// The cluster's view of its nodes, from the first node that answers.
    ///
    /// # Errors
    /// When no node answers `CLUSTER NODES`.
    pub fn topology(&self) -> io::Result<Vec<ClusterNode>> {
        for port in self.ports() {
            let Ok(text) = self.cli(port, &["CLUSTER", "NODES"]) else {
                continue;
            };
            let nodes: Vec<ClusterNode> = text
                .lines()
                .filter_map(|line| {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    let address = fields.get(1)?;
                    let port = address.split(['@', ',']).next()?.rsplit(':').next()?;
                    let flags = fields.get(2)?;
                    Some(ClusterNode {
                        port: port.parse().ok()?,
                        master: flags.contains("master"),
                        has_slots: fields.len() > 8,
                        failed: flags.contains("fail"),
                    })
                })
                .collect();
            if !nodes.is_empty() {
                return Ok(nodes);
            }
        }
        Err(io::Error::other("no cluster node answered CLUSTER NODES"))
    }

    /// The ports of the masters that own slots and are not marked failed.
    ///
    /// # Errors
    /// As [`topology`](Self::topology).
    pub fn masters(&self) -> io::Result<Vec<u16>> {
        Ok(self
            .topology()?
            .into_iter()
            .filter(|n| n.master && n.has_slots && !n.failed)
            .map(|n| n.port)
            .collect())
    }

    /// Waits until every replica's link to its master is up (its first sync is done).
    ///
    /// # Errors
    /// If that does not happen within `within`.
    pub fn wait_replicas_synced(&self, within: Duration) -> io::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            let synced = self.topology()?.iter().filter(|n| !n.master).all(|n| {
                self.cli(n.port, &["INFO", "replication"])
                    .is_ok_and(|info| info.contains("master_link_status:up"))
            });
            if synced {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the cluster's replicas did not sync",
                ));
            }
            // Waits for the real replicas to finish their first sync with their masters.
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until every running node says `cluster_state:ok`.
    ///
    /// # Errors
    /// If that does not happen within `within`.
    pub fn wait_ok(&self, within: Duration) -> io::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            let ok = self.ports().into_iter().all(|port| {
                // A node that does not answer (killed or paused) has no say.
                self.cli(port, &["CLUSTER", "INFO"])
                    .map_or(true, |info| info.contains("cluster_state:ok"))
            });
            if ok {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the cluster did not reach cluster_state:ok",
                ));
            }
            // Waits for the real nodes to agree on the slots (after a start or a failover).
            thread::sleep(Duration::from_millis(50));
        }
    }
}
