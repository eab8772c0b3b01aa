//! What the sync task knows of one key between rounds: its books, which the key's cell
//! stores and the node side of a round reads and writes.

/// The sync task's books for one key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Books {
    /// Which books these are (0 until the key's first round).
    pub(crate) epoch: u64,
    /// Every unit admitted on this node since the books began.
    pub(crate) spent: u64,
    /// The reservation of the last answer received.
    pub(crate) known: u64,
    /// The allowance and the overdraft as the task last left them.
    pub(crate) lease_base: u64,
    pub(crate) overdraft_base: u64,
    /// The demand last reported, and its running average (weights).
    pub(crate) demand: u64,
    pub(crate) average: u64,
    /// The running average of what the key admitted (a weight; see
    /// [`average_use`](super::key::average_use)).
    pub(crate) usage: u64,
    /// When (limiter clock, ns) the key was last sent, last used, and when the last
    /// acknowledged round was collected.
    pub(crate) last_round: u64,
    pub(crate) last_active: u64,
    pub(crate) last_ok: u64,
    /// A report went out and was not acknowledged yet.
    pub(crate) pending: bool,
    /// Tokens handed out by the local fallback since the last acknowledged round (and
    /// not given back): Redis forgives them if it lost the key's state meanwhile.
    pub(crate) local: u64,
    /// Fractions of a token owed by the local fallback's refill, in ticks.
    pub(crate) local_credit: u64,
    /// Of `local`, tokens handed out from the one-time budget after the key's share was
    /// no longer reserved.
    pub(crate) beyond: u64,
    /// Whether this outage's one-time budget was handed out.
    pub(crate) budget_spent: bool,
    /// The key's share (a weight) as the last answer granted it, and until when (limiter
    /// clock, ns) Redis reserves it should this node fall silent.
    pub(crate) share: u64,
    pub(crate) share_until: u64,
    /// The last acknowledged round released everything.
    pub(crate) released: bool,
    /// A cold key's hash as announced (see [`fleet_hash`]), once the task has looked.
    pub(crate) fleet: u64,
    /// Until when (Redis clock, ms) the key's announcement as hot lasts (0: not
    /// announced by this node).
    pub(crate) announced_until: u64,
    /// The key turned hot by its own demand here: its next round announces it, whatever
    /// its demand then.
    pub(crate) announce: bool,
}

impl Books {
    /// The books of a key first seen, with `overdraft` to spend until its first round.
    pub(crate) fn fresh(overdraft: u64) -> Self {
        Self {
            overdraft_base: overdraft,
            ..Self::default()
        }
    }
}
