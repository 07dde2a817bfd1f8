//! The quota decisions, free of I/O: given providers as read (with their generations), what to
//! write and what to answer. The database layer reads, calls these, and writes conditionally on
//! the generations read, which is the algorithm of the quota's reference design (check
//! availability and read the generation, write only if the generation is unchanged, otherwise
//! read again and retry); the single-provider fast path
//! (`ops::take_fast`) encodes the same decision as the condition of one write instead.

use std::collections::{BTreeMap, BTreeSet};

use bson::DateTime;

use crate::quota::error::{QuotaError, Refusal};
use crate::quota::model::{Entry, NewProvider, ProviderDoc, ProviderId, Request, StripeId};
use crate::repo::fields::MAX_NAME;

/// Provider stripes as read: id -> (generation, stored value); a request's decision gets one per
/// provider, the one holding the request's entries (see `stripes`).
pub(crate) type Docs = BTreeMap<StripeId, (i64, ProviderDoc)>;

/// The stripe of `provider` in `docs`.
pub(crate) fn stripe_of<'a>(
    docs: &'a Docs,
    provider: &ProviderId,
) -> Option<(&'a StripeId, &'a (i64, ProviderDoc))> {
    docs.iter().find(|(id, _)| id.is(provider))
}

/// A provider's new value, to be written only if its generation is still the one read.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Write {
    pub(crate) generation: i64,
    pub(crate) doc: ProviderDoc,
}

/// What taking a request comes to.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Take {
    /// Already applied (a retry); `expires` is the reservation's expiry, if it is one.
    Replay { expires: Option<DateTime> },
    /// Write these (one per provider touched, ancestors included).
    Apply(Vec<Write>),
}

/// Checks a name: `what` says which (`provider scope`, `provider resource`, `consumer`,
/// `request id`). Names are copied into every provider (and ancestor) a request touches, hot
/// documents, so they stay under [`MAX_NAME`] bytes.
pub(crate) fn check_name(what: &'static str, value: &str) -> Result<(), QuotaError> {
    let invalid = |reason: String| QuotaError::InvalidName {
        what,
        name: value.to_string(),
        reason,
    };
    if value.is_empty() {
        return Err(invalid("it is empty".into()));
    }
    if value.len() > MAX_NAME {
        return Err(invalid(format!(
            "it has {} bytes, more than {MAX_NAME}",
            value.len()
        )));
    }
    // A NUL or a line break in an id is almost always a caller's encoding bug, and would make
    // errors and logs lie about what was asked.
    if let Some(c) = value.chars().find(|c| c.is_control()) {
        return Err(invalid(format!(
            "it holds the control character U+{:04X}",
            u32::from(c)
        )));
    }
    Ok(())
}

/// Checks a provider id's parts.
pub(crate) fn check_provider(id: &ProviderId) -> Result<(), QuotaError> {
    check_name("provider scope", &id.scope)?;
    check_name("provider resource", &id.resource)
}

/// Checks a new provider before anything is read or written.
pub(crate) fn check_new(new: &NewProvider) -> Result<(), QuotaError> {
    check_provider(&new.id)?;
    check_limit(&new.id, new.limit)?;
    if let Some(parent) = &new.parent {
        check_provider(parent)?;
        if parent == &new.id {
            return Err(QuotaError::InvalidRequest {
                reason: format!("{} cannot be its own parent", new.id),
            });
        }
    }
    Ok(())
}

/// Checks a limit.
pub(crate) fn check_limit(id: &ProviderId, limit: i64) -> Result<(), QuotaError> {
    if limit < 0 {
        return Err(QuotaError::NegativeLimit {
            provider: id.clone(),
            limit,
        });
    }
    Ok(())
}

/// Checks a request before anything is read or written.
pub(crate) fn check_request(req: &Request) -> Result<(), QuotaError> {
    check_name("consumer", &req.consumer)?;
    check_name("request id", &req.id)?;
    if req.claims.is_empty() {
        return Err(QuotaError::InvalidRequest {
            reason: format!(
                "request {} of consumer {} names no provider",
                req.id, req.consumer
            ),
        });
    }
    let mut seen = BTreeSet::new();
    for (provider, amount) in &req.claims {
        check_provider(provider)?;
        if *amount <= 0 {
            return Err(QuotaError::InvalidAmount {
                provider: provider.clone(),
                amount: *amount,
            });
        }
        if !seen.insert(provider) {
            return Err(QuotaError::DuplicateProvider {
                provider: provider.clone(),
            });
        }
    }
    Ok(())
}

