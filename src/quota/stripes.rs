//! Providers spread over several documents once their allocations outgrow one.
//!
//! A consume writes one document, and that write scans and rewrites the whole document, so a
//! provider whose every allocation sat in one document would make each consume cost in
//! proportion to how many others hold part of it. Instead a provider is kept in *stripes*:
//! stripe 0 is the provider's own document, and each stripe holds
//!
//! - the entries of the requests whose hash (of consumer and request id) ends in the stripe's
//!   number, written in `bits` binary digits, and
//! - a *share* of the provider's limit (its `limit`), with its usage and `available` as before.
//!
//! The shares add up to the provider's limit at every moment (only transactions move them), and
//! every consume is conditional on its stripe's `available`, so the provider as a whole is never
//! over its limit. A request's entry is always in the stripe its hash addresses, so the
//! single-write consume's condition "this request is not recorded yet" still sees every earlier
//! copy of the request.
//!
//! **Splitting.** A consume's condition also asks that its stripe hold fewer than
//! [`STRIPE_ENTRIES`] entries. A full stripe is split in one transaction: stripe `a` with `bits =
//! l` becomes stripes `a` and `a + 2^l`, both with `l + 1` bits, its entries going by the next bit
//! of their hash and its free share halved between them; stripe 0 records the new layout. The
//! split bumps the stripe's `bits`, which every consume names in its condition, so a copy sent
//! under the old layout (late, or from a process that has not seen the split) matches nothing
//! and its sender re-reads the layout. Stripes only split, never merge, so a stripe whose `bits`
//! is what the sender expected still holds exactly the hashes it did.
//!
//! **Borrowing.** A stripe without room for a consume while the provider has it takes share from
//! the others (most free first) in one transaction conditioned on every stripe's generation,
//! and the consume is tried again; when the whole provider lacks room the consume is refused
//! with the provider's own numbers. So no capacity is lost to the striping.
//!
//! Cost: a consume addresses its stripe from a layout the handle caches (one round trip when the
//! cache is current, as before), and writes a document of at most [`STRIPE_ENTRIES`] entries,
//! whatever the provider holds. A provider with few allocations keeps a single stripe and is
//! stored exactly as before.

use std::collections::BTreeMap;
use std::sync::Arc;

use bson::{doc, Bson, DateTime};
use sha2::{Digest, Sha256};

use crate::quota::decide::{Docs, Write};
use crate::quota::error::{QuotaError, Refusal};
use crate::quota::model::{Entry, Part, ProviderDoc, ProviderId, StripeId};
use crate::quota::ops::Attempts;
use crate::quota::Quota;

/// The most entries a stripe takes before it is split (released requests kept against late
/// copies count too). A consume rewrites one stripe, so this bounds its cost.
pub(crate) const STRIPE_ENTRIES: usize = 32;

/// The most bits a stripe is addressed by: past this (2^40 stripes, more than any provider could
/// fill) a stripe grows instead of splitting.
const MAX_BITS: i64 = 40;

/// The hash that addresses a request's stripe: stable across processes, versions and platforms
/// (a standard digest, not the standard library's hasher, whose output may change).
pub(crate) fn hash(consumer: &str, request: &str) -> u64 {
    let mut digest = Sha256::new();
    digest.update(consumer.as_bytes());
    // Names hold no control characters (`decide::check_name`), so this separates them.
    digest.update([0u8]);
    digest.update(request.as_bytes());
    let bytes = digest.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&bytes[..8]);
    u64::from_le_bytes(first)
}

/// Which stripes a provider has, and how many bits address each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout(BTreeMap<i64, i64>);

impl Layout {
    /// A provider stored in one document.
    pub(crate) fn single() -> Layout {
        Layout([(0, 0)].into_iter().collect())
    }

    /// The layout stripe 0 records.
    pub(crate) fn of(head: &ProviderDoc) -> Layout {
        if head.stripes.is_empty() {
            return Layout([(0, head.bits)].into_iter().collect());
        }
        Layout(head.stripes.iter().map(|p| (p.s, p.bits)).collect())
    }

