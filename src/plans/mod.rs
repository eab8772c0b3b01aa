//! Plans: named sets of quotas ("free": `60/min` and `10000/month calendar`; "pro":
//! `600/min`), and for each key the plan it is on, from an operator's assignment or a
//! resolver of yours (a database lookup, a claim of the key), kept so that the resolver
//! runs once per key, not once per check.
//!
//! ```
//! use tollgate::plans::Plans;
//! use tollgate::Algorithm;
//!
//! let plans: Plans<String> = Plans::builder("free")
//!     .plan("free", ["60/min".parse()?, "10000/month calendar".parse()?])
//!     .plan("pro", ["600/min".parse()?])
//!     .algorithm(Algorithm::SlidingWindow)
//!     // Keys that start with "pro_" are on the pro plan; the others, on the default.
//!     .resolver(|key: &String| key.starts_with("pro_").then_some("pro"))
//!     .build()?;
//! assert_eq!(plans.check("pro_7f3a").limit(), 600);
//! assert_eq!(plans.check("anon").limit(), 60);
//! plans.assign("anon", "pro")?; // an upgrade, live
//! assert_eq!(plans.plan_of("anon").as_ref(), "pro");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Each plan is a [`RateLimiter`] of its own (compound when it has several quotas), so
//! a check is the plan book's lookup (one read-locked shard of 64) then the plan's own
//! check, and a key's state lives in its plan's limiter.

pub(crate) mod book;

use std::borrow::Borrow;
use std::collections::HashMap;
use std::fmt;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};

use crate::algorithm::Algorithm;
use crate::clock::{Clock, MonotonicClock};
use crate::decision::Decision;
use crate::error::{ConfigError, InsufficientCapacity, SettleError};
use crate::limiter::{Key, RateLimiter};
use crate::quota::Quota;
use crate::store::WhenFull;
use book::{Book, Found};

/// The plans whose slot for a key is loaded ahead of each check's book lookup.
const PREFETCHED: usize = 4;

/// The plans found by name with a scan of their names rather than a map lookup.
const SCANNED: usize = 8;

/// The most plans a [`Plans`] holds.
pub const MAX_PLANS: usize = 256;

/// A resolver as the book calls it: hands the plan name it finds for a key (if any) to
/// its second argument.
type Resolver<K> = Box<dyn Fn(&K, &mut dyn FnMut(&str)) + Send + Sync>;

/// A plan's name and its quotas, each with its capacity, its first quota first.
#[cfg(feature = "tower")]
pub(crate) type PlanQuotas = (Arc<str>, Vec<(Quota, u64)>);

/// One plan: its name and its limiter.
struct Plan<K, C> {
    name: Arc<str>,
    limiter: RateLimiter<K, Arc<C>>,
}

/// Keys limited by the quotas of their plan. Cheap to clone; clones share everything.
///
/// A key's plan is, in order: the plan an operator [`assign`](Self::assign)ed it to;
/// the [resolver](PlansBuilder::resolver)'s answer, kept for
/// [`keep_answers_for`](PlansBuilder::keep_answers_for); the default plan.
///
/// # Changes while serving
/// - [`assign`](Self::assign) and [`unassign`](Self::unassign) move one key. Its state
///   stays with each plan: a key moved to another plan starts it where it left it (a key
///   new to the plan, full), and finds its old plan's counts again if it moves back
///   before they are swept. A check racing the move is decided by either plan.
/// - [`set_plan`](Self::set_plan) adds a plan, or changes every quota of one (each
///   quota's consumed units carry over, as
///   [`RateLimiter::set_quotas`] carries them).
/// - [`forget_answers`](Self::forget_answers) makes every key ask the resolver again.
pub struct Plans<K, C = MonotonicClock> {
    inner: Arc<Inner<K, C>>,
}

struct Inner<K, C> {
    name: Arc<str>,
    plans: Box<[OnceLock<Plan<K, C>>]>,
    /// Plan names to their index; only plan changes write it.
    names: RwLock<HashMap<Arc<str>, u32>>,
    /// Serialises [`Plans::set_plan`].
    defining: Mutex<()>,
    default: u32,
    book: Book<K>,
    resolver: Option<Resolver<K>>,
    template: Template,
    clock: Arc<C>,
    /// Resolver answers naming no plan (the default plan decided).
    unknown: AtomicU64,
    /// Resolver calls.
    resolved: AtomicU64,
}

