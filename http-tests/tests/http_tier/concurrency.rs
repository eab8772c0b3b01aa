//! The concurrency layer over real sockets: a slot held until the response body ends
//! (a streamed body, a client that goes away), 429 with `Retry-After` beyond the limit,
//! the same with a rate limit (neither charged for what the other refused), and gRPC's
//! `RESOURCE_EXHAUSTED` from tonic's client.

use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing;
use bytes::Bytes;
use http_body::Frame;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tollgate::http::{ConcurrencyLimitLayer, KeyExtractor, RateLimitLayer};
use tollgate::{ConcurrencyLimiter, RateLimiter};

use crate::grpc::greeter;
use crate::serve;

/// A body whose frames the test sends, one by one; it ends when the sender is dropped.
struct Streamed(mpsc::UnboundedReceiver<Bytes>);

impl http_body::Body for Streamed {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}

/// An app at `/stream` whose responses stream what the test sends through the channel
/// the handler hands it, and at `/` a plain "hello".
fn app(streams: mpsc::UnboundedSender<mpsc::UnboundedSender<Bytes>>) -> Router {
    Router::new()
        .route(
            "/stream",
            routing::get(move || {
                let streams = streams.clone();
                async move {
                    let (tx, rx) = mpsc::unbounded_channel();
                    tx.send(Bytes::from_static(b"first\n")).unwrap();
                    streams.send(tx).unwrap();
                    axum::body::Body::new(Streamed(rx))
                }
            }),
        )
        .route("/", routing::get(|| async { "hello" }))
}

/// Sends a GET and reads until `until` appears in what came back (or the connection
/// closes); returns the connection (still open) and the text.
async fn request(addr: SocketAddr, path: &str, key: &str, until: &str) -> (TcpStream, String) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nx-api-key: {key}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !String::from_utf8_lossy(&seen).contains(until) {
        let mut buf = [0u8; 4096];
        let n = tokio::time::timeout_at(deadline.into(), stream.read(&mut buf))
            .await
            .expect("the response came in time")
            .unwrap();
        if n == 0 {
            break;
        }
        seen.extend_from_slice(&buf[..n]);
    }
    (stream, String::from_utf8(seen).unwrap())
}

fn status(text: &str) -> u16 {
    text.split(' ').nth(1).unwrap().parse().unwrap()
}

async fn settle(limiter: &ConcurrencyLimiter<String>, key: &str, in_flight: u32) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while limiter.in_flight(key) != in_flight {
        assert!(
            Instant::now() < deadline,
            "{} in flight",
            limiter.in_flight(key)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn the_slot_is_held_until_the_body_ends_and_the_limit_answers_429() {
    let slots: ConcurrencyLimiter<String> = ConcurrencyLimiter::new(1);
    let (streams_tx, mut streams) = mpsc::unbounded_channel();
    let addr = serve(app(streams_tx).layer(
        ConcurrencyLimitLayer::new(slots.clone()).key(KeyExtractor::header("x-api-key").unwrap()),
    ))
    .await;

    // A streamed response is under way: its slot is held while the body is open.
    let (mut open, head) = request(addr, "/stream", "alice", "first").await;
    assert_eq!(status(&head), 200, "{head}");
    let body = streams.recv().await.unwrap();
    assert_eq!(slots.in_flight("alice"), 1);
    let (_, refused) = request(addr, "/", "alice", "retry_after_seconds").await;
    assert_eq!(status(&refused), 429, "{refused}");
    assert!(
        refused.to_ascii_lowercase().contains("retry-after: 1\r\n"),
        "{refused}"
    );
    assert!(
        refused.contains(r#""error":"concurrency_limit_exceeded""#),
        "{refused}"
    );
    // Another key has its own slots.
    let (_, other) = request(addr, "/", "bob", "hello").await;
    assert_eq!(status(&other), 200, "{other}");

    // The body ends: the slot comes back.
    body.send(Bytes::from_static(b"last\n")).unwrap();
    drop(body);
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), open.read_to_end(&mut rest)).await;
    settle(&slots, "alice", 0).await;
    let (_, again) = request(addr, "/", "alice", "hello").await;
    assert_eq!(status(&again), 200, "{again}");

    // A client that goes away mid-body gives the slot back too.
    let (gone, _) = request(addr, "/stream", "carol", "first").await;
    let _body = streams.recv().await.unwrap();
    assert_eq!(slots.in_flight("carol"), 1);
    drop(gone);
    settle(&slots, "carol", 0).await;
}

#[tokio::test]
async fn with_a_rate_limit_neither_is_charged_for_what_the_other_refused() {
    let rate: RateLimiter<String> = RateLimiter::new("2/min".parse().unwrap());
    let slots: ConcurrencyLimiter<String> = ConcurrencyLimiter::new(1);
    let (streams_tx, mut streams) = mpsc::unbounded_channel();
    let key = || KeyExtractor::header("x-api-key").unwrap();
    let addr = serve(
        app(streams_tx)
            .layer(RateLimitLayer::new(rate.clone()).key(key()))
            .layer(ConcurrencyLimitLayer::new(slots.clone()).key(key())),
    )
    .await;
    let (mut open, head) = request(addr, "/stream", "k", "first").await;
    assert!(head.contains("ratelimit-remaining: 1"), "{head}");
    let body = streams.recv().await.unwrap();
    // Refused a slot: the rate limit is not asked.
    let (_, refused) = request(addr, "/", "k", "retry_after_seconds").await;
    assert_eq!(status(&refused), 429);
    assert_eq!(rate.peek("k").remaining(), 1);
    drop(body);
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), open.read_to_end(&mut rest)).await;
    settle(&slots, "k", 0).await;
    let (_, second) = request(addr, "/", "k", "hello").await;
    assert_eq!(status(&second), 200);
    // Denied by the rate: the slot taken for it comes back with the 429.
    let (_, denied) = request(addr, "/", "k", "retry_after_seconds").await;
    assert_eq!(status(&denied), 429);
    assert!(denied.contains("rate_limit_exceeded"), "{denied}");
    settle(&slots, "k", 0).await;
}

