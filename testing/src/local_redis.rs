//! A throwaway `redis-server` on an ephemeral loopback port, for tests and benchmarks.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// How long [`LocalRedis::connection`] waits to connect and for each answer.
pub const INSPECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How many times a server is started, on fresh ports, before its start is an error.
const START_ATTEMPTS: usize = 5;

/// How many of the server's last log lines an error of a failed start quotes.
const LOG_TAIL_LINES: usize = 3;

/// A port that was free a moment ago on `127.0.0.1`.
fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A `redis-server` process on `127.0.0.1` that this value owns: started on a free port
/// with persistence off, stopped (and its directory removed) on drop.
///
/// Meant for tests and benchmarks of the Redis tier; it needs `redis-server` on `PATH`.
/// Its `Debug` output shows no password.
pub struct LocalRedis {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    /// Further `redis-server` arguments (a password, cluster mode, TLS files).
    extra: Vec<String>,
    /// The port speaks TLS only.
    tls: bool,
    /// A Sentinel's configuration: written to `sentinel.conf` in `dir` on the first start
    /// (Sentinel rewrites it as it learns, and a restart keeps what it learnt), and the
    /// server runs with `--sentinel`.
    sentinel: Option<String>,
}

impl LocalRedis {
    /// Starts a server and waits until it answers `PING`.
    ///
    /// # Errors
    /// An error whose message says so when `redis-server` is not installed, or when it
    /// did not answer within 10 seconds.
    pub fn start() -> io::Result<Self> {
        Self::start_with(&[])
    }

    /// Starts a server with further `redis-server` arguments, for example
    /// `["--requirepass", "…"]` or `["--cluster-enabled", "yes"]`. It is ready once it
    /// answers `PING`, even with an error (`NOAUTH`).
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub fn start_with(args: &[&str]) -> io::Result<Self> {
        Self::launch(args, false, None, None)
    }

    /// [`start_with`](Self::start_with) for a node of a Redis Cluster: `args` should
    /// enable cluster mode, and the node gets a cluster bus port of its own
    /// (`--cluster-port`), picked afresh, like the client port, on every attempt to start.
    /// A bus port reserved once and kept would fail every retry the same way when
    /// another process took it between the reservation and the start.
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub fn start_cluster_node(args: &[&str]) -> io::Result<Self> {
        Self::launch(args, false, None, Some(&mut free_port))
    }

    /// Starts a server that speaks TLS only, with the certificate, key and CA files
    /// given (PEM), and clients not asked for certificates. It is ready once its port
    /// accepts connections.
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub fn start_tls(
        cert: &std::path::Path,
        key: &std::path::Path,
        ca: &std::path::Path,
    ) -> io::Result<Self> {
        Self::start_tls_with([cert, key, ca], &[])
    }

    /// [`start_tls`](Self::start_tls) with further arguments; `files` are the
    /// certificate, its key and the CA. Replication to and from it uses TLS too.
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub fn start_tls_with(files: [&std::path::Path; 3], args: &[&str]) -> io::Result<Self> {
        let mut all = tls_args(files);
        all.extend(args.iter().map(|&a| a.to_owned()));
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        Self::launch(&all, true, None, None)
    }

    /// Starts a Redis Sentinel whose configuration file holds `config` (its `sentinel
    /// monitor` lines and the like), on a free port. It is ready once it answers `PING`.
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub fn start_sentinel(config: &str) -> io::Result<Self> {
        Self::launch(&[], false, Some(config), None)
    }

    /// [`start_sentinel`](Self::start_sentinel), speaking TLS only, to its clients and
    /// to the nodes it watches; `files` are the certificate, its key and the CA.
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub fn start_sentinel_tls(config: &str, files: [&std::path::Path; 3]) -> io::Result<Self> {
        let args = tls_args(files);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Self::launch(&args, true, Some(config), None)
    }

