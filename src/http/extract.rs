//! How the layer finds a request's key: the [`ExtractKey`] trait, the request view that
//! closures see, and the checks every text key passes (UTF-8, a maximum length).

use std::borrow::Borrow;
use std::fmt;
use std::hash::Hash;
use std::ops::Deref;
use std::sync::Arc;

use http::{Extensions, HeaderMap, Method, Request, Uri, Version};

/// Finds the key of a request, for a limiter keyed by `K`.
///
/// The extractor sees the whole request, extensions included (a user id that
/// authentication middleware stored, axum's `ConnectInfo`, tonic's `TcpConnectInfo`), and
/// nothing is cloned to show it. It returns the key in the form the limiter looks keys up
/// by ([`Lookup`](Self::Lookup): `str` for `String` keys, `K` itself for `u64` or
/// `IpAddr` keys), borrowed from the request or written on the stack where it can, so an
/// existing key costs no allocation.
///
/// Built in: [`KeyExtractor`](super::KeyExtractor) (text keys: the peer or client
/// address, a header, a closure) and [`key_fn`] (any key type, from a closure).
///
/// ```
/// use http::Request;
/// use tollgate::http::{ExtractKey, KeyLimits, KeyRejection};
///
/// /// The tenant id that authentication middleware put into the extensions.
/// #[derive(Clone, Copy)]
/// struct TenantId(u64);
///
/// #[derive(Clone)]
/// struct ByTenant;
///
/// impl ExtractKey<u64> for ByTenant {
///     type Lookup = u64;
///     type Key<'r> = u64;
///
///     fn extract<B>(&self, req: &Request<B>, _: &KeyLimits) -> Result<u64, KeyRejection> {
///         req.extensions().get::<TenantId>().map(|t| t.0).ok_or(KeyRejection::Missing)
///     }
/// }
/// ```
pub trait ExtractKey<K>: Send + Sync + 'static {
    /// What the limiter looks the key up by.
    type Lookup: ?Sized + Hash + Eq + ToOwned<Owned = K>;
    /// A request's key, owned or borrowed from the request.
    type Key<'r>: Borrow<Self::Lookup>;

    /// The key of `req`. Text keys should pass through [`KeyLimits::text`] (or
    /// [`KeyLimits::bytes`]), which applies the layer's maximum length and UTF-8 check.
    ///
    /// # Errors
    /// [`KeyRejection::Missing`] when the request has no key (the layer then applies its
    /// [`MissingKey`](super::MissingKey) policy); the other variants for a key the layer
    /// rejects with a 400 (or gRPC `INVALID_ARGUMENT`).
    fn extract<'r, B>(
        &self,
        req: &'r Request<B>,
        limits: &KeyLimits,
    ) -> Result<Self::Key<'r>, KeyRejection>;

    /// What this extractor looks for in `req`, as the 400 for a request without it
    /// names it: "the `x-api-key` header", "the peer address". By default, "a rate-limit
    /// key".
    fn looks_for<B>(&self, req: &Request<B>) -> String {
        let _ = req;
        "a rate-limit key".to_owned()
    }
}

/// Why a request has no usable key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyRejection {
    /// The request carries no key: no peer address, no key header, or a closure that
    /// returned `None`.
    Missing,
    /// The key's bytes are not valid UTF-8 (a header value with bytes above 0x7F).
    NotUtf8,
    /// The key is longer than the layer's maximum ([`OversizedKey::Reject`]).
    TooLong {
        /// The key's length in bytes.
        len: usize,
        /// The maximum.
        max: usize,
    },
}

impl KeyRejection {
    /// The `reason` label of the layer's metric for a request it rejects:
    /// `missing_key`, `invalid_key` (not UTF-8) or `oversized_key`.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Missing => "missing_key",
            Self::NotUtf8 => "invalid_key",
            Self::TooLong { .. } => "oversized_key",
        }
    }
}

impl fmt::Display for KeyRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing => f.write_str(
                "this request carries nothing to rate-limit it by (no client address or key)",
            ),
            Self::NotUtf8 => {
                f.write_str("the rate-limit key is not valid UTF-8: send it as UTF-8 text")
            }
            Self::TooLong { len, max } => write!(
                f,
                "the rate-limit key is {len} bytes long; the most this server accepts is {max}: \
                 send a shorter key"
            ),
        }
    }
}

