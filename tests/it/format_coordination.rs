//! The stored format on the coordination collections' documents: a rate limiter, a batch, a
//! batch service, an OBT token counter, a fence and a minute of the contention record.
//!
//! Each kind is tested twice. Turned newer by hand (`_format: 3` set with the driver on a stored
//! document, in a database that writes format 1), every operation of this release that reads it
//! or writes it is refused with `ErrorKind::NewerFormat`, naming the collection, the id and both
//! formats, and the document is left byte for byte as it was, with nothing else written beside
//! it. Written by a store that plays a future release reading formats up to 3, it is unmarked
//! until that store switches the database to format 3 and marked `_format: 3` from then on, and
//! a store of this release (reading formats up to 2) refuses it.

use std::time::{Duration, Instant};

use bson::{doc, Bson, Document};
use futures::TryStreamExt;
use mongotx::collections::{
    BATCHES_COLLECTION, CONTENTION_COLLECTION, FENCES_COLLECTION, LIMITERS_COLLECTION,
    META_COLLECTION, OBTS_COLLECTION, SERVICES_SUFFIX, TOKENS_COLLECTION,
};
use mongotx::obt::{Fence, MongoFence, NewObt, Obt, Token};
use mongotx::queue::{BatchStatus, Batches, NewBatch, Submission, DEFAULT_DELAY};
use mongotx::ratelimit::{Limit, Priority, RateLimits};
use mongotx::{ErrorKind, Store};

use crate::common::TestDb;
use crate::contention::{alice_moved_on, stale_update};

/// Asserts that `err` (of kind `kind`) refuses a document of format 3 in a process reading
/// formats up to 2, naming `collection` and, when given, the document's `id` (as errors show it).
fn refused(kind: ErrorKind, err: &dyn std::fmt::Display, collection: &str, id: Option<&str>) {
    let message = err.to_string();
    assert_eq!(kind, ErrorKind::NewerFormat, "{message}");
    let parts = [collection, id.unwrap_or(collection), "format 3", "format 2"];
    for part in parts {
        assert!(message.contains(part), "{part:?} is not in: {message}");
    }
}

/// Awaits `$call`, which must fail refusing a newer format (see [`refused`]).
macro_rules! newer {
    ($call:expr, $collection:expr, $id:expr) => {{
        let err = $call
            .await
            .err()
            .unwrap_or_else(|| panic!("{} succeeded", stringify!($call)));
        refused(err.kind(), &err, $collection, $id);
    }};
}

/// Every document of `collection`, in `_id` order.
async fn everything(t: &TestDb, collection: &str) -> Vec<Document> {
    t.db.collection::<Document>(collection)
        .find(doc! {})
        .sort(doc! { "_id": 1 })
        .await
        .expect("read the collection")
        .try_collect()
        .await
        .expect("read the collection")
}

/// Document `id` of `collection` as stored.
async fn stored(t: &TestDb, collection: &str, id: impl Into<Bson>) -> Document {
    let id = id.into();
    t.db.collection::<Document>(collection)
        .find_one(doc! { "_id": id.clone() })
        .await
        .expect("read the document")
        .unwrap_or_else(|| panic!("{collection} {id} is not stored"))
}

/// Marks document `id` of `collection` as written in format 3, by hand (the validator this
/// release installs lets `_format` through); returns it as it now is.
async fn turn_newer(t: &TestDb, collection: &str, id: impl Into<Bson>) -> Document {
    let id = id.into();
    let marked =
        t.db.collection::<Document>(collection)
            .update_one(
                doc! { "_id": id.clone() },
                doc! { "$set": { "_format": 3_i64 } },
            )
            .await
            .expect("mark the document");
    assert_eq!(marked.modified_count, 1, "{collection} {id}");
    stored(t, collection, id).await
}

/// The format `stored` says it was written in: `None` when unmarked (format 1).
fn format_of(stored: &Document) -> Option<&Bson> {
    stored.get("_format")
}

fn assert_unmarked(stored: &Document) {
    assert_eq!(
        format_of(stored),
        None,
        "format 1 leaves it unmarked: {stored}"
    );
}

