//! Tests of the stripes' pure functions: layout, split, borrowing, sharing a limit, and a
//! property test driving them as a handle does.

use super::*;
use crate::quota::model::ProviderId;

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
        /// Consumer `c` takes `n` under request id `r` (the same pair again is a retry); with
        /// `race`, another handle splits the request's stripe (when full) between this one's
        /// reading it and its borrowing for it.
        Consume { c: u8, r: u8, n: i64, race: bool },
        /// Consumer `c` gives back everything it holds.
        Release { c: u8 },
        /// The limit becomes `limit`.
        SetLimit { limit: i64 },
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        prop::collection::vec(
            prop_oneof![
                12 => (0..60_u8, 0..2_u8, 1..5_i64, any::<bool>())
                    .prop_map(|(c, r, n, race)| Step::Consume { c, r, n, race }),
                2 => (0..60_u8).prop_map(|c| Step::Release { c }),
                2 => (0..400_i64).prop_map(|limit| Step::SetLimit { limit }),
            ],
            1..240,
        )
    }

    fn apply(all: &mut Docs, writes: Vec<Write>) {
        for w in writes {
            all.insert(w.doc.id.clone(), (w.generation + 1, w.doc));
        }
    }

    /// Applies `writes` as the store does: all of them when every one's generation is still
    /// the stored one, none otherwise.
    fn apply_checked(all: &mut Docs, writes: Vec<Write>) -> bool {
        let current = writes
            .iter()
            .all(|w| all.get(&w.doc.id).is_some_and(|(g, _)| *g == w.generation));
        if current {
            apply(all, writes);
        }
        current
    }

    /// Splits stripe `stripe` if it is full, as a handle does before deciding.
    fn split_if_full(all: &mut Docs, stripe: i64) -> bool {
        let head_id = StripeId::new(&ProviderId::new("p", "units"), 0);
        let id = StripeId::new(&ProviderId::new("p", "units"), stripe);
        let (generation, doc) = all[&id].clone();
        if doc.held.len() < STRIPE_ENTRIES {
            return false;
        }
        let head = (stripe != 0).then(|| all[&head_id].clone());
        match split(head.as_ref(), (generation, &doc), DateTime::from_millis(0)) {
            Full::Divide { writes, new } => {
                apply(all, writes);
                all.insert(new.id.clone(), (1, new));
                true
            }
            Full::Prune(write) => {
                apply(all, vec![write]);
                true
            }
            Full::Keep => false,
        }
    }

    /// Consumes as the handle does: split a full stripe, borrow when the stripe lacks room
    /// (taking in the same write as the borrow, `lend`), refuse only when the provider does.
    /// With `race`, a full stripe is split by "another handle" only after this one read it and
    /// found it short, before it reads every stripe to borrow. `Ok(true)` when it was taken now,
    /// `Ok(false)` for a replay.
    fn consume(all: &mut Docs, request: &Request, n: i64, race: bool) -> Result<bool, QuotaError> {
        let provider = ProviderId::new("p", "units");
        let head_id = StripeId::new(&provider, 0);
        let h = hash(&request.consumer, &request.id);
        let now = DateTime::from_millis(0);
        for _ in 0..64 {
            let layout = Layout::of(&all[&head_id].1);
            let (stripe, _) = layout.locate(h).expect("the layout covers every hash");
            let id = StripeId::new(&provider, stripe);
            if !race && split_if_full(all, stripe) {
                continue;
            }
            let one: Docs = [(id.clone(), all[&id].clone())].into_iter().collect();
            match take(request, &one, None, None, now) {
                Ok(Take::Replay { .. }) => return Ok(false),
                Ok(Take::Apply(writes)) => {
                    if one[&id].1.held.len() >= STRIPE_ENTRIES {
                        split_if_full(all, stripe);
                        continue;
                    }
                    if apply_checked(all, writes) {
                        return Ok(true);
                    }
                }
                Err(QuotaError::QuotaExceeded { .. }) => {
                    if race {
                        split_if_full(all, stripe);
                    }
                    let borrowed = match borrow(all, &id, n) {
                        Ok(writes) => writes,
                        Err(refusal) => {
                            return Err(QuotaError::QuotaExceeded {
                                consumer: request.consumer.clone(),
                                request: request.id.clone(),
                                refusals: vec![refusal],
                            })
                        }
                    };
                    let Some((lent, others)) = lend(&one, &id, borrowed.clone()) else {
                        continue;
                    };
                    match take(request, &lent, None, None, now) {
                        Ok(Take::Apply(mut writes)) => {
                            writes.extend(others);
                            if apply_checked(all, writes) {
                                return Ok(true);
                            }
                        }
                        // Not enough moved: the move is written alone.
                        _ => {
                            apply_checked(all, borrowed);
                        }
                    }
                }
                Err(e) => return Err(e),
            }
        }
        panic!("a consume did not settle in 64 splits and borrows: {request:?} {all:#?}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Whatever the consumes, retries, releases and new limits, the stripes' shares add
        /// up to the limit, each stripe's usage is its entries, every entry is where its
        /// hash points, no stripe outgrows its bound, a consume is granted exactly when the
        /// provider has room, and a retry counts once. With `lowered`, the provider starts as
        /// one full stripe whose limit was then lowered to that (the next consume splits it).
        #[test]
        fn stripes_keep_the_provider_whole(
            first in 1..200_i64,
            lowered in prop::option::of(0..32_i64),
            steps in steps(),
        ) {
            let provider = ProviderId::new("p", "units");
            let first = if lowered.is_some() { first.max(32) } else { first };
            let mut head = super::provider(first);
            head.id = StripeId::new(&provider, 0);
            let mut all: Docs = [(head.id.clone(), (1, head))].into_iter().collect();
            let mut limit = first;
            let mut held: BTreeMap<(u8, u8), i64> = BTreeMap::new();
            if let Some(lowered) = lowered {
                for c in 0..32_u8 {
                    let request = Request::with_id(format!("c{c}"), "r0").take(provider.clone(), 1);
                    prop_assert!(matches!(consume(&mut all, &request, 1, false), Ok(true)));
                    held.insert((c, 0), 1);
                }
                let writes = crate::quota::stripes::new_limit(&all, lowered);
                apply(&mut all, writes);
                limit = lowered;
            }
            for step in steps {
                let usage: i64 = held.values().sum();
                match step {
                    Step::Consume { c, r, n, race } => {
                        let request = Request::with_id(format!("c{c}"), format!("r{r}"))
                            .take(provider.clone(), n);
                        match (consume(&mut all, &request, n, race), held.get(&(c, r))) {
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
                        // As the public `set_limit` does: a provider of one stripe is given
                        // its limit whole, a striped one shares it out.
                        let writes = crate::quota::stripes::new_limit(&all, new);
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

    /// Every entry of every stripe sits where its hash points.
    fn misplaced(all: &Docs) -> Option<String> {
        let layout = Layout::of(&all[&StripeId::new(&ProviderId::new("p", "units"), 0)].1);
        all.iter().find_map(|(id, (_, doc))| {
            doc.held
                .iter()
                .find(|e| layout.locate(hash(&e.c, &e.r)) != Some((id.stripe, doc.bits)))
                .map(|e| format!("{e:?} in stripe {} of {} bits", id.stripe, doc.bits))
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// A consume short of room in a full stripe of a striped provider, whose stripe another
        /// handle splits before the consume borrows for it: the entry still lands where its
        /// hash points, and it counts once.
        #[test]
        fn a_borrow_racing_a_split_keeps_every_entry_where_its_hash_points(
            limit in 80..240_i64,
            spread in 33..70_usize,
            target in 0..1_000_u32,
            extra in 0..3_i64,
        ) {
            let provider = ProviderId::new("p", "units");
            let mut head = super::provider(limit);
            head.id = StripeId::new(&provider, 0);
            let mut all: Docs = [(head.id.clone(), (1, head))].into_iter().collect();
            // Enough entries of 1 to stripe the provider.
            for i in 0..spread {
                let r = Request::with_id(format!("s{i}"), "r").take(provider.clone(), 1);
                prop_assert!(consume(&mut all, &r, 1, false).is_ok());
            }
            let request = Request::with_id("t", format!("r{target}")).take(provider.clone(), 1);
            let h = hash(&request.consumer, &request.id);
            let head_id = StripeId::new(&provider, 0);
            let (stripe, _) = Layout::of(&all[&head_id].1).locate(h).expect("covered");
            let id = StripeId::new(&provider, stripe);
            // Fill the target's stripe to full with requests that land in it.
            let mut i = 0;
            while all[&id].1.held.len() < STRIPE_ENTRIES && i < 10_000 {
                i += 1;
                let r = format!("f{i}");
                if Layout::of(&all[&head_id].1).locate(hash("f", &r)).map(|(s, _)| s) == Some(stripe) {
                    let one: Docs = [(id.clone(), all[&id].clone())].into_iter().collect();
                    if let Ok(Take::Apply(writes)) =
                        take(&Request::with_id("f", &r).take(provider.clone(), 1), &one, None, None, DateTime::from_millis(0))
                    {
                        apply(&mut all, writes);
                    }
                }
            }
            let (_, doc) = all[&id].clone();
            prop_assume!(doc.held.len() == STRIPE_ENTRIES && stripe == id.stripe);
            let free: i64 = all.values().map(|(_, d)| d.available).sum();
            // Short in its stripe, with room in the provider.
            let n = doc.available.max(0) + 1 + extra;
            prop_assume!(n <= free);
            let request = Request::with_id("t", format!("r{target}")).take(provider.clone(), n);
            let usage: i64 = all.values().map(|(_, d)| d.usage).sum();
            prop_assert!(matches!(consume(&mut all, &request, n, true), Ok(true)));
            prop_assert_eq!(misplaced(&all), None);
            prop_assert!(matches!(consume(&mut all, &request, n, false), Ok(false)), "counted once");
            prop_assert_eq!(all.values().map(|(_, d)| d.usage).sum::<i64>(), usage + n);
        }
    }
}
