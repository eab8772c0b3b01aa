//! Passwords, ACL users, hashed keys and TLS, against real `redis-server`s that each test
//! starts: every way in works, on one server and on a cluster, and no secret shows in
//! `Debug`, `Display`, an error, the stats or a Redis key name.
#![cfg(feature = "redis")]

#[cfg(feature = "tls")]
use crate::common;

use std::process::Command;
use std::time::Duration;

use tollgate::redis::RedisLimiter;
use tollgate::sync::{RedisSync, SyncHandle};
use tollgate::{ConfigError, Quota, RateLimiter};
use tollgate_testing::{LocalCluster, LocalRedis};

const PASSWORD: &str = "hunter2-Xq9";

/// The ACL user `app` (password `app-pw-77`) with the keys both tiers write:
/// `tollgate:…` and the sync's registry `{tollgate}:…`.
const APP_USER: [&str; 8] = [
    "ACL",
    "SETUSER",
    "app",
    "on",
    ">app-pw-77",
    "~tollgate:*",
    "~{tollgate}:*",
    "+@all",
];

fn with_password(url: &str, user: &str, password: &str) -> String {
    url.replacen("redis://", &format!("redis://{user}:{password}@"), 1)
}

/// Every `Debug` and `Display` text a test can reach must not contain `secret`.
fn assert_hidden(secret: &str, texts: &[String]) {
    for text in texts {
        assert!(!text.contains(secret), "{secret:?} shows in {text}");
    }
}

async fn wait_synced(handle: &SyncHandle) {
    for _ in 0..200 {
        if handle.stats().syncs > 0 {
            return;
        }
        // Waits for the sync task's first round against the real Redis process.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never synced: {:?} {handle:?}", handle.stats());
}

/// What `redis-cli` prints for `command` on the server at `port` (with `password`).
fn redis_cli(port: u16, password: &str, command: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string(), "-a", password, "--no-auth-warning"])
        .args(command)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `KEYS *` on the server at `port` (with `password`).
fn all_keys(port: u16, password: &str) -> String {
    redis_cli(port, password, &["KEYS", "*"])
}

/// A server with `requirepass` and an ACL user: both tiers work with the right
/// credentials, fail with a typed error with wrong ones, and never show a password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_and_acl_users_work_and_never_show() {
    super::alone();
    let server = LocalRedis::start_with(&["--requirepass", PASSWORD]).unwrap();
    let status = Command::new("redis-cli")
        .args([
            "-p",
            &server.port().to_string(),
            "-a",
            PASSWORD,
            "--no-auth-warning",
        ])
        .args(APP_USER)
        .status()
        .unwrap();
    assert!(status.success());
    let quota = Quota::per_second(5).unwrap();
    for (user, password) in [("", PASSWORD), ("app", "app-pw-77")] {
        let url = with_password(&server.url(), user, password);
        // A long timeout: this test is about credentials, not latency.
        let builder = RedisLimiter::builder(&url, quota).timeout(Duration::from_secs(2));
        let builder_debug = format!("{builder:?}");
        let limiter = builder.build().await.unwrap();
        assert!(limiter.check("k").await.unwrap().is_allowed());

        let config = RedisSync::new(&url).interval(Duration::from_millis(20));
        let config_debug = format!("{config:?}");
        let (synced, handle) = RateLimiter::<String>::builder(quota)
            .build_synced(config)
            .unwrap();
        synced.check("k");
        wait_synced(&handle).await;
        assert_hidden(
            password,
            &[
                builder_debug,
                config_debug,
                format!("{limiter:?}"),
                format!("{:?}", handle.stats()),
                format!("{handle:?}"),
            ],
        );
        handle.shutdown().await;

        // A wrong password, and no password: typed errors that show neither.
        for bad in [
            with_password(&server.url(), user, "wrong-pw-31"),
            server.url(),
        ] {
            let err = RedisLimiter::builder(&bad, quota)
                .timeout(Duration::from_millis(500))
                .build()
                .await
                .unwrap_err();
            assert_hidden("wrong-pw-31", &[err.to_string(), format!("{err:?}")]);
            let err = RateLimiter::<String>::builder(quota)
                .build_synced(RedisSync::new(&bad).require_connection(true))
                .unwrap_err();
            assert!(matches!(err, ConfigError::RedisUnreachable { .. }), "{err}");
            assert_hidden("wrong-pw-31", &[err.to_string(), format!("{err:?}")]);
            // Without `require_connection`, the sync serves by its fallback, and says
            // why: the authentication failed (it used to say nothing but "errors").
            let (_limiter, handle) = RateLimiter::<String>::builder(quota)
                .build_synced(RedisSync::new(&bad).interval(Duration::from_millis(20)))
                .unwrap();
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while handle.stats().last_error.is_none() {
                assert!(std::time::Instant::now() < deadline, "{:?}", handle.stats());
                // Waits for the sync task's round to fail against the real Redis process.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let stats = handle.stats();
            assert_eq!(stats.last_error, Some("authentication"), "{stats:?}");
            assert_hidden(
                "wrong-pw-31",
                &[format!("{stats:?}"), format!("{handle:?}")],
            );
            handle.shutdown().await;
        }
    }
}