    pub(crate) fn is_single(&self) -> bool {
        self.0.len() == 1
    }

    /// Every stripe number.
    pub(crate) fn stripes(&self) -> impl Iterator<Item = i64> + '_ {
        self.0.keys().copied()
    }

    /// The stripe holding hash `h`, and its bits; `None` for a layout that does not cover it
    /// (stored inconsistently).
    pub(crate) fn locate(&self, h: u64) -> Option<(i64, i64)> {
        let (mut stripe, mut bits) = (0_i64, 0_i64);
        loop {
            let stored = *self.0.get(&stripe)?;
            if stored == bits {
                return Some((stripe, bits));
            }
            if stored < bits || bits >= MAX_BITS {
                return None;
            }
            bits += 1;
            stripe = i64::try_from(h % (1_u64 << bits)).ok()?;
        }
    }

    fn parts(&self) -> Vec<Part> {
        self.0.iter().map(|(&s, &bits)| Part { s, bits }).collect()
    }
}

/// What to do about a full stripe.
#[derive(Debug)]
pub(crate) enum Full {
    /// Forgetting its released requests made room: write it back.
    Prune(Write),
    /// Write these (the stripe, and stripe 0 when it is another) and insert the new stripe.
    Divide {
        writes: Vec<Write>,
        new: ProviderDoc,
    },
    /// It cannot split further (or is not full any more): leave it.
    Keep,
}

/// Plans splitting `stripe` (read at `generation`), given stripe 0 when that is another document.
pub(crate) fn split(
    head: Option<&(i64, ProviderDoc)>,
    (generation, stripe): (i64, &ProviderDoc),
    now: DateTime,
) -> Full {
    let mut old = stripe.clone();
    let before = old.held.len();
    old.held
        .retain(|e| !(e.is_tombstone() && e.dl.is_none_or(|dl| dl <= now)));
    if old.held.len() < STRIPE_ENTRIES {
        return if old.held.len() == before {
            Full::Keep
        } else {
            Full::Prune(Write {
                generation,
                doc: old,
            })
        };
    }
    if old.bits >= MAX_BITS {
        return Full::Keep;
    }
    let bits = old.bits + 1;
    let number = old.id.stripe + (1_i64 << old.bits);
    let provider = old.id.provider();
    let goes = |e: &Entry| hash(&e.c, &e.r) % (1_u64 << bits) == number.unsigned_abs();
    let (moved, kept): (Vec<Entry>, Vec<Entry>) = old.held.drain(..).partition(goes);
    old.held = kept;
    let moved_usage: i64 = moved.iter().map(|e| e.n).sum();
    let free = old.available.max(0);
    let new_limit = (moved_usage + free / 2).min(old.limit);
    let new = ProviderDoc {
        id: StripeId::new(&provider, number),
        limit: new_limit,
        usage: moved_usage,
        available: new_limit - moved_usage,
        parent: old.parent.clone(),
        ancestors: old.ancestors.clone(),
        held: moved,
        bits,
        stripes: Vec::new(),
        over: old.over,
    };
    old.limit -= new_limit;
    old.usage -= moved_usage;
    old.available = old.limit - old.usage;
    old.bits = bits;
    let mut layout = match head {
        Some((_, head)) => Layout::of(head),
        None => Layout::of(stripe),
    };
    layout.0.insert(old.id.stripe, bits);
    layout.0.insert(number, bits);
    let mut writes = Vec::new();
    match head {
        Some((head_generation, head)) => {
            let mut head = head.clone();
            head.stripes = layout.parts();
            writes.push(Write {
                generation: *head_generation,
                doc: head,
            });
        }
        None => old.stripes = layout.parts(),
    }
    writes.push(Write {
        generation,
        doc: old,
    });
    Full::Divide { writes, new }
}

