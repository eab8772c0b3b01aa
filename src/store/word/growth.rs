//! How a shard's table grows, shrinks and migrates: inserts, the steps a migration
//! takes under the writer mutex, and the help checks give it.

use super::*;

impl<K: crate::Key, R: Rule> WordStore<K, R> {
    /// A check met a migration under way (on its key's table, moved or not): one such
    /// check in [`HELP_EVERY`] per thread helps it along, under a guard of its own (a
    /// nested one on the slow path, which holds its own).
    #[cold]
    #[inline(never)]
    pub(super) fn met_migration(&self, shard: &WordShard<K, R>, now: u64) {
        let driven = self.driving.load(Ordering::Relaxed) > 0;
        if !driven && helps_this_time() {
            let guard = reclaim::pin();
            self.help(shard, &guard, now);
        }
    }

    /// Moves a batch of a migration's slots if no writer is busy (a check that met the
    /// migration helps it end). Allocates nothing: a table it unlinks is retired by the
    /// next writer.
    pub(super) fn help(&self, shard: &WordShard<K, R>, guard: &Guard<'_>, now: u64) {
        if let Some(mut writer) = shard.try_write() {
            if writer.help(guard, STEP_PER_INSERT, self.rehash(), now) {
                self.published(&mut writer);
            }
        }
    }

    /// Moves up to `budget` slots of the shard's migration, if one runs. Returns true if
    /// the migration ended.
    pub(super) fn step(
        &self,
        writer: &mut ShardWriter<'_, K, R>,
        guard: &Guard<'_>,
        budget: usize,
        now: u64,
    ) -> bool {
        let published = writer.step(guard, budget, self.rehash(), now);
        if published {
            self.published(writer);
        }
        published
    }

    /// Runs a migration under way to its end, under this hold of the writer mutex.
    pub(super) fn finish(&self, writer: &mut ShardWriter<'_, K, R>, guard: &Guard<'_>, now: u64) {
        self.step(writer, guard, usize::MAX, now);
    }

    /// Runs the shard's migration to its end, a batch at a time, taking the writer mutex
    /// for each batch only (for the paths that start one for an operator: quota changes,
    /// removals): checks and inserts go on between batches. Then destroys to their end
    /// the retired tables whose release went in pieces (the operator pays for those, not
    /// the next writes).
    pub(super) fn drive(&self, shard: &WordShard<K, R>, now: impl Fn() -> u64) {
        loop {
            let running = with_guard(|guard| {
                let mut writer = shard.write();
                self.step(&mut writer, guard, DRIVE_BATCH, now());
                writer.migrating(guard)
            });
            if !running {
                reclaim::global().release_parked();
                return;
            }
        }
    }

