//! A small xorshift generator (Marsaglia's 13/7/17), for jitter (the waiting API's random
//! extra wait and the sync's round schedule) and the stores' sampled eviction. Not for
//! anything that must be unpredictable.

#[cfg(any(feature = "redis", test))]
use std::time::Duration;

/// The generator's state: never zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct XorShift(u64);

impl XorShift {
    /// A generator seeded by `seed` (any value: a zero seed is made odd).
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed | 1)
    }

    /// The next draw.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in `[0.75·d, 1.25·d)` (`d·3/4` when `d` is under 2 ns).
    #[cfg(any(feature = "redis", test))]
    pub(crate) fn around(&mut self, d: Duration) -> Duration {
        let half = crate::clock::nanos(d / 2).max(1);
        d * 3 / 4 + Duration::from_nanos(self.next_u64() % half)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_never_stuck_and_stay_within_a_quarter() {
        let mut rng = XorShift::new(0);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..1_000 {
            assert!(seen.insert(rng.next_u64()), "a xorshift state repeated");
        }
        let d = Duration::from_millis(50);
        let (mut low, mut high) = (d, Duration::ZERO);
        for _ in 0..10_000 {
            let j = rng.around(d);
            assert!(j >= d * 3 / 4 && j < d * 5 / 4, "{j:?}");
            low = low.min(j);
            high = high.max(j);
        }
        // Spread over the whole range, not bunched: within 1% of each end.
        assert!(
            low < d * 76 / 100 && high > d * 124 / 100,
            "{low:?}..{high:?}"
        );
    }
}
