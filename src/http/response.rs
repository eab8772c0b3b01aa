//! The headers every limited response carries, and the 429 itself.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};

use super::body::RateLimitBody;
use super::extract::{KeyRejection, RequestHead};
use crate::decision::Decision;

/// Which rate-limit headers responses carry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HeaderStyle {
    /// `RateLimit-Limit`, `RateLimit-Remaining` and `RateLimit-Reset`.
    Legacy,
    /// The IETF httpapi draft-10 structured fields `RateLimit-Policy` and `RateLimit`.
    Ietf,
    /// Both.
    #[default]
    Both,
}

/// The body of a 429.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ErrorBody {
    /// `application/json`:
    /// `{"error":"rate_limit_exceeded","message":"…","retry_after_seconds":N}`.
    #[default]
    Json,
    /// `application/problem+json` (RFC 9457): `type`, `title`, `status`, `detail`, and
    /// `retry_after_seconds`.
    ProblemJson,
}

/// The gRPC status of a denied gRPC call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum GrpcCode {
    /// `RESOURCE_EXHAUSTED` (8): what gRPC clients expect of a rate limit.
    #[default]
    ResourceExhausted,
    /// `UNAVAILABLE` (14): Envoy's default, which clients retry by themselves.
    Unavailable,
}

impl GrpcCode {
    /// The status number.
    pub fn number(self) -> u16 {
        match self {
            Self::ResourceExhausted => 8,
            Self::Unavailable => 14,
        }
    }
}

/// gRPC's `INVALID_ARGUMENT`: a call whose key the layer rejects.
const GRPC_INVALID_ARGUMENT: u16 = 3;

/// A custom deny response: made from the decision and the request's head. The layer adds
/// the rate-limit headers and `Retry-After` unless the response already has them.
pub type DenyHook = Arc<dyn Fn(&Decision, &RequestHead<'_>) -> Response<Bytes> + Send + Sync>;

/// How the layer writes its headers and errors.
#[derive(Clone, Debug)]
pub(crate) struct Style {
    pub(crate) headers: HeaderStyle,
    pub(crate) body: ErrorBody,
    /// The policy name of the IETF fields, already quoted for a structured field.
    pub(crate) policy: String,
    /// The quota's window, whole seconds rounded up.
    pub(crate) window_secs: u64,
    /// The `RateLimit-Policy` value for the default quota's capacity, made once.
    pub(crate) policy_value: Option<(u64, HeaderValue)>,
    /// `RateLimit-Limit` of the default quota, made once.
    pub(crate) limit_value: HeaderValue,
    /// `RateLimit` values of the default quota, made the first time each is needed.
    pub(crate) states: StateFields,
    /// The gRPC status of a denied call.
    pub(crate) grpc: GrpcCode,
}

/// The most `RateLimit` values a layer keeps (about 40 bytes each).
const MAX_CACHED_FIELDS: usize = 16_384;

/// The `RateLimit` field values (`"policy";r=R;t=T`) of a quota of capacity `limit`, for
/// `R ≤ limit` and `T ≤ window`, each made once and then shared: a header value that is
/// cloned costs a reference count, not an allocation.
#[derive(Clone, Debug, Default)]
pub(crate) struct StateFields {
    limit: u64,
    /// Values of `t` per value of `r`.
    width: u64,
    values: Arc<[OnceLock<HeaderValue>]>,
}

impl StateFields {
    fn new(limit: u64, window_secs: u64) -> Self {
        let width = window_secs.saturating_add(1);
        let len = limit
            .saturating_add(1)
            .saturating_mul(width)
            .min(MAX_CACHED_FIELDS as u64);
        Self {
            limit,
            width,
            values: (0..len).map(|_| OnceLock::new()).collect(),
        }
    }

    /// The cached value for `r` and `t`, made by `make` the first time; `None` when the
    /// pair is outside the cache.
    fn get(
        &self,
        limit: u64,
        r: u64,
        t: u64,
        make: impl FnOnce() -> Option<HeaderValue>,
    ) -> Option<HeaderValue> {
        if limit != self.limit || t >= self.width {
            return make();
        }
        let index = r.checked_mul(self.width).and_then(|i| i.checked_add(t));
        match index
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| self.values.get(i))
        {
            Some(cell) => {
                if let Some(value) = cell.get() {
                    return Some(value.clone());
                }
                let value = make()?;
                Some(cell.get_or_init(|| value).clone())
            }
            None => make(),
        }
    }
}

