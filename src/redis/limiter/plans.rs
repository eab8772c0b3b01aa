//! Plans in the Redis tier: named sets of quotas, and each key's plan, whose quotas
//! travel as the arguments of every script call for the key (the scripts hold no
//! quota of their own, so one script serves every plan).

use super::*;
use crate::plans::MAX_PLANS;
use crate::plans::book::{Book, Found};

/// A resolver of a key's plan name ([`RedisBuilder::plan_resolver`]).
pub(super) type PlanResolver = Box<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// The index of the default plan: the limiter's own quotas.
pub(super) const DEFAULT_PLAN: u32 = 0;

/// A plan besides the default: its name, and its quotas in the scripts' units with
/// their keys' prefixes (quota `i` of every plan shares the `i`-th key of a user key, so
/// a key that changes plans finds its counts by position).
pub(super) struct PlanRules {
    name: Arc<str>,
    current: Current,
    also: Box<[Also]>,
}

/// The plans, and the book of each key's plan.
pub(super) struct PlanTable {
    default_name: Arc<str>,
    /// Plan `i` (from 1) at index `i − 1`.
    others: Box<[PlanRules]>,
    book: Book<String>,
    resolver: Option<PlanResolver>,
}

impl fmt::Debug for PlanTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = std::iter::once(&*self.default_name)
            .chain(self.others.iter().map(|p| &*p.name))
            .collect();
        f.debug_struct("PlanTable")
            .field("plans", &names)
            .field("resolver", &self.resolver.is_some())
            .finish_non_exhaustive()
    }
}

/// What a builder asked for: the default plan's name, the other plans, the resolver
/// and how long its answers are kept.
pub(super) struct PlanSettings {
    pub(super) default_name: Option<String>,
    pub(super) plans: Vec<(String, Vec<Quota>)>,
    pub(super) resolver: Option<PlanResolver>,
    pub(super) keep_answers: Option<Duration>,
    pub(super) max_keys: usize,
}

impl PlanSettings {
    /// The table, its plans checked and put in the scripts' units; `None` when no plan
    /// but the default is defined and no resolver is set.
    ///
    /// # Errors
    /// [`ConfigError::InvalidPlan`] for a plan with no name or no quota, one defined
    /// twice (or named as the default), more than [`MAX_PLANS`]; and as
    /// [`ScriptQuota::new`] for a quota the scripts cannot run.
    pub(super) fn table(
        self,
        algorithm: Algorithm,
        key_prefix: &str,
    ) -> Result<Option<PlanTable>, RedisError> {
        if self.plans.is_empty() && self.resolver.is_none() && self.default_name.is_none() {
            return Ok(None);
        }
        let invalid = |plan: &str, why| ConfigError::InvalidPlan {
            plan: plan.to_owned(),
            why,
        };
        let default_name: Arc<str> = Arc::from(self.default_name.as_deref().unwrap_or("default"));
        if default_name.is_empty() {
            return Err(invalid("", "a plan needs a name").into());
        }
        if self.plans.len() + 1 > MAX_PLANS {
            return Err(invalid(&self.plans[MAX_PLANS - 1].0, "more than 256 plans").into());
        }
        let short = short_name(algorithm);
        let mut names = std::collections::HashSet::from([&*default_name]);
        let mut others = Vec::with_capacity(self.plans.len());
        for (name, quotas) in &self.plans {
            if name.is_empty() {
                return Err(invalid(name, "a plan needs a name").into());
            }
            if !names.insert(name) {
                return Err(invalid(name, "defined twice (or named as the default plan)").into());
            }
            let Some((&first, rest)) = quotas.split_first() else {
                return Err(invalid(name, "a plan needs at least one quota").into());
            };
            let also = (1..)
                .zip(rest)
                .map(|(i, &quota)| {
                    Ok(Also {
                        quota,
                        rule: ScriptQuota::new(algorithm, quota)?,
                        prefix: format!("{key_prefix}:{short}+{i}:"),
                    })
                })
                .collect::<Result<Box<[Also]>, RedisError>>()?;
            others.push(PlanRules {
                name: Arc::from(name.as_str()),
                current: Current {
                    rule: ScriptQuota::new(algorithm, first)?,
                    quota: first,
                },
                also,
            });
        }
        let keep_ns = self.keep_answers.map_or(u64::MAX, crate::clock::nanos);
        Ok(Some(PlanTable {
            default_name,
            book: Book::new(keep_ns, self.max_keys.saturating_mul(others.len() + 1)),
            others: others.into_boxed_slice(),
            resolver: self.resolver,
        }))
    }
}