/// The providers a request touches: each claim's and its ancestors', needing `docs` for the
/// claimed providers only.
pub(crate) fn needs(req: &Request, docs: &Docs) -> Result<BTreeMap<ProviderId, i64>, QuotaError> {
    let mut needs: BTreeMap<ProviderId, i64> = BTreeMap::new();
    for (provider, amount) in &req.claims {
        let (_, (_, doc)) =
            stripe_of(docs, provider).ok_or_else(|| QuotaError::UnknownProvider {
                provider: provider.clone(),
            })?;
        for id in std::iter::once(provider).chain(doc.ancestors.iter()) {
            let total = needs.entry(id.clone()).or_insert(0);
            *total = total
                .checked_add(*amount)
                .ok_or_else(|| QuotaError::InvalidAmount {
                    provider: id.clone(),
                    amount: *amount,
                })?;
        }
    }
    Ok(needs)
}

/// Drops released requests whose late copies can no longer land.
fn prune(held: &mut Vec<Entry>, now: DateTime) -> bool {
    let before = held.len();
    held.retain(|e| !(e.is_tombstone() && e.dl.is_none_or(|dl| dl <= now)));
    held.len() != before
}

/// Decides a consume (`expires` = None) or a reservation (`expires` = Some) of `req`.
/// `dl` is stored in the new entries when a copy of the request may be in flight.
pub(crate) fn take(
    req: &Request,
    docs: &Docs,
    expires: Option<DateTime>,
    dl: Option<DateTime>,
    now: DateTime,
) -> Result<Take, QuotaError> {
    let needs = needs(req, docs)?;
    let mut found = Vec::new();
    let mut stripes = BTreeMap::new();
    for id in needs.keys() {
        let (stripe, (_, doc)) =
            stripe_of(docs, id).ok_or_else(|| QuotaError::UnknownProvider {
                provider: id.clone(),
            })?;
        stripes.insert(id, stripe);
        if let Some(entry) = doc.held.iter().find(|e| e.is(&req.consumer, &req.id)) {
            found.push((id, entry));
        }
    }
    if !found.is_empty() {
        let same = found.len() == needs.len()
            && found.iter().all(|(id, e)| match expires {
                None => e.exp.is_none() && (e.n == needs[*id] || e.is_tombstone()),
                Some(_) => e.exp.is_some() && e.n == needs[*id],
            });
        if !same {
            return Err(QuotaError::RequestReused {
                consumer: req.consumer.clone(),
                request: req.id.clone(),
            });
        }
        return Ok(Take::Replay {
            expires: found.iter().find_map(|(_, e)| e.exp),
        });
    }
    let refusals: Vec<Refusal> = needs
        .iter()
        .filter_map(|(id, need)| {
            let (_, doc) = &docs[stripes[id]];
            (doc.available < *need || doc.over).then(|| Refusal {
                provider: id.clone(),
                requested: *need,
                available: doc.available,
                limit: doc.limit,
            })
        })
        .collect();
    if !refusals.is_empty() {
        return Err(QuotaError::QuotaExceeded {
            consumer: req.consumer.clone(),
            request: req.id.clone(),
            refusals,
        });
    }
    let writes = needs
        .iter()
        .map(|(id, need)| {
            let (generation, doc) = &docs[stripes[id]];
            let mut doc = doc.clone();
            prune(&mut doc.held, now);
            doc.held.push(Entry {
                c: req.consumer.clone(),
                r: req.id.clone(),
                n: *need,
                exp: expires,
                dl,
            });
            doc.usage += need;
            doc.available -= need;
            Write {
                generation: *generation,
                doc,
            }
        })
        .collect();
    Ok(Take::Apply(writes))
}