/// The rate-limit header names, made once: `HeaderName::from_static` checks its text on
/// every call.
struct Names {
    limit: HeaderName,
    remaining: HeaderName,
    reset: HeaderName,
    policy: HeaderName,
    state: HeaderName,
}

fn names() -> &'static Names {
    static NAMES: OnceLock<Names> = OnceLock::new();
    NAMES.get_or_init(|| Names {
        limit: HeaderName::from_static("ratelimit-limit"),
        remaining: HeaderName::from_static("ratelimit-remaining"),
        reset: HeaderName::from_static("ratelimit-reset"),
        policy: HeaderName::from_static("ratelimit-policy"),
        state: HeaderName::from_static("ratelimit"),
    })
}

/// Whole seconds, rounded up.
fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// A header value of `n`: numbers below 4096 come from a table built once, whose values
/// share static storage, so most headers cost no allocation.
fn number(n: u64) -> HeaderValue {
    static SMALL: std::sync::OnceLock<Vec<HeaderValue>> = std::sync::OnceLock::new();
    let table = SMALL.get_or_init(|| {
        (0..4096u64)
            .map(|i| HeaderValue::from_static(Box::leak(i.to_string().into_boxed_str())))
            .collect()
    });
    usize::try_from(n)
        .ok()
        .and_then(|i| table.get(i))
        .cloned()
        .unwrap_or_else(|| HeaderValue::from(n))
}

/// Formats a structured field into a stack buffer and makes a header value of it.
fn field(args: std::fmt::Arguments<'_>) -> Option<HeaderValue> {
    use std::io::Write as _;
    let mut buf = [0u8; 128];
    let mut cursor = std::io::Cursor::new(&mut buf[..]);
    cursor.write_fmt(args).ok()?;
    let len = usize::try_from(cursor.position()).ok()?;
    HeaderValue::from_bytes(&buf[..len]).ok()
}

impl Style {
    /// The delta seconds of the `RateLimit` field's `t` and of `Retry-After`: for an
    /// admission, until the quota is full again; for a deny, until a retry succeeds,
    /// at least 1.
    fn wait_secs(decision: &Decision) -> u64 {
        match decision.retry_after() {
            Some(retry) => ceil_secs(retry).max(1),
            None => ceil_secs(decision.reset_after()),
        }
    }

    /// Makes the `RateLimit-Policy` value of a key with the default quota, whose
    /// capacity is `limit`, once.
    pub(crate) fn cache_policy(&mut self, limit: u64) {
        self.policy_value = field(format_args!(
            "{};q={limit};w={}",
            self.policy, self.window_secs
        ))
        .map(|v| (limit, v));
        self.states = StateFields::new(limit, self.window_secs);
        self.limit_value = number(limit);
    }

    /// Adds the rate-limit headers of `decision` to `headers`.
    pub(crate) fn apply(&self, decision: &Decision, headers: &mut HeaderMap) {
        if self.headers != HeaderStyle::Ietf {
            let limit = match &self.policy_value {
                // The default quota's limit: made once (a large one would allocate).
                Some((limit, _)) if *limit == decision.limit() => self.limit_value.clone(),
                _ => number(decision.limit()),
            };
            let names = names();
            headers.insert(names.limit.clone(), limit);
            headers.insert(names.remaining.clone(), number(decision.remaining()));
            headers.insert(
                names.reset.clone(),
                number(ceil_secs(decision.reset_after())),
            );
        }
        if self.headers != HeaderStyle::Legacy {
            let policy = match &self.policy_value {
                Some((limit, value)) if *limit == decision.limit() => Some(value.clone()),
                _ => field(format_args!(
                    "{};q={};w={}",
                    self.policy,
                    decision.limit(),
                    self.window_secs
                )),
            };
            let (r, t) = (decision.remaining(), Self::wait_secs(decision));
            let state = self.states.get(decision.limit(), r, t, || {
                field(format_args!("{};r={r};t={t}", self.policy))
            });
            if let Some(v) = policy {
                headers.insert(names().policy.clone(), v);
            }
            if let Some(v) = state {
                headers.insert(names().state.clone(), v);
            }
        }
    }

