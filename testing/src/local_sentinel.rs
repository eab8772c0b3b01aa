//! A throwaway Redis Sentinel deployment on loopback: one primary, its replicas and the
//! sentinels that watch them, for tests and benchmarks.

use std::io;
use std::thread;
use std::time::{Duration, Instant};

use crate::local_redis::LocalRedis;

/// The name the sentinels know the primary by.
pub const MASTER_NAME: &str = "tollgate-primary";

/// One primary, its replicas and its sentinels, each a `redis-server` on an ephemeral
/// loopback port that this value owns (stopped, and its directory removed, on drop).
///
/// Ready once every replica has synced and every sentinel knows every replica and
/// every other sentinel, so that a failover can start at once.
#[derive(Debug)]
pub struct LocalSentinel {
    /// The data nodes: the first started as the primary, the rest as its replicas. After
    /// a failover any of them may be the primary (ask [`primary_port`](Self::primary_port)).
    nodes: Vec<LocalRedis>,
    sentinels: Vec<LocalRedis>,
    password: Option<String>,
    sentinel_password: Option<String>,
}

impl LocalSentinel {
    /// Starts a primary, `replicas` replicas and `sentinels` sentinels (quorum: a
    /// majority), which call the primary down after `down_after` without a reply.
    ///
    /// # Errors
    /// When a process does not start, or the deployment is not ready within 30 seconds.
    pub fn start(replicas: usize, sentinels: usize, down_after: Duration) -> io::Result<Self> {
        Self::launch(replicas, sentinels, down_after, None, None)
    }

    /// [`start`](Self::start), with the data nodes requiring `password` (`requirepass`,
    /// `masterauth`) and, when given, the sentinels requiring `sentinel_password`.
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub fn start_with_passwords(
        replicas: usize,
        sentinels: usize,
        down_after: Duration,
        password: &str,
        sentinel_password: Option<&str>,
    ) -> io::Result<Self> {
        Self::launch(
            replicas,
            sentinels,
            down_after,
            Some(password),
            sentinel_password,
        )
    }

    fn launch(
        replicas: usize,
        sentinels: usize,
        down_after: Duration,
        password: Option<&str>,
        sentinel_password: Option<&str>,
    ) -> io::Result<Self> {
        // A replica syncs at once, not after the default 5 s wait for others.
        let mut args = vec!["--repl-diskless-sync-delay", "0"];
        if let Some(password) = password {
            args.extend(["--requirepass", password, "--masterauth", password]);
        }
        let primary = LocalRedis::start_with(&args)?;
        let primary_port = primary.port().to_string();
        let mut nodes = vec![primary];
        for _ in 0..replicas {
            let mut node_args = args.clone();
            node_args.extend(["--replicaof", "127.0.0.1", &primary_port]);
            nodes.push(LocalRedis::start_with(&node_args)?);
        }
        let quorum = sentinels / 2 + 1;
        let mut config = format!(
            "sentinel monitor {MASTER_NAME} 127.0.0.1 {primary_port} {quorum}\n\
             sentinel down-after-milliseconds {MASTER_NAME} {}\n\
             sentinel failover-timeout {MASTER_NAME} 10000\n\
             sentinel parallel-syncs {MASTER_NAME} 2\n",
            down_after.as_millis()
        );
        if let Some(password) = password {
            config.push_str(&format!("sentinel auth-pass {MASTER_NAME} {password}\n"));
        }
        if let Some(password) = sentinel_password {
            config.push_str(&format!(
                "requirepass {password}\nsentinel sentinel-pass {password}\n"
            ));
        }
        let mut watching = Vec::with_capacity(sentinels);
        for _ in 0..sentinels {
            watching.push(LocalRedis::start_sentinel(&config)?);
        }
        let deployment = Self {
            nodes,
            sentinels: watching,
            password: password.map(str::to_owned),
            sentinel_password: sentinel_password.map(str::to_owned),
        };
        deployment.wait_ready(replicas, Duration::from_secs(30))?;
        Ok(deployment)
    }