/// Plans moving share into `target` from the provider's other stripes (`all`, every stripe of
/// one provider) so that it has `need` available and a fair part of what else is free; the
/// provider's own refusal when all its stripes together lack `need`.
pub(crate) fn borrow(all: &Docs, target: &StripeId, need: i64) -> Result<Vec<Write>, Refusal> {
    let (limit, available) = all.values().fold((0_i64, 0_i64), |(l, a), (_, d)| {
        (l.saturating_add(d.limit), a.saturating_add(d.available))
    });
    let Some((_, (_, to))) = all.iter().find(|(id, _)| *id == target) else {
        return Err(Refusal {
            provider: target.provider(),
            requested: need,
            available,
            limit,
        });
    };
    if available < need {
        return Err(Refusal {
            provider: target.provider(),
            requested: need,
            available,
            limit,
        });
    }
    // Usage fell back under a lowered limit: share it out afresh, which also lifts `over`.
    if all.values().any(|(_, d)| d.over) {
        return Ok(share(all, limit));
    }
    let count = i64::try_from(all.len()).unwrap_or(i64::MAX).max(1);
    let mut wanted = (need - to.available).max(0) + (available - need) / count;
    let mut donors: Vec<(&StripeId, &(i64, ProviderDoc))> = all
        .iter()
        .filter(|(id, (_, d))| *id != target && d.available > 0)
        .collect();
    donors.sort_by_key(|(_, (_, d))| std::cmp::Reverse(d.available));
    let mut writes = Vec::new();
    let mut moved = 0;
    for (_, (generation, donor)) in donors {
        if wanted == 0 {
            break;
        }
        let take = donor.available.min(wanted);
        let mut donor = donor.clone();
        donor.limit -= take;
        donor.available -= take;
        writes.push(Write {
            generation: *generation,
            doc: donor,
        });
        wanted -= take;
        moved += take;
    }
    let (generation, to) = &all[target];
    let mut to = to.clone();
    to.limit += moved;
    to.available += moved;
    writes.push(Write {
        generation: *generation,
        doc: to,
    });
    Ok(writes)
}

/// Plans giving a striped provider the limit `limit`: each stripe keeps a share covering its
/// usage while the limit allows, and the rest is spread evenly. Below the provider's usage every
/// stripe is marked `over`: a release would otherwise give a stripe room while the provider as
/// a whole is still over its limit. Every stripe is written, so that
/// the writes (each conditional on the version read) also prove the shares were read at once.
pub(crate) fn share(all: &Docs, limit: i64) -> Vec<Write> {
    let count = i64::try_from(all.len()).unwrap_or(i64::MAX).max(1);
    let over = all.values().map(|(_, d)| d.usage).sum::<i64>() > limit;
    let mut left = limit;
    let mut shares: Vec<i64> = all
        .values()
        .map(|(_, d)| {
            let share = d.usage.clamp(0, left);
            left -= share;
            share
        })
        .collect();
    let (each, first) = (left / count, left % count);
    for (i, s) in shares.iter_mut().enumerate() {
        *s += each + if i == 0 { first } else { 0 };
    }
    all.values()
        .zip(shares)
        .map(|((generation, d), share)| {
            let mut doc = d.clone();
            doc.limit = share;
            doc.available = share - doc.usage;
            doc.over = over;
            Write {
                generation: *generation,
                doc,
            }
        })
        .collect()
}

impl Quota {
    /// The layout this handle last saw for `provider` (a single stripe when it saw none).
    pub(super) fn layout(&self, provider: &ProviderId) -> Arc<Layout> {
        self.layouts
            .lock()
            .ok()
            .and_then(|known| known.get(provider).cloned())
            .unwrap_or_else(|| Arc::new(Layout::single()))
    }

    /// Remembers a provider's layout (only striped ones are kept: the default is one stripe).
    /// Stripes only split, so a layout with fewer stripes than the one known is an older
    /// reading (another task's, landing late) and is not kept.
    pub(super) fn learn(&self, provider: &ProviderId, layout: Layout) {
        if layout.is_single() {
            return;
        }
        if let Ok(mut known) = self.layouts.lock() {
            match known.get(provider) {
                Some(old) if old.0.len() > layout.0.len() => {}
                _ => {
                    known.insert(provider.clone(), Arc::new(layout));
                }
            }
        }
    }

