//! One key's slots: how many are held, its maximum, and the callers waiting in line.
//!
//! ```text
//! state: AtomicU64 = [ 30 unused | TOUCHED | QUEUED | in flight: 32 bits ]
//! max:   AtomicU64 = [ 31 unused | OVERRIDE | maximum: 32 bits ]
//! queue: Mutex<VecDeque<(weight, Grant)>>   only while someone waits
//! ```
//!
//! A caller takes `n` slots with one CAS that adds `n` to the count if it stays within
//! the maximum and nobody waits in line (`QUEUED` clear): waiting callers are served in
//! arrival order, and a newcomer never passes them. A release subtracts with one
//! `fetch_sub`; only if `QUEUED` was set does it lock the queue and hand the freed slots
//! to the callers at its head, in order, for as long as they fit.
//!
//! The queue's mutex orders every change of `QUEUED`: a waiter sets it (or takes the
//! slots, if they fit and the queue is empty) with a CAS made under the mutex, and the
//! mutex's holder clears it when the queue drains. A release either comes before the
//! waiter's CAS (which then sees the slots free) or after it (and then sees `QUEUED`), so
//! no wake-up is lost.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Waker;

use parking_lot::Mutex;

/// The in-flight count's bits of [`Slot::state`].
const COUNT: u64 = 0xffff_ffff;
/// Set while the queue holds a waiter.
const QUEUED: u64 = 1 << 32;
/// Set by every acquire, cleared by a sweep that keeps the key: a key idle at a sweep
/// goes only if it was not touched since the one before (a second chance).
const TOUCHED: u64 = 1 << 33;
/// Set in [`Slot::max`] when the maximum is the key's own, not the limiter's default.
const OVERRIDE: u64 = 1 << 32;

/// Why slots could not be taken now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The key's slots are taken (or callers wait in line before this one).
    Full { in_flight: u32, max: u32 },
    /// More slots than the key's maximum: no release would ever let it in.
    NeverFits { max: u32 },
}

/// One key's slots.
pub(crate) struct Slot {
    state: AtomicU64,
    max: AtomicU64,
    queue: Mutex<VecDeque<Waiter>>,
}

/// A caller waiting in a key's line.
struct Waiter {
    weight: u32,
    grant: Arc<Grant>,
}

/// What a waiting caller and the releases that serve it share.
pub(crate) struct Grant {
    inner: Mutex<GrantState>,
}

#[derive(Default)]
struct GrantState {
    /// Its slots were taken for it: they are its caller's, to use or give back.
    granted: bool,
    /// Its caller gave up (before any grant).
    cancelled: bool,
    waker: Option<Waker>,
}

/// What [`Slot::enqueue`] did.
pub(crate) enum Queued {
    /// The slots were free and the line empty: they are taken.
    Taken,
    /// In line: the grant says when the slots are taken.
    Waiting(Arc<Grant>),
}

impl Slot {
    /// A key with nothing in flight, of maximum `max` (`is_override`: the key's own).
    pub(crate) fn new(max: u32, is_override: bool) -> Self {
        Self {
            state: AtomicU64::new(0),
            max: AtomicU64::new(pack_max(max, is_override)),
            queue: Mutex::new(VecDeque::new()),
        }
    }

    /// The key's maximum now.
    #[inline(always)]
    pub(crate) fn max(&self) -> u32 {
        (self.max.load(Ordering::Relaxed) & COUNT) as u32
    }

    /// Whether the maximum is the key's own.
    pub(crate) fn has_override(&self) -> bool {
        self.max.load(Ordering::Relaxed) & OVERRIDE != 0
    }

    /// The slots held now.
    pub(crate) fn in_flight(&self) -> u32 {
        (self.state.load(Ordering::Acquire) & COUNT) as u32
    }

    /// Whether nothing is held and nobody waits: dropping the key changes nothing.
    #[cfg(test)]
    fn is_idle(&self) -> bool {
        self.state.load(Ordering::Acquire) & (COUNT | QUEUED) == 0
    }

    /// For a sweep (under the shard's write lock, so no acquire runs): whether the key
    /// may go, being idle and (unless `force`) untouched since the last sweep; clears
    /// the touch of a key that stays.
    pub(crate) fn sweepable(&self, force: bool) -> bool {
        let state = self.state.fetch_and(!TOUCHED, Ordering::AcqRel);
        state & (COUNT | QUEUED) == 0 && (force || state & TOUCHED == 0)
    }

    /// Takes `weight` slots if they fit and nobody waits in line.
    ///
    /// # Locking behaviour
    /// Takes no lock: a load and a CAS.
    #[inline(always)]
    pub(crate) fn try_take(&self, weight: u32) -> Result<(), Refusal> {
        let max = self.max();
        let weight64 = u64::from(weight);
        let mut state = self.state.load(Ordering::Relaxed);
        loop {
            let in_flight = state & COUNT;
            if state & QUEUED != 0 || in_flight + weight64 > u64::from(max) {
                return Err(self.refusal(weight, in_flight as u32, max));
            }
            match self.state.compare_exchange_weak(
                state,
                (state + weight64) | TOUCHED,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(()),
                Err(now) => state = now,
            }
        }
    }

