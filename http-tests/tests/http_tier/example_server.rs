//! The example server (`cargo run --release --example server`) with Redis: `--sync off`
//! (the Redis script on every request), `--redis-cluster` seeds and `--redis-sentinel`,
//! in every sync mode, answering real HTTP requests over a socket.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tollgate_testing::{LocalCluster, LocalRedis, LocalSentinel, example_server};

/// The example server, killed on drop.
struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(args: &[&str]) -> Server {
    start_logging(args, &[], None)
}

/// As [`start`], with `env` set and, with `log`, everything the server writes to stderr
/// appended to it as it comes.
fn start_logging(
    args: &[&str],
    env: &[(&str, &str)],
    log: Option<std::sync::Arc<std::sync::Mutex<String>>>,
) -> Server {
    let mut child = Command::new(example_server())
        .args(["--listen", "127.0.0.1:0", "--quota", "5/min"])
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(if log.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .spawn()
        .unwrap();
    if let Some(log) = log {
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let mut log = log.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
    }
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(Duration::from_secs(20)).unwrap_or_default();
    let mut server = Server {
        child,
        addr: String::new(),
    };
    let addr = line
        .strip_prefix("listening on http://")
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("{args:?}: {line:?}"));
    server.addr = addr.to_owned();
    server
}

/// The status of `GET /` from `server`.
fn status(server: &Server) -> u16 {
    get(server, "/").0
}

/// Eight requests to one server at 5/min: the statuses.
fn eight(server: &Server) -> Vec<u16> {
    (0..8).map(|_| status(server)).collect()
}

const FIVE_OF_EIGHT: [u16; 8] = [200, 200, 200, 200, 200, 429, 429, 429];