    /// Starts a server on a free port, trying again on fresh ports (and a fresh bus port
    /// for a cluster node) when it exits at start: a port found free can be taken by
    /// another process before the server binds it. The error of the last attempt says
    /// what the server logged. A cluster node takes its bus port from `cluster_bus`.
    fn launch(
        args: &[&str],
        tls: bool,
        sentinel: Option<&str>,
        mut cluster_bus: Option<&mut dyn FnMut() -> io::Result<u16>>,
    ) -> io::Result<Self> {
        let mut last = None;
        for _ in 0..START_ATTEMPTS {
            let port = free_port()?;
            let dir =
                std::env::temp_dir().join(format!("tollgate-redis-{}-{port}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            let mut extra: Vec<String> = args.iter().map(|&a| a.to_owned()).collect();
            if let Some(bus) = cluster_bus.as_mut() {
                extra.extend(["--cluster-port".to_owned(), bus()?.to_string()]);
            }
            let mut server = Self {
                child: None,
                port,
                dir,
                extra,
                tls,
                sentinel: sentinel.map(str::to_owned),
            };
            match server.spawn() {
                Ok(()) => return Ok(server),
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(e),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("redis-server did not start")))
    }

    fn spawn(&mut self) -> io::Result<()> {
        let port = self.port.to_string();
        let ports: &[&str] = if self.tls {
            &["--port", "0", "--tls-port", &port]
        } else {
            &["--port", &port]
        };
        let mut command = Command::new("redis-server");
        if let Some(config) = &self.sentinel {
            // The configuration file comes first; Sentinel needs one it can rewrite.
            let file = self.dir.join("sentinel.conf");
            if !file.exists() {
                std::fs::write(&file, config)?;
            }
            command.arg(&file).arg("--sentinel");
        }
        // The server logs to its standard output, kept in a file of its directory (a
        // restart appends), so that a server that exits says why.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_file())?;
        let child = command
            .args(ports)
            .args(["--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.extra)
            .stdout(log)
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                if e.kind() == io::ErrorKind::NotFound {
                    io::Error::new(
                        e.kind(),
                        "redis-server is not installed: run ./scripts/test.sh, which installs it \
                         (apt-get install -y redis-server)",
                    )
                } else {
                    e
                }
            })?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.ping() {
                return Ok(());
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                return Err(io::Error::other(format!(
                    "redis-server exited: {status}; its log ends: {}",
                    self.log_tail()
                )));
            }
            // Waits for the real redis-server process to start listening.
            thread::sleep(Duration::from_millis(10));
        }
        self.stop();
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "redis-server did not answer PING within 10s",
        ))
    }

    fn log_file(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// The last lines the server logged, on one line.
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.log_file()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join(" | ")
    }

    fn ping(&self) -> bool {
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        if self.tls {
            return true;
        }
        let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
        let mut reply = [0u8; 1];
        // `+PONG`, or `-NOAUTH` from a server with a password: either way it serves.
        stream.write_all(b"PING\r\n").is_ok()
            && stream.read_exact(&mut reply).is_ok()
            && matches!(reply[0], b'+' | b'-')
    }

    /// The URL of the server: `redis://127.0.0.1:<port>/`, or `rediss://` for TLS.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "rediss" } else { "redis" };
        format!("{scheme}://127.0.0.1:{}/", self.port)
    }

    /// A connection of its own to a plain (not TLS) server, for a test to read or write
    /// keys directly. It waits up to [`INSPECT_TIMEOUT`] for each answer (redis-rs's
    /// default is 500 ms): a test reads Redis to check what the code under test did, and
    /// on a loaded machine, beside a sync task walking a million keys, a server can take
    /// longer than that to answer without anything being wrong.
    ///
    /// # Errors
    /// The client's error if the server does not answer.
    pub async fn connection(&self) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(INSPECT_TIMEOUT))
            .set_response_timeout(Some(INSPECT_TIMEOUT));
        redis::Client::open(self.url())?
            .get_multiplexed_async_connection_with_config(&config)
            .await
    }

    /// The directory the server runs in (its files, such as a cluster's `nodes.conf`).
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Kills the server (to simulate an outage). Its data is lost.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the server's process (SIGSTOP): it keeps its connections and data but
    /// answers nothing until [`resume`](Self::resume).
    ///
    /// # Errors
    /// If the signal could not be sent.
    pub fn pause(&self) -> io::Result<()> {
        self.signal("-STOP")
    }

    /// Lets a paused server run again (SIGCONT); it then runs what queued meanwhile.
    ///
    /// # Errors
    /// If the signal could not be sent.
    pub fn resume(&self) -> io::Result<()> {
        self.signal("-CONT")
    }

    fn signal(&self, signal: &str) -> io::Result<()> {
        let Some(child) = &self.child else {
            return Err(io::Error::other("redis-server is not running"));
        };
        let status = Command::new("kill")
            .arg(signal)
            .arg(child.id().to_string())
            .status()?;
        if status.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!("kill {signal} failed: {status}")))
        }
    }

    /// Starts the server again on the same port, with the same arguments, empty (a
    /// cluster node keeps its `nodes.conf`, so it rejoins its cluster).
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub fn restart(&mut self) -> io::Result<()> {
        self.stop();
        self.spawn()
    }
}