fn assert_marked(stored: &Document) {
    assert_eq!(
        format_of(stored),
        Some(&Bson::Int64(3)),
        "marked with format 3: {stored}"
    );
}

/// A store of a future release, reading stored formats up to 3.
fn future(t: &TestDb) -> Store {
    Store::builder(t.db.clone()).plays_format(3).build()
}

/// A store of this release (reading formats up to 2), that has announced nothing yet.
fn this_release(t: &TestDb) -> Store {
    Store::builder(t.db.clone()).build()
}

/// Switches the database to format 3 through `future` (no live instance reads less).
async fn switch_to_two(future: &Store) {
    let status = future.set_format(3).await.expect("switch to format 3");
    assert_eq!(status.writes, 3);
}

fn limit() -> Limit {
    Limit::new(10, Duration::from_secs(1))
}

fn services() -> String {
    format!("{BATCHES_COLLECTION}{SERVICES_SUFFIX}")
}

#[tokio::test]
async fn a_newer_limiter_is_neither_read_nor_written() {
    let t = TestDb::new().await;
    let limits = RateLimits::open(&t.store).await.expect("open");
    limits.define("maps", limit()).await.expect("define");
    let held = limits
        .reserve(&["maps"], 2, Priority::Bulk)
        .await
        .expect("reserve");
    let before = turn_newer(&t, LIMITERS_COLLECTION, "maps").await;
    let (coll, id) = (LIMITERS_COLLECTION, Some("\"maps\""));
    // The handle knows the limit already: its grant goes to the write, which the guard keeps
    // from matching.
    newer!(limits.try_reserve(&["maps"], 1, Priority::Bulk), coll, id);
    newer!(limits.settle(&held, 1), coll, id);
    newer!(limits.define("maps", limit()), coll, id);
    newer!(limits.usage("maps"), coll, id);
    newer!(limits.report("maps"), coll, id);
    newer!(
        mongotx::ratelimit::inspect(&t.store, coll, "maps"),
        coll,
        id
    );
    // A new handle reads the limit first.
    let fresh = RateLimits::open(&t.store).await.expect("open");
    newer!(fresh.limit("maps"), coll, id);
    newer!(fresh.reserve(&["maps"], 1, Priority::High), coll, id);
    // The sweep leaves it to the instances that read it.
    assert_eq!(limits.sweep().await.expect("sweep"), 0);
    assert_eq!(everything(&t, coll).await, vec![before]);
}

#[tokio::test]
async fn a_newer_batch_is_neither_read_nor_written() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.expect("open");
    let waiting = batches
        .add(&NewBatch::new("s1", "a1", "x"))
        .await
        .expect("add");
    let sent = batches
        .add(&NewBatch::new("s2", "b1", "y"))
        .await
        .expect("add");
    let claim = batches
        .claim(&sent, "submitter", Duration::from_secs(60))
        .await
        .expect("claim")
        .expect("claimed");
    turn_newer(&t, BATCHES_COLLECTION, "a1").await;
    turn_newer(&t, BATCHES_COLLECTION, "b1").await;
    let before = (
        everything(&t, BATCHES_COLLECTION).await,
        everything(&t, &services()).await,
    );
    let coll = BATCHES_COLLECTION;
    let (a1, b1) = (Some("\"a1\""), Some("\"b1\""));
    newer!(batches.get("a1"), coll, a1);
    newer!(batches.add(&NewBatch::new("s1", "a1", "x")), coll, a1);
    newer!(batches.round(), coll, None);
    // The slot is taken, the claim finds nothing it may match, and the slot is given back.
    newer!(
        batches.claim(&waiting, "submitter", Duration::from_secs(60)),
        coll,
        a1
    );
    newer!(batches.record(&claim, Submission::Accepted), coll, b1);
    newer!(
        batches.record_status(&claim.batch, BatchStatus::Pending),
        coll,
        b1
    );
    newer!(batches.watched(), coll, b1);
    newer!(batches.report("s2"), coll, b1);
    newer!(
        mongotx::queue::inspect(&t.store, coll, DEFAULT_DELAY, "s1"),
        coll,
        a1
    );
    let after = (
        everything(&t, BATCHES_COLLECTION).await,
        everything(&t, &services()).await,
    );
    assert_eq!(after, before);
}