    /// Waits until every replica's link to the primary is up and every sentinel sees
    /// `replicas` replicas and every other sentinel.
    fn wait_ready(&self, replicas: usize, within: Duration) -> io::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            let synced = self.nodes[1..].iter().all(|node| {
                self.data_query(node.port(), &["INFO", "replication"])
                    .is_ok_and(|info| text(&info).contains("master_link_status:up"))
            });
            let known = self.sentinels.iter().all(|sentinel| {
                let count = |what: &str| {
                    self.sentinel_query(sentinel.port(), &["SENTINEL", what, MASTER_NAME])
                        .map_or(0, |v| match v {
                            redis::Value::Array(items) => items.len(),
                            _ => 0,
                        })
                };
                count("replicas") == replicas && count("sentinels") + 1 == self.sentinels.len()
            });
            if synced && known {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the Sentinel deployment was not ready within its deadline",
                ));
            }
            // Sentinels find each other by hello messages, every 2 s.
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// The name the sentinels know the primary by ([`MASTER_NAME`]).
    pub fn master_name(&self) -> &'static str {
        MASTER_NAME
    }

    /// Every sentinel's `host:port`.
    pub fn sentinel_addresses(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port()))
            .collect()
    }

    /// Every sentinel's `redis://` URL, with the sentinels' password when they need one.
    pub fn sentinel_urls(&self) -> Vec<String> {
        let auth = self
            .sentinel_password
            .as_ref()
            .map_or(String::new(), |p| format!(":{p}@"));
        self.sentinels
            .iter()
            .map(|s| format!("redis://{auth}127.0.0.1:{}/", s.port()))
            .collect()
    }

    /// The primary's port as the first sentinel that answers reports it.
    ///
    /// # Errors
    /// When no sentinel answers.
    pub fn primary_port(&self) -> io::Result<u16> {
        let mut last = io::Error::other("no sentinel is running");
        for sentinel in &self.sentinels {
            match self.sentinel_query(
                sentinel.port(),
                &["SENTINEL", "get-master-addr-by-name", MASTER_NAME],
            ) {
                Ok(redis::Value::Array(fields)) if fields.len() == 2 => {
                    return text(&fields[1])
                        .parse()
                        .map_err(|_| io::Error::other("a sentinel reported no port"));
                }
                Ok(other) => last = io::Error::other(format!("unexpected reply {other:?}")),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Kills the primary (its data is lost) and returns its port.
    ///
    /// # Errors
    /// When no sentinel reports the primary.
    pub fn kill_primary(&mut self) -> io::Result<u16> {
        let port = self.primary_port()?;
        self.node(port)?.stop();
        Ok(port)
    }

    /// Waits until the sentinels report a primary other than `old` and it says it is
    /// one (`ROLE`), and returns its port.
    ///
    /// # Errors
    /// When that does not happen within `within`.
    pub fn wait_failover(&self, old: u16, within: Duration) -> io::Result<u16> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(port) = self.primary_port() {
                let promoted = port != old
                    && self
                        .data_query(port, &["ROLE"])
                        .is_ok_and(|role| match role {
                            redis::Value::Array(fields) => {
                                fields.first().is_some_and(|f| text(f) == "master")
                            }
                            _ => false,
                        });
                if promoted {
                    return Ok(port);
                }
            }
            thread::sleep(Duration::from_millis(20));
        }
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "no replica was promoted within the deadline",
        ))
    }

    /// The data node on `port`, to stop, pause or restart it.
    ///
    /// # Errors
    /// When no data node of this deployment has that port.
    pub fn node(&mut self, port: u16) -> io::Result<&mut LocalRedis> {
        self.nodes
            .iter_mut()
            .find(|n| n.port() == port)
            .ok_or_else(|| io::Error::other(format!("no data node on port {port}")))
    }

    /// The `i`-th sentinel, to stop, pause or restart it.
    ///
    /// # Panics
    /// When there are not that many sentinels.
    pub fn sentinel(&mut self, i: usize) -> &mut LocalRedis {
        &mut self.sentinels[i]
    }

    /// Runs a command on the data node on `port` (with the data nodes' password), 1 s
    /// timeout.
    ///
    /// # Errors
    /// The client's error.
    pub fn data_query(&self, port: u16, args: &[&str]) -> io::Result<redis::Value> {
        query(port, self.password.as_deref(), args)
    }

    fn sentinel_query(&self, port: u16, args: &[&str]) -> io::Result<redis::Value> {
        query(port, self.sentinel_password.as_deref(), args)
    }
}

/// Runs `args` on `127.0.0.1:port`, authenticating with `password` if given.
fn query(port: u16, password: Option<&str>, args: &[&str]) -> io::Result<redis::Value> {
    let auth = password.map_or(String::new(), |p| format!(":{p}@"));
    let client = redis::Client::open(format!("redis://{auth}127.0.0.1:{port}/"))
        .map_err(io::Error::other)?;
    let timeout = Duration::from_secs(1);
    let mut connection = client
        .get_connection_with_timeout(timeout)
        .map_err(io::Error::other)?;
    connection
        .set_read_timeout(Some(timeout))
        .map_err(io::Error::other)?;
    let mut cmd = redis::cmd(args[0]);
    for arg in &args[1..] {
        cmd.arg(*arg);
    }
    cmd.query(&mut connection).map_err(io::Error::other)
}

/// A reply's text (a bulk or simple string), or empty.
fn text(value: &redis::Value) -> String {
    match value {
        redis::Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        redis::Value::SimpleString(s) => s.clone(),
        redis::Value::VerbatimString { text, .. } => text.clone(),
        _ => String::new(),
    }
}