/// What the layer does with a text key longer than its maximum.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OversizedKey {
    /// Answer `400 Bad Request`; the request consumes nothing.
    #[default]
    Reject,
    /// Key the request by a 128-bit BLAKE3 digest of the key instead (34 bytes), so long
    /// keys cost no more memory than short ones.
    Hash,
}

/// The checks every text key passes: the layer's maximum key length, and what to do
/// with a longer key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyLimits {
    /// The longest key accepted as is, in bytes; 256 by default.
    pub max_len: usize,
    /// What a longer key gets; [`OversizedKey::Reject`] by default.
    pub oversized: OversizedKey,
}

impl Default for KeyLimits {
    fn default() -> Self {
        Self {
            max_len: 256,
            oversized: OversizedKey::Reject,
        }
    }
}

/// The prefix of a digest key. Keys are compared whole, so a digest key never equals a
/// key that was short enough to be kept, unless a client sends this very text.
const DIGEST_PREFIX: &str = "~h:";

impl KeyLimits {
    /// `key`, checked against the maximum length: as is, its digest
    /// ([`OversizedKey::Hash`]), or a rejection. An empty key is missing.
    ///
    /// # Errors
    /// [`KeyRejection::Missing`] for an empty key; [`KeyRejection::TooLong`] for a key
    /// longer than `max_len` under [`OversizedKey::Reject`].
    pub fn text<'r>(&self, key: &'r str) -> Result<TextKey<'r>, KeyRejection> {
        if key.is_empty() {
            return Err(KeyRejection::Missing);
        }
        if key.len() <= self.max_len {
            return Ok(TextKey::borrowed(key));
        }
        match self.oversized {
            OversizedKey::Reject => Err(KeyRejection::TooLong {
                len: key.len(),
                max: self.max_len,
            }),
            OversizedKey::Hash => Ok(TextKey::digest(key.as_bytes())),
        }
    }

    /// [`text`](Self::text) of a key the extractor made (an owned `String`).
    ///
    /// # Errors
    /// Those of [`text`](Self::text).
    pub fn owned(&self, key: String) -> Result<TextKey<'static>, KeyRejection> {
        match self.text(&key)? {
            TextKey(Text::Borrowed(_)) => Ok(TextKey::owned(key)),
            TextKey(Text::Inline { bytes, len }) => Ok(TextKey(Text::Inline { bytes, len })),
            TextKey(Text::Owned(digest)) => Ok(TextKey::owned(digest)),
        }
    }

    /// [`text`](Self::text) of a key of any type a closure made: a `String`, `Box<str>`
    /// or `Arc<str>` passes the checks (and becomes its digest if the limits say so);
    /// any other type is returned as is.
    ///
    /// # Errors
    /// Those of [`text`](Self::text), for a text key.
    pub fn any<K: 'static>(&self, mut key: K) -> Result<K, KeyRejection> {
        let any: &mut dyn std::any::Any = &mut key;
        if let Some(text) = any.downcast_mut::<String>() {
            *text = self.owned(std::mem::take(text))?.into_string();
        } else if let Some(text) = any.downcast_mut::<Box<str>>() {
            if let Some(digest) = self.replacement(text)? {
                *text = digest.into();
            }
        } else if let Some(text) = any.downcast_mut::<Arc<str>>() {
            if let Some(digest) = self.replacement(text)? {
                *text = digest.into();
            }
        }
        Ok(key)
    }

    /// What replaces `key` after the checks, if anything (its digest).
    fn replacement(&self, key: &str) -> Result<Option<String>, KeyRejection> {
        Ok(match self.text(key)? {
            TextKey(Text::Borrowed(_)) => None,
            digest => Some(digest.into_string()),
        })
    }

    /// [`text`](Self::text) of bytes that must be UTF-8 (a header value).
    ///
    /// # Errors
    /// [`KeyRejection::NotUtf8`], or those of [`text`](Self::text).
    pub fn bytes<'r>(&self, key: &'r [u8]) -> Result<TextKey<'r>, KeyRejection> {
        std::str::from_utf8(key)
            .map_err(|_| KeyRejection::NotUtf8)
            .and_then(|s| self.text(s))
    }
}