    /// The 429 for a denied `decision`: its headers, `Retry-After` (whole seconds,
    /// rounded up, at least 1, never earlier than the `RateLimit` field's `t`) and a JSON
    /// body.
    pub(crate) fn too_many_requests<B>(&self, decision: &Decision) -> Response<RateLimitBody<B>> {
        let retry = Self::wait_secs(decision);
        let detail = format!(
            "Too many requests: retry in {retry} second{}.",
            if retry == 1 { "" } else { "s" }
        );
        let (content_type, body) = match self.body {
            ErrorBody::Json => (
                "application/json",
                format!(
                    r#"{{"error":"rate_limit_exceeded","message":"{detail}","retry_after_seconds":{retry}}}"#
                ),
            ),
            ErrorBody::ProblemJson => (
                "application/problem+json",
                format!(
                    r#"{{"type":"https://docs.rs/tollgate/latest/tollgate/http/#rate-limit-exceeded","title":"Too Many Requests","status":429,"detail":"{detail}","retry_after_seconds":{retry}}}"#
                ),
            ),
        };
        let mut response = Response::new(RateLimitBody::own(body));
        *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        let headers = response.headers_mut();
        self.apply(decision, headers);
        headers.insert(RETRY_AFTER, number(retry));
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
        response
    }

    /// A denied gRPC call: HTTP 200 with `grpc-status` (the configured code), a
    /// `grpc-message`, the rate-limit headers and `retry-after` as metadata, and an empty
    /// body (a trailers-only response).
    pub(crate) fn grpc_denied<B>(&self, decision: &Decision) -> Response<RateLimitBody<B>> {
        let retry = Self::wait_secs(decision);
        let message = format!(
            "Too many requests: retry in {retry} second{}.",
            if retry == 1 { "" } else { "s" }
        );
        let mut response = grpc_status(self.grpc.number(), &message);
        let headers = response.headers_mut();
        self.apply(decision, headers);
        headers.insert(RETRY_AFTER, number(retry));
        response
    }

    /// A deny made by the user's hook, with the rate-limit headers and `Retry-After`
    /// added where the hook did not set them.
    pub(crate) fn hooked<B>(
        &self,
        hook: &DenyHook,
        decision: &Decision,
        head: &RequestHead<'_>,
    ) -> Response<RateLimitBody<B>> {
        let response = hook(decision, head);
        let (mut parts, body) = response.into_parts();
        let mut ours = HeaderMap::new();
        self.apply(decision, &mut ours);
        ours.insert(RETRY_AFTER, number(Self::wait_secs(decision)));
        for (name, value) in &ours {
            if !parts.headers.contains_key(name) {
                parts.headers.insert(name, value.clone());
            }
        }
        Response::from_parts(parts, RateLimitBody::own(body))
    }

    /// The 400 (or gRPC `INVALID_ARGUMENT`) for a request whose key the layer rejects:
    /// none found under [`MissingKey::Reject`](super::MissingKey::Reject), not UTF-8, or
    /// too long.
    pub(crate) fn rejected<B>(&self, why: KeyRejection, grpc: bool) -> Response<RateLimitBody<B>> {
        let message = why.to_string();
        if grpc {
            return grpc_status(GRPC_INVALID_ARGUMENT, &message);
        }
        let code = match why {
            KeyRejection::Missing => "rate_limit_key_missing",
            KeyRejection::NotUtf8 => "rate_limit_key_not_utf8",
            KeyRejection::TooLong { .. } => "rate_limit_key_too_long",
        };
        let body = format!(
            r#"{{"error":"{code}","message":"{}."}}"#,
            capitalised(&message)
        );
        let mut response = Response::new(RateLimitBody::own(body));
        *response.status_mut() = StatusCode::BAD_REQUEST;
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        response
    }
}

/// `s` with its first letter upper-case.
fn capitalised(s: &str) -> String {
    let mut chars = s.chars();
    chars.next().map_or_else(String::new, |first| {
        first.to_uppercase().chain(chars).collect()
    })
}

/// A trailers-only gRPC response of `status` and `message`.
fn grpc_status<B>(status: u16, message: &str) -> Response<RateLimitBody<B>> {
    let mut response = Response::new(RateLimitBody::own(Bytes::new()));
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert(
        HeaderName::from_static("grpc-status"),
        number(u64::from(status)),
    );
    if let Ok(value) = HeaderValue::from_str(&grpc_message(message)) {
        headers.insert(HeaderName::from_static("grpc-message"), value);
    }
    response
}

