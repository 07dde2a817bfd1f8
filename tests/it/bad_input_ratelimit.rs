//! Bad input to the rate limiter: every case is refused with a typed error and changes no
//! document of the database (`common::refusals`). A last test shows the inputs that look odd but
//! are accepted on purpose.

use crate::refuse;

use std::time::Duration;

use crate::common::refusals::Refusals;
use crate::common::TestDb;
use bson::{doc, Document};
use mongotx::collections::PROVIDERS_COLLECTION;
use mongotx::ratelimit::{
    Attempt, CallReservation, Limit, Priority, RateLimitError, RateLimitOptions, RateLimits,
};

const MINUTE: Duration = Duration::from_secs(60);

async fn granted(limits: &RateLimits, names: &[&str], n: u32, p: Priority) -> CallReservation {
    match limits.try_reserve(names, n, p).await.unwrap() {
        Attempt::Granted(r) => r,
        Attempt::Wait { after, .. } => panic!("{names:?}: {n} {p} calls refused, wait {after:?}"),
    }
}

/// Limiters `api` (10 a minute, 2 reserved) and `tenant` (10 a minute).
async fn seeded(t: &TestDb) -> RateLimits {
    let limits = RateLimits::open(&t.store).await.unwrap();
    limits
        .define("api", Limit::new(10, MINUTE).reserved(2))
        .await
        .unwrap();
    limits
        .define("tenant", Limit::new(10, MINUTE))
        .await
        .unwrap();
    limits
}

