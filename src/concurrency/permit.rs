//! The permit a caller holds while its request runs, and the wait for one.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use super::slot::{Grant, Slot};

/// Slots of one key, held until the permit is dropped: when the request ends, panics
/// (drops run while unwinding), or its future is cancelled. Owned, `Send` and
/// `'static`: move it into the task or the response body that ends the request.
#[must_use = "a permit gives its slots back as soon as it is dropped"]
pub struct Permit {
    /// `None` for a permit of weight 0.
    slot: Option<Arc<Slot>>,
    weight: u32,
}

impl Permit {
    pub(super) fn new(slot: Arc<Slot>, weight: u32) -> Self {
        Self {
            slot: Some(slot),
            weight,
        }
    }

    /// A permit that holds nothing (weight 0).
    pub(super) fn empty() -> Self {
        Self {
            slot: None,
            weight: 0,
        }
    }

    /// The slots it holds.
    pub fn weight(&self) -> u32 {
        self.weight
    }

    /// Gives back `n` of its slots now (at most all of them), keeping the rest: for a
    /// request whose size turned out smaller than reserved.
    pub fn release_part(&mut self, n: u32) {
        let n = n.min(self.weight);
        if n == 0 {
            return;
        }
        if let Some(slot) = &self.slot {
            slot.release(n);
        }
        self.weight -= n;
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        match &self.slot {
            Some(slot) if self.weight > 0 => slot.release(self.weight),
            _ => {}
        }
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("weight", &self.weight)
            .finish()
    }
}

/// A caller in a key's line; dropped before its grant, it leaves the line, and after
/// it (a grant it never saw), gives the slots back.
pub(crate) struct Waiting {
    slot: Arc<Slot>,
    grant: Arc<Grant>,
    weight: u32,
    done: bool,
}

impl Waiting {
    pub(super) fn new(slot: Arc<Slot>, grant: Arc<Grant>, weight: u32) -> Self {
        Self {
            slot,
            grant,
            weight,
            done: false,
        }
    }
}

impl Future for Waiting {
    type Output = Permit;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Permit> {
        if self.done {
            // Polled after completion: a contract breach by the caller; never a second
            // permit.
            return Poll::Pending;
        }
        if self.grant.poll_granted(cx.waker()) {
            self.done = true;
            Poll::Ready(Permit::new(Arc::clone(&self.slot), self.weight))
        } else {
            Poll::Pending
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if !self.done {
            self.slot.cancel(&self.grant, self.weight);
        }
    }
}