    /// Every stripe of `provider` (committed values), stripe 0 first, each as the layout read
    /// from stripe 0 has it: read again while a split moves it.
    pub(super) async fn read_stripes(&self, provider: &ProviderId) -> Result<Docs, QuotaError> {
        let mut attempts = Attempts::new(
            self.options.retry,
            format!("read the stripes of {provider}"),
        );
        loop {
            let (generation, head) = self.read_one(provider).await?;
            let layout = Layout::of(&head);
            self.learn(provider, layout.clone());
            let mut docs: Docs = [(head.id.clone(), (generation, head))]
                .into_iter()
                .collect();
            if layout.is_single() {
                return Ok(docs);
            }
            let others: Vec<Bson> = layout
                .stripes()
                .filter(|s| *s != 0)
                .map(|s| StripeId::new(provider, s).to_bson())
                .collect();
            docs.extend(self.holding(doc! { "_id": { "$in": others } }).await?);
            let consistent = layout.0.len() == docs.len()
                && docs
                    .iter()
                    .all(|(id, (_, d))| layout.0.get(&id.stripe) == Some(&d.bits));
            if consistent {
                return Ok(docs);
            }
            attempts
                .again(format!("{provider} was split while it was read"))
                .await?;
        }
    }

    /// Every stripe of `provider` as of one moment: read until two reads in a row agree (versions
    /// only grow, so then nothing moved in between).
    pub(super) async fn read_at_once(&self, provider: &ProviderId) -> Result<Docs, QuotaError> {
        let mut attempts =
            Attempts::new(self.options.retry, format!("read {provider} at one moment"));
        let mut last = self.read_stripes(provider).await?;
        while last.len() > 1 {
            let again = self.read_stripes(provider).await?;
            let same = again.len() == last.len()
                && again
                    .iter()
                    .all(|(k, (v, _))| last.get(k).is_some_and(|(w, _)| v == w));
            last = again;
            if same {
                break;
            }
            attempts
                .again(format!("{provider} changed while it was read"))
                .await?;
        }
        Ok(last)
    }

    /// Splits `stripe` of `provider` if it is still full (or only prunes it). Losing a race to
    /// another writer is fine: the caller reads again either way.
    pub(super) async fn split_stripe(
        &self,
        provider: &ProviderId,
        stripe: i64,
    ) -> Result<(), QuotaError> {
        let now = self.store.now().await?;
        let all = self.read_stripes(provider).await?;
        let Some(target) = all.get(&StripeId::new(provider, stripe)) else {
            return Ok(());
        };
        let head = (stripe != 0)
            .then(|| all.get(&StripeId::new(provider, 0)))
            .flatten();
        match split(head, (target.0, &target.1), now) {
            Full::Keep => {}
            Full::Prune(write) => {
                self.write(vec![write]).await?;
            }
            Full::Divide { writes, new } => {
                tracing::debug!(%provider, stripe, new = new.id.stripe, "quota: splitting a full stripe");
                self.write_and_insert(writes, &new).await?;
            }
        }
        Ok(())
    }