    #[cold]
    fn refusal(&self, weight: u32, in_flight: u32, max: u32) -> Refusal {
        if weight > max {
            Refusal::NeverFits { max }
        } else {
            Refusal::Full { in_flight, max }
        }
    }

    /// Gives back `weight` slots, and serves the line if anyone waits in it.
    ///
    /// # Locking behaviour
    /// A `fetch_sub`; the key's queue mutex only if callers wait.
    #[inline(always)]
    pub(crate) fn release(&self, weight: u32) {
        let before = self.state.fetch_sub(u64::from(weight), Ordering::Release);
        debug_assert!(
            before & COUNT >= u64::from(weight),
            "released more than held"
        );
        if before & QUEUED != 0 {
            self.serve();
        }
    }

    /// Takes `weight` slots now if they fit and the line is empty, or joins the line.
    /// The caller checked that `weight <= max` a moment ago; if the maximum has since
    /// dropped below it, the waiter stays in line until it rises again or it gives up.
    pub(crate) fn enqueue(&self, weight: u32) -> Queued {
        let mut queue = self.queue.lock();
        let weight64 = u64::from(weight);
        let mut state = self.state.load(Ordering::Acquire);
        loop {
            let fits = (state & COUNT) + weight64 <= u64::from(self.max());
            let next = if queue.is_empty() && fits {
                (state + weight64) | TOUCHED
            } else {
                state | QUEUED | TOUCHED
            };
            match self
                .state
                .compare_exchange_weak(state, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) if next & QUEUED == 0 => return Queued::Taken,
                Ok(_) => break,
                Err(now) => state = now,
            }
        }
        let grant = Arc::new(Grant {
            inner: Mutex::new(GrantState::default()),
        });
        queue.push_back(Waiter {
            weight,
            grant: Arc::clone(&grant),
        });
        drop(queue);
        // A release between the CAS and the push found the queue locked, and served it
        // after the push; nothing else to do.
        Queued::Waiting(grant)
    }

    /// A waiter that gives up: out of the line, unless its slots were already taken for
    /// it, in which case they are given back (and the line served with them).
    pub(crate) fn cancel(&self, grant: &Arc<Grant>, weight: u32) {
        let mut queue = self.queue.lock();
        let mut state = grant.inner.lock();
        if state.granted {
            drop(state);
            drop(queue);
            self.release(weight);
            return;
        }
        state.cancelled = true;
        drop(state);
        let at = queue.iter().position(|w| Arc::ptr_eq(&w.grant, grant));
        if let Some(at) = at {
            queue.remove(at);
        }
        // Its leaving may let those behind it in (a heavy waiter at the head blocks
        // lighter ones), or empty the line.
        self.serve_locked(&mut queue);
    }

    /// Serves the line: see [`serve_locked`](Self::serve_locked).
    #[cold]
    #[inline(never)]
    pub(crate) fn serve(&self) {
        let mut queue = self.queue.lock();
        self.serve_locked(&mut queue);
    }

    /// Hands free slots to the waiters at the head of the line, in order, while they fit;
    /// clears `QUEUED` once the line is empty.
    fn serve_locked(&self, queue: &mut VecDeque<Waiter>) {
        while let Some(head) = queue.front() {
            let weight = u64::from(head.weight);
            let max = u64::from(self.max());
            let mut state = self.state.load(Ordering::Acquire);
            let taken = loop {
                if (state & COUNT) + weight > max {
                    break false;
                }
                match self.state.compare_exchange_weak(
                    state,
                    state + weight,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => break true,
                    Err(now) => state = now,
                }
            };
            if !taken {
                return;
            }
            let head = queue.pop_front().expect("the head was just read");
            if !head.grant.give() {
                // Cancelled: a canceller removes itself under this mutex, so this is
                // only defensive. The slots go back; the loop goes on with the next.
                self.state.fetch_sub(weight, Ordering::Release);
            }
        }
        self.state.fetch_and(!QUEUED, Ordering::AcqRel);
    }

    /// Sets the maximum (`is_override`: the key's own); a rise serves the line.
    pub(crate) fn set_max(&self, max: u32, is_override: bool) {
        let before = self.max.swap(pack_max(max, is_override), Ordering::AcqRel);
        if (before & COUNT) < u64::from(max) && self.state.load(Ordering::Acquire) & QUEUED != 0 {
            self.serve();
        }
    }

    /// Callers waiting in line now.
    pub(crate) fn waiting(&self) -> usize {
        if self.state.load(Ordering::Acquire) & QUEUED == 0 {
            return 0;
        }
        self.queue.lock().len()
    }
}

fn pack_max(max: u32, is_override: bool) -> u64 {
    u64::from(max) | if is_override { OVERRIDE } else { 0 }
}