/// A `grpc-message` value: percent-encoded outside printable ASCII, and `%` itself.
fn grpc_message(message: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(message.len());
    for byte in message.bytes() {
        if (0x20..=0x7e).contains(&byte) && byte != b'%' {
            out.push(char::from(byte));
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn style(headers: HeaderStyle) -> Style {
        Style {
            headers,
            body: ErrorBody::Json,
            policy: "\"default\"".to_owned(),
            window_secs: 60,
            policy_value: None,
            limit_value: number(0),
            states: StateFields::default(),
            grpc: GrpcCode::default(),
        }
    }

    #[test]
    fn sub_second_waits_round_up_to_one() {
        let d = Decision::deny(10, 0, 250_000_000, 100_000_000);
        let r: Response<RateLimitBody<String>> = style(HeaderStyle::Both).too_many_requests(&d);
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()["retry-after"], "1");
        assert_eq!(r.headers()["ratelimit"], "\"default\";r=0;t=1");
        assert_eq!(r.headers()["ratelimit-reset"], "1");
        let RateLimitBody::Own { bytes: Some(body) } = r.body() else {
            panic!("a 429 has a body of the layer's own");
        };
        assert!(
            std::str::from_utf8(body)
                .unwrap()
                .contains(r#""retry_after_seconds":1"#)
        );
    }

    #[test]
    fn header_styles_are_exclusive() {
        let d = Decision::allow(10, 4, 2_500_000_000);
        let mut legacy = HeaderMap::new();
        style(HeaderStyle::Legacy).apply(&d, &mut legacy);
        assert_eq!(legacy.len(), 3);
        assert_eq!(legacy["ratelimit-reset"], "3");
        let mut ietf = HeaderMap::new();
        style(HeaderStyle::Ietf).apply(&d, &mut ietf);
        assert_eq!(ietf.len(), 2);
        assert_eq!(ietf["ratelimit-policy"], "\"default\";q=10;w=60");
        assert_eq!(ietf["ratelimit"], "\"default\";r=4;t=3");
    }

    #[test]
    fn state_fields_are_made_once_and_match_uncached_ones() {
        let mut cached = style(HeaderStyle::Ietf);
        cached.cache_policy(10);
        let plain = style(HeaderStyle::Ietf);
        for (remaining, reset_ns) in [
            (4, 2_500_000_000),
            (0, 60_000_000_000),
            (10, 0),
            (3, 500_000_000),
        ] {
            let d = Decision::allow(10, remaining, reset_ns);
            let (mut a, mut b) = (HeaderMap::new(), HeaderMap::new());
            cached.apply(&d, &mut a);
            plain.apply(&d, &mut b);
            assert_eq!(a, b);
            let mut again = HeaderMap::new();
            cached.apply(&d, &mut again);
            assert_eq!(again, a);
        }
        // Another limit (a key with its own quota) is made afresh.
        let d = Decision::allow(7, 2, 1_000_000_000);
        let (mut a, mut b) = (HeaderMap::new(), HeaderMap::new());
        cached.apply(&d, &mut a);
        plain.apply(&d, &mut b);
        assert_eq!(a, b);
    }

    #[test]
    fn grpc_denies_are_trailers_only_with_the_configured_status() {
        let d = Decision::deny(10, 0, 2_000_000_000, 1_500_000_000);
        let mut s = style(HeaderStyle::Both);
        let r: Response<RateLimitBody<String>> = s.grpc_denied(&d);
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["grpc-status"], "8");
        assert_eq!(r.headers()["content-type"], "application/grpc");
        assert_eq!(r.headers()["retry-after"], "2");
        assert_eq!(r.headers()["ratelimit-remaining"], "0");
        assert!(
            r.headers()["grpc-message"]
                .to_str()
                .unwrap()
                .contains("retry in 2 seconds")
        );
        assert!(matches!(r.body(), RateLimitBody::Own { bytes: None }));
        s.grpc = GrpcCode::Unavailable;
        let r: Response<RateLimitBody<String>> = s.grpc_denied(&d);
        assert_eq!(r.headers()["grpc-status"], "14");
        assert_eq!(grpc_message("50% €"), "50%25 %E2%82%AC");
    }
}
