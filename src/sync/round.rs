//! What a round carries, as pure functions beside the [driver](super::driver): which keys
//! ([`Selection`]: at most the round's cap, the most urgent first) and how they are
//! split into script calls ([`batches`]: by cluster slot, at most a batch each). The task
//! feeds them its keys and sends what they return; the tests below run them over
//! generated inputs.

use std::collections::HashMap;
use std::hash::Hash;

use super::key::Need;

/// The keys one round carries: at most `max`, the most urgent first (a lease before a
/// report before a release).
pub(crate) struct Selection<K> {
    max: usize,
    /// The keys taken, by [`Need`].
    classes: [Vec<K>; 3],
    /// Keys that needed a round and did not get into this one.
    waiting: usize,
}

impl<K> Selection<K> {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            max,
            classes: [Vec::new(), Vec::new(), Vec::new()],
            waiting: 0,
        }
    }

    /// Offers `key`, which needs `need`. It is taken while the keys taken of its class
    /// and the more urgent ones leave room (a more urgent key offered later may still
    /// push it out); otherwise it is given back, for the caller to release locally or to
    /// count as [`waiting`](Self::wait).
    pub(crate) fn offer(&mut self, key: K, need: Need) -> Result<(), K> {
        let class = need as usize;
        let ahead: usize = self.classes[..class].iter().map(Vec::len).sum();
        if self.classes[class].len() < self.max.saturating_sub(ahead) {
            self.classes[class].push(key);
            Ok(())
        } else {
            Err(key)
        }
    }

    /// Counts a key given back by [`offer`](Self::offer) that waits for a later round.
    pub(crate) fn wait(&mut self) {
        self.waiting += 1;
    }

    /// The round's keys, most urgent first, and how many keys wait for a later round.
    pub(crate) fn finish(self) -> (Vec<K>, usize) {
        let [mut chosen, report, release] = self.classes;
        chosen.extend(report);
        chosen.extend(release);
        let waiting = self.waiting + chosen.len().saturating_sub(self.max);
        chosen.truncate(self.max);
        (chosen, waiting)
    }
}

/// One call of the round script: with the heartbeat (the registry as its first key) or
/// not, and the indices of the round's keys it carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Call {
    pub(crate) registry: bool,
    pub(crate) items: Vec<usize>,
}