#[tokio::test]
async fn a_newer_batch_service_is_neither_read_nor_written() {
    let t = TestDb::new().await;
    let batches = Batches::open(&t.store).await.expect("open");
    let first = batches
        .add(&NewBatch::new("s3", "c1", "z"))
        .await
        .expect("add");
    let services = services();
    turn_newer(&t, &services, "s3").await;
    let before = (
        everything(&t, BATCHES_COLLECTION).await,
        everything(&t, &services).await,
    );
    let id = Some("\"s3\"");
    // The stamp is drawn from the service before the batch is inserted: nothing is.
    newer!(batches.add(&NewBatch::new("s3", "c2", "z")), &services, id);
    newer!(
        batches.claim(&first, "submitter", Duration::from_secs(60)),
        &services,
        id
    );
    newer!(batches.report("s3"), &services, id);
    let after = (
        everything(&t, BATCHES_COLLECTION).await,
        everything(&t, &services).await,
    );
    assert_eq!(after, before);
}

#[tokio::test]
async fn a_newer_token_counter_is_neither_read_nor_written() {
    let t = TestDb::new().await;
    let obt = Obt::open(&t.store).await.expect("open");
    obt.create(NewObt::new("t0", "owner0"))
        .await
        .expect("create");
    turn_newer(&t, TOKENS_COLLECTION, OBTS_COLLECTION).await;
    let before = (
        everything(&t, TOKENS_COLLECTION).await,
        everything(&t, OBTS_COLLECTION).await,
    );
    let id = format!("\"{OBTS_COLLECTION}\"");
    newer!(
        obt.create(NewObt::new("t1", "owner1")),
        TOKENS_COLLECTION,
        Some(&id)
    );
    newer!(obt.issue_token(), TOKENS_COLLECTION, Some(&id));
    let after = (
        everything(&t, TOKENS_COLLECTION).await,
        everything(&t, OBTS_COLLECTION).await,
    );
    assert_eq!(after, before);
}

#[tokio::test]
async fn a_newer_fence_is_neither_read_nor_written() {
    let t = TestDb::new().await;
    let fence = MongoFence::open(&t.store).await.expect("open");
    fence.admit("volume", Token(5)).await.expect("admit");
    let before = turn_newer(&t, FENCES_COLLECTION, "volume").await;
    let id = Some("\"volume\"");
    // Higher, equal and lower tokens alike: what the document means is not this release's to
    // say.
    for token in [6, 5, 1] {
        newer!(fence.admit("volume", Token(token)), FENCES_COLLECTION, id);
    }
    newer!(fence.seen("volume"), FENCES_COLLECTION, id);
    assert_eq!(everything(&t, FENCES_COLLECTION).await, vec![before]);
}

/// Waits, if need be, until the server's clock is early enough in its minute that the next few
/// seconds' flushes of the contention record go to the same minute's documents.
async fn early_in_a_minute(store: &Store) {
    let now = store.server_time().await.expect("the server's time");
    let into = now.timestamp_millis().rem_euclid(60_000);
    if into > 40_000 {
        let left = u64::try_from(60_000 - into).unwrap_or(0) + 500;
        tokio::time::sleep(Duration::from_millis(left)).await;
    }
}