/// A cluster whose nodes require a password: both tiers work through it, with the
/// default user's password and with an ACL user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_with_a_password_works() {
    super::alone();
    let cluster =
        LocalCluster::start_with_password(3, 0, Duration::from_secs(2), PASSWORD).unwrap();
    for port in cluster.ports() {
        assert_eq!(cluster.cli(port, &APP_USER).unwrap().trim(), "OK");
    }
    for (user, password) in [("", PASSWORD), ("app", "app-pw-77")] {
        one_cluster_user(&cluster, user, password).await;
    }
}

async fn one_cluster_user(cluster: &LocalCluster, user: &str, password: &str) {
    let urls: Vec<String> = cluster
        .urls()
        .iter()
        .map(|u| with_password(u, user, password))
        .collect();
    let seeds: Vec<&str> = urls.iter().map(String::as_str).collect();
    let quota = Quota::per_second(5).unwrap();
    let limiter = RedisLimiter::cluster_builder(&seeds, quota)
        .timeout(Duration::from_secs(1))
        .build()
        .await
        .unwrap();
    for k in 0..100 {
        assert!(limiter.check(&format!("k{k}")).await.unwrap().is_allowed());
    }
    let (synced, handle) = RateLimiter::<String>::builder(quota)
        .build_synced(RedisSync::cluster(&seeds).interval(Duration::from_millis(20)))
        .unwrap();
    for k in 0..100 {
        synced.check(format!("k{k}").as_str());
    }
    wait_synced(&handle).await;
    assert_hidden(
        password,
        &[format!("{limiter:?}"), format!("{:?}", handle.stats())],
    );
    assert_eq!(handle.stats().errors, 0, "{:?}", handle.stats());
    handle.shutdown().await;

    // A wrong password is refused, and does not show.
    let bad = with_password(&cluster.urls()[0], user, "wrong-pw-31");
    let err = RedisLimiter::cluster_builder(&[&bad], quota)
        .timeout(Duration::from_millis(500))
        .build()
        .await
        .unwrap_err();
    assert_hidden("wrong-pw-31", &[err.to_string(), format!("{err:?}")]);
}