/// What every plan's limiter is built with.
#[derive(Clone, Debug)]
struct Template {
    algorithm: Algorithm,
    shards: Option<usize>,
    max_keys: Option<usize>,
    expected_keys: usize,
    when_full: WhenFull,
    block_for: Option<Duration>,
    block_after: Option<(u32, Duration)>,
}

impl<K, C> Clone for Plans<K, C> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<K: Key, C: Clock> fmt::Debug for Plans<K, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plans")
            .field("name", &self.inner.name)
            .field("plans", &self.plan_names())
            .field("default", &self.plan(self.inner.default).name)
            .field("algorithm", &self.inner.template.algorithm)
            .finish_non_exhaustive()
    }
}

/// Counts of a [`Plans`]' plan book.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PlanStats {
    /// Keys an operator assigned to a plan.
    pub assigned: usize,
    /// Resolver answers kept.
    pub answers: usize,
    /// Calls of the resolver since the limiter was built.
    pub resolver_calls: u64,
    /// Resolver answers that named no plan of the limiter (the default plan decided).
    pub unknown_plans: u64,
}

impl<K: Key> Plans<K> {
    /// A builder whose keys are on `default` unless assigned or resolved to another
    /// plan; `default` must be one of the plans defined.
    pub fn builder(default: &str) -> PlansBuilder<K> {
        PlansBuilder {
            name: Arc::from("default"),
            plans: Vec::new(),
            default: default.to_owned(),
            resolver: None,
            keep_ns: u64::MAX,
            clock: MonotonicClock::new(),
            template: Template {
                algorithm: Algorithm::default(),
                shards: None,
                max_keys: None,
                expected_keys: 0,
                when_full: WhenFull::default(),
                block_for: None,
                block_after: None,
            },
        }
    }
}

impl<K: Key, C: Clock> Plans<K, C> {
    #[inline]
    fn plan(&self, index: u32) -> &Plan<K, C> {
        // Indices come from the book, the names or the default, each of a defined plan.
        self.inner.plans[index as usize]
            .get()
            .unwrap_or_else(|| self.default_plan())
    }

    #[cold]
    fn default_plan(&self) -> &Plan<K, C> {
        self.inner.plans[self.inner.default as usize]
            .get()
            .expect("the default plan is defined at build")
    }