/// Splits a round's `keys` into pipelines of script calls of at most `batch` keys each.
///
/// On one server (`slot_of` is `None`) one pipeline carries every key, each call with
/// the registry (an empty round is the heartbeat alone). On a cluster every call's keys
/// share a slot (`slot_of`): the heartbeat goes alone, in its own pipeline, and each
/// slot's keys in one more, in the order each slot first appears.
pub(crate) fn batches<S: Hash + Eq>(
    keys: &[Vec<u8>],
    batch: usize,
    slot_of: Option<impl Fn(&[u8]) -> S>,
) -> Vec<Vec<Call>> {
    let batch = batch.max(1);
    let chunks = |indices: &[usize], registry: bool| -> Vec<Call> {
        indices
            .chunks(batch)
            .map(|items| Call {
                registry,
                items: items.to_vec(),
            })
            .collect()
    };
    let heartbeat = || Call {
        registry: true,
        items: Vec::new(),
    };
    let Some(slot_of) = slot_of else {
        if keys.is_empty() {
            return vec![vec![heartbeat()]];
        }
        let all: Vec<usize> = (0..keys.len()).collect();
        return vec![chunks(&all, true)];
    };
    let mut slots: HashMap<S, usize> = HashMap::new();
    let mut by_slot: Vec<Vec<usize>> = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let next = by_slot.len();
        let at = *slots.entry(slot_of(key)).or_insert(next);
        if at == next {
            by_slot.push(Vec::new());
        }
        by_slot[at].push(i);
    }
    let mut plan = vec![vec![heartbeat()]];
    plan.extend(by_slot.iter().map(|indices| chunks(indices, false)));
    plan
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn need(n: u8) -> Need {
        match n % 3 {
            0 => Need::Lease,
            1 => Need::Report,
            _ => Need::Release,
        }
    }

    #[test]
    fn a_full_round_takes_leases_before_reports_before_releases() {
        let mut s = Selection::new(3);
        for (key, n) in [
            ("r1", Need::Release),
            ("p1", Need::Report),
            ("r2", Need::Release),
        ] {
            assert!(s.offer(key, n).is_ok());
        }
        assert_eq!(s.offer("r3", Need::Release), Err("r3"));
        s.wait();
        assert!(s.offer("l1", Need::Lease).is_ok());
        assert!(s.offer("l2", Need::Lease).is_ok());
        let (chosen, waiting) = s.finish();
        assert_eq!(chosen, ["l1", "l2", "p1"]);
        // r3 waited; r1 and r2 were pushed out by the later leases.
        assert_eq!(waiting, 3);
    }

    #[test]
    fn a_round_of_no_room_takes_nothing() {
        let mut s = Selection::new(0);
        assert_eq!(s.offer(1, Need::Lease), Err(1));
        s.wait();
        assert_eq!(s.finish(), (Vec::new(), 1));
    }

    proptest! {
        /// Whatever the order keys come in: at most `max` are chosen, most urgent first;
        /// no chosen key is less urgent than a key left out; each offered key is chosen,
        /// given back or counted waiting, once.
        #[test]
        fn the_most_urgent_keys_fill_the_round(
            needs in prop::collection::vec(any::<u8>(), 0..200),
            max in 0usize..50,
        ) {
            let mut s = Selection::new(max);
            let mut given_back = Vec::new();
            for (key, &n) in needs.iter().enumerate() {
                if let Err(key) = s.offer(key, need(n)) {
                    given_back.push(key);
                    s.wait();
                }
            }
            let (chosen, waiting) = s.finish();
            prop_assert!(chosen.len() <= max);
            prop_assert_eq!(chosen.len() + waiting, needs.len());
            let urgency = |key: &usize| need(needs[*key]) as usize;
            prop_assert!(chosen.windows(2).all(|w| urgency(&w[0]) <= urgency(&w[1])));
            let worst_chosen = chosen.iter().map(urgency).max();
            let mut left_out: Vec<usize> =
                (0..needs.len()).filter(|k| !chosen.contains(k)).collect();
            left_out.sort_by_key(urgency);
            if let (Some(worst), Some(best_left)) = (worst_chosen, left_out.first().map(urgency)) {
                prop_assert!(worst <= best_left, "a less urgent key went before a more urgent one");
            }
            // The round is full whenever a key was left out.
            prop_assert!(left_out.is_empty() || chosen.len() == max);
        }

        /// Every key goes in exactly one call, no call carries more than `batch` keys; on
        /// one server every call carries the registry, on a cluster exactly one call
        /// does (the heartbeat, alone) and every other call's keys share a slot.
        #[test]
        fn every_key_goes_once_in_calls_of_one_slot(
            keys in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..4), 0..300),
            batch in 0usize..40,
            slots in 1u8..20,
            cluster: bool,
        ) {
            let slot_of = |key: &[u8]| key.iter().fold(0u8, |a, b| a.wrapping_add(*b)) % slots;
            let plan = batches(&keys, batch, cluster.then_some(slot_of));
            let calls: Vec<&Call> = plan.iter().flatten().collect();
            let registry = calls.iter().filter(|c| c.registry).count();
            prop_assert_eq!(registry, if cluster { 1 } else { calls.len() });
            let mut seen = vec![0u32; keys.len()];
            for call in &calls {
                prop_assert!(call.items.len() <= batch.max(1));
                prop_assert!(call.registry || !call.items.is_empty());
                for &i in &call.items {
                    seen[i] += 1;
                }
                if cluster {
                    prop_assert!(!call.registry || call.items.is_empty());
                    let first = call.items.first().map(|&i| slot_of(&keys[i]));
                    prop_assert!(call.items.iter().all(|&i| Some(slot_of(&keys[i])) == first));
                } else {
                    prop_assert_eq!(plan.len(), 1);
                }
            }
            prop_assert!(seen.iter().all(|&n| n == 1));
        }
    }
}
