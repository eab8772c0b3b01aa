//! A slot's state word: one `u64` ([`AtomicU64`]), or two `u64` states changed together by
//! one 16-byte compare-and-swap ([`AtomicPair`]), for a key held to two quotas at once.
//!
//! The table's protocol (see the [parent module](super)) reads only a value's
//! [`head`](Atom::head): the `u64` that is `EMPTY`, `REMOVED`, `FROZEN` or a live state.
//! A pair's head is its first state; its second state rides along, written and read in
//! the same atomic operations, so every step of the protocol holds for the pair exactly as
//! for one word.

use super::sync::{AtomicU64, Ordering};
use super::{EMPTY, STATE_MAX};

/// A slot's atomic state word.
///
/// # Safety
/// All-zero bytes are a valid value of the implementing type, equal to
/// [`empty`](Atom::empty): its head is `EMPTY` (a table's slots come from a zeroed
/// allocation).
pub(crate) unsafe trait Atom: Send + Sync + 'static {
    /// A state, or a marker in the head.
    type Value: Copy + Eq + std::fmt::Debug + Send + Sync + 'static;

    /// A word whose head is `EMPTY`.
    fn empty() -> Self;
    /// The `u64` the protocol reads: `EMPTY`, `REMOVED`, `FROZEN` or a live state.
    fn head(value: Self::Value) -> u64;
    /// A value whose head is `marker` (the rest zero).
    fn marker(marker: u64) -> Self::Value;
    /// Every state of `value` clamped to [`STATE_MAX`], so a live value never reads as
    /// a marker.
    fn clamp(value: Self::Value) -> Self::Value;
    fn load(&self, order: Ordering) -> Self::Value;
    fn store(&self, value: Self::Value, order: Ordering);
    fn compare_exchange(
        &self,
        current: Self::Value,
        new: Self::Value,
        success: Ordering,
        failure: Ordering,
    ) -> Result<Self::Value, Self::Value>;
    /// [`compare_exchange`](Self::compare_exchange), allowed to fail spuriously (which
    /// costs a loop nothing, and saves one on machines with load-linked stores).
    fn compare_exchange_weak(
        &self,
        current: Self::Value,
        new: Self::Value,
        success: Ordering,
        failure: Ordering,
    ) -> Result<Self::Value, Self::Value> {
        self.compare_exchange(current, new, success, failure)
    }
    /// Writes the word without changing it, so the kernel maps its page for writing
    /// (see the parent module's `touch`).
    fn touch(&self);
}

/// A word is stored inverted, so that all-zero bytes are `EMPTY` (`u64::MAX`).
#[inline(always)]
const fn stored(word: u64) -> u64 {
    !word
}

// SAFETY: an `AtomicU64` of 0 is a valid value, and stores `!0 = EMPTY`.
unsafe impl Atom for AtomicU64 {
    type Value = u64;

    fn empty() -> Self {
        AtomicU64::new(stored(EMPTY))
    }

    #[inline(always)]
    fn head(value: u64) -> u64 {
        value
    }

    #[inline(always)]
    fn marker(marker: u64) -> u64 {
        marker
    }

    #[inline(always)]
    fn clamp(value: u64) -> u64 {
        value.min(STATE_MAX)
    }

    #[inline(always)]
    fn load(&self, order: Ordering) -> u64 {
        stored(AtomicU64::load(self, order))
    }

    #[inline(always)]
    fn store(&self, value: u64, order: Ordering) {
        AtomicU64::store(self, stored(value), order);
    }

    #[inline(always)]
    fn compare_exchange(
        &self,
        current: u64,
        new: u64,
        success: Ordering,
        failure: Ordering,
    ) -> Result<u64, u64> {
        AtomicU64::compare_exchange(self, stored(current), stored(new), success, failure)
            .map(stored)
            .map_err(stored)
    }

    #[inline(always)]
    fn compare_exchange_weak(
        &self,
        current: u64,
        new: u64,
        success: Ordering,
        failure: Ordering,
    ) -> Result<u64, u64> {
        AtomicU64::compare_exchange_weak(self, stored(current), stored(new), success, failure)
            .map(stored)
            .map_err(stored)
    }

    fn touch(&self) {
        // An opaque 0: an add of a constant 0 may compile to a fenced load, which maps
        // the shared zero page instead of writing.
        self.fetch_add(std::hint::black_box(0), Ordering::Relaxed);
    }
}

