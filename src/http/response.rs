//! The headers every limited response carries, and the 429 itself.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};

use super::body::RateLimitBody;
use super::extract::{KeyRejection, RequestHead};
use super::values;
use crate::decision::Decision;

/// Which rate-limit headers responses carry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
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
#[non_exhaustive]
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
    policy: String,
    /// The quota's window, whole seconds rounded up.
    window_secs: u64,
    /// The values made once for the default quota, if the layer knows it.
    default: Option<DefaultValues>,
    /// The limiter's further quotas ([`Builder::also`](crate::Builder::also)), in order.
    also: Vec<AlsoPolicy>,
    /// With further quotas: the `RateLimit-Policy` value listing every quota.
    policy_list: Option<HeaderValue>,
    /// The limiter's own quotas: the first, then `also[..own - 1]`; the layer's further
    /// limits follow in `also`.
    own: usize,
    /// The policy index decisions of the layer's first further limit carry.
    extras_at: usize,
    /// The gRPC status of a denied call.
    pub(crate) grpc: GrpcCode,
}

/// One of a limiter's further quotas, as the IETF fields name it.
#[derive(Clone, Debug)]
struct AlsoPolicy {
    /// Its name, quoted for a structured field.
    name: String,
    /// Its capacity (`q`).
    limit: u64,
    /// Its window, whole seconds rounded up (`w`).
    window_secs: u64,
}

/// The values of the default quota's headers that are the same for many responses,
/// made once (see [`values`](super::values)).
#[derive(Clone, Debug)]
struct DefaultValues {
    /// The quota's capacity: what its decisions report as their limit.
    limit: u64,
    /// `RateLimit-Limit` (numbers below 65,536 have one anyway).
    limit_value: Option<&'static HeaderValue>,
    /// `RateLimit-Policy`.
    policy: Option<&'static HeaderValue>,
    /// `RateLimit`, per `r` and `t`.
    states: StateFields,
}

/// The most `RateLimit` values a layer keeps a table entry for (16 bytes each).
const MAX_CACHED_FIELDS: usize = 16_384;

/// The `RateLimit` field values (`"policy";r=R;t=T`) of a quota of capacity `limit`, for
/// `R ≤ limit` and `T ≤ window`, each made the first time it is needed.
#[derive(Clone)]
struct StateFields {
    /// Values of `t` per value of `r`.
    width: u64,
    values: Arc<[OnceLock<&'static HeaderValue>]>,
}

impl std::fmt::Debug for StateFields {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let made = self.values.iter().filter(|v| v.get().is_some()).count();
        f.debug_struct("StateFields")
            .field("width", &self.width)
            .field("cells", &self.values.len())
            .field("made", &made)
            .finish()
    }
}

impl StateFields {
    fn new(limit: u64, window_secs: u64) -> Self {
        let width = window_secs.saturating_add(1);
        let len = limit
            .saturating_add(1)
            .saturating_mul(width)
            .min(MAX_CACHED_FIELDS as u64);
        Self {
            width,
            values: (0..len).map(|_| OnceLock::new()).collect(),
        }
    }

    /// The value for `r` and `t` of `policy`; `None` when the pair is outside the table,
    /// or when no more values may be made once.
    #[inline]
    fn get(&self, r: u64, t: u64, policy: &str) -> Option<&'static HeaderValue> {
        if t >= self.width {
            return None;
        }
        let index = r.checked_mul(self.width)?.checked_add(t)?;
        let cell = self.values.get(usize::try_from(index).ok()?)?;
        if let Some(value) = cell.get() {
            return Some(value);
        }
        let value = state_field(policy, r, t).and_then(|v| values::interned(v.as_bytes()))?;
        Some(cell.get_or_init(|| value))
    }
}

