//! Plans on a synced limiter: a key's plan gives it a quota of its own
//! ([`SyncedLimiter::set_quota`]), which travels with the key's rounds to Redis and from
//! there to every other node, as per-key quotas do.

use std::borrow::Borrow;
use std::fmt;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

use super::SyncedLimiter;
use crate::clock::{Clock, MonotonicClock};
use crate::decision::Decision;
use crate::error::{ConfigError, InsufficientCapacity};
use crate::limiter::Key;
use crate::plans::MAX_PLANS;
use crate::plans::book::{Book, Found};
use crate::quota::Quota;

/// The index of the default plan: the limiter's own quota.
const DEFAULT_PLAN: u32 = 0;

/// A resolver of a key's plan name.
type Resolver<K> = Box<dyn Fn(&K) -> Option<String> + Send + Sync>;

/// A synced limiter whose keys are on plans: each plan is a quota, and a key's plan
/// sets its quota of its own on every node. Made by [`SyncedLimiter::plans`]; cheap to
/// clone.
///
/// A key's plan is, in order: an operator's [`assign`](Self::assign)ment (made on any
/// node: it travels to every node with the key's rounds, as
/// [`SyncedLimiter::set_quota`] does); the [resolver](SyncedPlansBuilder::resolver)'s
/// answer on this node, kept; the default plan (the limiter's own quota). A resolver's
/// answer naming the default plan leaves a quota the key has from elsewhere (an
/// assignment on another node) in force; one naming another plan sets that plan's quota,
/// and, as with `set_quota`, the latest setting wins on every node: give every node the
/// same resolver.
///
/// A plan is one quota: the sync holds a key to one quota of its own (with the
/// limiter's [`also`](crate::Builder::also) quotas beside it, shared by every plan).
/// Plans of several quotas run in the process ([`Plans`](crate::plans::Plans)) and in
/// Redis (`RedisBuilder::plan`).
///
/// ```no_run
/// use tollgate::sync::{RedisSync, SyncedLimiter};
/// use tollgate::RateLimiter;
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let (limiter, _sync): (SyncedLimiter<String>, _) = RateLimiter::builder("60/min".parse()?)
///     .build_synced(RedisSync::new("redis://127.0.0.1/"))?;
/// let plans = limiter
///     .plans("free")
///     .plan("pro", "600/min".parse()?)
///     .resolver(|key: &String| key.starts_with("pro_").then_some("pro"))
///     .build()?;
/// assert_eq!(plans.check("pro_7f3a").limit(), 600);
/// plans.assign("anon", "pro")?; // on every node, with the key's next round
/// # Ok(())
/// # }
/// ```
pub struct SyncedPlans<K, C = MonotonicClock> {
    inner: Arc<Inner<K, C>>,
}

struct Inner<K, C> {
    limiter: SyncedLimiter<K, C>,
    default_name: Arc<str>,
    /// Plan `i` (from 1) at index `i − 1`.
    others: Box<[(Arc<str>, Quota)]>,
    book: Book<K>,
    resolver: Option<Resolver<K>>,
}

impl<K, C> Clone for SyncedPlans<K, C> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<K, C> fmt::Debug for SyncedPlans<K, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SyncedPlans")
            .field("default", &self.inner.default_name)
            .field("plans", &self.inner.others)
            .field("resolver", &self.inner.resolver.is_some())
            .finish_non_exhaustive()
    }
}

/// Configures [`SyncedPlans`]; made by [`SyncedLimiter::plans`].
#[must_use = "a builder does nothing until .build() is called"]
pub struct SyncedPlansBuilder<K, C = MonotonicClock> {
    limiter: SyncedLimiter<K, C>,
    default_name: String,
    plans: Vec<(String, Quota)>,
    resolver: Option<Resolver<K>>,
    keep_answers: Option<Duration>,
}

impl<K, C> fmt::Debug for SyncedPlansBuilder<K, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SyncedPlansBuilder")
            .field("default", &self.default_name)
            .field("plans", &self.plans)
            .field("resolver", &self.resolver.is_some())
            .field("keep_answers", &self.keep_answers)
            .finish_non_exhaustive()
    }
}

