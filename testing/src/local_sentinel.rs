//! A throwaway Redis Sentinel deployment on loopback: one primary, its replicas and the
//! sentinels that watch them, for tests and benchmarks.

use std::io;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use crate::local_redis::{LocalRedis, redact, redis_cli};

/// The name the sentinels know the primary by.
pub const MASTER_NAME: &str = "tollgate-primary";

/// One primary, its replicas and its sentinels, each a `redis-server` on an ephemeral
/// loopback port that this value owns (stopped, and its directory removed, on drop).
///
/// Ready once every replica has synced and every sentinel knows every replica and
/// every other sentinel, so that a failover can start at once. Its `Debug` output shows
/// no password.
pub struct LocalSentinel {
    /// The data nodes: the first started as the primary, the rest as its replicas. After
    /// a failover any of them may be the primary (ask [`primary_port`](Self::primary_port)).
    nodes: Vec<LocalRedis>,
    sentinels: Vec<LocalRedis>,
    password: Option<String>,
    sentinel_password: Option<String>,
    /// With TLS: the CA that signed every process's certificate.
    tls_ca: Option<PathBuf>,
}

impl std::fmt::Debug for LocalSentinel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalSentinel")
            .field("nodes", &self.nodes)
            .field("sentinels", &self.sentinels)
            .field("password", &redact(self.password.as_ref()))
            .field(
                "sentinel_password",
                &redact(self.sentinel_password.as_ref()),
            )
            .field("tls_ca", &self.tls_ca)
            .finish()
    }
}

/// A deployment's TLS files: the certificate (for 127.0.0.1), its key and the CA.
#[derive(Clone, Copy, Debug)]
pub struct TlsFiles<'a> {
    /// The certificate every process presents.
    pub cert: &'a Path,
    /// Its private key.
    pub key: &'a Path,
    /// The CA that signed it.
    pub ca: &'a Path,
}

impl LocalSentinel {
    /// Starts a primary, `replicas` replicas and `sentinels` sentinels (quorum: a
    /// majority), which call the primary down after `down_after` without a reply.
    ///
    /// # Errors
    /// When a process does not start, or the deployment is not ready within 30 seconds.
    pub fn start(replicas: usize, sentinels: usize, down_after: Duration) -> io::Result<Self> {
        Self::launch(replicas, sentinels, down_after, None, None, None)
    }

    /// [`start`](Self::start), every process speaking TLS only (to clients, and among
    /// themselves), with the certificate, key and CA of `tls`.
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub fn start_tls(
        replicas: usize,
        sentinels: usize,
        down_after: Duration,
        tls: TlsFiles<'_>,
    ) -> io::Result<Self> {
        Self::launch(replicas, sentinels, down_after, None, None, Some(tls))
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
            None,
        )
    }

    fn launch(
        replicas: usize,
        sentinels: usize,
        down_after: Duration,
        password: Option<&str>,
        sentinel_password: Option<&str>,
        tls: Option<TlsFiles<'_>>,
    ) -> io::Result<Self> {
        // A replica syncs at once, not after the default 5 s wait for others.
        let mut args = vec!["--repl-diskless-sync-delay", "0"];
        if let Some(password) = password {
            args.extend(["--requirepass", password, "--masterauth", password]);
        }
        let start = |args: &[&str]| match tls {
            Some(tls) => LocalRedis::start_tls_with([tls.cert, tls.key, tls.ca], args),
            None => LocalRedis::start_with(args),
        };
        let primary = start(&args)?;
        let primary_port = primary.port().to_string();
        let mut nodes = vec![primary];
        for _ in 0..replicas {
            let mut node_args = args.clone();
            node_args.extend(["--replicaof", "127.0.0.1", &primary_port]);
            nodes.push(start(&node_args)?);
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
            watching.push(match tls {
                Some(tls) => LocalRedis::start_sentinel_tls(&config, [tls.cert, tls.key, tls.ca])?,
                None => LocalRedis::start_sentinel(&config)?,
            });
        }
        let deployment = Self {
            nodes,
            sentinels: watching,
            password: password.map(str::to_owned),
            sentinel_password: sentinel_password.map(str::to_owned),
            tls_ca: tls.map(|t| t.ca.to_owned()),
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
                    .is_ok_and(|info| info.contains("master_link_status:up"))
            });
            let known = self.sentinels.iter().all(|sentinel| {
                // Raw replies: each replica or sentinel is a map whose first field is
                // `name`.
                let count = |what: &str| {
                    self.sentinel_query(sentinel.port(), &["SENTINEL", what, MASTER_NAME])
                        .map_or(0, |out| out.lines().filter(|l| *l == "name").count())
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

    /// Every sentinel's URL (`rediss://` with TLS), with the sentinels' password when
    /// they need one.
    pub fn sentinel_urls(&self) -> Vec<String> {
        let auth = self
            .sentinel_password
            .as_ref()
            .map_or(String::new(), |p| format!(":{p}@"));
        let scheme = if self.tls_ca.is_some() {
            "rediss"
        } else {
            "redis"
        };
        self.sentinels
            .iter()
            .map(|s| format!("{scheme}://{auth}127.0.0.1:{}/", s.port()))
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
                Ok(out) => match out.lines().nth(1).map(str::parse) {
                    Some(Ok(port)) => return Ok(port),
                    _ => last = io::Error::other(format!("unexpected reply {out:?}")),
                },
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
                        .is_ok_and(|role| role.starts_with("master"));
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

    /// Runs a command on the data node on `port` (with the data nodes' password and the
    /// TLS CA) through `redis-cli`, 1 s timeout, and returns its raw output.
    ///
    /// # Errors
    /// When `redis-cli` fails or the node does not answer in time.
    pub fn data_query(&self, port: u16, args: &[&str]) -> io::Result<String> {
        redis_cli(port, self.password.as_deref(), self.tls_ca.as_deref(), args)
    }

    fn sentinel_query(&self, port: u16, args: &[&str]) -> io::Result<String> {
        redis_cli(
            port,
            self.sentinel_password.as_deref(),
            self.tls_ca.as_deref(),
            args,
        )
    }
}