/// Limiter names that cannot name a limiter: empty, longer than 512 bytes, with a NUL or another
/// control character, in every call that takes one; and lists of limiters that are empty or name
/// one twice.
#[tokio::test]
async fn unusable_limiter_names_and_lists() {
    let t = TestDb::new().await;
    let limits = seeded(&t).await;
    let long = "x".repeat(513);
    let huge = "y".repeat(100_000);
    let limit = Limit::new(5, MINUTE);
    let mut r = Refusals::new(&t.db);

    refuse!(
        r,
        "define an empty name",
        limits.define("", limit),
        RateLimitError::InvalidRequest { .. }
    );
    refuse!(
        r,
        "define a 513-byte name",
        limits.define(&long, limit),
        RateLimitError::InvalidRequest { .. }
    );
    refuse!(
        r,
        "define a 100 kB name",
        limits.define(&huge, limit),
        RateLimitError::InvalidRequest { .. }
    );
    refuse!(
        r,
        "define a name with a NUL",
        limits.define("api\0v2", limit),
        RateLimitError::InvalidRequest { .. }
    );
    refuse!(
        r,
        "define a name with a tab",
        limits.define("maps\tapi", limit),
        RateLimitError::InvalidRequest { .. }
    );
    refuse!(
        r,
        "the limit of an empty name",
        limits.limit(""),
        RateLimitError::InvalidRequest { .. }
    );
    refuse!(
        r,
        "the usage of an empty name",
        limits.usage(""),
        RateLimitError::InvalidRequest { .. }
    );
    refuse!(
        r,
        "the usage of a 513-byte name",
        limits.usage(&long),
        RateLimitError::InvalidRequest { .. }
    );
    refuse!(
        r,
        "the usage of a name with a NUL",
        limits.usage("api\0"),
        RateLimitError::InvalidRequest { .. }
    );
    refuse!(
        r,
        "reserve on an empty name",
        limits.try_reserve(&[""], 1, Priority::Bulk),
        RateLimitError::InvalidRequest { .. }
    );
    refuse!(
        r,
        "reserve on a name with a NUL next to a good one",
        limits.try_reserve(&["api", "tenant\0"], 1, Priority::High),
        RateLimitError::InvalidRequest { .. }
    );
    refuse!(
        r,
        "wait for a 513-byte name",
        limits.reserve(&[long.as_str()], 1, Priority::Bulk),
        RateLimitError::InvalidRequest { .. }
    );
    refuse!(
        r,
        "reserve on no limiter",
        limits.try_reserve(&[], 1, Priority::Bulk),
        RateLimitError::InvalidRequest { .. }
    );
    refuse!(
        r,
        "wait on no limiter",
        limits.reserve_within(&[], 1, Priority::High, MINUTE),
        RateLimitError::InvalidRequest { .. }
    );
    refuse!(
        r,
        "one limiter named twice",
        limits.try_reserve(&["api", "tenant", "api"], 1, Priority::Bulk),
        RateLimitError::InvalidRequest { .. }
    );
    refuse!(
        r,
        "wait on one limiter named twice",
        limits.reserve(&["tenant", "tenant"], 1, Priority::Bulk),
        RateLimitError::InvalidRequest { .. }
    );
    assert!(r.checked() >= 16, "{}", r.checked());

    // The messages name the collection and the name (escaped, and cut when long).
    let says = limits.usage("api\0").await.unwrap_err().to_string();
    assert!(
        says.contains("ratelimits") && says.contains(r#""api\0""#),
        "{says}"
    );
    let says = limits.define(&huge, limit).await.unwrap_err().to_string();
    assert!(says.contains("100000") && says.len() < 300, "{says}");
}

/// Limits that cannot be enforced: no calls, more than a million, windows, holds or graces of
/// zero, of more than a day or with a fraction of a millisecond (stored in whole milliseconds,
/// they would not read back as defined), a reserved part as large as the limit; and a new
/// definition of a live limiter.
#[tokio::test]
async fn limits_that_cannot_be_enforced() {
    let t = TestDb::new().await;
    let limits = seeded(&t).await;
    let cases: Vec<(&str, Limit)> = vec![
        ("zero calls", Limit::new(0, MINUTE)),
        ("a million and one calls", Limit::new(1_000_001, MINUTE)),
        ("u32::MAX calls", Limit::new(u32::MAX, MINUTE)),
        ("a zero window", Limit::new(5, Duration::ZERO)),
        (
            "a window under a millisecond",
            Limit::new(5, Duration::from_micros(500)),
        ),
        (
            "a window of 1.5 ms",
            Limit::new(5, Duration::from_micros(1500)),
        ),
        (
            "a window of more than a day",
            Limit::new(5, Duration::from_secs(86_401)),
        ),
        ("a window of Duration::MAX", Limit::new(5, Duration::MAX)),
        ("all calls reserved", Limit::new(5, MINUTE).reserved(5)),
        (
            "more calls reserved than the limit",
            Limit::new(5, MINUTE).reserved(u32::MAX),
        ),
        ("a zero hold", Limit::new(5, MINUTE).hold(Duration::ZERO)),
        (
            "a hold of 2.5 ms",
            Limit::new(5, MINUTE).hold(Duration::from_micros(2500)),
        ),
        (
            "a hold of more than a day",
            Limit::new(5, MINUTE).hold(Duration::from_secs(86_401)),
        ),
        (
            "a grace of more than a day",
            Limit::new(5, MINUTE).grace(Duration::from_secs(90_000)),
        ),
        (
            "a grace of 100 µs",
            Limit::new(5, MINUTE).grace(Duration::from_micros(100)),
        ),
        (
            "a grace of Duration::MAX",
            Limit::new(5, MINUTE).grace(Duration::MAX),
        ),
        (
            "a skew of more than a day",
            Limit::new(5, MINUTE).skew(Duration::from_secs(86_401)),
        ),
        (
            "a skew of 1.5 ms",
            Limit::new(5, MINUTE).skew(Duration::from_micros(1_500)),
        ),
    ];
    let mut r = Refusals::new(&t.db);
    for (what, limit) in cases {
        refuse!(
            r,
            what,
            limits.define("fresh", limit),
            RateLimitError::InvalidLimit { .. }
        );
    }
    refuse!(
        r,
        "redefine a live limiter with another limit",
        limits.define("api", Limit::new(10, MINUTE).reserved(3)),
        RateLimitError::LimitMismatch { .. }
    );
    refuse!(
        r,
        "redefine a live limiter with another window",
        limits.define("tenant", Limit::new(10, Duration::from_secs(61))),
        RateLimitError::LimitMismatch { .. }
    );
    assert!(r.checked() >= 20, "{}", r.checked());
}

/// Requests for calls that can never be granted: zero, more than the limit (or, for bulk
/// callers, than the limit less the reserved part), `u32::MAX`; and limiters never defined,
/// alone or next to known ones, in every call that names one.
#[tokio::test]
async fn impossible_counts_and_unknown_limiters() {
    let t = TestDb::new().await;
    let limits = seeded(&t).await;
    let mut r = Refusals::new(&t.db);

    refuse!(
        r,
        "reserve zero calls",
        limits.try_reserve(&["api"], 0, Priority::Bulk),
        RateLimitError::ZeroCalls { .. }
    );
    refuse!(
        r,
        "wait for zero calls",
        limits.reserve(&["api", "tenant"], 0, Priority::High),
        RateLimitError::ZeroCalls { .. }
    );
    refuse!(
        r,
        "bulk caller asks for the reserved part too",
        limits.try_reserve(&["api"], 9, Priority::Bulk),
        RateLimitError::TooManyCalls {
            requested: 9,
            most: 8,
            ..
        }
    );
    refuse!(
        r,
        "high-priority caller asks for more than the limit",
        limits.try_reserve(&["api"], 11, Priority::High),
        RateLimitError::TooManyCalls { most: 10, .. }
    );
    refuse!(
        r,
        "u32::MAX calls",
        limits.try_reserve(&["tenant"], u32::MAX, Priority::High),
        RateLimitError::TooManyCalls { .. }
    );
    refuse!(
        r,
        "too many for one of two limiters",
        limits.try_reserve(&["tenant", "api"], 9, Priority::Bulk),
        RateLimitError::TooManyCalls { .. }
    );
    refuse!(
        r,
        "wait for more than can ever be granted",
        limits.reserve_within(&["api"], 9, Priority::Bulk, MINUTE),
        RateLimitError::TooManyCalls { .. }
    );
    refuse!(
        r,
        "reserve on an unknown limiter",
        limits.try_reserve(&["nope"], 1, Priority::Bulk),
        RateLimitError::UnknownLimiter { .. }
    );
    refuse!(
        r,
        "reserve on an unknown limiter next to a known one",
        limits.try_reserve(&["api", "nope"], 1, Priority::High),
        RateLimitError::UnknownLimiter { .. }
    );
    refuse!(
        r,
        "wait on an unknown limiter",
        limits.reserve(&["nope"], 1, Priority::Bulk),
        RateLimitError::UnknownLimiter { .. }
    );
    refuse!(
        r,
        "the limit of an unknown limiter",
        limits.limit("nope"),
        RateLimitError::UnknownLimiter { .. }
    );
    refuse!(
        r,
        "the usage of an unknown limiter",
        limits.usage("nope"),
        RateLimitError::UnknownLimiter { .. }
    );
    assert!(r.checked() >= 12, "{}", r.checked());
}

/// Settlements that do not apply: more calls made than reserved (up to `u32::MAX`), settling
/// twice (with the same or another count, on one limiter or several), and reservations granted
/// by another collection of limiters, on a limiter of the same name or one this collection
/// does not have.
#[tokio::test]
async fn settlements_that_do_not_apply() {
    let t = TestDb::new().await;
    let limits = seeded(&t).await;
    let elsewhere = RateLimits::with_options(
        &t.store,
        RateLimitOptions::default().collection("other_limits"),
    )
    .await
    .unwrap();
    elsewhere
        .define("api", Limit::new(10, MINUTE).reserved(2))
        .await
        .unwrap();
    elsewhere
        .define("only_there", Limit::new(10, MINUTE))
        .await
        .unwrap();
    let foreign = granted(&elsewhere, &["api"], 1, Priority::Bulk).await;
    let foreign_only = granted(&elsewhere, &["only_there"], 1, Priority::Bulk).await;
    let live = granted(&limits, &["api"], 4, Priority::Bulk).await;
    let settled = granted(&limits, &["api"], 2, Priority::High).await;
    limits.settle(&settled, 1).await.unwrap();
    let both = granted(&limits, &["api", "tenant"], 2, Priority::Bulk).await;
    limits.settle(&both, 2).await.unwrap();

    let mut r = Refusals::new(&t.db);
    refuse!(
        r,
        "more calls made than reserved",
        limits.settle(&live, 5),
        RateLimitError::MadeExceedsReserved {
            made: 5,
            reserved: 4,
            ..
        }
    );
    refuse!(
        r,
        "u32::MAX calls made",
        limits.settle(&live, u32::MAX),
        RateLimitError::MadeExceedsReserved { .. }
    );
    refuse!(
        r,
        "settle twice with the same count",
        limits.settle(&settled, 1),
        RateLimitError::AlreadySettled { made: 1, .. }
    );
    refuse!(
        r,
        "settle twice with another count",
        limits.settle(&settled, 0),
        RateLimitError::AlreadySettled { made: 1, .. }
    );
    refuse!(
        r,
        "settle twice across two limiters",
        limits.settle(&both, 1),
        RateLimitError::AlreadySettled { .. }
    );
    refuse!(
        r,
        "settle a reservation of another collection",
        limits.settle(&foreign, 1),
        RateLimitError::UnknownReservation { .. }
    );
    refuse!(
        r,
        "settle a reservation on a limiter this collection lacks",
        limits.settle(&foreign_only, 0),
        RateLimitError::UnknownLimiter { .. }
    );
    refuse!(
        r,
        "more calls made than reserved, on a foreign reservation",
        limits.settle(&foreign, 2),
        RateLimitError::MadeExceedsReserved { .. }
    );
    assert!(r.checked() >= 8, "{}", r.checked());
    limits.settle(&live, 4).await.unwrap();
    elsewhere.settle(&foreign, 1).await.unwrap();
}

/// The validator installed on `name`, if any.
async fn validator(t: &TestDb, name: &str) -> Option<Document> {
    let mut specs =
        t.db.list_collections()
            .filter(doc! { "name": name })
            .await
            .unwrap();
    use futures::TryStreamExt;
    let spec = specs.try_next().await.unwrap()?;
    spec.options.validator
}

/// Options that make no sense, refused before any collection is created or changed: collection
/// names the server refuses or that belong to someone else (mongotx's own collections, a
/// collection holding documents that are not limiters), and polls of zero or absurd length.
#[tokio::test]
async fn options_that_make_no_sense() {
    let t = TestDb::new().await;
    t.db.collection::<Document>("accounts")
        .insert_one(doc! { "_id": "acc", "owner": "Ann", "balance": 10_i64 })
        .await
        .unwrap();
    let long = "l".repeat(300);
    let cases: Vec<(&str, RateLimitOptions)> = vec![
        (
            "an empty collection",
            RateLimitOptions::default().collection(""),
        ),
        (
            "a collection with a $",
            RateLimitOptions::default().collection("rate$limits"),
        ),
        (
            "a collection with a NUL",
            RateLimitOptions::default().collection("rate\0limits"),
        ),
        (
            "a system collection",
            RateLimitOptions::default().collection("system.limits"),
        ),
        (
            "a collection name of 300 bytes",
            RateLimitOptions::default().collection(long.as_str()),
        ),
        (
            "a collection name starting with a dot",
            RateLimitOptions::default().collection(".limits"),
        ),
        (
            "the quota's collection",
            RateLimitOptions::default().collection(PROVIDERS_COLLECTION),
        ),
        (
            "mongotx's transaction log",
            RateLimitOptions::default().collection("mongotx_transactions"),
        ),
        (
            "a collection of the caller's accounts",
            RateLimitOptions::default().collection("accounts"),
        ),
        (
            "a zero poll",
            RateLimitOptions::default().poll(Duration::ZERO),
        ),
        (
            "a poll under a millisecond",
            RateLimitOptions::default().poll(Duration::from_micros(200)),
        ),
        (
            "a poll of more than a day",
            RateLimitOptions::default().poll(Duration::from_secs(86_401)),
        ),
        (
            "a poll of Duration::MAX",
            RateLimitOptions::default().poll(Duration::MAX),
        ),
        (
            "a zero send window",
            RateLimitOptions::default().send_window(Duration::ZERO),
        ),
        (
            "a send window of more than a day",
            RateLimitOptions::default().send_window(Duration::from_secs(86_401)),
        ),
    ];
    let mut r = Refusals::new(&t.db);
    for (what, options) in cases {
        refuse!(
            r,
            what,
            RateLimits::with_options(&t.store, options),
            RateLimitError::InvalidOption { .. }
        );
    }
    assert!(r.checked() >= 15, "{}", r.checked());
    assert_eq!(
        validator(&t, "accounts").await,
        None,
        "the caller's collection keeps its (absent) validator"
    );
}

/// Inputs that look odd but are accepted on purpose: `$` and `.` in limiter names (the name is
/// only ever a value, the document's id, never a field name or path), names of exactly 512
/// bytes, a limit of one call, and a wait of zero (one try, then `TimedOut`).
#[tokio::test]
async fn odd_but_valid_names_and_waits() {
    let t = TestDb::new().await;
    let limits = RateLimits::open(&t.store).await.unwrap();
    let edge = "z".repeat(512);
    // Names starting with `$` are valid too, but the local stand-in server evaluates the stored
    // `_id` inside the granting pipeline's `$mergeObjects: ["$$ROOT", ...]` (MongoDB does not),
    // so they are left out here.
    for name in ["log.$[]", "wait.x", "a$$NOW", ".", edge.as_str(), "ünïcödé"] {
        limits.define(name, Limit::new(1, MINUTE)).await.unwrap();
        let r = granted(&limits, &[name], 1, Priority::Bulk).await;
        assert_eq!(limits.usage(name).await.unwrap().pending, 1, "{name}");
        let err = limits
            .reserve_within(&[name], 1, Priority::Bulk, Duration::ZERO)
            .await
            .unwrap_err();
        assert!(matches!(err, RateLimitError::TimedOut { .. }), "{err}");
        limits.settle(&r, 0).await.unwrap();
        let r = limits
            .reserve_within(&[name], 1, Priority::High, Duration::ZERO)
            .await
            .unwrap();
        limits.settle(&r, 1).await.unwrap();
        let usage = limits.usage(name).await.unwrap();
        assert_eq!(
            (usage.pending, usage.high, usage.waiting),
            (0, 1, 0),
            "{name}"
        );
    }
}
