//! `hash_keys`: Redis key names that hold a keyed digest of each user key instead of the
//! key itself, so that API keys and tokens used as limiter keys never reach Redis.

use std::fmt;

/// The context string that turns a caller's secret into the digest's key (BLAKE3's key
/// derivation mode): a secret used elsewhere yields unrelated digests here.
const CONTEXT: &str = "tollgate 2026-11-30 redis key digest v1";

/// The keyed hash (BLAKE3, 128-bit output as 32 hex digits) of user keys. It keeps only
/// the derived key, never the secret, and shows neither in `Debug`.
#[derive(Clone)]
pub(crate) struct KeyHasher {
    key: [u8; 32],
}

impl fmt::Debug for KeyHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("KeyHasher(<redacted>)")
    }
}

impl KeyHasher {
    pub(crate) fn new(secret: &[u8]) -> Self {
        Self {
            key: blake3::derive_key(CONTEXT, secret),
        }
    }

    /// Appends `h:` and the digest of `key` in lowercase hex to `out`.
    pub(crate) fn write(&self, key: &[u8], out: &mut Vec<u8>) {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let digest = blake3::keyed_hash(&self.key, key);
        out.extend_from_slice(b"h:");
        for &byte in &digest.as_bytes()[..16] {
            out.push(HEX[usize::from(byte >> 4)]);
            out.push(HEX[usize::from(byte & 15)]);
        }
    }
}

/// Appends the part of a Redis key that names `key`, which goes between the braces of
/// its hash tag: the key itself or, with a hasher, its digest.
///
/// Redis Cluster hashes a key name only up to the first `}` after its first `{`, so a
/// `}` in the key would end the tag early (`x}1`, `x}2` and `x` would share one slot, and
/// a client choosing keys could pin any number of them to one master). It is written
/// `%7D`, and `%` itself `%25`, so that the tag is always the whole key and distinct keys
/// keep distinct names; a key with neither is written as it is.
pub(crate) fn write_key(hasher: Option<&KeyHasher>, key: &[u8], out: &mut Vec<u8>) {
    match hasher {
        Some(h) => h.write(key, out),
        None if !key.iter().any(|&b| b == b'}' || b == b'%') => out.extend_from_slice(key),
        None => {
            for &byte in key {
                match byte {
                    b'}' => out.extend_from_slice(b"%7D"),
                    b'%' => out.extend_from_slice(b"%25"),
                    other => out.push(other),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(secret: &[u8], key: &str) -> String {
        let mut out = Vec::new();
        KeyHasher::new(secret).write(key.as_bytes(), &mut out);
        String::from_utf8(out).unwrap()
    }

    fn written(key: &str) -> String {
        let mut out = Vec::new();
        write_key(None, key.as_bytes(), &mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn a_closing_brace_cannot_end_the_hash_tag_and_names_stay_distinct() {
        assert_eq!(written("user_1024"), "user_1024");
        assert_eq!(written("x}1"), "x%7D1");
        assert_eq!(written("%7D"), "%257D");
        assert_eq!(written("a{b}c%"), "a{b%7Dc%25");
        let keys = ["x", "x}", "x%7D", "x%", "x%25", "}", "%", "", "}}", "%%"];
        let names: std::collections::HashSet<String> = keys.iter().map(|k| written(k)).collect();
        assert_eq!(names.len(), keys.len(), "two keys share a name");
        assert!(names.iter().all(|n| !n.contains('}')));
    }

    #[test]
    fn digests_are_stable_keyed_and_hide_the_key() {
        let a = digest(b"secret", "Bearer sk_live_123");
        assert_eq!(a.len(), 2 + 32);
        assert!(a.starts_with("h:"));
        assert!(!a.contains("sk_live"));
        assert_eq!(a, digest(b"secret", "Bearer sk_live_123"), "stable");
        assert_ne!(a, digest(b"other", "Bearer sk_live_123"), "keyed");
        assert_ne!(a, digest(b"secret", "Bearer sk_live_124"));
        let debug = format!("{:?}", KeyHasher::new(b"secret"));
        assert!(!debug.contains("secret"), "{debug}");
    }
}