/// The contention record's one document, once a flush has written it.
async fn the_minute(t: &TestDb) -> Document {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let found = everything(t, CONTENTION_COLLECTION).await;
        if let [one] = &found[..] {
            return one.clone();
        }
        assert!(found.is_empty(), "one minute of the record: {found:?}");
        assert!(Instant::now() < deadline, "no flush of the record");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A store of `t`'s database writing its contention record every 50 ms.
fn counting(builder: mongotx::StoreBuilder) -> Store {
    builder
        .contention_flush_every(Duration::from_millis(50))
        .build()
}

#[tokio::test]
async fn a_newer_minute_of_the_contention_record_is_neither_read_nor_written() {
    let t = TestDb::new().await;
    let store = counting(Store::builder(t.db.clone()));
    early_in_a_minute(&store).await;
    let accounts = alice_moved_on(&store).await;
    stale_update(&accounts, "alice").await;
    let minute = the_minute(&t).await;
    assert_unmarked(&minute);
    let before = turn_newer(
        &t,
        CONTENTION_COLLECTION,
        minute.get("_id").cloned().expect("_id"),
    )
    .await;
    // Counted, and flushed at once by the shutdown: the flush is refused (and logged).
    stale_update(&accounts, "alice").await;
    store.shutdown(Duration::from_secs(10)).await;
    assert_eq!(everything(&t, CONTENTION_COLLECTION).await, vec![before]);
    newer!(
        mongotx::admin::contention(&t.store, Duration::from_secs(3600), 10),
        CONTENTION_COLLECTION,
        Some("\"accounts\"")
    );
}

#[tokio::test]
async fn limiters_are_marked_once_the_database_writes_format_two() {
    let t = TestDb::new().await;
    let future = future(&t);
    let limits = RateLimits::open(&future).await.expect("open");
    limits.define("old", limit()).await.expect("define");
    assert_unmarked(&stored(&t, LIMITERS_COLLECTION, "old").await);
    switch_to_two(&future).await;
    limits.define("new", limit()).await.expect("define");
    assert_marked(&stored(&t, LIMITERS_COLLECTION, "new").await);
    // A grant rewrites the limiter: in the format written now.
    let held = limits
        .reserve(&["old"], 1, Priority::Bulk)
        .await
        .expect("reserve");
    assert_marked(&stored(&t, LIMITERS_COLLECTION, "old").await);
    limits.settle(&held, 1).await.expect("settle");

    let this = RateLimits::open(&this_release(&t)).await.expect("open");
    for name in ["old", "new"] {
        let id = format!("\"{name}\"");
        newer!(this.usage(name), LIMITERS_COLLECTION, Some(&id));
    }
    // Nor does this release write in a database that writes a format it does not read.
    let before = everything(&t, LIMITERS_COLLECTION).await;
    newer!(
        this.define("other", limit()),
        META_COLLECTION,
        Some("format")
    );
    assert_eq!(everything(&t, LIMITERS_COLLECTION).await, before);
}

#[tokio::test]
async fn batches_and_services_are_marked_once_the_database_writes_format_two() {
    let t = TestDb::new().await;
    let future = future(&t);
    let services = services();
    let batches = Batches::open(&future).await.expect("open");
    let first = batches
        .add(&NewBatch::new("s", "a", "x"))
        .await
        .expect("add");
    assert_unmarked(&stored(&t, BATCHES_COLLECTION, "a").await);
    assert_unmarked(&stored(&t, &services, "s").await);
    switch_to_two(&future).await;
    batches
        .add(&NewBatch::new("s", "b", "y"))
        .await
        .expect("add");
    assert_marked(&stored(&t, BATCHES_COLLECTION, "b").await);
    assert_marked(&stored(&t, &services, "s").await);
    let claim = batches
        .claim(&first, "submitter", Duration::from_secs(60))
        .await
        .expect("claim")
        .expect("claimed");
    batches
        .record(&claim, Submission::Accepted)
        .await
        .expect("record");
    assert_marked(&stored(&t, BATCHES_COLLECTION, "a").await);

    let this = Batches::open(&this_release(&t)).await.expect("open");
    newer!(this.get("b"), BATCHES_COLLECTION, Some("\"b\""));
    newer!(this.get("a"), BATCHES_COLLECTION, Some("\"a\""));
    newer!(this.report("s"), BATCHES_COLLECTION, None);
    let before = everything(&t, BATCHES_COLLECTION).await;
    newer!(
        this.add(&NewBatch::new("t", "c", "z")),
        META_COLLECTION,
        Some("format")
    );
    assert_eq!(everything(&t, BATCHES_COLLECTION).await, before);
}

#[tokio::test]
async fn token_counters_are_marked_once_the_database_writes_format_two() {
    let t = TestDb::new().await;
    // An instance of this release that read the database's format (1) just before the switch,
    // and has not looked again since (it looks at most every refresh interval).
    let behind = Store::builder(t.db.clone())
        .format_refresh(Duration::from_secs(3600))
        .build();
    let behind_obt = Obt::open(&behind).await.expect("open");
    // Shut down, it no longer counts among the live instances the switch waits for.
    behind.shutdown(Duration::from_secs(5)).await;
    let future = future(&t);
    let obt = Obt::open(&future).await.expect("open");
    obt.create(NewObt::new("t0", "owner0"))
        .await
        .expect("create");
    assert_unmarked(&stored(&t, TOKENS_COLLECTION, OBTS_COLLECTION).await);
    switch_to_two(&future).await;
    obt.create(NewObt::new("t1", "owner1"))
        .await
        .expect("create");
    assert_marked(&stored(&t, TOKENS_COLLECTION, OBTS_COLLECTION).await);

    // The instance behind still writes format 1 as far as it knows: the counter's own mark
    // refuses it.
    let before = (
        everything(&t, TOKENS_COLLECTION).await,
        everything(&t, OBTS_COLLECTION).await,
    );
    let id = format!("\"{OBTS_COLLECTION}\"");
    newer!(behind_obt.issue_token(), TOKENS_COLLECTION, Some(&id));
    newer!(
        behind_obt.create(NewObt::new("t2", "owner2")),
        TOKENS_COLLECTION,
        Some(&id)
    );
    let after = (
        everything(&t, TOKENS_COLLECTION).await,
        everything(&t, OBTS_COLLECTION).await,
    );
    assert_eq!(after, before);
    // A new instance of this release is refused by the database's format before anything.
    let err = Obt::open(&this_release(&t))
        .await
        .expect_err("opened in a database of format 3");
    refused(err.kind(), &err, META_COLLECTION, None);
}

#[tokio::test]
async fn fences_are_marked_once_the_database_writes_format_two() {
    let t = TestDb::new().await;
    let future = future(&t);
    let fence = MongoFence::open(&future).await.expect("open");
    fence.admit("volume", Token(1)).await.expect("admit");
    assert_unmarked(&stored(&t, FENCES_COLLECTION, "volume").await);
    switch_to_two(&future).await;
    fence.admit("volume", Token(2)).await.expect("admit");
    fence.admit("host", Token(1)).await.expect("admit");
    assert_marked(&stored(&t, FENCES_COLLECTION, "volume").await);
    assert_marked(&stored(&t, FENCES_COLLECTION, "host").await);
    assert_eq!(fence.seen("volume").await.expect("seen"), Some(Token(2)));

    let this = MongoFence::open(&this_release(&t)).await.expect("open");
    newer!(this.seen("volume"), FENCES_COLLECTION, Some("\"volume\""));
    let before = everything(&t, FENCES_COLLECTION).await;
    newer!(
        this.admit("disk", Token(3)),
        META_COLLECTION,
        Some("format")
    );
    assert_eq!(everything(&t, FENCES_COLLECTION).await, before);
}

#[tokio::test]
async fn the_contention_record_is_marked_once_the_database_writes_format_two() {
    let t = TestDb::new().await;
    let future = counting(Store::builder(t.db.clone()).plays_format(3));
    early_in_a_minute(&future).await;
    let accounts = alice_moved_on(&future).await;
    stale_update(&accounts, "alice").await;
    assert_unmarked(&the_minute(&t).await);
    switch_to_two(&future).await;
    stale_update(&accounts, "alice").await;
    future.shutdown(Duration::from_secs(10)).await;
    let minute = the_minute(&t).await;
    assert_marked(&minute);
    assert_eq!(minute.get_i64("conflicts").expect("conflicts"), 2);
    newer!(
        mongotx::admin::contention(&t.store, Duration::from_secs(3600), 10),
        CONTENTION_COLLECTION,
        Some("\"accounts\"")
    );
}