    /// The index of `key`'s plan: the book's, else the resolver's answer (kept), else
    /// the default.
    #[inline]
    fn index_of<Q>(&self, key: &Q) -> u32
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        // The key's slot in each of the first plans starts loading while the book is
        // read, so that the plan's check does not wait for its own load after the book's.
        for plan in self.inner.plans[..PREFETCHED]
            .iter()
            .map_while(OnceLock::get)
        {
            plan.limiter.prefetch(key);
        }
        match self.inner.book.find(key, || self.inner.clock.now_ns()) {
            Found::Assigned(plan) | Found::Resolved(plan) => plan,
            Found::Unknown => self.resolve(key),
        }
    }

    /// Asks the resolver for `key`'s plan and keeps its answer.
    #[cold]
    #[inline(never)]
    fn resolve<Q>(&self, key: &Q) -> u32
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let inner = &self.inner;
        let Some(resolver) = &inner.resolver else {
            return inner.default;
        };
        let owned = key.to_owned();
        let mut plan = inner.default;
        inner.resolved.fetch_add(1, Ordering::Relaxed);
        resolver(&owned, &mut |name| plan = self.index_or_default(name));
        inner.book.remember(owned, plan, inner.clock.now_ns());
        plan
    }

    /// The index of the plan named `name`.
    fn named(&self, name: &str) -> Result<u32, ConfigError> {
        self.inner
            .names
            .read()
            .get(name)
            .copied()
            .ok_or_else(|| ConfigError::UnknownPlan(name.to_owned()))
    }

    /// The limiter of `key`'s plan.
    fn limiter_of<Q>(&self, key: &Q) -> &RateLimiter<K, Arc<C>>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        &self.plan(self.index_of(key)).limiter
    }

    /// Checks one request for `key` under its plan's quotas, and consumes one unit of
    /// each if it is admitted. The decision's `limit` is the plan's.
    ///
    /// # Locking behaviour
    /// The read lock of one of the plan book's 64 shards, then as
    /// [`RateLimiter::check`]. The first check of a key the book does not know (or
    /// whose resolver answer is older than
    /// [`keep_answers_for`](PlansBuilder::keep_answers_for)) calls the resolver, with
    /// no lock held, then takes that shard's write lock to keep the answer.
    #[inline]
    pub fn check<Q>(&self, key: &Q) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.limiter_of(key).check(key)
    }

    /// [`check`](Self::check), with the name of the plan that decided.
    pub fn check_planned<Q>(&self, key: &Q) -> (Decision, Arc<str>)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let plan = self.plan(self.index_of(key));
        (plan.limiter.check(key), Arc::clone(&plan.name))
    }

    /// Checks one request for `key` under the plan named `plan`, which the caller knows
    /// (from the request, say: see the HTTP layer's plan extractor); the book and the
    /// resolver are not asked. A plan name the limiter lacks decides by the default plan
    /// (counted in [`PlanStats::unknown_plans`] and logged).
    ///
    /// # Locking behaviour
    /// As [`RateLimiter::check`] for the first 8 plans defined; the read lock of the
    /// plan names first for the others.
    pub fn check_in<Q>(&self, plan: &str, key: &Q) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.plan(self.index_or_default(plan)).limiter.check(key)
    }

    /// The index of the plan named `name`, or the default's if none is (counted).
    fn index_or_default(&self, name: &str) -> u32 {
        // The first plans by a scan of their names (no lock, no hash), the rest by map.
        let first = self.inner.plans[..SCANNED]
            .iter()
            .map_while(OnceLock::get)
            .position(|p| *p.name == *name);
        let found = match first {
            Some(index) => Some(index as u32),
            None => self.inner.names.read().get(name).copied(),
        };
        found.unwrap_or_else(|| {
            self.inner.unknown.fetch_add(1, Ordering::Relaxed);
            crate::observe::unknown_plan(&self.inner.name, name);
            self.inner.default
        })
    }

    /// [`check`](Self::check) for a request of cost `n` (see [`RateLimiter::check_n`]).
    ///
    /// # Errors
    /// [`InsufficientCapacity`] when `n` exceeds what the key's plan can ever admit at
    /// once.
    pub fn check_n<Q>(&self, key: &Q, n: u64) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.limiter_of(key).check_n(key, n)
    }

    /// A check under the plan named `plan` (`key`'s own if `None`) whose admission more
    /// than `max_delay` ns away is a deny, with the deciding plan's index: the HTTP
    /// layer's check.
    #[cfg(feature = "tower")]
    pub(crate) fn check_indexed<Q>(
        &self,
        plan: Option<&str>,
        key: &Q,
        max_delay: u64,
    ) -> (Decision, u32)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let index = match plan {
            Some(name) => self.index_or_default(name),
            None => self.index_of(key),
        };
        let limiter = &self.plan(index).limiter;
        let decision = if max_delay == u64::MAX {
            limiter.check(key)
        } else {
            crate::decision::unit(limiter.check_within(key, 1, max_delay))
        };
        (decision, index)
    }

    /// The decision a unit request for `key` would get now under its plan, consuming
    /// nothing (see [`RateLimiter::peek`]). A key the book does not know may call the
    /// resolver, whose answer is kept.
    pub fn peek<Q>(&self, key: &Q) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.limiter_of(key).peek(key)
    }

    /// Charges `n` units to `key` under its plan (see [`RateLimiter::charge`]).
    ///
    /// # Errors
    /// Those of [`RateLimiter::charge`].
    pub fn charge<Q>(&self, key: &Q, n: u64) -> Result<Decision, SettleError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.limiter_of(key).charge(key, n)
    }

    /// Gives back up to `n` units of `key`'s plan (see [`RateLimiter::refund`]).
    ///
    /// # Errors
    /// Those of [`RateLimiter::refund`].
    pub fn refund<Q>(&self, key: &Q, n: u64) -> Result<Decision, SettleError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.limiter_of(key).refund(key, n)
    }

    /// Forgets `key`'s state under every plan (its plan stays).
    pub fn reset<Q>(&self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        for plan in self.defined() {
            plan.limiter.reset(key);
        }
    }

    /// Blocks `key` for `duration` under its plan (see [`RateLimiter::block`]).
    pub fn block<Q>(&self, key: &Q, duration: Duration)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.limiter_of(key).block(key, duration);
    }

    /// Ends `key`'s block under every plan; true if it was blocked under one.
    pub fn unblock<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.defined()
            .fold(false, |was, p| p.limiter.unblock(key) | was)
    }

    /// Puts `key` on the plan named `plan`, live (see [the type's docs](Self)).
    ///
    /// # Errors
    /// [`ConfigError::UnknownPlan`]; nothing changes then.
    ///
    /// # Locking behaviour
    /// The write lock of one of the plan book's shards.
    pub fn assign<Q>(&self, key: &Q, plan: &str) -> Result<(), ConfigError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let index = self.named(plan)?;
        self.inner.book.assign(key.to_owned(), index);
        Ok(())
    }

    /// Takes `key`'s assignment away: its plan is the resolver's again (asked anew),
    /// or the default. Returns the plan it was assigned to, if any.
    pub fn unassign<Q>(&self, key: &Q) -> Option<Arc<str>>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let index = self.inner.book.unassign(key)?;
        Some(Arc::clone(&self.plan(index).name))
    }

    /// The name of `key`'s plan (which may call the resolver, keeping its answer).
    pub fn plan_of<Q>(&self, key: &Q) -> Arc<str>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        Arc::clone(&self.plan(self.index_of(key)).name)
    }

    /// Makes the resolver be asked again for `key` at its next check (an answer that
    /// changed in your database). An assignment stays.
    pub fn forget_answer<Q>(&self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.inner.book.forget(key);
    }

    /// Makes the resolver be asked again for every key. Assignments stay.
    pub fn forget_answers(&self) {
        self.inner.book.forget_answers();
    }

    /// Adds the plan `name` with `quotas`, or changes every quota of the plan of that
    /// name (in order: each quota's consumed units carry over), live.
    ///
    /// # Errors
    /// For a new plan, those of [`PlansBuilder::build`] for its quotas, and
    /// [`ConfigError::InvalidPlan`] beyond [`MAX_PLANS`] plans; for a plan that exists,
    /// those of [`RateLimiter::set_quotas`] (the number of quotas stays). Nothing
    /// changes then.
    pub fn set_plan(
        &self,
        name: &str,
        quotas: impl IntoIterator<Item = Quota>,
    ) -> Result<(), ConfigError> {
        let quotas: Vec<Quota> = quotas.into_iter().collect();
        let inner = &self.inner;
        let _serial = inner.defining.lock();
        if let Ok(index) = self.named(name) {
            return self.plan(index).limiter.set_quotas(&quotas);
        }
        let index = inner.names.read().len();
        if index >= MAX_PLANS {
            return Err(invalid(
                name,
                "a limiter holds at most MAX_PLANS (256) plans",
            ));
        }
        let plan = inner
            .template
            .plan(&inner.name, name, &quotas, Arc::clone(&inner.clock))?;
        let name = Arc::clone(&plan.name);
        // Published before its name, so that any index read from the names is defined.
        if inner.plans[index].set(plan).is_err() {
            return Err(invalid(&name, "defined twice at once"));
        }
        inner.names.write().insert(name, index as u32);
        Ok(())
    }

    /// Every plan's name, in the order they were defined.
    pub fn plan_names(&self) -> Vec<Arc<str>> {
        self.defined().map(|p| Arc::clone(&p.name)).collect()
    }

    /// The quotas of the plan named `plan`, its first quota first.
    ///
    /// # Errors
    /// [`ConfigError::UnknownPlan`].
    pub fn quotas_of(&self, plan: &str) -> Result<Vec<Quota>, ConfigError> {
        Ok(self.plan(self.named(plan)?).limiter.quotas())
    }

    /// The limiter of the plan named `plan`: its keys, counters and quotas.
    ///
    /// # Errors
    /// [`ConfigError::UnknownPlan`].
    pub fn limiter(&self, plan: &str) -> Result<&RateLimiter<K, Arc<C>>, ConfigError> {
        Ok(&self.plan(self.named(plan)?).limiter)
    }

    /// The default plan's index.
    #[cfg(feature = "tower")]
    pub(crate) fn default_index(&self) -> u32 {
        self.inner.default
    }

    /// The default plan's name.
    pub fn default_plan_name(&self) -> Arc<str> {
        Arc::clone(&self.plan(self.inner.default).name)
    }

    /// The limiter's name (its plans' limiters are named `<name>/<plan>`).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The algorithm every plan runs.
    pub fn algorithm(&self) -> Algorithm {
        self.inner.template.algorithm
    }

    /// The clock every plan reads.
    pub fn clock(&self) -> &C {
        &self.inner.clock
    }

    /// Keys held in all plans' limiters.
    pub fn len(&self) -> usize {
        self.defined().map(|p| p.limiter.len()).sum()
    }

    /// Whether no plan holds a key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The plan book's counts.
    pub fn stats(&self) -> PlanStats {
        let (assigned, answers) = self.inner.book.counts();
        PlanStats {
            assigned,
            answers,
            resolver_calls: self.inner.resolved.load(Ordering::Relaxed),
            unknown_plans: self.inner.unknown.load(Ordering::Relaxed),
        }
    }

    /// The keys assigned to the plan named `plan`.
    ///
    /// # Errors
    /// [`ConfigError::UnknownPlan`].
    pub fn assigned_to(&self, plan: &str) -> Result<usize, ConfigError> {
        Ok(self.inner.book.assigned_to(self.named(plan)?))
    }

    fn defined(&self) -> impl Iterator<Item = &Plan<K, C>> {
        self.inner.plans.iter().map_while(OnceLock::get)
    }

    /// Every plan's name and quotas with its index, for the HTTP layer's fields.
    #[cfg(feature = "tower")]
    pub(crate) fn plan_table(&self) -> Vec<PlanQuotas> {
        self.defined()
            .map(|p| {
                let mut quotas = vec![(p.limiter.quota(), p.limiter.quota_capacity())];
                quotas.extend(p.limiter.also_policies());
                (Arc::clone(&p.name), quotas)
            })
            .collect()
    }
}