impl<K: Key, C: Clock> SyncedLimiter<K, C> {
    /// Puts this limiter's keys on plans: its own quota is the plan named `default`,
    /// and [`plan`](SyncedPlansBuilder::plan) adds the others.
    pub fn plans(self, default: &str) -> SyncedPlansBuilder<K, C> {
        SyncedPlansBuilder {
            limiter: self,
            default_name: default.to_owned(),
            plans: Vec::new(),
            resolver: None,
            keep_answers: None,
        }
    }
}

impl<K: Key, C: Clock> SyncedPlansBuilder<K, C> {
    /// Defines the plan `name`: a key on it is held to `quota` (the limiter's
    /// algorithm) on every node.
    pub fn plan(mut self, name: &str, quota: Quota) -> Self {
        self.plans.push((name.to_owned(), quota));
        self
    }

    /// Finds a key's plan the first time this node checks it: a plan's name (one not
    /// defined decides by the default, logged), or `None` for the default. The answer is
    /// kept for [`keep_answers_for`](Self::keep_answers_for) (for ever unless set).
    pub fn resolver<F, R>(mut self, resolver: F) -> Self
    where
        F: Fn(&K) -> Option<R> + Send + Sync + 'static,
        R: AsRef<str>,
    {
        self.resolver = Some(Box::new(move |key| {
            resolver(key).map(|name| name.as_ref().to_owned())
        }));
        self
    }

    /// How long a resolver's answer is kept before it is asked again.
    pub fn keep_answers_for(mut self, keep: Duration) -> Self {
        self.keep_answers = Some(keep);
        self
    }

    /// Checks the plans.
    ///
    /// # Errors
    /// [`ConfigError::InvalidPlan`] for a plan with no name, one defined twice (or
    /// named as the default), more than [`MAX_PLANS`]; and as
    /// [`SyncedLimiter::set_quota`] for a quota the sync cannot hold.
    pub fn build(self) -> Result<SyncedPlans<K, C>, ConfigError> {
        let invalid = |plan: &str, why| ConfigError::InvalidPlan {
            plan: plan.to_owned(),
            why,
        };
        if self.default_name.is_empty() {
            return Err(invalid("", "a plan needs a name"));
        }
        if self.plans.len() + 1 > MAX_PLANS {
            return Err(invalid(&self.plans[MAX_PLANS - 1].0, "more than 256 plans"));
        }
        let mut names = std::collections::HashSet::from([self.default_name.as_str()]);
        let mut others = Vec::with_capacity(self.plans.len());
        for (name, quota) in &self.plans {
            if name.is_empty() {
                return Err(invalid(name, "a plan needs a name"));
            }
            if !names.insert(name) {
                return Err(invalid(
                    name,
                    "defined twice (or named as the default plan)",
                ));
            }
            self.limiter.key_quota_fits(*quota)?;
            others.push((Arc::from(name.as_str()), *quota));
        }
        let keep_ns = self.keep_answers.map_or(u64::MAX, crate::clock::nanos);
        Ok(SyncedPlans {
            inner: Arc::new(Inner {
                default_name: Arc::from(self.default_name.as_str()),
                others: others.into_boxed_slice(),
                book: Book::new(keep_ns, usize::MAX),
                resolver: self.resolver,
                limiter: self.limiter,
            }),
        })
    }
}