/// Two states, the head first, as one value.
pub(crate) type Two = [u64; 2];

/// The 16-byte word of a key held to two quotas: both states change in one
/// compare-and-swap, so a check decides the pair all or nothing with no refund, and a
/// migration freezes both at once.
///
/// On x86-64, `lock cmpxchg16b` and `vmovdqa` (atomic for an aligned 16 bytes on every
/// CPU with AVX, by Intel's and AMD's manuals), inline: a check makes no call for its
/// word. Elsewhere, portable-atomic's `AtomicU128` (also on x86-64 under `--cfg
/// tollgate_portable_pair`, which ./scripts/test.sh runs the store's and the engine's
/// tests under, so that this path is tested here too). Usable only where
/// [`lock_free`](Self::lock_free) says so; [`PairPolicy`](crate::store::rule::PairPolicy)s,
/// the only users, are made only then.
#[repr(C, align(16))]
pub(crate) struct AtomicPair(Bits);

#[cfg(all(
    target_arch = "x86_64",
    not(tollgate_portable_pair),
    not(tollgate_loom)
))]
type Bits = std::cell::UnsafeCell<u128>;

#[cfg(all(
    any(not(target_arch = "x86_64"), tollgate_portable_pair),
    not(tollgate_loom)
))]
type Bits = portable_atomic::AtomicU128;

/// Under loom, whose atomics stop at 64 bits: a loom mutex over the value, which loom
/// explores as one atomic step.
#[cfg(tollgate_loom)]
type Bits = super::sync::Mutex<u128>;

#[cfg(all(
    target_arch = "x86_64",
    not(tollgate_portable_pair),
    not(tollgate_loom)
))]
// SAFETY: every access to the bits goes through the atomic instructions below (an
// aligned `vmovdqa` load or store, `lock cmpxchg16b`), so sharing them between threads is
// sound. (portable-atomic's `AtomicU128` and loom's mutex are `Sync` themselves.)
unsafe impl Sync for AtomicPair {}

impl AtomicPair {
    /// The bits stored for `value`: the head inverted (so zero is `EMPTY`), the second
    /// state as it is.
    #[inline(always)]
    fn pack(value: Two) -> u128 {
        u128::from(stored(value[0])) | u128::from(value[1]) << 64
    }

    #[inline(always)]
    fn unpack(bits: u128) -> Two {
        [stored(bits as u64), (bits >> 64) as u64]
    }
}

#[cfg(all(
    target_arch = "x86_64",
    not(tollgate_portable_pair),
    not(tollgate_loom)
))]
impl AtomicPair {
    /// Whether this CPU has `cmpxchg16b` and AVX (detected once, then a cached flag).
    pub(crate) fn lock_free() -> bool {
        std::arch::is_x86_feature_detected!("cmpxchg16b")
            && std::arch::is_x86_feature_detected!("avx")
    }

    fn with_bits(bits: u128) -> Self {
        Self(std::cell::UnsafeCell::new(bits))
    }

    /// An atomic 16-byte load. Ordered as an x86 load (acquire), and a compiler barrier.
    #[inline(always)]
    fn load_bits(&self) -> u128 {
        let (lo, hi): (u64, u64);
        // SAFETY: the pointer is to 16 aligned bytes (`align(16)`) alive for `&self`.
        // `vmovdqa` of an aligned 16 bytes is one atomic access on the CPUs with AVX,
        // which `lock_free` requires before any pair exists (a CPU without it would
        // raise #UD: the process dies of SIGILL, touching nothing). The block may read
        // and write memory as far as the compiler knows, so nothing moves across it.
        unsafe {
            std::arch::asm!(
                "vmovdqa {x}, xmmword ptr [{p}]",
                "vmovq {lo}, {x}",
                "vpextrq {hi}, {x}, 1",
                p = in(reg) self.0.get(),
                x = out(xmm_reg) _,
                lo = out(reg) lo,
                hi = out(reg) hi,
                options(nostack, preserves_flags),
            );
        }
        u128::from(lo) | u128::from(hi) << 64
    }