fn invalid(plan: &str, why: &'static str) -> ConfigError {
    ConfigError::InvalidPlan {
        plan: plan.to_owned(),
        why,
    }
}

impl Template {
    /// The plan `plan` of the limiter `limiter`, with `quotas` on `clock`.
    fn plan<K: Key, C: Clock>(
        &self,
        limiter: &str,
        plan: &str,
        quotas: &[Quota],
        clock: Arc<C>,
    ) -> Result<Plan<K, C>, ConfigError> {
        let Some((&first, also)) = quotas.split_first() else {
            return Err(invalid(plan, "a plan needs at least one quota"));
        };
        if plan.is_empty() {
            return Err(invalid(plan, "a plan needs a name"));
        }
        let mut builder = RateLimiter::<K>::builder(first)
            .algorithm(self.algorithm)
            .when_full(self.when_full)
            .expected_keys(self.expected_keys)
            .name(&format!("{limiter}/{plan}"))
            .clock(clock);
        for &quota in also {
            builder = builder.also(quota);
        }
        if let Some(shards) = self.shards {
            builder = builder.shards(shards);
        }
        if let Some(keys) = self.max_keys {
            builder = builder.max_keys(keys);
        }
        if let Some(block) = self.block_for {
            builder = builder.block_for(block);
        }
        if let Some((denies, within)) = self.block_after {
            builder = builder.block_after(denies, within);
        }
        Ok(Plan {
            name: Arc::from(plan),
            limiter: builder.build()?,
        })
    }
}