/// `args` with the value after each password flag (`--requirepass`, `--masterauth`)
/// replaced by `<redacted>`: what a `Debug` output of a server's arguments may show.
pub(crate) fn redacted(args: &[String]) -> Vec<String> {
    let mut shown = Vec::with_capacity(args.len());
    let mut secret_next = false;
    for arg in args {
        shown.push(if secret_next {
            "<redacted>".to_owned()
        } else {
            arg.clone()
        });
        secret_next = matches!(arg.as_str(), "--requirepass" | "--masterauth");
    }
    shown
}

/// `Some("<redacted>")` for a password that is set: a helper's `Debug` shows whether
/// it has one, never which.
pub(crate) fn redact(password: Option<&String>) -> Option<&'static str> {
    password.map(|_| "<redacted>")
}

impl std::fmt::Debug for LocalRedis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalRedis")
            .field("port", &self.port)
            .field("running", &self.child.is_some())
            .field("dir", &self.dir)
            .field("args", &redacted(&self.extra))
            .field("tls", &self.tls)
            // A Sentinel's configuration may hold its masters' passwords.
            .field("sentinel", &self.sentinel.is_some())
            .finish()
    }
}

/// The arguments that make a server speak TLS only with `files` (certificate, key, CA),
/// clients not asked for certificates, replication over TLS too.
fn tls_args(files: [&std::path::Path; 3]) -> Vec<String> {
    let [cert, key, ca] = files.map(|p| p.display().to_string());
    [
        "--tls-cert-file",
        &cert,
        "--tls-key-file",
        &key,
        "--tls-ca-cert-file",
        &ca,
        "--tls-auth-clients",
        "no",
        "--tls-replication",
        "yes",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// Runs one `redis-cli` command against `127.0.0.1:port` (1 s timeout) with `password`
/// and, for a TLS port, the CA `tls_ca`; returns what it printed (raw: one line per
/// value, an error reply as its text).
pub(crate) fn redis_cli(
    port: u16,
    password: Option<&str>,
    tls_ca: Option<&std::path::Path>,
    args: &[&str],
) -> io::Result<String> {
    let mut command = Command::new("timeout");
    command.args(["1", "redis-cli", "-h", "127.0.0.1", "-p", &port.to_string()]);
    if let Some(password) = password {
        command.args(["-a", password, "--no-auth-warning"]);
    }
    if let Some(ca) = tls_ca {
        command.arg("--tls").arg("--cacert").arg(ca);
    }
    let output = command
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(cli_missing)?;
    if output.status.success() {
        return Ok(String::from_utf8_lossy(&output.stdout).into_owned());
    }
    Err(io::Error::other(cli_failure(port, args, &output, password)))
}

/// Why a `redis-cli` call failed: its command's name, its exit (`timeout` exits with 124
/// when the call ran past its 1 s), and the last line it wrote, with any password in it
/// redacted.
fn cli_failure(
    port: u16,
    args: &[&str],
    output: &std::process::Output,
    password: Option<&str>,
) -> String {
    let command = args.first().copied().unwrap_or("");
    let exit = match output.status.code() {
        Some(124) => "timed out after 1 s".to_owned(),
        Some(code) => format!("exit status {code}"),
        None => "killed by a signal".to_owned(),
    };
    let said = [&output.stderr, &output.stdout]
        .into_iter()
        .filter_map(|bytes| {
            let text = String::from_utf8_lossy(bytes);
            text.lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .map(str::to_owned)
        })
        .next()
        .unwrap_or_default();
    let said = match password {
        Some(password) if !password.is_empty() => said.replace(password, "<redacted>"),
        _ => said,
    };
    format!("redis-cli -p {port} {command} failed: {exit}; it said: {said:?}")
}

/// A failure to run `redis-cli`, saying how to install it when it is missing.
pub(crate) fn cli_missing(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::NotFound {
        io::Error::new(
            e.kind(),
            "redis-cli is not installed: run ./scripts/test.sh",
        )
    } else {
        e
    }
}

impl Drop for LocalRedis {
    fn drop(&mut self) {
        // A paused server must run again to be killed cleanly.
        let _ = self.resume();
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLUSTER: [&str; 2] = ["--cluster-enabled", "yes"];

    #[test]
    fn debug_output_shows_no_password() {
        let server = LocalRedis::start_with(&["--requirepass", "s3cret-pw"]).unwrap();
        let shown = format!("{server:?}");
        assert!(!shown.contains("s3cret-pw"), "{shown}");
        assert!(
            shown.contains("--requirepass") && shown.contains("<redacted>"),
            "{shown}"
        );
        let args = ["--masterauth", "pw-1", "--port", "1", "--requirepass"].map(str::to_owned);
        assert_eq!(
            redacted(&args),
            ["--masterauth", "<redacted>", "--port", "1", "--requirepass"]
        );
    }

    #[test]
    fn a_server_that_exits_at_start_says_why() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port().to_string();
        let mut args = CLUSTER.to_vec();
        args.extend(["--cluster-port", &port]);
        let error = LocalRedis::start_with(&args).unwrap_err();
        let message = error.to_string();
        assert!(
            message.contains("redis-server exited") && message.contains("already in use"),
            "{message}"
        );
    }

    #[test]
    fn a_failed_cli_call_says_why_and_shows_no_password() {
        // A server that takes the connection and never answers: the call times out.
        let silent = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = silent.local_addr().unwrap().port();
        let secret = "hunter2-secret";
        let error = redis_cli(port, Some(secret), None, &["PING"]).unwrap_err();
        let message = error.to_string();
        assert!(
            message.contains(&format!(
                "redis-cli -p {port} PING failed: timed out after 1 s"
            )),
            "{message}"
        );
        assert!(!message.contains(secret), "{message}");
        // Nothing listening: redis-cli's own words.
        drop(silent);
        let message = redis_cli(port, Some(secret), None, &["PING"])
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("exit status") && message.contains("Connection refused"),
            "{message}"
        );
        assert!(!message.contains(secret), "{message}");
    }

    #[test]
    fn a_cluster_node_whose_bus_port_was_taken_starts_on_a_fresh_one() {
        // The first bus port is taken before the server binds it, as another test's
        // server can; the second attempt gets a fresh one. A bus port reserved once and
        // passed in `args` failed every attempt the same way.
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let taken_port = taken.local_addr().unwrap().port();
        let mut picked = Vec::new();
        let mut pick = || {
            let port = if picked.is_empty() {
                taken_port
            } else {
                free_port()?
            };
            picked.push(port);
            Ok(port)
        };
        let node = LocalRedis::launch(&CLUSTER, false, None, Some(&mut pick)).unwrap();
        assert_eq!(picked.len(), 2, "{picked:?}");
        assert_eq!(picked[0], taken_port);
        let bus = picked[1];
        assert_ne!(bus, taken_port);
        assert!(
            node.extra
                .ends_with(&["--cluster-port".to_owned(), bus.to_string()])
        );
        assert!(
            TcpStream::connect(("127.0.0.1", bus)).is_ok(),
            "the bus listens"
        );
        let info = redis_cli(node.port(), None, None, &["INFO", "cluster"]).unwrap();
        assert!(info.contains("cluster_enabled:1"), "{info}");
        drop(taken);
    }
}
