//! Tests of the quota decisions: checks, takes, releases, confirmations and limits, and a
//! property test over a three-level hierarchy.

use super::*;

fn at(ms: i64) -> DateTime {
    DateTime::from_millis(ms)
}

fn provider(scope: &str, limit: i64, ancestors: &[&str]) -> ProviderDoc {
    ProviderDoc {
        id: StripeId::new(&ProviderId::new(scope, "cores"), 0),
        limit,
        usage: 0,
        available: limit,
        parent: ancestors.first().map(|a| ProviderId::new(*a, "cores")),
        ancestors: ancestors
            .iter()
            .map(|a| ProviderId::new(*a, "cores"))
            .collect(),
        held: Vec::new(),
        bits: 0,
        stripes: Vec::new(),
        over: false,
    }
}

fn docs(list: Vec<ProviderDoc>) -> Docs {
    list.into_iter().map(|d| (d.id.clone(), (7, d))).collect()
}

fn applied(take: Take) -> Vec<Write> {
    match take {
        Take::Apply(writes) => writes,
        other => panic!("expected writes, got {other:?}"),
    }
}

fn apply(docs: &mut Docs, writes: Vec<Write>) {
    for w in writes {
        let slot = docs.get_mut(&w.doc.id).expect("written provider was read");
        *slot = (slot.0 + 1, w.doc);
    }
}

#[test]
fn bad_requests_are_refused_before_any_read() {
    let p = ProviderId::new("p", "cores");
    let cases = [
        (Request::new("c"), "no provider"),
        (Request::new("").take(p.clone(), 1), "consumer"),
        (Request::with_id("c", "").take(p.clone(), 1), "request id"),
        (Request::new("c").take(p.clone(), 0), "not a positive"),
        (Request::new("c").take(p.clone(), -3), "not a positive"),
        (Request::new("c").take(("", "cores"), 1), "scope"),
        (
            Request::new("c").take(p.clone(), 1).take(p.clone(), 2),
            "twice",
        ),
    ];
    for (req, says) in cases {
        let err = check_request(&req).expect_err(says);
        assert!(err.to_string().contains(says), "{err} should say {says}");
    }
    assert!(matches!(
        check_limit(&p, -1),
        Err(QuotaError::NegativeLimit { limit: -1, .. })
    ));
    assert!(check_new(&NewProvider::new(p.clone(), 5).parent(p)).is_err());
}

#[test]
fn a_child_takes_from_every_ancestor_or_from_none() {
    let mut d = docs(vec![
        provider("root", 10, &[]),
        provider("mid", 8, &["root"]),
        provider("leaf", 100, &["mid", "root"]),
    ]);
    let req = Request::new("vm").take(("leaf", "cores"), 6);
    let writes = applied(take(&req, &d, None, None, at(0)).unwrap());
    assert_eq!(writes.len(), 3);
    apply(&mut d, writes);
    for (_, doc) in d.values() {
        assert_eq!(doc.usage, 6, "{}", doc.id);
    }
    // The middle level has 2 left: a second request of 3 is refused there, and only there.
    let second = Request::new("vm2").take(("leaf", "cores"), 3);
    match take(&second, &d, None, None, at(0)) {
        Err(QuotaError::QuotaExceeded { refusals, .. }) => {
            assert_eq!(refusals.len(), 1);
            assert_eq!(refusals[0].provider, ProviderId::new("mid", "cores"));
            assert_eq!(
                (
                    refusals[0].requested,
                    refusals[0].available,
                    refusals[0].limit
                ),
                (3, 2, 8)
            );
        }
        other => panic!("expected QuotaExceeded, got {other:?}"),
    }
}

#[test]
fn claims_under_one_ancestor_add_up_there() {
    let d = docs(vec![
        provider("root", 10, &[]),
        provider("a", 10, &["root"]),
        provider("b", 10, &["root"]),
    ]);
    let req = Request::new("c")
        .take(("a", "cores"), 6)
        .take(("b", "cores"), 5);
    match take(&req, &d, None, None, at(0)) {
        Err(QuotaError::QuotaExceeded { refusals, .. }) => {
            assert_eq!(refusals[0].provider, ProviderId::new("root", "cores"));
            assert_eq!(refusals[0].requested, 11);
        }
        other => panic!("expected QuotaExceeded, got {other:?}"),
    }
}