/// Configures a [`Plans`]. Made by [`Plans::builder`].
#[must_use = "a builder does nothing until .build() is called"]
pub struct PlansBuilder<K, C = MonotonicClock> {
    name: Arc<str>,
    plans: Vec<(String, Vec<Quota>)>,
    default: String,
    resolver: Option<Resolver<K>>,
    keep_ns: u64,
    clock: C,
    template: Template,
}

impl<K, C> fmt::Debug for PlansBuilder<K, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PlansBuilder")
            .field("name", &self.name)
            .field("plans", &self.plans)
            .field("default", &self.default)
            .field("resolver", &self.resolver.is_some())
            .field("template", &self.template)
            .finish_non_exhaustive()
    }
}

impl<K: Key, C: Clock> PlansBuilder<K, C> {
    /// Defines the plan `name`: every key on it is held to each of `quotas`, all or
    /// nothing, the first quota's `limit` in decisions (see
    /// [`Builder::also`](crate::Builder::also)).
    pub fn plan(mut self, name: &str, quotas: impl IntoIterator<Item = Quota>) -> Self {
        self.plans
            .push((name.to_owned(), quotas.into_iter().collect()));
        self
    }

    /// Finds the plan of a key the book does not know: the plan it names, the default
    /// if it names none (`None`) or one that does not exist (counted in
    /// [`PlanStats::unknown_plans`] and logged). Called with no lock held, once per key
    /// until its answer is older than [`keep_answers_for`](Self::keep_answers_for).
    pub fn resolver<F, R>(mut self, resolver: F) -> Self
    where
        F: Fn(&K) -> Option<R> + Send + Sync + 'static,
        R: AsRef<str>,
    {
        self.resolver = Some(Box::new(move |key, found| {
            if let Some(name) = resolver(key) {
                found(name.as_ref());
            }
        }));
        self
    }

