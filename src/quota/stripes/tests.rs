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