#[test]
fn a_repeated_request_is_a_replay_and_a_changed_one_is_refused() {
    let mut d = docs(vec![provider("p", 10, &[])]);
    let req = Request::new("c").take(("p", "cores"), 4);
    let w = applied(take(&req, &d, None, None, at(0)).unwrap());
    apply(&mut d, w);
    assert_eq!(
        take(&req, &d, None, None, at(0)).unwrap(),
        Take::Replay { expires: None }
    );
    let mut other = req.clone();
    other.claims[0].1 = 5;
    assert!(matches!(
        take(&other, &d, None, None, at(0)),
        Err(QuotaError::RequestReused { .. })
    ));
    // The same id as a reservation is a different request.
    assert!(matches!(
        take(&req, &d, Some(at(10)), None, at(0)),
        Err(QuotaError::RequestReused { .. })
    ));
}

#[test]
fn release_keeps_a_marker_only_while_a_late_copy_could_land() {
    let mut d = docs(vec![provider("p", 10, &[])]);
    let quiet = Request::new("c").take(("p", "cores"), 2);
    let unsure = Request::new("c").take(("p", "cores"), 3);
    let w = applied(take(&quiet, &d, None, None, at(0)).unwrap());
    apply(&mut d, w);
    let w = applied(take(&unsure, &d, None, Some(at(100)), at(0)).unwrap());
    apply(&mut d, w);
    let (writes, returned) = remove(&d, |e| e.c == "c", at(50));
    assert_eq!(returned, vec![(ProviderId::new("p", "cores"), 5)]);
    apply(&mut d, writes);
    let doc = &d[&StripeId::new(&ProviderId::new("p", "cores"), 0)].1;
    assert_eq!((doc.usage, doc.available), (0, 10));
    assert_eq!(doc.held.len(), 1, "only the unsure request is remembered");
    assert!(doc.held[0].is_tombstone());
    // A late copy of it is a replay, not a new charge.
    assert!(matches!(
        take(&unsure, &d, None, None, at(60)),
        Ok(Take::Replay { .. })
    ));
    // Nothing left to release; past the deadline the marker is forgotten.
    assert!(remove(&d, |e| e.c == "c", at(60)).0.is_empty());
    assert!(pruned(
        &d[&StripeId::new(&ProviderId::new("p", "cores"), 0)].1,
        at(100)
    )
    .is_some_and(|doc| doc.held.is_empty()));
}

#[test]
fn confirm_decides_by_expiry_and_is_idempotent() {
    let mut d = docs(vec![
        provider("root", 10, &[]),
        provider("p", 10, &["root"]),
    ]);
    let req = Request::new("c").take(("p", "cores"), 4);
    let w = applied(take(&req, &d, Some(at(100)), None, at(0)).unwrap());
    apply(&mut d, w);
    assert!(matches!(
        confirm("c", &req.id, &d, at(100)),
        Err(QuotaError::ReservationExpired { .. })
    ));
    assert!(matches!(
        confirm("c", "other", &d, at(0)),
        Err(QuotaError::UnknownReservation { .. })
    ));
    let Confirm::Apply(writes) = confirm("c", &req.id, &d, at(99)).unwrap() else {
        panic!("expected writes");
    };
    assert_eq!(writes.len(), 2);
    apply(&mut d, writes);
    assert_eq!(confirm("c", &req.id, &d, at(500)).unwrap(), Confirm::Done);
    for (_, doc) in d.values() {
        assert_eq!(doc.usage, 4);
    }
}

