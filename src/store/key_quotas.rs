//! Keys with a quota of their own, as both stores keep them per shard: a hash set with a
//! one-hash Bloom filter in front, so that a check on any other key costs one bit test.
//! The locked store keeps its set under the shard's lock; the lock-free store publishes an
//! immutable copy with each table (its keys behind an `Arc`, shared by the copies).

use hashbrown::HashTable;

use super::hash::spread;
use super::{FILTER_WORDS, filter_bit};
use crate::algorithm::Policy;

/// A key (or the `Arc` that shares it) and its own policy.
#[derive(Clone)]
struct KeyQuota<H, P> {
    key: H,
    policy: P,
}

/// The keys of one shard with their own policy, `H` holding each key.
#[derive(Clone)]
pub(crate) struct KeyQuotas<H, P> {
    map: HashTable<KeyQuota<H, P>>,
    /// Bit [`filter_bit`] of each key's hash: a clear bit means no quota of its own.
    bits: [u64; FILTER_WORDS],
}

impl<H, P> KeyQuotas<H, P> {
    pub(crate) fn new() -> Self {
        Self {
            map: HashTable::new(),
            bits: [0; FILTER_WORDS],
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The policy of the key whose hash is `hash` and which `is_key` recognises, if it
    /// has one of its own.
    #[inline]
    pub(crate) fn get(&self, hash: u64, is_key: impl Fn(&H) -> bool) -> Option<&P> {
        let (word, bit) = filter_bit(hash);
        if self.bits[word] & bit == 0 {
            return None;
        }
        self.map
            .find(spread(hash), |o| is_key(&o.key))
            .map(|o| &o.policy)
    }

    /// Follows a change of the default policy to `default` (see [`Policy::rebase`]).
    pub(crate) fn rebase(&mut self, default: &P)
    where
        P: Policy,
    {
        for o in self.map.iter_mut() {
            o.policy = o.policy.rebase(default);
        }
    }

    /// Runs `f` on every key's policy.
    pub(crate) fn for_each_policy(&mut self, mut f: impl FnMut(&mut P)) {
        for o in self.map.iter_mut() {
            f(&mut o.policy);
        }
    }

    /// Gives `key` (whose hash is `hash`) its own `policy`, or takes it away (`None`).
    /// `same` compares two held keys; `rehash` gives any held key's hash.
    pub(crate) fn set(
        &mut self,
        hash: u64,
        key: H,
        policy: Option<P>,
        same: impl Fn(&H, &H) -> bool,
        rehash: impl Fn(&H) -> u64,
    ) {
        let is_key = |held: &H| same(held, &key);
        match (self.map.find_mut(spread(hash), |o| is_key(&o.key)), policy) {
            (Some(o), Some(policy)) => o.policy = policy,
            (Some(_), None) => {
                if let Ok(o) = self.map.find_entry(spread(hash), |o| is_key(&o.key)) {
                    o.remove();
                }
                // Rebuild the filter from the keys that remain.
                self.bits = [0; FILTER_WORDS];
                for o in self.map.iter() {
                    let (word, bit) = filter_bit(rehash(&o.key));
                    self.bits[word] |= bit;
                }
            }
            (None, Some(policy)) => {
                let quota = KeyQuota { key, policy };
                self.map
                    .insert_unique(spread(hash), quota, |o| spread(rehash(&o.key)));
                let (word, bit) = filter_bit(hash);
                self.bits[word] |= bit;
            }
            (None, None) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys whose hash is the key itself (so filter bits and buckets can be chosen).
    fn quotas() -> KeyQuotas<u64, u32> {
        KeyQuotas::new()
    }

    #[test]
    fn set_get_replace_and_remove_keep_the_filter_exact() {
        let mut q = quotas();
        let id = |k: &u64| *k;
        let same = |a: &u64, b: &u64| a == b;
        // Keys in filter bits 1 and 2 (bits 40‥50 of the hash, here the key itself).
        let (a, b) = ((1 << 40) | 7, (2 << 40) | 9);
        assert!(q.is_empty() && q.get(a, |k| *k == a).is_none());
        q.set(a, a, Some(1), same, id);
        q.set(b, b, Some(2), same, id);
        assert_eq!(q.get(a, |k| *k == a), Some(&1));
        assert_eq!(q.get(b, |k| *k == b), Some(&2));
        // Another key in a's filter bit is not confused with a.
        let twin = (1 << 63) | a;
        assert_eq!(filter_bit(twin), filter_bit(a));
        assert_eq!(q.get(twin, |k| *k == twin), None);
        q.set(a, a, Some(3), same, id);
        assert_eq!(q.get(a, |k| *k == a), Some(&3));
        // Removing a clears its bit (no other key shares it): lookups stop there.
        q.set(a, a, None, same, id);
        assert_eq!(q.get(a, |k| *k == a), None);
        let (word, bit) = filter_bit(a);
        assert_eq!(q.bits[word] & bit, 0);
        assert_eq!(q.get(b, |k| *k == b), Some(&2));
        q.set(b, b, None, same, id);
        assert!(q.is_empty());
        assert!(q.bits.iter().all(|w| *w == 0));
        // Removing a key that has no quota changes nothing.
        q.set(5, 5, None, same, id);
        assert!(q.is_empty());
    }
}