impl RedisLimiter {
    /// The index of `key`'s plan: an operator's assignment, else the resolver's answer
    /// (kept), else the default. The default at once without plans.
    pub(super) fn plan_index(&self, key: &str) -> u32 {
        let inner = &*self.inner;
        let Some(table) = &inner.plans else {
            return DEFAULT_PLAN;
        };
        match table.book.find(key, || inner.local_clock.now_ns()) {
            Found::Assigned(plan) | Found::Resolved(plan) => plan,
            Found::Unknown => {
                let Some(resolver) = &table.resolver else {
                    return DEFAULT_PLAN;
                };
                let plan = match resolver(key) {
                    Some(name) => self.named(&name).unwrap_or_else(|_| {
                        crate::observe::unknown_plan(&inner.name, &name);
                        DEFAULT_PLAN
                    }),
                    None => DEFAULT_PLAN,
                };
                table
                    .book
                    .remember(key.to_owned(), plan, inner.local_clock.now_ns());
                plan
            }
        }
    }

    /// The index of the plan named `name`.
    fn named(&self, name: &str) -> Result<u32, RedisError> {
        let unknown = || RedisError::Config(ConfigError::UnknownPlan(name.to_owned()));
        let table = self.inner.plans.as_ref();
        if table.map_or("default", |t| &*t.default_name) == name {
            return Ok(DEFAULT_PLAN);
        }
        let others = table.ok_or_else(unknown)?;
        let at = others.others.iter().position(|p| &*p.name == name);
        at.map(|i| i as u32 + 1).ok_or_else(unknown)
    }

    /// The quotas of plan `plan`: the first in force and the `also` quotas.
    pub(super) fn rules(&self, plan: u32) -> (Current, &[Also]) {
        let inner = &*self.inner;
        let other = (plan != DEFAULT_PLAN)
            .then(|| inner.plans.as_ref()?.others.get(plan as usize - 1))
            .flatten();
        match other {
            Some(p) => (p.current, &p.also),
            None => (*inner.current.read(), &inner.also),
        }
    }

    /// Checks one request for `key` under the quotas of the plan named `plan`, whatever
    /// the key's own plan (for a caller that knows it: a claim of an authenticated
    /// request, say).
    ///
    /// # Errors
    /// [`RedisError::Config`] ([`ConfigError::UnknownPlan`]) for a plan not defined,
    /// before any I/O; otherwise as [`check`](Self::check).
    pub async fn check_in(&self, plan: &str, key: &str) -> Result<Decision, RedisError> {
        self.check_n_in(plan, key, 1).await
    }

    /// [`check_in`](Self::check_in) of a request of cost `n`.
    ///
    /// # Errors
    /// As [`check_in`](Self::check_in) and [`check_n`](Self::check_n).
    pub async fn check_n_in(&self, plan: &str, key: &str, n: u64) -> Result<Decision, RedisError> {
        let plan = self.named(plan)?;
        self.check_planned(key, n, plan).await
    }

    /// Puts `key` on the plan named `plan` on this node (every node holds its own plan
    /// book: give each the same assignments, or the same resolver). The key's counts
    /// stay in Redis by position: a key moved to a plan with the same periods keeps what
    /// it used. This node's deny cache forgets the key.
    ///
    /// # Errors
    /// [`RedisError::Config`] ([`ConfigError::UnknownPlan`]) for a plan not defined.
    pub fn assign(&self, key: &str, plan: &str) -> Result<(), RedisError> {
        let index = self.named(plan)?;
        let Some(table) = &self.inner.plans else {
            return Ok(());
        };
        table.book.assign(key.to_owned(), index);
        if let Some(cache) = &self.inner.cache {
            cache.forget(key);
        }
        Ok(())
    }