#[test]
fn lowering_a_limit_below_usage_only_blocks_new_takes() {
    let mut d = docs(vec![provider("p", 10, &[])]);
    let req = Request::new("c").take(("p", "cores"), 8);
    let w = applied(take(&req, &d, None, None, at(0)).unwrap());
    apply(&mut d, w);
    let id = ProviderId::new("p", "cores");
    let lowered = set_limit(&d[&StripeId::new(&id, 0)].1, 5);
    assert_eq!((lowered.usage, lowered.available), (8, -3));
    d.insert(StripeId::new(&id, 0), (9, lowered));
    let more = Request::new("c2").take(id.clone(), 1);
    assert!(matches!(
        take(&more, &d, None, None, at(0)),
        Err(QuotaError::QuotaExceeded { .. })
    ));
    let (_, returned) = remove(&d, |e| e.c == "c", at(0));
    assert_eq!(returned, vec![(id, 8)]);
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    /// One step against a three-level hierarchy (org > team > project).
    #[derive(Debug, Clone)]
    enum Step {
        /// Consumer `c` takes `n` of the provider at `level`, under request id `r`.
        Consume { c: u8, r: u8, level: usize, n: i64 },
        /// Consumer `c` gives back everything it holds.
        Release { c: u8 },
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        prop::collection::vec(
            prop_oneof![
                3 => (0..4_u8, 0..6_u8, 0..3_usize, 1..40_i64)
                    .prop_map(|(c, r, level, n)| Step::Consume { c, r, level, n }),
                1 => (0..4_u8).prop_map(|c| Step::Release { c }),
            ],
            1..40,
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Whatever the order of consumes, retries of the same request and releases, no
        /// provider goes over its limit, usage plus available is the limit, usage is what
        /// its entries hold, a refused request changes nothing, and a request sent again
        /// counts once.
        #[test]
        fn no_provider_goes_over_its_limit_and_a_retry_counts_once(
            limits in (1..120_i64, 1..120_i64, 1..120_i64),
            steps in steps(),
        ) {
            let mut d = docs(vec![
                provider("org", limits.0, &[]),
                provider("team", limits.1, &["org"]),
                provider("project", limits.2, &["team", "org"]),
            ]);
            let levels = ["org", "team", "project"];
            let mut sent: BTreeMap<(u8, u8), i64> = BTreeMap::new();
            for step in steps {
                match step {
                    Step::Consume { c, r, level, n } => {
                        let req = Request::with_id(format!("c{c}"), format!("r{r}"))
                            .take(ProviderId::new(levels[level], "cores"), n);
                        let before = d.clone();
                        match take(&req, &d, None, None, at(0)) {
                            Ok(Take::Apply(writes)) => {
                                prop_assert!(!sent.contains_key(&(c, r)), "{req:?} applied twice");
                                sent.insert((c, r), n);
                                apply(&mut d, writes);
                            }
                            Ok(Take::Replay { .. }) => {
                                prop_assert!(sent.contains_key(&(c, r)), "{req:?} replayed unsent");
                            }
                            Err(QuotaError::QuotaExceeded { refusals, .. }) => {
                                prop_assert!(!refusals.is_empty());
                                prop_assert!(refusals.iter().all(|f| f.requested > f.available));
                            }
                            // The same id with another amount or provider.
                            Err(QuotaError::RequestReused { .. }) => {
                                prop_assert!(sent.contains_key(&(c, r)));
                            }
                            Err(other) => prop_assert!(false, "{req:?}: {other}"),
                        }
                        if d != before {
                            // Only an applied request changes anything.
                            prop_assert!(sent.contains_key(&(c, r)));
                        }
                    }
                    Step::Release { c } => {
                        let consumer = format!("c{c}");
                        let (writes, _) = remove(&d, |e| e.c == consumer, at(0));
                        apply(&mut d, writes);
                        sent.retain(|(sc, _), _| *sc != c);
                    }
                }
                for (generation, doc) in d.values() {
                    prop_assert!(*generation >= 7);
                    prop_assert!(doc.usage >= 0 && doc.available >= 0, "{doc:?}");
                    prop_assert_eq!(doc.usage + doc.available, doc.limit);
                    let held: i64 = doc.held.iter().map(|e| e.n).sum();
                    prop_assert_eq!(held, doc.usage, "{:?}", doc);
                }
                // An ancestor holds at least what its descendants hold.
                let usage = |scope: &str| d[&StripeId::new(&ProviderId::new(scope, "cores"), 0)].1.usage;
                prop_assert!(usage("org") >= usage("team") && usage("team") >= usage("project"));
            }
        }
    }
}