    /// The write path of a check on a key that was absent or in the middle of its move:
    /// under the writer mutex, finds the key again (another thread may have inserted it,
    /// or the writer that moved it has placed it) and decides on it, doing none of an
    /// insert's work, which may allocate. Otherwise moves a batch of a migration under
    /// way, writes ahead a growing table's next one, makes room, inserts the key and
    /// decides, and sets `wrote` (that work may retire a table: the caller's collect is
    /// then a writer's). `None`: look again.
    #[cold]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn insert<Q>(
        &self,
        shard: &WordShard<K, R>,
        guard: &Guard<'_>,
        hash: u64,
        key: &Q,
        now: u64,
        op: Op,
        wrote: &mut bool,
    ) -> Result<Option<Decision>, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let mut writer = shard.write();
        if let Located::Found { table, slot, raw } =
            writer.table(guard).locate(hash, |k| k.borrow() == key)
        {
            let policy = table.meta.policy_for(hash, key);
            op.fits(policy)?;
            return Ok(match apply(slot, raw, policy, now, op) {
                Applied::Done(decision) => Some(decision),
                Applied::Frozen | Applied::Removed => None,
            });
        }
        // Absent. (Under the writer mutex no key is half moved: frozen and absent from the
        // next table means removed after its move.) Moving slots cannot bring it back.
        *wrote = true;
        self.step(&mut writer, guard, STEP_PER_INSERT, now);
        self.prepare_growth(&mut writer, guard);
        // The policy may have changed since the lock-free read; the step may have ended
        // the migration (then its table is the current one).
        let policy = *writer.target(guard).meta.policy_for(hash, key);
        op.fits(&policy)?;
        if let Some(decision) = op.on_absent(&policy, now) {
            return Ok(Some(decision));
        }
        if let Err(retry_after_ns) = self.counts.take_place(
            || self.make_room(&mut writer, guard, now),
            || self.denies.invalidate(),
        ) {
            return Ok(Some(self.counts.refusal(policy.capacity(), retry_after_ns)));
        }
        if !writer.has_room(guard) {
            self.rebuild_full(&mut writer, guard, now);
        }
        match writer.insert(guard, hash, key.to_owned(), R::UNTOUCHED) {
            Ok(slot) => {
                writer.state().live += 1;
                let applied = apply(slot, slot.load_raw(), &policy, now, op);
                if let Word::Live(state) = slot.load() {
                    let from = policy.droppable_from(state, now);
                    let hand = writer.state();
                    hand.drop_from = hand.drop_from.min(from);
                }
                Ok(match applied {
                    Applied::Done(decision) => Some(decision),
                    Applied::Frozen | Applied::Removed => None,
                })
            }
            Err(_) => {
                // The shard is at its largest table (2³² slots).
                self.counts.give_back();
                Ok(Some(
                    self.counts
                        .refusal(policy.capacity(), policy.fallback_retry_ns()),
                ))
            }
        }
    }

    /// Writes a few pages of the table a growing shard will move to next, once it is
    /// near full (see [`PREPARE_AHEAD`]).
    pub(super) fn prepare_growth(&self, writer: &mut ShardWriter<'_, K, R>, guard: &Guard<'_>) {
        if !writer.state().growing || writer.migrating(guard) {
            return;
        }
        let capacity = writer.table(guard).capacity();
        if !writer.nearly_full(guard, capacity / PREPARE_AHEAD) {
            return;
        }
        let live = writer.state().live;
        writer.prepare(guard, grown(capacity), live, PREPARE_PAGES);
    }

    /// Rebuilds a full table (live and removed slots at the load limit). With sweeping
    /// on, first drops the keys untouched for a period and since the last such rebuild
    /// (see [`Sweep`]): the keys in use stay, whatever their period. Then sizes the new
    /// table for what the last rebuild's span showed:
    /// - the keys left fill at most 60% of it: the same size without the removed slots,
    ///   or, under an eighth, a table they fill 30% of (every key inserted since the last
    ///   rebuild is among them, so the smaller table takes as many inserts again before it
    ///   is full: it does not regrow at once);
    /// - more, and nothing was dropped (the keys are all in use: growth): [`grown`];
    /// - more, after drops: [`grown`] but at most 2×. Either the keys in use outnumber
    ///   what one span holds (they come back after a drop: the table grows until a span
    ///   covers them), or a flood of keys goes idle, and then the keys carried over fill
    ///   at least 30% of the larger table, so its next span inserts at most 56% of it, all
    ///   of which a rebuild's sweep finds under 60%: growth stops, and the flood is held to
    ///   about two spans' worth of keys. (Growth by more than 2.3× would not stop.)
    ///
    /// The sweep reads every slot under the writer mutex (O(1) per insert, amortised, but
    /// not bounded per insert: 1.8 ms at 250,000 keys), so it runs only once a key can be
    /// droppable ([`Hand::drop_from`]): a table growing with its keys all in use skips it.
    /// The rebuild itself is a migration: this call only starts it, and inserts and
    /// checks move its slots a batch at a time.
    pub(super) fn rebuild_full(
        &self,
        writer: &mut ShardWriter<'_, K, R>,
        guard: &Guard<'_>,
        now: u64,
    ) {
        // A migration under way ends first: then the current table is the full one.
        self.finish(writer, guard, now);
        let capacity = writer.table(guard).capacity();
        let mut dropped = 0;
        // Only once a key can go: a skipped sweep does what one dropping nothing would,
        // which is all it could do.
        let sweeping = self.limits.sweep && now >= writer.state().drop_from;
        #[cfg(test)]
        if self.limits.sweep && !sweeping {
            let missed = self.droppable(writer, guard, now);
            let hand = writer.state();
            hand.skipped_sweeps += 1;
            hand.missed += missed;
        }
        if sweeping {
            let built = writer.state().built;
            let swept = self.sweep(writer, guard, now, capacity, Some(built));
            dropped = swept.dropped;
            // The sweep read every key of the shard: the bound is theirs alone now.
            writer.state().drop_from = swept.drop_from;
            #[cfg(test)]
            {
                writer.state().full_sweeps += 1;
            }
            self.counts.swept(dropped);
        }
        writer.state().built = now;
        let needed = writer.state().live + 1;
        let capacity = if needed * GROW_ABOVE_DEN <= capacity * GROW_ABOVE_NUM {
            if needed * 8 < capacity {
                (needed * 10 / 3).max(self.floor)
            } else {
                capacity
            }
        } else if dropped == 0 {
            grown(capacity)
        } else {
            grown(capacity).min(capacity * 2)
        };
        writer.state().growing = capacity > writer.table(guard).capacity();
        self.resize_to(writer, guard, capacity, now);
    }

    /// Starts migrating the shard to a table sized for `live` keys at the target load.
    pub(super) fn resize(
        &self,
        writer: &mut ShardWriter<'_, K, R>,
        guard: &Guard<'_>,
        live: usize,
        now: u64,
    ) {
        let capacity = (live * TARGET_LOAD_DEN / TARGET_LOAD_NUM).max(self.floor);
        self.resize_to(writer, guard, capacity, now);
    }

    /// Starts migrating the shard to a table of `capacity` slots (more if its keys need
    /// them), with the same policies, leaving removed slots behind.
    pub(super) fn resize_to(
        &self,
        writer: &mut ShardWriter<'_, K, R>,
        guard: &Guard<'_>,
        capacity: usize,
        now: u64,
    ) {
        let meta = writer.target(guard).meta.clone();
        self.begin(writer, guard, capacity, meta, now);
    }

    /// Starts a migration to a table of `capacity` slots carrying `meta` (finishing one
    /// under way first).
    pub(super) fn begin(
        &self,
        writer: &mut ShardWriter<'_, K, R>,
        guard: &Guard<'_>,
        capacity: usize,
        meta: Policies<K, R>,
        now: u64,
    ) {
        self.finish(writer, guard, now);
        let live = writer.state().live;
        writer.begin_migration(guard, capacity, live, meta, self.rehash(), now);
        self.counts.resized();
    }

    /// Bookkeeping after a migration published its table: the hand starts over.
    pub(super) fn published(&self, writer: &mut ShardWriter<'_, K, R>) {
        writer.state().at = 0;
    }

    /// Shrinks the shard's table once it is under a quarter full, so memory taken by a
    /// flood is given back.
    pub(super) fn shrink_if_sparse(
        &self,
        writer: &mut ShardWriter<'_, K, R>,
        guard: &Guard<'_>,
        now: u64,
    ) {
        let live = writer.state().live;
        let capacity = writer.target(guard).capacity();
        if capacity > self.floor && live * 4 < capacity {
            self.resize(
                writer,
                guard,
                live * 2 * TARGET_LOAD_NUM / TARGET_LOAD_DEN,
                now,
            );
        }
    }
}