    /// Takes `key`'s assignment away: the resolver (or the default) decides again.
    /// Returns the plan it was assigned to, if any.
    pub fn unassign(&self, key: &str) -> Option<Arc<str>> {
        let table = self.inner.plans.as_ref()?;
        let plan = table.book.unassign(key)?;
        if let Some(cache) = &self.inner.cache {
            cache.forget(key);
        }
        Some(self.plan_name(plan))
    }

    /// The name of `key`'s plan (asking the resolver, once, if the book does not know).
    pub fn plan_of(&self, key: &str) -> Arc<str> {
        self.plan_name(self.plan_index(key))
    }

    /// Makes the resolver be asked again for every key whose plan it answered
    /// (assignments stay).
    pub fn forget_plan_answers(&self) {
        if let Some(table) = &self.inner.plans {
            table.book.forget_answers();
        }
    }

    /// The plans' names, the default's first.
    pub fn plan_names(&self) -> Vec<Arc<str>> {
        match &self.inner.plans {
            None => vec![Arc::from("default")],
            Some(t) => std::iter::once(Arc::clone(&t.default_name))
                .chain(t.others.iter().map(|p| Arc::clone(&p.name)))
                .collect(),
        }
    }

    /// The quotas of the plan named `plan`, its first first.
    ///
    /// # Errors
    /// [`RedisError::Config`] ([`ConfigError::UnknownPlan`]) for a plan not defined.
    pub fn quotas_of(&self, plan: &str) -> Result<Vec<Quota>, RedisError> {
        let (current, also) = self.rules(self.named(plan)?);
        Ok(std::iter::once(current.quota)
            .chain(also.iter().map(|a| a.quota))
            .collect())
    }

    /// [`check_or`](Self::check_or) of one request for `key` under the plan named
    /// `plan` (a name not defined: the default plan), or the key's own plan if `None`,
    /// for the HTTP layer: the decision, the error the fail mode answered for, and the
    /// deciding plan's index.
    #[cfg(feature = "tower")]
    pub(crate) async fn check_reporting_in(
        &self,
        plan: Option<&str>,
        key: &str,
        mode: FailMode,
    ) -> (Decision, Option<RedisError>, u32) {
        let index = match plan {
            Some(name) => self.named(name).unwrap_or(DEFAULT_PLAN),
            None => self.plan_index(key),
        };
        match self.check_planned(key, 1, index).await {
            Ok(decision) => (decision, None, index),
            Err(e) => (self.fail_mode_in(mode, key, 1, index), Some(e), index),
        }
    }

    /// Each plan's name and quotas with their capacities, by index (the default
    /// first); empty for a limiter without plans.
    #[cfg(feature = "tower")]
    pub(crate) fn plan_table(&self) -> Vec<crate::plans::PlanQuotas> {
        let Some(table) = &self.inner.plans else {
            return Vec::new();
        };
        let algorithm = self.inner.algorithm;
        (0..=table.others.len() as u32)
            .map(|plan| {
                let (current, also) = self.rules(plan);
                let quotas = std::iter::once(current.quota)
                    .chain(also.iter().map(|a| a.quota))
                    .map(|q| (q, capacity_of(algorithm, q)))
                    .collect();
                (self.plan_name(plan), quotas)
            })
            .collect()
    }

    /// Every Redis key that may hold `key`'s state, under any plan's quotas: the
    /// limiter's own ([`redis_keys`](Self::redis_keys)), then those of further quotas
    /// of longer plans.
    pub(super) fn every_state_key(&self, key: &str) -> Vec<Vec<u8>> {
        let mut keys = self.redis_keys(key);
        let longest = self.inner.plans.as_ref().map_or(&[][..], |t| {
            t.others
                .iter()
                .map(|p| &p.also[..])
                .max_by_key(|also| also.len())
                .unwrap_or(&[])
        });
        for also in longest.iter().skip(keys.len() - 1) {
            keys.push(self.state_key(&also.prefix, key));
        }
        keys
    }

    fn plan_name(&self, plan: u32) -> Arc<str> {
        match &self.inner.plans {
            None => Arc::from("default"),
            Some(t) => match plan.checked_sub(1).and_then(|i| t.others.get(i as usize)) {
                Some(p) => Arc::clone(&p.name),
                None => Arc::clone(&t.default_name),
            },
        }
    }
}