#[tokio::test]
async fn a_grpc_call_over_the_limit_is_resource_exhausted() {
    use tonic::transport::{Endpoint, Server};

    let slots: ConcurrencyLimiter<String> = ConcurrencyLimiter::new(1);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        Server::builder()
            .layer(ConcurrencyLimitLayer::new(slots.clone()).key(KeyExtractor::peer_ip()))
            .add_service(greeter::Greeter)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    greeter::say_hello(channel.clone(), "ada").await.unwrap();
    // Another request of this peer holds its one slot.
    let held = slots.try_acquire("127.0.0.1").unwrap();
    let status = greeter::say_hello(channel.clone(), "ada")
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert_eq!(status.metadata().get("retry-after").unwrap(), "1");
    assert!(
        status.message().contains("in flight"),
        "{}",
        status.message()
    );
    drop(held);
    greeter::say_hello(channel, "ada").await.unwrap();
    settle(&slots, "127.0.0.1", 0).await;
}

/// `queue(max_wait)`: a request of a full key waits in line and is served once the slot
/// comes back; one that waits past `max_wait` gets the 429.
#[tokio::test]
async fn a_queued_request_waits_for_the_slot_or_its_deadline() {
    let slots: ConcurrencyLimiter<String> = ConcurrencyLimiter::new(1);
    let (streams_tx, mut streams) = mpsc::unbounded_channel();
    let layer = |wait| {
        ConcurrencyLimitLayer::new(slots.clone())
            .key(KeyExtractor::header("x-api-key").unwrap())
            .queue(wait)
    };
    let addr = serve(app(streams_tx.clone()).layer(layer(Duration::from_secs(10)))).await;
    let (mut open, _) = request(addr, "/stream", "k", "first").await;
    let body = streams.recv().await.unwrap();
    // Waits (the slot is held) ...
    let waiting = tokio::spawn(async move { request(addr, "/", "k", "hello").await.1 });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiting.is_finished());
    assert_eq!(slots.stats().waiting, 1);
    // ... and is served once the body ends.
    drop(body);
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), open.read_to_end(&mut rest)).await;
    let served = waiting.await.unwrap();
    assert_eq!(status(&served), 200, "{served}");
    settle(&slots, "k", 0).await;

    // A short queue: the 429 once the wait is over.
    let addr = serve(app(streams_tx).layer(layer(Duration::from_millis(100)))).await;
    let (_open, _) = request(addr, "/stream", "k", "first").await;
    let _body = streams.recv().await.unwrap();
    let started = Instant::now();
    let (_, refused) = request(addr, "/", "k", "retry_after_seconds").await;
    assert_eq!(status(&refused), 429, "{refused}");
    assert!(started.elapsed() >= Duration::from_millis(100));
    assert_eq!(slots.stats().waiting, 0);
}
