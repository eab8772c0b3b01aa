//! The headers every limited response carries, and the 429 itself.

use std::time::Duration;

use http::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};

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
    }

    /// Adds the rate-limit headers of `decision` to `headers`.
    pub(crate) fn apply(&self, decision: &Decision, headers: &mut HeaderMap) {
        if self.headers != HeaderStyle::Ietf {
            headers.insert(
                HeaderName::from_static("ratelimit-limit"),
                number(decision.limit()),
            );
            headers.insert(
                HeaderName::from_static("ratelimit-remaining"),
                number(decision.remaining()),
            );
            headers.insert(
                HeaderName::from_static("ratelimit-reset"),
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
            let state = field(format_args!(
                "{};r={};t={}",
                self.policy,
                decision.remaining(),
                Self::wait_secs(decision)
            ));
            if let Some(v) = policy {
                headers.insert(HeaderName::from_static("ratelimit-policy"), v);
            }
            if let Some(v) = state {
                headers.insert(HeaderName::from_static("ratelimit"), v);
            }
        }
    }

    /// The 429 for a denied `decision`: its headers, `Retry-After` (whole seconds,
    /// rounded up, at least 1, never earlier than the `RateLimit` field's `t`) and a JSON
    /// body.
    pub(crate) fn too_many_requests<B: From<String>>(&self, decision: &Decision) -> Response<B> {
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
        let mut response = Response::new(B::from(body));
        *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        let headers = response.headers_mut();
        self.apply(decision, headers);
        headers.insert(RETRY_AFTER, number(retry));
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
        response
    }

    /// The 400 for a request the layer found no key for, under
    /// [`MissingKey::Reject`](super::MissingKey::Reject).
    pub(crate) fn missing_key<B: From<String>>(&self) -> Response<B> {
        let body = r#"{"error":"rate_limit_key_missing","message":"This request carries nothing to rate-limit it by (no client address or key header)."}"#;
        let mut response = Response::new(B::from(body.to_owned()));
        *response.status_mut() = StatusCode::BAD_REQUEST;
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        response
    }
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
        }
    }

    #[test]
    fn sub_second_waits_round_up_to_one() {
        let d = Decision::deny(10, 0, 250_000_000, 100_000_000);
        let r: Response<String> = style(HeaderStyle::Both).too_many_requests(&d);
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()["retry-after"], "1");
        assert_eq!(r.headers()["ratelimit"], "\"default\";r=0;t=1");
        assert_eq!(r.headers()["ratelimit-reset"], "1");
        assert!(r.body().contains(r#""retry_after_seconds":1"#));
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
}
