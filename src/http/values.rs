//! Header values made once and kept for the process's life, so that the headers of an
//! admitted response cost no allocation and no shared reference count.
//!
//! ```text
//! number(n)        n < 65,536 ─► NUMBERS[n]: OnceLock<&'static HeaderValue>  (lazily leaked)
//!                  larger     ─► made per response
//! interned(text)   ─► INTERNED: Mutex<HashMap<&'static [u8], &'static HeaderValue>>
//!                     at most 65,536 values; past that, None (the caller makes its own)
//! ```
//!
//! A value made here is a `HeaderValue` over static bytes: cloning it copies two words,
//! and dropping it does nothing. A clone of a value over shared bytes would bump an atomic
//! count instead (and write a cache line that every core serving requests shares).
//! Neither table is ever freed; their sizes are bounded: at most 65,536 numbers (about
//! 5 MiB if every one is used, plus a 1 MiB table of which only the pages used
//! become resident) and 65,536 interned fields (about 8 MiB at most: the `RateLimit` and
//! `RateLimit-Policy` values of the quotas in use; a layer made again reuses them).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use bytes::Bytes;
use http::HeaderValue;

/// Numbers below this get a value made once.
const NUMBERS: usize = 1 << 16;

/// The most values [`interned`] makes in a process.
const MAX_INTERNED: usize = 1 << 16;

/// A value over `bytes`, leaked for the process's life; `None` if they are not a valid
/// header value.
fn leak(bytes: &[u8]) -> Option<&'static HeaderValue> {
    HeaderValue::from_bytes(bytes).ok()?;
    let bytes: &'static [u8] = Box::leak(bytes.into());
    let value = HeaderValue::from_maybe_shared(Bytes::from_static(bytes)).ok()?;
    Some(Box::leak(Box::new(value)))
}

/// The value of `n`, made once for the process; `None` from 65,536 up.
pub(crate) fn number(n: u64) -> Option<&'static HeaderValue> {
    static TABLE: [OnceLock<&'static HeaderValue>; NUMBERS] = [const { OnceLock::new() }; NUMBERS];
    let cell = TABLE.get(usize::try_from(n).ok()?)?;
    if let Some(value) = cell.get() {
        return Some(value);
    }
    // Two threads that miss at once may each leak a value; one is kept. That happens at
    // most once per number and thread.
    let mut buf = [0u8; 20];
    let value = leak(digits(n, &mut buf))?;
    Some(cell.get_or_init(|| value))
}

/// The value of `n`: the one made once, or (from 65,536 up) a new one.
pub(crate) fn number_value(n: u64) -> HeaderValue {
    number(n).cloned().unwrap_or_else(|| HeaderValue::from(n))
}

/// The value of `text`, made once for the process and shared by every layer that asks
/// for the same text; `None` if `text` is not a valid header value, or once 65,536 values
/// are made.
pub(crate) fn interned(text: &[u8]) -> Option<&'static HeaderValue> {
    static INTERNED: OnceLock<Mutex<HashMap<&'static [u8], &'static HeaderValue>>> =
        OnceLock::new();
    let mut map = INTERNED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(value) = map.get(text) {
        return Some(value);
    }
    if map.len() >= MAX_INTERNED {
        return None;
    }
    let value = leak(text)?;
    map.insert(value.as_bytes(), value);
    Some(value)
}

/// The decimal digits of `n`, written at the end of `buf`.
fn digits(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        // `n % 10` is a digit: it fits a byte.
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[at..];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_made_once_and_read_as_their_digits() {
        for n in [0, 7, 10, 4_095, 4_096, 65_535] {
            let a = number(n).unwrap();
            assert_eq!(a, &n.to_string());
            assert!(std::ptr::eq(a, number(n).unwrap()), "{n} made twice");
        }
        assert_eq!(number(65_536), None);
        assert_eq!(number_value(65_536), "65536");
        assert_eq!(number_value(u64::MAX), &u64::MAX.to_string());
    }

    #[test]
    fn equal_texts_share_one_value_and_bad_ones_get_none() {
        let a = interned(br#""default";r=3;t=1"#).unwrap();
        let b = interned(br#""default";r=3;t=1"#.to_vec().as_slice()).unwrap();
        assert!(std::ptr::eq(a, b));
        assert_eq!(a, r#""default";r=3;t=1"#);
        assert_eq!(interned(b"bad\nvalue"), None);
    }
}