    /// How long a resolver's answer is kept; for ever unless given (then
    /// [`Plans::forget_answer`] makes a key ask again). Answers beyond
    /// [`max_keys`](Self::max_keys) per plan are dropped, the stale first.
    pub fn keep_answers_for(mut self, keep: Duration) -> Self {
        self.keep_ns = crate::clock::nanos(keep);
        self
    }

    /// The algorithm every plan runs; [`Algorithm::TokenBucket`] by default.
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.template.algorithm = algorithm;
        self
    }

    /// The name of the limiter (its plans' limiters are named `<name>/<plan>`).
    pub fn name(mut self, name: &str) -> Self {
        self.name = Arc::from(name);
        self
    }

    /// The time source every plan reads.
    pub fn clock<C2: Clock>(self, clock: C2) -> PlansBuilder<K, C2> {
        PlansBuilder {
            name: self.name,
            plans: self.plans,
            default: self.default,
            resolver: self.resolver,
            keep_ns: self.keep_ns,
            clock,
            template: self.template,
        }
    }

    /// The shard count of each plan's limiter ([`Builder::shards`](crate::Builder::shards)).
    pub fn shards(mut self, shards: usize) -> Self {
        self.template.shards = Some(shards);
        self
    }

    /// The most keys each plan's limiter holds ([`Builder::max_keys`](crate::Builder::max_keys)),
    /// and the most resolver answers the book keeps for each plan.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.template.max_keys = Some(max_keys);
        self
    }

    /// The keys each plan's tables are sized for ([`Builder::expected_keys`](crate::Builder::expected_keys)).
    pub fn expected_keys(mut self, keys: usize) -> Self {
        self.template.expected_keys = keys;
        self
    }

    /// What a full plan does with a new key ([`Builder::when_full`](crate::Builder::when_full)).
    pub fn when_full(mut self, when_full: WhenFull) -> Self {
        self.template.when_full = when_full;
        self
    }

    /// Blocks a key that breaks its plan's limit ([`Builder::block_for`](crate::Builder::block_for)).
    pub fn block_for(mut self, duration: Duration) -> Self {
        self.template.block_for = Some(duration);
        self
    }

    /// Blocks only after `denies` denies within `within` ([`Builder::block_after`](crate::Builder::block_after)).
    pub fn block_after(mut self, denies: u32, within: Duration) -> Self {
        self.template.block_after = Some((denies, within));
        self
    }

    /// Builds every plan's limiter.
    ///
    /// # Errors
    /// [`ConfigError::InvalidPlan`] for a plan defined twice, with no quota, or beyond
    /// [`MAX_PLANS`]; [`ConfigError::UnknownPlan`] when the default plan is not defined;
    /// and those of [`Builder::build`](crate::Builder::build) for each plan's quotas.
    pub fn build(self) -> Result<Plans<K, C>, ConfigError> {
        if self.plans.len() > MAX_PLANS {
            return Err(invalid(
                &self.plans[MAX_PLANS].0,
                "a limiter holds at most MAX_PLANS (256) plans",
            ));
        }
        let clock = Arc::new(self.clock);
        let slots: Box<[OnceLock<Plan<K, C>>]> = (0..MAX_PLANS).map(|_| OnceLock::new()).collect();
        let mut names = HashMap::new();
        for (index, (name, quotas)) in self.plans.iter().enumerate() {
            if names.contains_key(name.as_str()) {
                return Err(invalid(name, "defined twice"));
            }
            let plan = self
                .template
                .plan(&self.name, name, quotas, Arc::clone(&clock))?;
            names.insert(Arc::clone(&plan.name), index as u32);
            let _ = slots[index].set(plan);
        }
        let default = *names
            .get(self.default.as_str())
            .ok_or_else(|| ConfigError::UnknownPlan(self.default.clone()))?;
        let most = self
            .template
            .max_keys
            .map_or(usize::MAX, |m| m.saturating_mul(self.plans.len()));
        Ok(Plans {
            inner: Arc::new(Inner {
                name: self.name,
                plans: slots,
                names: RwLock::new(names),
                defining: Mutex::new(()),
                default,
                book: Book::new(self.keep_ns, most),
                resolver: self.resolver,
                template: self.template,
                clock,
                unknown: AtomicU64::new(0),
                resolved: AtomicU64::new(0),
            }),
        })
    }
}