#[test]
fn sync_off_runs_the_redis_script_on_every_request() {
    let redis = LocalRedis::start().unwrap();
    let url = redis.url();
    let a = start(&["--redis", &url, "--sync", "off"]);
    let b = start(&["--redis", &url, "--sync", "off"]);
    // Two servers share one exact limit: 5 in all.
    let statuses: Vec<u16> = (0..8)
        .map(|i| status(if i % 2 == 0 { &a } else { &b }))
        .collect();
    assert_eq!(statuses, FIVE_OF_EIGHT);

    // Without Redis, `--sync off` is refused with one clear line.
    let out = Command::new(example_server())
        .args(["--sync", "off"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--sync off needs --redis"));
}

/// A wrong Redis password with the sync on: the server says so at start (not only
/// "Redis is not answering"), its `warn` event names the cause, and its per-second line
/// shows it, all without the password. With `RUST_LOG=tollgate=debug` the server prints
/// tollgate's `debug` events too (the later failed rounds). (The server installed no
/// tracing subscriber: `RUST_LOG` printed nothing.)
#[test]
fn a_wrong_password_is_named_in_the_servers_log() {
    let redis = LocalRedis::start_with(&["--requirepass", "right-one"]).unwrap();
    let url = format!("redis://:hunter2@127.0.0.1:{}/", redis.port());
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let server = start_logging(
        &["--redis", &url],
        &[("RUST_LOG", "tollgate=debug")],
        Some(std::sync::Arc::clone(&log)),
    );
    // It serves meanwhile (by the fallback's share of 5/min).
    assert!([200, 429].contains(&status(&server)));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = log.lock().unwrap().clone();
        let ready = text.contains("authentication failed")
            && text.contains("WARN")
            && text.contains("DEBUG")
            && text.contains("kind=\"authentication\"");
        if ready {
            assert!(!text.contains("hunter2"), "{text}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no authentication error in the log: {text}"
        );
        // Waits for the example server's process to write its log.
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn redis_cluster_seeds_work_in_every_sync_mode() {
    let cluster = LocalCluster::start(3, 0, Duration::from_secs(2)).unwrap();
    let seeds = cluster.urls().join(",");
    for mode in ["off", "reconcile", "lease"] {
        let server = start(&["--redis-cluster", &seeds, "--sync", mode]);
        holds_five_per_minute(&server, mode);
    }
}

/// Behind Sentinel, with passwords on the data nodes (from the environment) and on the
/// sentinels (in their URLs), every sync mode holds the quota; a wrong master name stops
/// the server with a message that names it and shows no password.
#[test]
fn redis_sentinel_works_in_every_sync_mode() {
    let data_pw = "data-pw-5120";
    let sentinel =
        LocalSentinel::start_with_passwords(1, 3, Duration::from_secs(1), data_pw, Some("s-pw-77"))
            .unwrap();
    let sentinels = sentinel.sentinel_urls().join(",");
    let env = [("TOLLGATE_REDIS_MASTER_PASSWORD", data_pw)];
    for mode in ["off", "reconcile", "lease"] {
        let args = [
            "--redis-sentinel",
            &sentinels,
            "--redis-master",
            sentinel.master_name(),
            "--sync",
            mode,
        ];
        let server = start_logging(&args, &env, None);
        holds_five_per_minute(&server, mode);
    }
    let out = Command::new(example_server())
        .args(["--listen", "127.0.0.1:0", "--sync", "off"])
        .args(["--redis-sentinel", &sentinels, "--redis-master", "no-such"])
        .env("TOLLGATE_REDIS_MASTER_PASSWORD", data_pw)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no-such"), "{stderr}");
    assert!(
        !stderr.contains(data_pw) && !stderr.contains("s-pw-77"),
        "{stderr}"
    );
}

/// A server at 5/min with `--sync mode` admits five requests and no more. In lease mode
/// a node spends only what it leased, and leases by demand: requests spread over rounds
/// get the whole quota, and never more.
fn holds_five_per_minute(server: &Server, mode: &str) {
    if mode == "lease" {
        let allowed = (0..12)
            .filter(|_| {
                std::thread::sleep(Duration::from_millis(100));
                status(server) == 200
            })
            .count();
        assert_eq!(allowed, 5, "--sync lease");
    } else {
        assert_eq!(eight(server), FIVE_OF_EIGHT, "--sync {mode}");
    }
}

/// `GET path` from `server`: the status and the body.
fn get(server: &Server, path: &str) -> (u16, String) {
    let reply = reply(server, path);
    let status = reply.split(' ').nth(1).unwrap().parse().unwrap();
    let body = reply
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned();
    (status, body)
}

/// The whole reply to `GET path` from `server`.
fn reply(server: &Server, path: &str) -> String {
    let mut stream = TcpStream::connect(&server.addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
        server.addr
    )
    .unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    reply
}

/// The value of the Prometheus sample `series` (name and labels as exposed) in `text`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
}

#[test]
fn metrics_show_exactly_what_the_clients_saw() {
    let server = start(&[]);
    // 5/min: of 8 requests, 5 pass and 3 are denied; health checks and scrapes are not
    // limited and not counted.
    let statuses = eight(&server);
    assert_eq!(statuses, FIVE_OF_EIGHT);
    for _ in 0..3 {
        assert_eq!(get(&server, "/healthz").0, 200);
        assert_eq!(get(&server, "/metrics").0, 200);
    }
    let (status, text) = get(&server, "/metrics");
    assert_eq!(status, 200);
    let allowed = statuses.iter().filter(|s| **s == 200).count() as f64;
    let denied = statuses.iter().filter(|s| **s == 429).count() as f64;
    assert_eq!(
        sample(
            &text,
            r#"tollgate_decisions_total{limiter="api",outcome="allowed"}"#
        ),
        Some(allowed),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            r#"tollgate_decisions_total{limiter="api",outcome="denied"}"#
        ),
        Some(denied),
        "{text}"
    );
    assert_eq!(
        sample(&text, r#"tollgate_keys{limiter="api"}"#),
        Some(1.0),
        "{text}"
    );
    assert!(
        text.contains("# TYPE tollgate_decisions_total counter"),
        "{text}"
    );
}

#[test]
fn shadow_mode_serves_every_request_and_counts_the_denies() {
    let server = start(&["--shadow"]);
    // 5/min: the same 8 requests as above are all served; the 3 the limiter denied are
    // counted as shadow_denied (and, by the limiter, as denied).
    assert_eq!(eight(&server), [200; 8]);
    let (_, text) = get(&server, "/metrics");
    for (outcome, count) in [("allowed", 5.0), ("denied", 3.0), ("shadow_denied", 3.0)] {
        assert_eq!(
            sample(
                &text,
                &format!(r#"tollgate_decisions_total{{limiter="api",outcome="{outcome}"}}"#)
            ),
            Some(count),
            "{outcome}: {text}"
        );
    }
}

#[test]
fn a_repeated_quota_holds_each_key_to_both_on_every_tier() {
    // 5/min (the first --quota, which `start` passes) and 3/min: 3 pass, 5 are denied.
    let server = start(&["--quota", "3/min"]);
    assert_eq!(eight(&server), [200, 200, 200, 429, 429, 429, 429, 429]);
    // The same in Redis, one script call deciding both quotas.
    let redis = LocalRedis::start().unwrap();
    let exact = start(&["--quota", "3/min", "--redis", &redis.url(), "--sync", "off"]);
    assert_eq!(eight(&exact), [200, 200, 200, 429, 429, 429, 429, 429]);
    // And on the synced tier, each quota synced under keys of its own; the headers list
    // both policies.
    let synced = start(&["--quota", "3/min", "--redis", &redis.url()]);
    let policy = policy_header(&synced);
    assert!(
        policy.contains("q=5;w=60") && policy.contains("q=3;w=60"),
        "{policy}"
    );
    assert_eq!(
        eight(&synced)[..7],
        [200, 200, 429, 429, 429, 429, 429],
        "the header's request was the first of 3"
    );
}

/// The `RateLimit-Policy` field of a `GET /` from `server` (empty if none).
fn policy_header(server: &Server) -> String {
    reply(server, "/")
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("ratelimit-policy")
                .then(|| value.trim().to_owned())
        })
        .unwrap_or_default()
}

/// The server's resident memory, from `/proc/<pid>/status` (Linux), in bytes.
fn resident_bytes(server: &Server) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", server.child.id())).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in {status}"));
    kib * 1024
}