/// A text key: borrowed from the request, written on the stack (an address, a digest),
/// or owned (made by a closure). Only the last allocates.
pub struct TextKey<'r>(Text<'r>);

enum Text<'r> {
    Inline { bytes: [u8; INLINE], len: u8 },
    Borrowed(&'r str),
    Owned(String),
}

/// The bytes a stack key holds: enough for "ffff:…:ffff/128" (43) and a digest (35).
const INLINE: usize = 48;

impl<'r> TextKey<'r> {
    /// A key borrowed from the request.
    pub fn borrowed(key: &'r str) -> Self {
        Self(Text::Borrowed(key))
    }

    /// A key made by the caller.
    pub fn owned(key: String) -> Self {
        Self(Text::Owned(key))
    }

    /// A key written on the stack by `write` (which must write at most 48 bytes of
    /// UTF-8); `None` if it writes more.
    pub(crate) fn inline(write: impl FnOnce(&mut dyn fmt::Write) -> fmt::Result) -> Option<Self> {
        let mut w = StackWriter {
            bytes: [0; INLINE],
            len: 0,
        };
        write(&mut w).ok()?;
        Some(Self(Text::Inline {
            bytes: w.bytes,
            len: u8::try_from(w.len).ok()?,
        }))
    }

    /// A stack key of `text`, which must be ASCII of at most 48 bytes (other bytes become
    /// `?`; longer text is cut).
    pub(crate) fn ascii(text: &[u8]) -> Self {
        let mut bytes = [0; INLINE];
        let len = text.len().min(INLINE);
        for (to, &from) in bytes.iter_mut().zip(&text[..len]) {
            *to = if from.is_ascii() { from } else { b'?' };
        }
        // `len` is at most 48.
        Self(Text::Inline {
            bytes,
            len: len as u8,
        })
    }

    /// The digest key of `bytes`: `~h:` and 32 hex digits of their BLAKE3 hash.
    fn digest(bytes: &[u8]) -> Self {
        let hash = blake3::hash(bytes);
        let written = Self::inline(|w| {
            w.write_str(DIGEST_PREFIX)?;
            hash.as_bytes()[..16]
                .iter()
                .try_for_each(|b| write!(w, "{b:02x}"))
        });
        // 35 bytes always fit the 48 of the buffer.
        written.unwrap_or_else(|| Self::owned(hash.to_hex().to_string()))
    }

    /// The key as an owned `String` (no copy if it is one already).
    fn into_string(self) -> String {
        match self.0 {
            Text::Owned(key) => key,
            _ => self.as_str().to_owned(),
        }
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        match &self.0 {
            // Only whole `str`s are written into the buffer, so this cannot fail.
            Text::Inline { bytes, len } => {
                std::str::from_utf8(&bytes[..usize::from(*len)]).unwrap_or_default()
            }
            Text::Borrowed(s) => s,
            Text::Owned(s) => s,
        }
    }
}

impl Deref for TextKey<'_> {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl Borrow<str> for TextKey<'_> {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl fmt::Debug for TextKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

/// A `fmt::Write` into a fixed buffer; fails if it would overflow.
struct StackWriter {
    bytes: [u8; INLINE],
    len: usize,
}

impl fmt::Write for StackWriter {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let end = self.len + s.len();
        self.bytes
            .get_mut(self.len..end)
            .ok_or(fmt::Error)?
            .copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

/// A request without its body, as closures see it: borrowed from the request, nothing
/// cloned.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct RequestHead<'a> {
    /// The method.
    pub method: &'a Method,
    /// The URI.
    pub uri: &'a Uri,
    /// The HTTP version.
    pub version: Version,
    /// The headers.
    pub headers: &'a HeaderMap,
    /// The extensions: the connection's address, what earlier middleware stored.
    pub extensions: &'a Extensions,
}

impl<'a> RequestHead<'a> {
    /// The head of `req`.
    pub fn of<B>(req: &'a Request<B>) -> Self {
        Self {
            method: req.method(),
            uri: req.uri(),
            version: req.version(),
            headers: req.headers(),
            extensions: req.extensions(),
        }
    }
}

/// A key extractor for any key type, from a closure of the request's head: see
/// [`key_fn`].
#[derive(Clone)]
pub struct KeyFromFn<F>(F);

impl<F> fmt::Debug for KeyFromFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("KeyFromFn(..)")
    }
}