/// Removes the entries `pick` selects from every provider in `docs` (entries that may still
/// have a late copy in flight stay, at 0, until their deadline); returns the writes and the
/// amount returned to each provider. Providers with nothing picked are left alone, apart from
/// forgetting expired tombstones where something else is written anyway. What went back to the
/// stripes of one provider is added up.
pub(crate) fn remove(
    docs: &Docs,
    pick: impl Fn(&Entry) -> bool,
    now: DateTime,
) -> (Vec<Write>, Vec<(ProviderId, i64)>) {
    let mut writes = Vec::new();
    let mut returned: BTreeMap<ProviderId, i64> = BTreeMap::new();
    for (id, (generation, doc)) in docs {
        if !doc.held.iter().any(|e| !e.is_tombstone() && pick(e)) {
            continue;
        }
        let mut doc = doc.clone();
        let mut amount = 0;
        let mut held = Vec::with_capacity(doc.held.len());
        for e in doc.held.drain(..) {
            if e.is_tombstone() || !pick(&e) {
                held.push(e);
                continue;
            }
            amount += e.n;
            if let Some(dl) = e.dl.filter(|dl| *dl > now) {
                held.push(Entry {
                    n: 0,
                    exp: None,
                    dl: Some(dl),
                    ..e
                });
            }
        }
        prune(&mut held, now);
        doc.held = held;
        doc.usage -= amount;
        doc.available += amount;
        // A provider of one stripe is its own whole: it is over exactly while its usage is.
        // (A striped one learns that it is back under by reading every stripe: `borrow`.)
        if doc.is_whole() {
            doc.over = doc.available < 0;
        }
        *returned.entry(id.provider()).or_default() += amount;
        writes.push(Write {
            generation: *generation,
            doc,
        });
    }
    (writes, returned.into_iter().collect())
}

/// What confirming a reservation comes to.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Confirm {
    /// Already confirmed (a retry).
    Done,
    /// Write these.
    Apply(Vec<Write>),
}

/// Decides confirming reservation (`consumer`, `request`) found in `docs`.
pub(crate) fn confirm(
    consumer: &str,
    request: &str,
    docs: &Docs,
    now: DateTime,
) -> Result<Confirm, QuotaError> {
    let entries: Vec<&Entry> = docs
        .values()
        .filter_map(|(_, doc)| doc.held.iter().find(|e| e.is(consumer, request)))
        .filter(|e| !e.is_tombstone())
        .collect();
    if entries.is_empty() {
        return Err(QuotaError::UnknownReservation {
            consumer: consumer.to_string(),
            request: request.to_string(),
        });
    }
    if entries.iter().all(|e| e.exp.is_none()) {
        return Ok(Confirm::Done);
    }
    if let Some(expired_at) = entries.iter().filter_map(|e| e.exp).find(|exp| *exp <= now) {
        return Err(QuotaError::ReservationExpired {
            consumer: consumer.to_string(),
            request: request.to_string(),
            expired_at: expired_at.to_chrono(),
        });
    }
    let writes = docs
        .values()
        .filter(|(_, doc)| doc.held.iter().any(|e| e.is(consumer, request)))
        .map(|(generation, doc)| {
            let mut doc = doc.clone();
            for e in doc.held.iter_mut().filter(|e| e.is(consumer, request)) {
                e.exp = None;
            }
            Write {
                generation: *generation,
                doc,
            }
        })
        .collect();
    Ok(Confirm::Apply(writes))
}

/// The provider of one stripe with a new limit (usage is untouched: a limit below it only
/// blocks new takes). Below its usage it is marked `over`, which a split hands to both halves:
/// each half's own `available` would otherwise show room the provider as a whole lacks.
pub(crate) fn set_limit(doc: &ProviderDoc, limit: i64) -> ProviderDoc {
    let mut doc = doc.clone();
    doc.limit = limit;
    doc.available = limit - doc.usage;
    doc.over = doc.available < 0;
    doc
}

/// The provider without tombstones past their deadline, if it had any.
pub(crate) fn pruned(doc: &ProviderDoc, now: DateTime) -> Option<ProviderDoc> {
    let mut doc = doc.clone();
    prune(&mut doc.held, now).then_some(doc)
}

/// A new provider's stored value.
pub(crate) fn new_provider(new: &NewProvider, parent: Option<&ProviderDoc>) -> ProviderDoc {
    let ancestors = match parent {
        Some(parent) => std::iter::once(parent.id.provider())
            .chain(parent.ancestors.iter().cloned())
            .collect(),
        None => Vec::new(),
    };
    ProviderDoc {
        id: StripeId::new(&new.id, 0),
        limit: new.limit,
        usage: 0,
        available: new.limit,
        parent: new.parent.clone(),
        ancestors,
        held: Vec::new(),
        bits: 0,
        stripes: Vec::new(),
        over: false,
    }
}

#[cfg(test)]
mod tests {
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
}