/// `--expected-keys` sizes the tables at start: on the local tier every page of them is
/// written then (a million keys' tables, about 20 MB, are resident before any request),
/// and both the local and the synced tier refuse a count no table can hold, in one line.
#[test]
fn expected_keys_sizes_the_tables_at_start() {
    let plain = start(&[]);
    let sized = start(&["--expected-keys", "1000000"]);
    let (plain_rss, sized_rss) = (resident_bytes(&plain), resident_bytes(&sized));
    assert!(
        sized_rss > plain_rss + 15_000_000,
        "sized {sized_rss} bytes resident against {plain_rss} without"
    );
    assert_eq!(eight(&sized), FIVE_OF_EIGHT);

    let redis = LocalRedis::start().unwrap();
    let synced = start(&["--expected-keys", "100000", "--redis", &redis.url()]);
    holds_five_per_minute(&synced, "reconcile");

    let too_many = usize::MAX.to_string();
    for tier in [&[][..], &["--redis", &redis.url()][..]] {
        let out = Command::new(example_server())
            .args(["--listen", "127.0.0.1:0", "--expected-keys", &too_many])
            .args(tier)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{tier:?}: {stderr}");
        assert!(
            stderr.contains(&format!(
                "expected_keys {too_many} cannot be sized for up front"
            )),
            "{tier:?}: {stderr}"
        );
    }
    let out = Command::new(example_server())
        .args(["--expected-keys", "lots"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("invalid value 'lots' for '--expected-keys'"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--concurrency 1`: while a slow request of a key is in flight, the key's next one gets
/// 429 with `Retry-After`; another key, or the same once the first has answered, is served.
#[test]
fn concurrency_holds_each_key_to_its_requests_in_flight() {
    let server = start(&[
        "--quota",
        "1000/s",
        "--key",
        "header:x-api-key",
        "--concurrency",
        "1",
    ]);
    let send = |key: &str, path: &str| {
        let mut stream = TcpStream::connect(&server.addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: {}\r\nx-api-key: {key}\r\nConnection: close\r\n\r\n",
            server.addr
        )
        .unwrap();
        stream
    };
    let read = |mut stream: TcpStream| {
        let mut reply = String::new();
        stream.read_to_string(&mut reply).unwrap();
        reply
    };
    let slow = send("alice", "/api/slow?delay_ms=1500");
    std::thread::sleep(Duration::from_millis(300));
    let refused = read(send("alice", "/"));
    assert!(refused.starts_with("HTTP/1.1 429"), "{refused}");
    assert!(
        refused.to_ascii_lowercase().contains("retry-after: 1\r\n"),
        "{refused}"
    );
    assert!(refused.contains("concurrency_limit_exceeded"), "{refused}");
    let other = read(send("bob", "/"));
    assert!(other.starts_with("HTTP/1.1 200"), "{other}");
    let slow = read(slow);
    assert!(slow.starts_with("HTTP/1.1 200"), "{slow}");
    let again = read(send("alice", "/"));
    assert!(again.starts_with("HTTP/1.1 200"), "{again}");
    // And a bad value is one line, exit status 2.
    let out = Command::new(example_server())
        .args(["--concurrency", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("'--concurrency'"),
        "{out:?}"
    );
}