/// Keys requests by `f`, for a limiter of any key type (`None`: the request has no key).
/// This is the one way to key by a closure.
///
/// A text key (`String`, `Box<str>`, `Arc<str>`) passes the layer's
/// [`KeyLimits`]: an empty one is missing, and a longer one than
/// [`max_key_len`](super::RateLimitLayer::max_key_len) is rejected or hashed.
///
/// ```
/// use tollgate::http::{key_fn, RateLimitLayer, RequestHead};
/// use tollgate::RateLimiter;
///
/// #[derive(Clone, Copy)]
/// struct UserId(u64);
///
/// let limiter: RateLimiter<u64> = RateLimiter::new("100/min".parse()?);
/// let by_user = key_fn(|head: &RequestHead<'_>| head.extensions.get::<UserId>().map(|u| u.0));
/// let layer = RateLimitLayer::keyed(limiter, by_user);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn key_fn<K, F>(f: F) -> KeyFromFn<F>
where
    F: Fn(&RequestHead<'_>) -> Option<K> + Send + Sync + 'static,
{
    KeyFromFn(f)
}

impl<K, F> ExtractKey<K> for KeyFromFn<F>
where
    K: crate::Key + Clone,
    F: Fn(&RequestHead<'_>) -> Option<K> + Send + Sync + 'static,
{
    type Lookup = K;
    type Key<'r> = K;

    fn extract<B>(&self, req: &Request<B>, limits: &KeyLimits) -> Result<K, KeyRejection> {
        let key = (self.0)(&RequestHead::of(req)).ok_or(KeyRejection::Missing)?;
        limits.any(key)
    }
}

/// Whether `req` is a gRPC call (`content-type: application/grpc`, `+proto`, `+json`…).
pub(crate) fn is_grpc<B>(req: &http::Request<B>) -> bool {
    req.headers()
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_keys_are_checked_for_length_and_utf8() {
        let limits = KeyLimits {
            max_len: 8,
            oversized: OversizedKey::Reject,
        };
        assert_eq!(limits.text("abc").unwrap().as_str(), "abc");
        assert_eq!(limits.text("12345678").unwrap().as_str(), "12345678");
        assert_eq!(
            limits.text("123456789").unwrap_err(),
            KeyRejection::TooLong { len: 9, max: 8 }
        );
        assert_eq!(limits.text("").unwrap_err(), KeyRejection::Missing);
        assert_eq!(
            limits.bytes(&[0x66, 0xff]).unwrap_err(),
            KeyRejection::NotUtf8
        );
        assert_eq!(limits.bytes("€".as_bytes()).unwrap().as_str(), "€");
    }

    #[test]
    fn oversized_keys_hash_to_distinct_short_digests() {
        let limits = KeyLimits {
            max_len: 8,
            oversized: OversizedKey::Hash,
        };
        let long_a = "a".repeat(65_536);
        let mut long_b = long_a.clone();
        long_b.push('b');
        let a = limits.text(&long_a).unwrap();
        let b = limits.text(&long_b).unwrap();
        assert!(a.as_str().starts_with(DIGEST_PREFIX));
        assert_eq!(a.len(), 35);
        assert_ne!(a.as_str(), b.as_str());
        // The same key hashes the same way every time (and on every node).
        assert_eq!(limits.text(&long_a).unwrap().as_str(), a.as_str());
    }

    #[test]
    fn rejections_say_what_is_wrong() {
        assert!(KeyRejection::NotUtf8.to_string().contains("UTF-8"));
        assert!(
            KeyRejection::TooLong { len: 300, max: 256 }
                .to_string()
                .contains("300 bytes")
        );
    }
}