impl<K: Key, C: Clock> SyncedPlans<K, C> {
    /// Makes sure `key` carries its plan's quota: the book knows it, or the resolver's
    /// answer is kept and its plan's quota set (unless the key has it already).
    #[inline]
    fn settle_plan<Q>(&self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let inner = &*self.inner;
        let Some(resolver) = &inner.resolver else {
            return;
        };
        let now = || inner.limiter.clock().now_ns();
        if inner.book.find(key, now) != Found::Unknown {
            return;
        }
        let owned = key.to_owned();
        let plan = match resolver(&owned) {
            Some(name) => self.named(&name).unwrap_or_else(|_| {
                crate::observe::unknown_plan(inner.limiter.name(), &name);
                DEFAULT_PLAN
            }),
            None => DEFAULT_PLAN,
        };
        inner.book.remember(owned, plan, now());
        if let Some(&(_, quota)) = plan
            .checked_sub(1)
            .and_then(|i| inner.others.get(i as usize))
        {
            if inner.limiter.quota_for(key) != quota {
                // Checked at build: it cannot fail.
                let _ = inner.limiter.set_quota(key, quota);
            }
        }
    }

    fn named(&self, name: &str) -> Result<u32, ConfigError> {
        if *self.inner.default_name == *name {
            return Ok(DEFAULT_PLAN);
        }
        let at = self.inner.others.iter().position(|(n, _)| **n == *name);
        at.map(|i| i as u32 + 1)
            .ok_or_else(|| ConfigError::UnknownPlan(name.to_owned()))
    }

    /// Checks one request for `key` under its plan's quota, as
    /// [`SyncedLimiter::check`] does.
    pub fn check<Q>(&self, key: &Q) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.settle_plan(key);
        self.inner.limiter.check(key)
    }

    /// Checks a request of cost `n` for `key` under its plan's quota.
    ///
    /// # Errors
    /// As [`SyncedLimiter::check_n`].
    pub fn check_n<Q>(&self, key: &Q, n: u64) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.settle_plan(key);
        self.inner.limiter.check_n(key, n)
    }

    /// Puts `key` on the plan named `plan`, on every node: its quota travels with the
    /// key's next round, as [`SyncedLimiter::set_quota`] (or, for the default plan,
    /// [`remove_quota`](SyncedLimiter::remove_quota)) makes it; what the key used stays
    /// used.
    ///
    /// # Errors
    /// [`ConfigError::UnknownPlan`] for a plan not defined.
    pub fn assign<Q>(&self, key: &Q, plan: &str) -> Result<(), ConfigError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let inner = &*self.inner;
        let index = self.named(plan)?;
        inner.book.assign(key.to_owned(), index);
        match index
            .checked_sub(1)
            .and_then(|i| inner.others.get(i as usize))
        {
            Some(&(_, quota)) => inner.limiter.set_quota(key, quota),
            None => {
                inner.limiter.remove_quota(key);
                Ok(())
            }
        }
    }

    /// Takes `key`'s assignment away on this node and returns it to the default quota
    /// on every node; its next check asks the resolver again. Returns the plan it was
    /// assigned to here, if any.
    pub fn unassign<Q>(&self, key: &Q) -> Option<Arc<str>>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let plan = self.inner.book.unassign(key)?;
        self.inner.limiter.remove_quota(key);
        Some(self.plan_name(plan))
    }

    /// The name of the plan `key` is on, by the quota it carries on this node (its
    /// plan's, set here or learned from a round; the default's otherwise).
    pub fn plan_of<Q>(&self, key: &Q) -> Arc<str>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.settle_plan(key);
        let quota = self.inner.limiter.quota_for(key);
        match self.inner.others.iter().find(|(_, q)| *q == quota) {
            Some((name, _)) => Arc::clone(name),
            None => Arc::clone(&self.inner.default_name),
        }
    }

    /// The plans' names, the default's first.
    pub fn plan_names(&self) -> Vec<Arc<str>> {
        std::iter::once(Arc::clone(&self.inner.default_name))
            .chain(self.inner.others.iter().map(|(n, _)| Arc::clone(n)))
            .collect()
    }

    /// The synced limiter underneath.
    pub fn limiter(&self) -> &SyncedLimiter<K, C> {
        &self.inner.limiter
    }

    fn plan_name(&self, plan: u32) -> Arc<str> {
        match plan
            .checked_sub(1)
            .and_then(|i| self.inner.others.get(i as usize))
        {
            Some((name, _)) => Arc::clone(name),
            None => Arc::clone(&self.inner.default_name),
        }
    }
}