/// The rate-limit header names, in the order of [`Made`]'s values. Constants, so that a
/// use writes the name's words in place rather than cloning a shared one.
const LIMIT: HeaderName = HeaderName::from_static("ratelimit-limit");
const REMAINING: HeaderName = HeaderName::from_static("ratelimit-remaining");
const RESET: HeaderName = HeaderName::from_static("ratelimit-reset");
const POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const STATE: HeaderName = HeaderName::from_static("ratelimit");
/// gRFC A6's server pushback: a client with a retry policy waits this many ms before
/// its next attempt.
const GRPC_RETRY_PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// The values of a decision's rate-limit headers, when every one was made once: in the
/// order `RateLimit-Limit`, `-Remaining`, `-Reset`, `-Policy`, `RateLimit`; `None` for a
/// header the style leaves out.
pub(crate) type Made = [Option<&'static HeaderValue>; 5];

/// Adds the headers of `values` to `headers`. A header map already at `http`'s limit
/// (32,768 entries) gets none, rather than a panic.
#[inline]
pub(crate) fn insert_made(values: &Made, headers: &mut HeaderMap) {
    let [limit, remaining, reset, policy, state] = *values;
    if headers
        .try_reserve(values.iter().flatten().count())
        .is_err()
    {
        return;
    }
    // Reserved: none of these can reach the limit.
    if let Some(v) = limit {
        let _ = headers.try_insert(LIMIT, v.clone());
    }
    if let Some(v) = remaining {
        let _ = headers.try_insert(REMAINING, v.clone());
    }
    if let Some(v) = reset {
        let _ = headers.try_insert(RESET, v.clone());
    }
    if let Some(v) = policy {
        let _ = headers.try_insert(POLICY, v.clone());
    }
    if let Some(v) = state {
        let _ = headers.try_insert(STATE, v.clone());
    }
}

/// Whole seconds, rounded up.
/// A deny's exact wait in whole milliseconds, rounded up (at least 1: a deny never waits
/// 0): the value of `grpc-retry-pushback-ms`.
fn pushback_ms(decision: &Decision) -> u64 {
    decision.retry_after_ns().div_ceil(1_000_000).max(1)
}

fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
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

/// The `RateLimit` field of `policy` with `r` units left and `t` seconds to wait.
fn state_field(policy: &str, r: u64, t: u64) -> Option<HeaderValue> {
    field(format_args!("{policy};r={r};t={t}"))
}

/// The `RateLimit-Policy` field of `policy` for a quota of `limit` per `window` seconds.
fn policy_field(policy: &str, limit: u64, window_secs: u64) -> Option<HeaderValue> {
    field(format_args!("{policy};q={limit};w={window_secs}"))
}

impl Style {
    /// The style of a layer whose quota has a window of `window_secs` (whole seconds,
    /// rounded up) and, if known, a capacity of `limit`: both rate-limit header styles,
    /// JSON bodies, the policy `"default"`, gRPC's `RESOURCE_EXHAUSTED`.
    pub(crate) fn new(window_secs: u64, limit: Option<u64>) -> Self {
        let mut style = Self {
            headers: HeaderStyle::Both,
            body: ErrorBody::Json,
            policy: "\"default\"".to_owned(),
            window_secs,
            default: None,
            also: Vec::new(),
            policy_list: None,
            own: 1,
            extras_at: 1,
            grpc: GrpcCode::default(),
        };
        style.remake(limit);
        style
    }

    /// Names the policy of the IETF fields (`quoted` is a structured-field string).
    pub(crate) fn set_policy(&mut self, quoted: String) {
        self.policy = quoted;
        self.remake(self.default.as_ref().map(|d| d.limit));
    }

    /// Names the policies in order, the first quota's first (each `quoted`); names
    /// beyond the quotas are ignored, quotas beyond the names keep theirs.
    pub(crate) fn set_policies(&mut self, quoted: Vec<String>) {
        let mut names = quoted.into_iter();
        if let Some(first) = names.next() {
            self.policy = first;
        }
        for (also, name) in self.also.iter_mut().zip(names) {
            also.name = name;
        }
        self.remake(self.default.as_ref().map(|d| d.limit));
    }

    /// Adds the limiter's further quotas, `(capacity, window in whole seconds)` each,
    /// named `"also1"`, `"also2"`, … until named otherwise.
    pub(crate) fn set_also(&mut self, also: &[(u64, u64)]) {
        self.also = also
            .iter()
            .enumerate()
            .map(|(i, &(limit, window_secs))| AlsoPolicy {
                name: format!("\"also{}\"", i + 1),
                limit,
                window_secs,
            })
            .collect();
        self.own = 1 + also.len();
        self.extras_at = self.own;
        self.remake(self.default.as_ref().map(|d| d.limit));
    }

    /// Decisions of the layer's further limits carry policy indices from `at` (a layer
    /// of plans: past the most quotas any plan has).
    pub(crate) fn set_extras_at(&mut self, at: usize) {
        self.extras_at = at;
    }

    /// This style for the plan named `plan`, whose quotas are
    /// `quotas` (capacity and window in whole seconds each, its first quota's first):
    /// its name and quotas replace the limiter's own, the layer's further limits and
    /// every other setting stay.
    pub(crate) fn for_plan(&self, plan: &str, quotas: &[(u64, u64)]) -> Self {
        let mut style = self.clone();
        let Some((&(limit, window_secs), also)) = quotas.split_first() else {
            return style;
        };
        style.policy = quoted(plan);
        style.window_secs = window_secs;
        style.also = also
            .iter()
            .enumerate()
            .map(|(i, &(limit, window_secs))| AlsoPolicy {
                name: quoted(&format!("{plan}+{}", i + 1)),
                limit,
                window_secs,
            })
            .chain(self.also[self.own - 1..].iter().cloned())
            .collect();
        style.own = quotas.len();
        style.remake(Some(limit));
        style
    }

    /// Adds one more policy after the others (a further limit of the layer's), with
    /// its `quoted` name.
    pub(crate) fn push_policy(&mut self, quoted: String, limit: u64, window_secs: u64) {
        self.also.push(AlsoPolicy {
            name: quoted,
            limit,
            window_secs,
        });
        self.remake(self.default.as_ref().map(|d| d.limit));
    }

    /// Makes the default quota's values afresh.
    fn remake(&mut self, limit: Option<u64>) {
        self.policy_list = (!self.also.is_empty())
            .then(|| {
                let mut list = limit.map_or_else(String::new, |limit| {
                    format!("{};q={limit};w={}", self.policy, self.window_secs)
                });
                for also in &self.also {
                    if !list.is_empty() {
                        list.push_str(", ");
                    }
                    list.push_str(&format!(
                        "{};q={};w={}",
                        also.name, also.limit, also.window_secs
                    ));
                }
                HeaderValue::from_str(&list).ok()
            })
            .flatten();
        self.default = limit.map(|limit| DefaultValues {
            limit,
            limit_value: values::interned(limit.to_string().as_bytes()),
            policy: match &self.policy_list {
                Some(list) => values::interned(list.as_bytes()),
                None => policy_field(&self.policy, limit, self.window_secs)
                    .and_then(|v| values::interned(v.as_bytes())),
            },
            states: StateFields::new(limit, self.window_secs),
        });
    }

    /// The quoted name of the limiter's quota number `policy`.
    fn name_of(&self, policy: usize) -> &str {
        let i = match policy {
            0 => return &self.policy,
            p if p < self.own => p - 1,
            p if p >= self.extras_at => self.own - 1 + (p - self.extras_at),
            _ => return &self.policy,
        };
        self.also.get(i).map_or(&self.policy, |a| &a.name)
    }

    /// The delta seconds of the `RateLimit` field's `t` and of `Retry-After`: for an
    /// admission, until the quota is full again; for a deny, until a retry succeeds,
    /// at least 1.
    fn wait_secs(decision: &Decision) -> u64 {
        match decision.retry_after() {
            Some(retry) => ceil_secs(retry).max(1),
            None => ceil_secs(decision.reset_after()),
        }
    }

    /// The default quota's values, if `decision` is one of its.
    fn default_for(&self, decision: &Decision) -> Option<&DefaultValues> {
        self.default
            .as_ref()
            .filter(|d| d.limit == decision.limit() && decision.policy() == 0)
    }

    /// The values of `decision`'s headers, if every one was made once: the common case,
    /// which [`insert_made`] adds with no allocation and no reference count.
    #[inline]
    pub(crate) fn made(&self, decision: &Decision) -> Option<Made> {
        let mut made = [None; 5];
        if self.headers != HeaderStyle::Ietf {
            let limit = decision.limit();
            made[0] = Some(
                values::number(limit)
                    .or_else(|| self.default_for(decision).and_then(|d| d.limit_value))?,
            );
            made[1] = Some(values::number(decision.remaining())?);
            made[2] = Some(values::number(ceil_secs(decision.reset_after()))?);
        }
        if self.headers != HeaderStyle::Legacy {
            let default = self.default_for(decision)?;
            made[3] = Some(default.policy?);
            made[4] = Some(default.states.get(
                decision.remaining(),
                Self::wait_secs(decision),
                &self.policy,
            )?);
        }
        Some(made)
    }

    /// Adds the rate-limit headers of `decision` to `headers`, making the values that
    /// were not made once.
    pub(crate) fn apply(&self, decision: &Decision, headers: &mut HeaderMap) {
        if let Some(made) = self.made(decision) {
            return insert_made(&made, headers);
        }
        let default = self.default_for(decision);
        if self.headers != HeaderStyle::Ietf {
            let limit = default
                .and_then(|d| d.limit_value)
                .cloned()
                .unwrap_or_else(|| values::number_value(decision.limit()));
            // At `http`'s limit (32,768 entries) a header is left out, not a panic.
            let _ = headers.try_insert(LIMIT, limit);
            let _ = headers.try_insert(REMAINING, values::number_value(decision.remaining()));
            let _ = headers.try_insert(
                RESET,
                values::number_value(ceil_secs(decision.reset_after())),
            );
        }
        if self.headers != HeaderStyle::Legacy {
            let policy = match (default.and_then(|d| d.policy), &self.policy_list) {
                (Some(made), _) => Some(made.clone()),
                (None, Some(list)) => Some(list.clone()),
                (None, None) => policy_field(&self.policy, decision.limit(), self.window_secs),
            };
            let (r, t) = (decision.remaining(), Self::wait_secs(decision));
            let state = match default.and_then(|d| d.states.get(r, t, &self.policy)) {
                Some(made) => Some(made.clone()),
                None => state_field(self.name_of(decision.policy()), r, t),
            };
            if let Some(v) = policy {
                let _ = headers.try_insert(POLICY, v);
            }
            if let Some(v) = state {
                let _ = headers.try_insert(STATE, v);
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
        headers.insert(RETRY_AFTER, values::number_value(retry));
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
        response
    }

    /// A denied gRPC call: HTTP 200 with `grpc-status` (the configured code), a
    /// `grpc-message`, the rate-limit headers, `retry-after` and
    /// `grpc-retry-pushback-ms` as metadata, and an empty body (a trailers-only
    /// response).
    pub(crate) fn grpc_denied<B>(&self, decision: &Decision) -> Response<RateLimitBody<B>> {
        let retry = Self::wait_secs(decision);
        let message = format!(
            "Too many requests: retry in {retry} second{}.",
            if retry == 1 { "" } else { "s" }
        );
        let mut response = grpc_status(self.grpc.number(), &message);
        let headers = response.headers_mut();
        self.apply(decision, headers);
        headers.insert(RETRY_AFTER, values::number_value(retry));
        headers.insert(
            GRPC_RETRY_PUSHBACK,
            values::number_value(pushback_ms(decision)),
        );
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
        ours.insert(RETRY_AFTER, values::number_value(Self::wait_secs(decision)));
        for (name, value) in &ours {
            if !parts.headers.contains_key(name) {
                let _ = parts.headers.try_insert(name, value.clone());
            }
        }
        Response::from_parts(parts, RateLimitBody::own(body))
    }

    /// The 400 (or gRPC `INVALID_ARGUMENT`) for a request whose key the layer rejects:
    /// none found under [`MissingKey::Reject`](super::MissingKey::Reject) (the message
    /// names `looked_for`, what the extractor looks for), not UTF-8, or too long.
    pub(crate) fn rejected<B>(
        &self,
        why: KeyRejection,
        looked_for: &str,
        grpc: bool,
    ) -> Response<RateLimitBody<B>> {
        let message = match why {
            KeyRejection::Missing => {
                format!("this request has no rate-limit key: the server looks for {looked_for}")
            }
            other => other.to_string(),
        };
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
            json_escaped(&capitalised(&message))
        );
        let mut response = Response::new(RateLimitBody::own(body));
        *response.status_mut() = StatusCode::BAD_REQUEST;
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        response
    }
}

/// `name` as a structured-field string: quoted, with quotes and backslashes escaped.
pub(crate) fn quoted(name: &str) -> String {
    format!("\"{}\"", name.replace('\\', "\\\\").replace('"', "\\\""))
}

/// `s` as the inside of a JSON string.
pub(crate) fn json_escaped(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out
}

/// `s` with its first letter upper-case.
fn capitalised(s: &str) -> String {
    let mut chars = s.chars();
    chars.next().map_or_else(String::new, |first| {
        first.to_uppercase().chain(chars).collect()
    })
}

/// A trailers-only gRPC response of `status` and `message`.
pub(crate) fn grpc_status<B>(status: u16, message: &str) -> Response<RateLimitBody<B>> {
    let mut response = Response::new(RateLimitBody::own(Bytes::new()));
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert(
        HeaderName::from_static("grpc-status"),
        values::number_value(u64::from(status)),
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
            ..Style::new(60, None)
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
        let cached = Style {
            headers: HeaderStyle::Ietf,
            ..Style::new(60, Some(10))
        };
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
    fn the_default_quota_s_headers_are_made_once_and_equal_made_ones() {
        let style = Style::new(1, Some(1_000));
        let mut plain = Style::new(1, None);
        plain.headers = HeaderStyle::Both;
        for (remaining, reset_ns) in [(999, 1_000_000), (0, 1_000_000_000), (1_000, 0)] {
            let d = Decision::allow(1_000, remaining, reset_ns);
            let made = style
                .made(&d)
                .expect("the default quota's values are made once");
            let again = style.made(&d).expect("and found again");
            for (a, b) in made.iter().zip(&again) {
                assert!(std::ptr::eq(a.unwrap(), b.unwrap()), "one value per text");
            }
            let (mut fast, mut slow) = (HeaderMap::new(), HeaderMap::new());
            insert_made(&made, &mut fast);
            plain.apply(&d, &mut slow);
            assert_eq!(fast, slow);
            assert_eq!(fast.len(), 5);
        }
        // A key with its own quota, or a number past the table, is made per response.
        assert!(style.made(&Decision::allow(7, 2, 1_000_000_000)).is_none());
        let big = Decision::allow(1_000_000, 70_000, 1_000_000_000);
        assert!(style.made(&big).is_none());
        let mut headers = HeaderMap::new();
        style.apply(&big, &mut headers);
        assert_eq!(headers["ratelimit-remaining"], "70000");
        assert_eq!(headers["ratelimit"], "\"default\";r=70000;t=1");
        assert_eq!(headers["ratelimit-policy"], "\"default\";q=1000000;w=1");
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
        assert_eq!(r.headers()["grpc-retry-pushback-ms"], "1500");
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
        // The pushback is exact to the millisecond, rounded up, never 0.
        for (retry_ns, ms) in [
            (1, "1"),
            (1_000_000, "1"),
            (1_000_001, "2"),
            (59_999_999_999, "60000"),
        ] {
            let d = Decision::deny(10, 0, retry_ns, retry_ns);
            let r: Response<RateLimitBody<String>> = s.grpc_denied(&d);
            assert_eq!(r.headers()["grpc-retry-pushback-ms"], ms, "{retry_ns} ns");
        }
    }
}