/// With `hash_keys`, neither tier writes a key (here an API token) into a Redis key
/// name: only its keyed digest. Nodes with the same secret share a limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hashed_keys_keep_tokens_out_of_redis() {
    super::alone();
    let server = LocalRedis::start_with(&["--requirepass", PASSWORD]).unwrap();
    let url = with_password(&server.url(), "", PASSWORD);
    let token = "Bearer sk_live_51H8xyzSECRET";
    let quota: Quota = "3/min".parse().unwrap();
    let a = RedisLimiter::builder(&url, quota)
        .hash_keys("key-hash-secret")
        .build()
        .await
        .unwrap();
    let b = RedisLimiter::builder(&url, quota)
        .hash_keys("key-hash-secret")
        .build()
        .await
        .unwrap();
    let redis_key = String::from_utf8(a.redis_key(token)).unwrap();
    assert!(!redis_key.contains("sk_live"), "{redis_key}");
    assert!(redis_key.starts_with("tollgate:tb:{h:"), "{redis_key}");
    assert_eq!(redis_key, String::from_utf8(b.redis_key(token)).unwrap());
    // Two nodes with the same secret share the 3 requests.
    let allowed = [
        a.check(token).await.unwrap(),
        b.check(token).await.unwrap(),
        a.check(token).await.unwrap(),
        b.check(token).await.unwrap(),
    ]
    .map(|d| d.is_allowed());
    assert_eq!(allowed, [true, true, true, false]);

    let config = RedisSync::new(&url)
        .interval(Duration::from_millis(20))
        .hash_keys("key-hash-secret");
    assert_hidden(
        "key-hash-secret",
        &[format!("{config:?}"), format!("{a:?}")],
    );
    let (synced, handle) = RateLimiter::<String>::builder(quota)
        .build_synced(config)
        .unwrap();
    wait_synced(&handle).await;
    // The key spends its cold share (3 at once) and turns hot: it is announced (under
    // its Redis key) and synced.
    for _ in 0..4 {
        synced.check(token);
    }
    for _ in 0..200 {
        if handle.stats().keys_turned_hot > 0 {
            break;
        }
        handle.sync_now();
        // Waits for the sync task's round against the real Redis process.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut keys = all_keys(server.port(), PASSWORD);
    while !keys.contains(":sync:tb:{h:") {
        assert!(std::time::Instant::now() < deadline, "{keys}");
        handle.sync_now();
        // Waits for the sync task's round against the real Redis process.
        tokio::time::sleep(Duration::from_millis(10)).await;
        keys = all_keys(server.port(), PASSWORD);
    }
    assert_eq!(
        keys.lines().filter(|k| k.contains("{h:")).count(),
        2,
        "{keys}"
    );
    assert!(!keys.contains("sk_live"), "{keys}");
    let announced = redis_cli(
        server.port(),
        PASSWORD,
        &["ZRANGE", "{tollgate}:sync:tb:hot", "0", "-1"],
    );
    assert!(announced.contains(":sync:tb:{h:"), "{announced}");
    assert!(!announced.contains("sk_live"), "{announced}");
    handle.shutdown().await;
}

/// `rediss://` to a TLS-only redis-server whose certificate the test's own CA signed:
/// both tiers work when told to trust that CA, and fail with a typed error otherwise.
#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_works_with_a_trusted_ca_only() {
    super::alone();
    let dir = std::env::temp_dir().join(format!("tollgate-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    common::certificates(&dir);
    let server = LocalRedis::start_tls(
        &dir.join("server.crt"),
        &dir.join("server.key"),
        &dir.join("ca.crt"),
    )
    .unwrap();
    let ca = std::fs::read(dir.join("ca.crt")).unwrap();
    let url = server.url();
    assert!(url.starts_with("rediss://"), "{url}");
    let quota = Quota::per_second(5).unwrap();
    let limiter = RedisLimiter::builder(&url, quota)
        .tls_root_cert(ca.clone())
        .timeout(Duration::from_secs(2))
        .build()
        .await
        .unwrap();
    assert!(limiter.check("k").await.unwrap().is_allowed());
    let (synced, handle) = RateLimiter::<String>::builder(quota)
        .build_synced(
            RedisSync::new(&url)
                .tls_root_cert(ca)
                .interval(Duration::from_millis(20)),
        )
        .unwrap();
    synced.check("k");
    wait_synced(&handle).await;
    handle.shutdown().await;

    // Without the CA, the certificate is not trusted: a typed error, no hang.
    let err = RedisLimiter::builder(&url, quota)
        .timeout(Duration::from_secs(2))
        .build()
        .await
        .unwrap_err();
    assert!(!err.to_string().is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}
