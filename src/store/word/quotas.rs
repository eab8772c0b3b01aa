//! Per-key quotas, the default quota and removal: the operator's paths, each of which
//! drives the migration it starts to its end.

use super::*;

impl<K: crate::Key, R: Rule> WordStore<K, R> {
    /// Removes `key`'s state (not its key quota); true if it held state.
    ///
    /// Takes the key's shard writer mutex (and, if the removal shrinks the table, again
    /// for each batch of the migration).
    pub(crate) fn remove<Q>(&self, key: &Q, now: impl Fn() -> u64) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hash(key);
        let shard = self.shard(hash);
        let _driving = Driving::new(&self.driving);
        let removed = with_guard(|guard| {
            let mut writer = shard.write();
            let Located::Found { slot, .. } =
                writer.table(guard).locate(hash, |k| k.borrow() == key)
            else {
                return false;
            };
            if writer.remove(slot).is_none() {
                return false;
            }
            writer.state().live -= 1;
            self.shrink_if_sparse(&mut writer, guard, now());
            true
        });
        if removed {
            self.counts.removed();
            self.denies.invalidate();
            self.drive(shard, now);
        }
        removed
    }

    /// Gives `key` its own policy (`Some`) or returns it to the default (`None`),
    /// converting its state. The shard migrates to a table carrying the new policies;
    /// until its slot has moved, the key is decided by the old ones.
    ///
    /// Takes the key's shard writer mutex, once to start the migration and once for each
    /// batch of it: checks go on meanwhile.
    pub(crate) fn set_key_quota(&self, key: K, policy: Option<WordPolicy>, now: impl Fn() -> u64) {
        let hash = self.hash(&key);
        let shard = self.shard(hash);
        let _driving = Driving::new(&self.driving);
        with_guard(|guard| {
            let mut writer = shard.write();
            self.finish(&mut writer, guard, now());
            let table = writer.table(guard);
            let mut key_quotas = table
                .meta
                .key_quotas
                .as_deref()
                .map_or_else(KeyQuotas::new, Clone::clone);
            let rehash = self.rehash();
            key_quotas.set(
                hash,
                Arc::new(key),
                policy.map(|first| table.meta.default.with_first(first)),
                |a, b| **a == **b,
                |k: &Arc<K>| rehash(k),
            );
            let meta = Policies {
                default: table.meta.default,
                key_quotas: (!key_quotas.is_empty()).then(|| Arc::new(key_quotas)),
            };
            let capacity = table.capacity();
            // Converted states and another period: the bound no longer holds.
            writer.state().drop_from = 0;
            self.begin(&mut writer, guard, capacity, meta, now());
        });
        self.denies.invalidate();
        self.drive(shard, &now);
        self.denies.invalidate();
    }

    /// The policy of the limiter's own quota that `key` is limited by. Takes no lock.
    pub(crate) fn policy_of<Q>(&self, key: &Q) -> WordPolicy
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.rule_of(key).first()
    }

    /// The rule `key` is limited by. Takes no lock.
    pub(crate) fn rule_of<Q>(&self, key: &Q) -> R
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hash(key);
        with_guard(
            |guard| match self.locate(self.shard(hash), guard, hash, key) {
                Located::Found { table, .. } | Located::Absent { table } => {
                    *table.meta.policy_for(hash, key)
                }
                Located::Moving => *self
                    .shard(hash)
                    .read(guard)
                    .newest()
                    .meta
                    .policy_for(hash, key),
            },
        )
    }

    /// The default policy. Takes no lock.
    pub(crate) fn default_policy(&self) -> WordPolicy {
        self.default_rule().first()
    }

    /// The default rule (every quota's policy). Takes no lock.
    pub(crate) fn default_rule(&self) -> R {
        with_guard(|guard| self.shards[0].read(guard).newest().meta.default)
    }

    /// Replaces the default quota, keeping the algorithm, converting every key without a
    /// key quota. Each shard migrates to a table carrying the new default; until a key's
    /// slot has moved, it is decided by the old one, and its state is converted as it
    /// moves (at that instant).
    ///
    /// Takes each shard's writer mutex once to start its migration and once for each
    /// batch of it: checks never wait on it (a check meeting a key in the middle of its
    /// move, a few nanoseconds, waits for that move), and inserts go on between batches.
    pub(crate) fn set_default_quota(
        &self,
        quota: Quota,
        now: impl Fn() -> u64,
    ) -> Result<(), ConfigError> {
        self.set_default_rule(
            |rule| Ok(rule.with_first(rule.first().with_quota(quota)?)),
            now,
        )
    }

    /// [`set_default_quota`](Self::set_default_quota) for the whole rule: `change` makes
    /// the new default rule of the current one (under the lock that serialises changes),
    /// and every key without a key quota is converted to it.
    pub(crate) fn set_default_rule(
        &self,
        change: impl FnOnce(R) -> Result<R, ConfigError>,
        now: impl Fn() -> u64,
    ) -> Result<(), ConfigError> {
        let _serial = self.reconfigure.lock();
        let policy = change(self.default_rule())?;
        let _driving = Driving::new(&self.driving);
        for shard in self.shards.iter() {
            with_guard(|guard| {
                let mut writer = shard.write();
                self.finish(&mut writer, guard, now());
                let table = writer.table(guard);
                let meta = Policies {
                    default: policy,
                    // A key quota replaces the first quota only: its others follow.
                    key_quotas: table.meta.key_quotas.as_deref().map(|held| {
                        let mut rebased = held.clone();
                        rebased.for_each_policy(|own| *own = policy.with_first(own.first()));
                        Arc::new(rebased)
                    }),
                };
                let capacity = table.capacity();
                // Converted states and another period: the bound no longer holds.
                writer.state().drop_from = 0;
                self.begin(&mut writer, guard, capacity, meta, now());
            });
        }
        self.denies.invalidate();
        for shard in self.shards.iter() {
            self.drive(shard, &now);
        }
        self.denies.invalidate();
        Ok(())
    }
}