impl Grant {
    /// Marks the grant given and wakes its caller; false if the caller gave up.
    fn give(&self) -> bool {
        let mut state = self.inner.lock();
        if state.cancelled {
            return false;
        }
        state.granted = true;
        let waker = state.waker.take();
        drop(state);
        if let Some(waker) = waker {
            waker.wake();
        }
        true
    }

    /// Whether the slots were taken for the caller; if not, remembers `waker`.
    pub(crate) fn poll_granted(&self, waker: &Waker) -> bool {
        let mut state = self.inner.lock();
        if state.granted {
            return true;
        }
        match &state.waker {
            Some(w) if w.will_wake(waker) => {}
            _ => state.waker = Some(waker.clone()),
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noop_waker() -> Waker {
        Waker::noop().clone()
    }

    #[test]
    fn slots_are_taken_up_to_the_maximum_and_given_back() {
        let slot = Slot::new(3, false);
        slot.try_take(2).unwrap();
        slot.try_take(1).unwrap();
        assert_eq!(
            slot.try_take(1),
            Err(Refusal::Full {
                in_flight: 3,
                max: 3
            })
        );
        assert_eq!(slot.try_take(4), Err(Refusal::NeverFits { max: 3 }));
        slot.release(2);
        assert_eq!(slot.in_flight(), 1);
        slot.release(1);
        assert!(slot.is_idle());
        // Touched since the last sweep: it stays once, then goes.
        assert!(!slot.sweepable(false));
        assert!(slot.sweepable(false));
        slot.try_take(1).unwrap();
        assert!(!slot.sweepable(true), "held: never swept");
    }

    #[test]
    fn waiters_are_served_in_arrival_order_and_newcomers_do_not_pass_them() {
        let slot = Slot::new(2, false);
        slot.try_take(2).unwrap();
        let Queued::Waiting(heavy) = slot.enqueue(2) else {
            panic!("the slots are taken")
        };
        let Queued::Waiting(light) = slot.enqueue(1) else {
            panic!("the line is not empty")
        };
        assert_eq!(slot.waiting(), 2);
        slot.release(1);
        // One slot is free, but the head needs two, and the light one waits behind it;
        // a newcomer does not pass either.
        assert!(!heavy.poll_granted(&noop_waker()));
        assert!(!light.poll_granted(&noop_waker()));
        assert!(matches!(slot.try_take(1), Err(Refusal::Full { .. })));
        slot.release(1);
        assert!(heavy.poll_granted(&noop_waker()));
        assert!(!light.poll_granted(&noop_waker()));
        assert_eq!(slot.in_flight(), 2);
        slot.release(2);
        assert!(light.poll_granted(&noop_waker()));
        assert_eq!(slot.in_flight(), 1);
        assert_eq!(slot.waiting(), 0);
        slot.release(1);
        assert!(slot.is_idle(), "the line drained, so QUEUED is clear");
    }

    #[test]
    fn a_cancelled_head_lets_the_line_behind_it_in() {
        let slot = Slot::new(2, false);
        slot.try_take(1).unwrap();
        let Queued::Waiting(heavy) = slot.enqueue(2) else {
            panic!("one slot is taken")
        };
        let Queued::Waiting(light) = slot.enqueue(1) else {
            panic!("the line is not empty")
        };
        slot.cancel(&heavy, 2);
        assert!(light.poll_granted(&noop_waker()));
        assert_eq!(slot.in_flight(), 2);
        slot.release(2);
        assert!(slot.is_idle());
    }

    #[test]
    fn a_waiter_cancelled_after_its_grant_gives_the_slots_back() {
        let slot = Slot::new(1, false);
        slot.try_take(1).unwrap();
        let Queued::Waiting(grant) = slot.enqueue(1) else {
            panic!("the slot is taken")
        };
        slot.release(1);
        assert_eq!(slot.in_flight(), 1, "taken for the waiter");
        slot.cancel(&grant, 1);
        assert!(slot.is_idle());
    }

    #[test]
    fn a_raised_maximum_serves_the_line_and_a_lowered_one_admits_nobody_new() {
        let slot = Slot::new(1, false);
        slot.try_take(1).unwrap();
        let Queued::Waiting(grant) = slot.enqueue(1) else {
            panic!("the slot is taken")
        };
        slot.set_max(2, true);
        assert!(slot.has_override());
        assert!(grant.poll_granted(&noop_waker()));
        slot.set_max(1, false);
        assert!(matches!(slot.try_take(1), Err(Refusal::Full { .. })));
        slot.release(1);
        assert!(matches!(slot.try_take(1), Err(Refusal::Full { .. })));
        slot.release(1);
        slot.try_take(1).unwrap();
    }

    #[test]
    fn a_maximum_of_zero_admits_nothing() {
        let slot = Slot::new(0, false);
        assert_eq!(slot.try_take(1), Err(Refusal::NeverFits { max: 0 }));
    }
}