    /// An atomic 16-byte store (release, as every x86 store).
    #[inline(always)]
    fn store_bits(&self, bits: u128) {
        // SAFETY: as in `load_bits`: an aligned `vmovdqa` store is one atomic access on
        // the CPUs `lock_free` admits.
        unsafe {
            std::arch::asm!(
                "vmovq {x}, {lo}",
                "vpinsrq {x}, {x}, {hi}, 1",
                "vmovdqa xmmword ptr [{p}], {x}",
                p = in(reg) self.0.get(),
                x = out(xmm_reg) _,
                lo = in(reg) bits as u64,
                hi = in(reg) (bits >> 64) as u64,
                options(nostack, preserves_flags),
            );
        }
    }

    /// `lock cmpxchg16b`: replaces `current` with `new`; the bits it held either way.
    /// A full barrier. It writes the line even when it fails, with the bits it read.
    #[inline(always)]
    fn cas_bits(&self, current: u128, new: u128) -> Result<u128, u128> {
        let (lo, hi): (u64, u64);
        let swapped: u8;
        // SAFETY: the pointer is to 16 aligned bytes alive for `&self`, and
        // `cmpxchg16b` exists on every CPU `lock_free` admits. `rbx`, which the
        // instruction reads and LLVM reserves, is swapped in from a scratch register and
        // restored before the block ends; the pointer is pinned to `rdi`, so it is never
        // allocated to `rbx`.
        unsafe {
            std::arch::asm!(
                "xchg {new_lo}, rbx",
                "lock cmpxchg16b xmmword ptr [rdi]",
                "sete {swapped}",
                "mov rbx, {new_lo}",
                in("rdi") self.0.get(),
                new_lo = inout(reg) new as u64 => _,
                swapped = out(reg_byte) swapped,
                in("rcx") (new >> 64) as u64,
                inout("rax") current as u64 => lo,
                inout("rdx") (current >> 64) as u64 => hi,
                options(nostack),
            );
        }
        let held = u128::from(lo) | u128::from(hi) << 64;
        if swapped != 0 { Ok(held) } else { Err(held) }
    }
}

#[cfg(all(
    any(not(target_arch = "x86_64"), tollgate_portable_pair),
    not(tollgate_loom)
))]
impl AtomicPair {
    /// Whether this machine has lock-free 16-byte atomics (portable-atomic detects it).
    pub(crate) fn lock_free() -> bool {
        portable_atomic::AtomicU128::is_lock_free()
    }

    fn with_bits(bits: u128) -> Self {
        Self(portable_atomic::AtomicU128::new(bits))
    }

    #[inline(always)]
    fn load_bits(&self) -> u128 {
        self.0.load(Ordering::Acquire)
    }

    #[inline(always)]
    fn store_bits(&self, bits: u128) {
        self.0.store(bits, Ordering::Release);
    }

    #[inline(always)]
    fn cas_bits(&self, current: u128, new: u128) -> Result<u128, u128> {
        self.0
            .compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
    }
}

#[cfg(tollgate_loom)]
impl AtomicPair {
    pub(crate) fn lock_free() -> bool {
        true
    }

    fn with_bits(bits: u128) -> Self {
        Self(super::sync::Mutex::new(bits))
    }

    fn load_bits(&self) -> u128 {
        *super::sync::lock(&self.0)
    }

    fn store_bits(&self, bits: u128) {
        *super::sync::lock(&self.0) = bits;
    }

    fn cas_bits(&self, current: u128, new: u128) -> Result<u128, u128> {
        let mut bits = super::sync::lock(&self.0);
        if *bits == current {
            *bits = new;
            Ok(current)
        } else {
            Err(*bits)
        }
    }
}

// SAFETY: `AtomicPair` is 16 bytes of `u128` (in an `UnsafeCell`, or portable-atomic's
// `AtomicU128`, itself a `u128` in an `UnsafeCell`): zero is a valid value, and zero bits
// unpack to a head of `!0 = EMPTY`. (Under loom, tables are built value by value from
// `empty`, never from zeroed bytes.)
unsafe impl Atom for AtomicPair {
    type Value = Two;

    fn empty() -> Self {
        Self::with_bits(Self::pack([EMPTY, 0]))
    }

    #[inline(always)]
    fn head(value: Two) -> u64 {
        value[0]
    }

    #[inline(always)]
    fn marker(marker: u64) -> Two {
        [marker, 0]
    }

    #[inline(always)]
    fn clamp(value: Two) -> Two {
        [value[0].min(STATE_MAX), value[1].min(STATE_MAX)]
    }

