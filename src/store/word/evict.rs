//! Making room in a full table: the sweep of idle keys and the eviction of the least
//! costly ones.

use super::*;

impl<K: crate::Key, R: Rule> WordStore<K, R> {
    /// The policy of the key in `slot` (which must hold one).
    pub(super) fn slot_policy<'t>(
        &self,
        table: &'t Table<K, Policies<K, R>, R::Atom>,
        slot: &Slot<K, R::Atom>,
    ) -> &'t R {
        if table.meta.key_quotas.is_none() {
            return &table.meta.default;
        }
        slot.with_key(|key| table.meta.policy_for(self.hash(key), key))
            .unwrap_or(&table.meta.default)
    }

    /// Moves the eviction hand over `slots` slots of the current table, dropping the keys
    /// back to untouched (see [`Sweep`]; with a `grace`, only those untouched for a period
    /// and since then, or for 4 periods and 1 s). Returns how many were removed, the
    /// soonest time, in ns, at which a visited survivor will be droppable by a sweep like
    /// this one, and the soonest instant at which a rebuild's sweep could drop one.
    pub(super) fn sweep(
        &self,
        writer: &mut ShardWriter<'_, K, R>,
        guard: &Guard<'_>,
        now: u64,
        slots: usize,
        grace: Option<u64>,
    ) -> Swept {
        let table = writer.table(guard);
        let capacity = table.capacity();
        let mut sweep = Sweep::new(now, grace);
        let mut drop_from = u64::MAX;
        for _ in 0..slots.min(capacity) {
            let at = writer.state().at % capacity;
            writer.state().at = at + 1;
            let slot = table.slot(at);
            let Some(judged) = self.judge(table, slot, &sweep, now) else {
                continue;
            };
            // A check that changed the state meanwhile keeps the key.
            if sweep.visit(judged.wait, || writer.remove_unchanged(slot, judged.state)) {
                writer.state().live -= 1;
            } else if judged.wait > 0 {
                // Untouched from `since + wait` on (see `Rule::droppable_from`).
                drop_from = drop_from.min(judged.droppable_at);
            } else {
                drop_from = 0;
            }
        }
        let (dropped, soonest) = sweep.finish();
        Swept {
            dropped,
            soonest,
            drop_from,
        }
    }

    /// How `sweep` judges the key in `slot` at `now`: `None` if the slot holds no live key.
    pub(super) fn judge(
        &self,
        table: &Table<K, Policies<K, R>, R::Atom>,
        slot: &Slot<K, R::Atom>,
        sweep: &Sweep,
        now: u64,
    ) -> Option<Judged<StateOf<R>>> {
        let Word::Live(state) = slot.load() else {
            return None;
        };
        let verdict = self.slot_policy(table, slot).judge(state, now, sweep);
        Some(Judged {
            state,
            wait: verdict.wait,
            droppable_at: verdict.droppable_at,
        })
    }

    /// How many keys of the current table a rebuild's sweep at `now` would drop, dropping
    /// none.
    #[cfg(test)]
    pub(super) fn droppable(
        &self,
        writer: &mut ShardWriter<'_, K, R>,
        guard: &Guard<'_>,
        now: u64,
    ) -> usize {
        let table = writer.table(guard);
        let sweep = Sweep::new(now, Some(writer.state().built));
        (0..table.capacity())
            .filter_map(|at| self.judge(table, table.slot(at), &sweep, now))
            .filter(|judged| judged.wait == 0)
            .count()
    }

    /// Makes room for one key in a full store: an untouched key near the hand if there is
    /// one, else, under [`WhenFull::EvictLeastActive`], of a few sampled keys the one
    /// whose eviction loses the least: the fewest units consumed, then the soonest reset.
    pub(super) fn make_room(
        &self,
        writer: &mut ShardWriter<'_, K, R>,
        guard: &Guard<'_>,
        now: u64,
    ) -> Room {
        let Swept {
            dropped, soonest, ..
        } = self.sweep(writer, guard, now, SCAN_WHEN_FULL * 8, None);
        if dropped > 0 {
            self.shrink_if_sparse(writer, guard, now);
            return Room::Untouched;
        }
        let table = writer.table(guard);
        let fallback = table.meta.default.fallback_retry_ns().max(1);
        if self.limits.when_full == WhenFull::DenyNewKeys || writer.state().live == 0 {
            return Room::none_until(soonest, fallback);
        }
        // While a migration runs, the live keys are in both tables: positions past the
        // current table's are the new one's.
        let target = writer.target(guard);
        let positions = if std::ptr::eq(table, target) {
            table.capacity()
        } else {
            table.capacity() + target.capacity()
        };
        let slot_at = |at: usize| {
            if at < table.capacity() {
                (table, table.slot(at))
            } else {
                (target, target.slot(at - table.capacity()))
            }
        };
        // With no more live keys than samples, every key is a candidate (the table is
        // then small: it shrinks below a quarter full): random draws could miss the one
        // that loses least.
        let every = writer.state().live <= SAMPLES;
        let mut rng = writer.state().rng;
        let victim = least_costly(positions, every, SAMPLES * 8, &mut rng, |at| {
            let (table, slot) = slot_at(at);
            let Word::Live(state) = slot.load() else {
                return None;
            };
            Some(self.slot_policy(table, slot).eviction_cost(state, now))
        });
        // The draws can all miss in tables of mostly removed slots (a flood evicts a key
        // per insert): then the first live key from a random position.
        let start = (rng.next_u64() % positions as u64) as usize;
        writer.state().rng = rng;
        let victim = victim.or_else(|| {
            (0..positions)
                .map(|i| (start + i) % positions)
                .find(|&at| matches!(slot_at(at).1.load(), Word::Live(_)))
        });
        let Some(at) = victim else {
            return Room::None {
                retry_after_ns: fallback,
            };
        };
        if writer.remove(slot_at(at).1).is_some() {
            writer.state().live -= 1;
            Room::Active
        } else {
            Room::None {
                retry_after_ns: fallback,
            }
        }
    }
}