    /// Moves share into `stripe` so that it has `need` available; the provider's refusal when
    /// all of it lacks that. Losing a race is fine: the caller tries its consume again.
    pub(super) async fn borrow_into(
        &self,
        stripe: &StripeId,
        need: i64,
    ) -> Result<Option<Refusal>, QuotaError> {
        let provider = stripe.provider();
        let all = self.read_stripes(&provider).await?;
        let planned = match borrow(&all, stripe, need) {
            Ok(writes) => Ok(writes),
            // Stripes read one after another can miss share on its way between them: a refusal
            // stands only on a reading of one moment.
            Err(_) => borrow(&self.read_at_once(&provider).await?, stripe, need),
        };
        match planned {
            Ok(writes) => {
                self.write(writes).await?;
                Ok(None)
            }
            Err(refusal) => Ok(Some(refusal)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn provider(limit: i64) -> ProviderDoc {
        ProviderDoc {
            id: StripeId::new(&ProviderId::new("p", "units"), 0),
            limit,
            usage: 0,
            available: limit,
            parent: None,
            ancestors: Vec::new(),
            held: Vec::new(),
            bits: 0,
            stripes: Vec::new(),
            over: false,
        }
    }

    fn entry(i: usize, n: i64) -> Entry {
        Entry {
            c: format!("c{i}"),
            r: "r".into(),
            n,
            exp: None,
            dl: None,
        }
    }

    fn full(limit: i64) -> ProviderDoc {
        let mut doc = provider(limit);
        doc.held = (0..STRIPE_ENTRIES).map(|i| entry(i, 2)).collect();
        doc.usage = 2 * STRIPE_ENTRIES as i64;
        doc.available = limit - doc.usage;
        doc
    }

    /// Splits stripe 0 of a full provider and returns every stripe afterwards.
    fn split_once(doc: ProviderDoc) -> Docs {
        let Full::Divide { writes, new } = split(None, (1, &doc), DateTime::from_millis(0)) else {
            panic!("a full stripe splits");
        };
        let mut all: Docs = writes
            .into_iter()
            .map(|w| (w.doc.id.clone(), (w.generation + 1, w.doc)))
            .collect();
        all.insert(new.id.clone(), (1, new));
        all
    }

    #[test]
    fn a_split_keeps_every_entry_at_its_address_and_the_shares_whole() {
        let all = split_once(full(1_000));
        assert_eq!(all.len(), 2);
        let head = &all[&StripeId::new(&ProviderId::new("p", "units"), 0)].1;
        let layout = Layout::of(head);
        assert_eq!(layout.stripes().collect::<Vec<_>>(), vec![0, 1]);
        let (mut limit, mut usage, mut entries) = (0, 0, 0);
        for (id, (_, doc)) in &all {
            assert_eq!(doc.bits, 1);
            for e in &doc.held {
                assert_eq!(
                    layout.locate(hash(&e.c, &e.r)),
                    Some((id.stripe, 1)),
                    "{e:?}"
                );
            }
            assert_eq!(doc.usage, doc.held.iter().map(|e| e.n).sum::<i64>());
            assert_eq!(doc.available, doc.limit - doc.usage);
            limit += doc.limit;
            usage += doc.usage;
            entries += doc.held.len();
        }
        assert_eq!((limit, usage, entries), (1_000, 64, STRIPE_ENTRIES));
    }

    #[test]
    fn a_layout_addresses_every_hash_to_exactly_one_stripe() {
        // Stripe 0 split twice and stripe 1 once: stripes 0 (2 bits), 1 (2 bits), 2 (2 bits), 3
        // (2 bits), after 0 -> {0, 1}, 0 -> {0, 2}, 1 -> {1, 3}.
        let layout = Layout([(0, 2), (1, 2), (2, 2), (3, 2)].into_iter().collect());
        for h in 0..64_u64 {
            assert_eq!(layout.locate(h), Some((i64::try_from(h % 4).unwrap(), 2)));
        }
        // Uneven: 0 -> {0 (1 bit), 1 (1 bit)}, then 1 -> {1 (2 bits), 3 (2 bits)}.
        let layout = Layout([(0, 1), (1, 2), (3, 2)].into_iter().collect());
        assert_eq!(layout.locate(6), Some((0, 1)));
        assert_eq!(layout.locate(5), Some((1, 2)));
        assert_eq!(layout.locate(7), Some((3, 2)));
        // A layout that lost a stripe does not cover every hash.
        assert_eq!(Layout([(0, 1)].into_iter().collect()).locate(1), None);
    }

    #[test]
    fn borrowing_moves_share_without_changing_the_total_and_refuses_past_it() {
        let mut all = split_once(full(100));
        let target = StripeId::new(&ProviderId::new("p", "units"), 1);
        // Empty the target's room, so it must borrow.
        {
            let (_, doc) = all.get_mut(&target).unwrap();
            doc.limit = doc.usage;
            doc.available = 0;
        }
        let total: i64 = all.values().map(|(_, d)| d.limit).sum();
        let free: i64 = all.values().map(|(_, d)| d.available).sum();
        let writes = borrow(&all, &target, free).expect("all of what is free can be borrowed");
        for w in writes {
            all.insert(w.doc.id.clone(), (w.generation + 1, w.doc));
        }
        assert_eq!(all.values().map(|(_, d)| d.limit).sum::<i64>(), total);
        assert_eq!(all[&target].1.available, free);
        assert!(all.values().all(|(_, d)| d.limit >= 0 && d.available >= 0));
        let refusal = borrow(&all, &target, free + 1).unwrap_err();
        assert_eq!(
            (refusal.available, refusal.limit, refusal.requested),
            (free, total, free + 1)
        );
    }

    #[test]
    fn a_new_limit_is_shared_out_whole() {
        let all = split_once(full(1_000));
        for limit in [0, 5, 64, 65, 1_000, 12_345] {
            let mut after = all.clone();
            for w in share(&all, limit) {
                after.insert(w.doc.id.clone(), (w.generation + 1, w.doc));
            }
            assert_eq!(after.values().map(|(_, d)| d.limit).sum::<i64>(), limit);
            assert!(after.values().all(|(_, d)| d.limit >= 0));
            assert!(after
                .values()
                .all(|(_, d)| d.available == d.limit - d.usage));
        }
    }

    mod properties {
        use super::*;
        use crate::quota::decide::{remove, take, Take};
        use crate::quota::error::QuotaError;
        use crate::quota::model::Request;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Step {
            /// Consumer `c` takes `n` under request id `r` (the same pair again is a retry).
            Consume { c: u8, r: u8, n: i64 },
            /// Consumer `c` gives back everything it holds.
            Release { c: u8 },
            /// The limit becomes `limit`.
            SetLimit { limit: i64 },
        }

        fn steps() -> impl Strategy<Value = Vec<Step>> {
            prop::collection::vec(
                prop_oneof![
                    12 => (0..60_u8, 0..2_u8, 1..5_i64)
                        .prop_map(|(c, r, n)| Step::Consume { c, r, n }),
                    3 => (0..60_u8).prop_map(|c| Step::Release { c }),
                    1 => (0..400_i64).prop_map(|limit| Step::SetLimit { limit }),
                ],
                1..160,
            )
        }

        fn apply(all: &mut Docs, writes: Vec<Write>) {
            for w in writes {
                all.insert(w.doc.id.clone(), (w.generation + 1, w.doc));
            }
        }

        /// Consumes as the handle does, single-threaded: split a full stripe, borrow when the
        /// stripe lacks room, refuse only when the provider does. `Ok(true)` when it was taken
        /// now, `Ok(false)` for a replay.
        fn consume(all: &mut Docs, request: &Request, n: i64) -> Result<bool, QuotaError> {
            let provider = ProviderId::new("p", "units");
            let head_id = StripeId::new(&provider, 0);
            let h = hash(&request.consumer, &request.id);
            for _ in 0..64 {
                let layout = Layout::of(&all[&head_id].1);
                let (stripe, _) = layout.locate(h).expect("the layout covers every hash");
                let id = StripeId::new(&provider, stripe);
                let (generation, doc) = all[&id].clone();
                if doc.held.len() >= STRIPE_ENTRIES {
                    let head = (stripe != 0).then(|| all[&head_id].clone());
                    match split(head.as_ref(), (generation, &doc), DateTime::from_millis(0)) {
                        Full::Divide { writes, new } => {
                            apply(all, writes);
                            all.insert(new.id.clone(), (1, new));
                            continue;
                        }
                        Full::Prune(write) => {
                            apply(all, vec![write]);
                            continue;
                        }
                        Full::Keep => {}
                    }
                }
                let one: Docs = [(id.clone(), (generation, doc))].into_iter().collect();
                match take(request, &one, None, None, DateTime::from_millis(0)) {
                    Ok(Take::Replay { .. }) => return Ok(false),
                    Ok(Take::Apply(writes)) => {
                        apply(all, writes);
                        return Ok(true);
                    }
                    Err(QuotaError::QuotaExceeded { .. }) => match borrow(all, &id, n) {
                        Ok(writes) => apply(all, writes),
                        Err(refusal) => {
                            return Err(QuotaError::QuotaExceeded {
                                consumer: request.consumer.clone(),
                                request: request.id.clone(),
                                refusals: vec![refusal],
                            })
                        }
                    },
                    Err(e) => return Err(e),
                }
            }
            panic!("a consume did not settle in 64 splits and borrows");
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]

            /// Whatever the consumes, retries, releases and new limits, the stripes' shares add
            /// up to the limit, each stripe's usage is its entries, every entry is where its
            /// hash points, no stripe outgrows its bound, a consume is granted exactly when the
            /// provider has room, and a retry counts once.
            #[test]
            fn stripes_keep_the_provider_whole(first in 1..400_i64, steps in steps()) {
                let provider = ProviderId::new("p", "units");
                let mut head = super::provider(first);
                head.id = StripeId::new(&provider, 0);
                let mut all: Docs = [(head.id.clone(), (1, head))].into_iter().collect();
                let mut limit = first;
                let mut held: BTreeMap<(u8, u8), i64> = BTreeMap::new();
                for step in steps {
                    let usage: i64 = held.values().sum();
                    match step {
                        Step::Consume { c, r, n } => {
                            let request = Request::with_id(format!("c{c}"), format!("r{r}"))
                                .take(provider.clone(), n);
                            match (consume(&mut all, &request, n), held.get(&(c, r))) {
                                (Ok(true), None) => {
                                    prop_assert!(usage + n <= limit);
                                    held.insert((c, r), n);
                                }
                                (Ok(false), Some(_)) => {}
                                (Err(QuotaError::QuotaExceeded { refusals, .. }), None) => {
                                    prop_assert!(usage + n > limit, "refused with room");
                                    prop_assert_eq!(refusals[0].available, limit - usage);
                                    prop_assert_eq!(refusals[0].limit, limit);
                                }
                                (Err(QuotaError::RequestReused { .. }), Some(m)) => {
                                    prop_assert_ne!(*m, n);
                                }
                                (outcome, before) => {
                                    prop_assert!(false, "{outcome:?} with {before:?} held");
                                }
                            }
                        }
                        Step::Release { c } => {
                            let (writes, _) =
                                remove(&all, |e| e.c == format!("c{c}"), DateTime::from_millis(0));
                            apply(&mut all, writes);
                            held.retain(|(holder, _), _| *holder != c);
                        }
                        Step::SetLimit { limit: new } => {
                            let writes = share(&all, new);
                            apply(&mut all, writes);
                            limit = new;
                        }
                    }
                    let layout = Layout::of(&all[&StripeId::new(&provider, 0)].1);
                    prop_assert_eq!(layout.stripes().count(), all.len());
                    let mut shares = 0;
                    for (id, (_, doc)) in &all {
                        prop_assert!(doc.held.len() <= STRIPE_ENTRIES);
                        prop_assert_eq!(doc.usage, doc.held.iter().map(|e| e.n).sum::<i64>());
                        prop_assert_eq!(doc.available, doc.limit - doc.usage);
                        prop_assert!(doc.limit >= 0);
                        for e in &doc.held {
                            prop_assert_eq!(layout.locate(hash(&e.c, &e.r)), Some((id.stripe, doc.bits)));
                        }
                        shares += doc.limit;
                    }
                    prop_assert_eq!(shares, limit);
                    let stored: i64 = all.values().map(|(_, d)| d.usage).sum();
                    prop_assert_eq!(stored, held.values().sum::<i64>());
                }
            }
        }
    }
}