    /// Every access is as strong as x86's (acquire loads, release stores, sequentially
    /// consistent compare-and-swaps), whatever `order` asks.
    #[inline(always)]
    fn load(&self, _order: Ordering) -> Two {
        Self::unpack(self.load_bits())
    }

    #[inline(always)]
    fn store(&self, value: Two, _order: Ordering) {
        self.store_bits(Self::pack(value));
    }

    #[inline(always)]
    fn compare_exchange(
        &self,
        current: Two,
        new: Two,
        _: Ordering,
        _: Ordering,
    ) -> Result<Two, Two> {
        self.cas_bits(Self::pack(current), Self::pack(new))
            .map(Self::unpack)
            .map_err(Self::unpack)
    }

    /// A compare-and-swap of 0 for 0: it changes nothing (the bits are 0 and stay so, or
    /// are not 0 and are written back as they were), but a locked instruction always
    /// writes, which maps the page for writing. Never a load and a store: checks may be
    /// changing the word meanwhile.
    fn touch(&self) {
        let _ = self.cas_bits(0, 0);
    }
}

#[cfg(all(test, not(tollgate_loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_zeroed_pair_is_empty_and_values_round_trip() {
        assert!(
            AtomicPair::lock_free(),
            "this machine has cmpxchg16b and AVX"
        );
        // SAFETY: `Atom`'s contract: all-zero bytes are a valid `AtomicPair`.
        let zero: AtomicPair = unsafe { std::mem::zeroed() };
        assert_eq!(AtomicPair::head(zero.load(Ordering::Acquire)), EMPTY);
        let pair = AtomicPair::empty();
        assert_eq!(pair.load(Ordering::Acquire), [EMPTY, 0]);
        pair.store([5, u64::MAX], Ordering::Release);
        assert_eq!(pair.load(Ordering::Acquire), [5, u64::MAX]);
        // A failed swap changes nothing and says what the word holds.
        assert_eq!(
            pair.compare_exchange([5, 0], [6, 6], Ordering::AcqRel, Ordering::Acquire),
            Err([5, u64::MAX])
        );
        assert_eq!(
            pair.compare_exchange([0, u64::MAX], [6, 6], Ordering::AcqRel, Ordering::Acquire),
            Err([5, u64::MAX])
        );
        assert_eq!(
            pair.compare_exchange([5, u64::MAX], [6, 7], Ordering::AcqRel, Ordering::Acquire),
            Ok([5, u64::MAX])
        );
        assert_eq!(pair.load(Ordering::Acquire), [6, 7]);
        // Touching writes the value back as it is, zero or not.
        pair.touch();
        assert_eq!(pair.load(Ordering::Acquire), [6, 7]);
        zero.touch();
        assert_eq!(AtomicPair::head(zero.load(Ordering::Acquire)), EMPTY);
        assert_eq!(
            AtomicPair::clamp([u64::MAX, u64::MAX]),
            [STATE_MAX, STATE_MAX]
        );
    }

    /// Two threads move both halves of one word together, each by compare-and-swap,
    /// while a third loads it: every load sees halves that belong together (never half
    /// of one write and half of another), and no increment is lost.
    #[test]
    fn both_halves_change_together_under_contention() {
        const ROUNDS: u64 = 200_000;
        let pair = AtomicPair::empty();
        pair.store([0, 0], Ordering::Release);
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    for _ in 0..ROUNDS {
                        let mut seen = pair.load(Ordering::Acquire);
                        loop {
                            let next = [seen[0] + 1, seen[1].wrapping_sub(1)];
                            match pair.compare_exchange_weak(
                                seen,
                                next,
                                Ordering::AcqRel,
                                Ordering::Acquire,
                            ) {
                                Ok(_) => break,
                                Err(actual) => seen = actual,
                            }
                        }
                    }
                });
            }
            s.spawn(|| {
                let mut loads = 0u64;
                while !done.load(std::sync::atomic::Ordering::Relaxed) || loads == 0 {
                    let [up, down] = pair.load(Ordering::Acquire);
                    assert_eq!(up.wrapping_add(down), 0, "a torn load: {up}, {down}");
                    loads += 1;
                }
            });
            // The loader stops once both writers are done.
            while pair.load(Ordering::Acquire)[0] < 2 * ROUNDS {
                std::hint::spin_loop();
            }
            done.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        assert_eq!(
            pair.load(Ordering::Acquire),
            [2 * ROUNDS, (2 * ROUNDS).wrapping_neg()]
        );
    }
}
