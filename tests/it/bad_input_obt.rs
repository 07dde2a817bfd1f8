//! Bad input to the OBT module and its fences: every refusal is a typed error and changes no
//! document of the database, the token counter included (checked by `common::refusals`).
//!
//! Every case is set up first (OBTs created, preempted, released, transactions staged), then
//! checked; nothing runs in the background while a check snapshots the database.

use crate::common;
use crate::refuse;

use std::time::Duration;

use crate::common::refusals::Refusals;
use crate::common::TestDb;
use mongotx::collections::META_COLLECTION;
use mongotx::collections::{FENCES_COLLECTION, OBTS_COLLECTION, TOKENS_COLLECTION};
use mongotx::fields::MAX_NAME;
use mongotx::obt::{
    Fence, FenceError, MemoryFence, MongoFence, NewObt, Obt, ObtError, ObtOptions, Token, MAX_LEASE,
};
use mongotx::Update;

async fn obts(t: &TestDb) -> Obt {
    Obt::open(&t.store).await.unwrap()
}

/// A name one byte longer than allowed, of two-byte characters.
fn too_long() -> String {
    "é".repeat(MAX_NAME / 2) + "x"
}

/// Ids, owner names and leases that are unusable are refused before anything is read or written;
/// so are options naming a collection the OBT module cannot use.
#[tokio::test]
async fn unusable_ids_owners_leases_and_collections() {
    let t = TestDb::new().await;
    let obt = obts(&t).await;
    obt.create(NewObt::new("t0", "owner0")).await.unwrap();
    let mut r = Refusals::new(&t.db);

    // create
    refuse!(
        r,
        "create with an empty id",
        obt.create(NewObt::new("", "o")),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "create with an empty owner",
        obt.create(NewObt::new("t1", "")),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "create with a NUL in the id",
        obt.create(NewObt::new("t\0", "o")),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "create with a NUL in the owner",
        obt.create(NewObt::new("t1", "o\0x")),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "create with an id over MAX_NAME bytes",
        obt.create(NewObt::new(too_long(), "o")),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "create with an owner over MAX_NAME bytes",
        obt.create(NewObt::new("t1", too_long())),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "create with a zero lease",
        obt.create(NewObt::new("t1", "o").lease(Duration::ZERO)),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "create with a lease under a millisecond",
        obt.create(NewObt::new("t1", "o").lease(Duration::from_micros(999))),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "create with a lease over MAX_LEASE",
        obt.create(NewObt::new("t1", "o").lease(MAX_LEASE + Duration::from_millis(1))),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "create with Duration::MAX as lease",
        obt.create(NewObt::new("t1", "o").lease(Duration::MAX)),
        ObtError::Invalid { .. }
    );

    // reads and the name-based calls
    refuse!(
        r,
        "get of an empty id",
        obt.get(""),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "observe of an over-long id",
        obt.observe(&too_long()),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "check with an empty owner",
        obt.check("t0", "", 0),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "check with a negative stage",
        obt.check("t0", "owner0", -1),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "advance to a negative stage",
        obt.advance("t0", "owner0", -1),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "advance to i64::MIN",
        obt.advance("t0", "owner0", i64::MIN),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "preempt with an empty current owner",
        obt.preempt("t0", "", "x"),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "preempt for an over-long new owner",
        obt.preempt("t0", "owner0", &too_long()),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "take_over_expired for an empty new owner",
        obt.take_over_expired("t0", ""),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "release of an id with a NUL",
        obt.release("t0\0", "owner0"),
        ObtError::Invalid { .. }
    );

    // options: collections the module cannot (or must not) keep OBTs in
    for (what, name) in [
        ("an empty collection name", String::new()),
        ("a collection name with '$'", "ob$ts".to_string()),
        ("a collection name with a NUL", "ob\0ts".to_string()),
        ("a system. collection", "system.obts".to_string()),
        (
            "the token counters' collection",
            TOKENS_COLLECTION.to_string(),
        ),
        (
            "the default fence collection",
            FENCES_COLLECTION.to_string(),
        ),
        (
            "the transaction records",
            t.store.transactions_collection().to_string(),
        ),
        ("the collection registry", META_COLLECTION.to_string()),
    ] {
        refuse!(
            r,
            &format!("Obt::with_options on {what}"),
            Obt::with_options(&t.store, ObtOptions::default().collection(name.clone())),
            ObtError::Invalid { .. }
        );
    }
    refuse!(
        r,
        "Obt::with_options with a clock slack over the longest lease",
        Obt::with_options(
            &t.store,
            ObtOptions::default()
                .collection("slack_obts")
                .clock_slack(MAX_LEASE + std::time::Duration::from_millis(1))
        ),
        ObtError::Invalid { .. }
    );
    assert!(r.checked() >= 29, "{} refusals checked", r.checked());
}

/// The four refusals that must come before a fencing token is issued (the counter document in
/// the tokens collection must not move), and the other take-over refusals that can be told
/// from the committed OBT before taking one.
#[tokio::test]
async fn refusals_that_must_not_consume_a_token() {
    let t = TestDb::new().await;
    let obt = obts(&t).await;
    obt.create(NewObt::new("plain", "owner0")).await.unwrap();
    obt.create(NewObt::new("leased", "owner0").lease(MAX_LEASE))
        .await
        .unwrap();
    // A lease of 1 ms: a contender's observation is old enough almost at once.
    let mut short = obt
        .create(NewObt::new("short", "owner0").lease(Duration::from_millis(1)))
        .await
        .unwrap();
    let gone = obt
        .create(NewObt::new("gone", "owner0").lease(Duration::from_millis(1)))
        .await
        .unwrap();
    let no_lease = obt.observe("plain").await.unwrap();
    let live = obt.observe("leased").await.unwrap();
    let mut forged = obt.observe("leased").await.unwrap();
    forged.state.lease = Some(Duration::from_millis(1));
    let stale = obt.observe("short").await.unwrap();
    let released = obt.observe("gone").await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    // The owner of "short" shows a sign of life after the contender looked; "gone" is released.
    obt.heartbeat(&mut short).await.unwrap();
    obt.release_owned(&gone).await.unwrap();
    let mut r = Refusals::new(&t.db);

    // The four.
    refuse!(
        r,
        "create of an existing id",
        obt.create(NewObt::new("plain", "owner9")),
        ObtError::Exists { .. }
    );
    refuse!(
        r,
        "preempt of a missing OBT",
        obt.preempt("nope", "owner0", "owner1"),
        ObtError::NotFound { .. }
    );
    refuse!(
        r,
        "preempt naming the wrong current owner",
        obt.preempt("plain", "someone", "owner1"),
        ObtError::NotOwner { .. }
    );
    refuse!(
        r,
        "take_over_expired of an OBT without a lease",
        obt.take_over_expired("plain", "owner1"),
        ObtError::NoLease { .. }
    );

    // More of the same kind.
    refuse!(
        r,
        "create of an existing id by its own owner",
        obt.create(NewObt::new("plain", "owner0")),
        ObtError::Exists { .. }
    );
    refuse!(
        r,
        "create of an existing id with a lease",
        obt.create(NewObt::new("leased", "owner1").lease(Duration::from_secs(5))),
        ObtError::Exists { .. }
    );
    refuse!(
        r,
        "preempt of a released OBT",
        obt.preempt("gone", "owner0", "owner1"),
        ObtError::NotFound { .. }
    );
    refuse!(
        r,
        "take_over_expired of a missing OBT",
        obt.take_over_expired("nope", "owner1"),
        ObtError::NotFound { .. }
    );
    refuse!(
        r,
        "take_over_expired of an OBT whose lease is live",
        obt.take_over_expired("leased", "owner1"),
        ObtError::LeaseLive { .. }
    );
    refuse!(
        r,
        "take_over of an OBT without a lease",
        obt.take_over(&no_lease, "owner1"),
        ObtError::NoLease { .. }
    );
    refuse!(
        r,
        "take_over before the lease has passed",
        obt.take_over(&live, "owner1"),
        ObtError::LeaseLive { .. }
    );
    refuse!(
        r,
        "take_over with an observation whose lease was shortened by hand",
        obt.take_over(&forged, "owner1"),
        ObtError::LeaseLive { .. }
    );
    refuse!(
        r,
        "take_over of an OBT that changed since it was observed",
        obt.take_over(&stale, "owner1"),
        ObtError::Changed { .. }
    );
    refuse!(
        r,
        "take_over of an OBT released since it was observed",
        obt.take_over(&released, "owner1"),
        ObtError::NotFound { .. }
    );
    refuse!(
        r,
        "take_over for an empty new owner",
        obt.take_over(&stale, ""),
        ObtError::Invalid { .. }
    );
    assert!(r.checked() >= 15, "{} refusals checked", r.checked());
}

/// The calls that name the owner (as the OBT reference design's HTTP interface does) made by
/// someone who is not the owner, for an OBT that is not there, or with a stage going backwards;
/// releasing twice.
#[tokio::test]
async fn wrong_owners_unknown_ids_and_stages_going_backwards() {
    let t = TestDb::new().await;
    let obt = obts(&t).await;
    obt.create(NewObt::new("t0", "owner0")).await.unwrap();
    obt.advance("t0", "owner0", 3).await.unwrap();
    obt.create(NewObt::new("twice", "owner0")).await.unwrap();
    obt.release("twice", "owner0").await.unwrap();
    let mut r = Refusals::new(&t.db);

    refuse!(
        r,
        "get of an unknown id",
        obt.get("nope"),
        ObtError::NotFound { .. }
    );
    refuse!(
        r,
        "observe of an unknown id",
        obt.observe("nope"),
        ObtError::NotFound { .. }
    );
    refuse!(
        r,
        "check by another owner",
        obt.check("t0", "someone", 3),
        ObtError::NotOwner { .. }
    );
    refuse!(
        r,
        "check with an older stage",
        obt.check("t0", "owner0", 2),
        ObtError::StageReplayed {
            current: 3,
            presented: 2,
            ..
        }
    );
    refuse!(
        r,
        "check of an unknown id",
        obt.check("nope", "owner0", 0),
        ObtError::NotFound { .. }
    );
    refuse!(
        r,
        "advance backwards",
        obt.advance("t0", "owner0", 2),
        ObtError::StageReplayed {
            current: 3,
            presented: 2,
            ..
        }
    );
    refuse!(
        r,
        "advance back to stage 0",
        obt.advance("t0", "owner0", 0),
        ObtError::StageReplayed { .. }
    );
    refuse!(
        r,
        "advance by another owner",
        obt.advance("t0", "someone", 9),
        ObtError::NotOwner { .. }
    );
    refuse!(
        r,
        "advance of an unknown id",
        obt.advance("nope", "owner0", 1),
        ObtError::NotFound { .. }
    );
    refuse!(
        r,
        "release by another owner",
        obt.release("t0", "someone"),
        ObtError::NotOwner { .. }
    );
    refuse!(
        r,
        "release of an unknown id",
        obt.release("nope", "owner0"),
        ObtError::NotFound { .. }
    );
    refuse!(
        r,
        "release twice",
        obt.release("twice", "owner0"),
        ObtError::NotFound { .. }
    );
    refuse!(
        r,
        "preempt by naming the new owner as the current one",
        obt.preempt("t0", "owner1", "owner0"),
        ObtError::NotOwner { .. }
    );
    assert!(r.checked() >= 13, "{} refusals checked", r.checked());
}

/// Ownership handles that are stale (preempted, released, taken over), forged or emptied by
/// hand, used for heartbeats, owned advances and releases, and owned commits.
#[tokio::test]
async fn stale_and_forged_ownership_handles() {
    let t = TestDb::new().await;
    let obt = obts(&t).await;
    let accounts = common::open_accounts(&t.store).await;
    common::seed_accounts(&accounts, &[("acc", 10)]).await;
    let txns = common::finishing(&t.store);

    let mut preempted = obt
        .create(NewObt::new("p", "api-1").lease(Duration::from_secs(60)))
        .await
        .unwrap();
    obt.preempt("p", "api-1", "api-2").await.unwrap();
    let mut released = obt
        .create(NewObt::new("r", "api-1").lease(Duration::from_secs(60)))
        .await
        .unwrap();
    obt.release_owned(&released).await.unwrap();
    let mut mine = obt
        .create(NewObt::new("m", "api-1").lease(Duration::from_secs(60)))
        .await
        .unwrap();
    obt.advance_owned(&mut mine, 5).await.unwrap();
    let mut forged_token = mine.clone();
    forged_token.token = Token(mine.token.0 + 1_000);
    let mut never_issued = mine.clone();
    never_issued.token = Token(0);
    let mut emptied = mine.clone();
    emptied.id = String::new();
    let mut no_owner = mine.clone();
    no_owner.owner = String::new();
    // An ownership of another namespace: its id does not exist in the default one.
    let other = Obt::with_options(&t.store, ObtOptions::default().collection("other_obts"))
        .await
        .unwrap();
    let mut foreign = other.create(NewObt::new("f", "api-1")).await.unwrap();
    let v = accounts.get("acc").await.unwrap().version;
    let staged = |n: usize| {
        let tx = txns.begin();
        let accounts = accounts.clone();
        async move {
            tx.update(
                &accounts,
                "acc",
                v,
                &Update::new().set("note", format!("by a stale owner {n}")),
            )
            .await
            .unwrap();
            tx
        }
    };
    let (tx1, tx2, tx3, tx4) = (
        staged(1).await,
        staged(2).await,
        staged(3).await,
        staged(4).await,
    );
    let mut r = Refusals::new(&t.db);

    refuse!(
        r,
        "heartbeat after being preempted",
        obt.heartbeat(&mut preempted),
        ObtError::Preempted { now: Some(_), .. }
    );
    refuse!(
        r,
        "heartbeat after release",
        obt.heartbeat(&mut released),
        ObtError::Preempted { now: None, .. }
    );
    refuse!(
        r,
        "advance_owned after being preempted",
        obt.advance_owned(&mut preempted, 1),
        ObtError::Preempted { .. }
    );
    refuse!(
        r,
        "advance_owned backwards",
        obt.advance_owned(&mut mine, 4),
        ObtError::StageReplayed {
            current: 5,
            presented: 4,
            ..
        }
    );
    refuse!(
        r,
        "advance_owned to a negative stage",
        obt.advance_owned(&mut mine, -1),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "release_owned after being preempted",
        obt.release_owned(&preempted),
        ObtError::Preempted { .. }
    );
    refuse!(
        r,
        "release_owned twice",
        obt.release_owned(&released),
        ObtError::NotFound { .. }
    );
    refuse!(
        r,
        "heartbeat with a token that is not the OBT's",
        obt.heartbeat(&mut forged_token),
        ObtError::Preempted { .. }
    );
    refuse!(
        r,
        "release_owned with a token that is not the OBT's",
        obt.release_owned(&forged_token),
        ObtError::Preempted { .. }
    );
    refuse!(
        r,
        "heartbeat with a token never issued",
        obt.heartbeat(&mut never_issued),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "advance_owned with an emptied id",
        obt.advance_owned(&mut emptied, 6),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "release_owned with an emptied owner",
        obt.release_owned(&no_owner),
        ObtError::Invalid { .. }
    );
    refuse!(
        r,
        "heartbeat of another namespace's ownership",
        obt.heartbeat(&mut foreign),
        ObtError::Preempted { now: None, .. }
    );
    refuse!(
        r,
        "commit_owned after being preempted",
        obt.commit_owned(tx1, &preempted),
        ObtError::Preempted { now: Some(_), .. }
    );
    refuse!(
        r,
        "commit_owned after release",
        obt.commit_owned(tx2, &released),
        ObtError::Preempted { now: None, .. }
    );
    refuse!(
        r,
        "commit_owned with a token that is not the OBT's",
        obt.commit_owned(tx3, &forged_token),
        ObtError::Preempted { .. }
    );
    refuse!(
        r,
        "commit_owned with an emptied id",
        obt.commit_owned(tx4, &emptied),
        ObtError::Invalid { .. }
    );
    assert!(r.checked() >= 17, "{} refusals checked", r.checked());
}

/// Fences: stale tokens, tokens never issued, unusable resource names and fence collections.
#[tokio::test]
async fn fences_refuse_stale_tokens_and_unusable_resources() {
    let t = TestDb::new().await;
    let fence = MongoFence::open(&t.store).await.unwrap();
    fence.admit("vol", Token(5)).await.unwrap();
    let memory = MemoryFence::new();
    memory.admit("vol", Token(5)).await.unwrap();
    let mut r = Refusals::new(&t.db);

    refuse!(
        r,
        "MongoFence admission with a stale token",
        fence.admit("vol", Token(4)),
        FenceError::StaleToken {
            seen: Token(5),
            presented: Token(4),
            ..
        }
    );
    refuse!(
        r,
        "MongoFence admission with token 0",
        fence.admit("vol2", Token(0)),
        FenceError::Invalid { .. }
    );
    refuse!(
        r,
        "MongoFence admission with a negative token",
        fence.admit("vol2", Token(-7)),
        FenceError::Invalid { .. }
    );
    refuse!(
        r,
        "MongoFence admission on an empty resource",
        fence.admit("", Token(9)),
        FenceError::Invalid { .. }
    );
    refuse!(
        r,
        "MongoFence admission on a resource with a NUL",
        fence.admit("vol\0", Token(9)),
        FenceError::Invalid { .. }
    );
    refuse!(
        r,
        "MongoFence admission on an over-long resource",
        fence.admit(&too_long(), Token(9)),
        FenceError::Invalid { .. }
    );
    refuse!(
        r,
        "MongoFence seen of an empty resource",
        fence.seen(""),
        FenceError::Invalid { .. }
    );
    refuse!(
        r,
        "MemoryFence admission with a stale token",
        memory.admit("vol", Token(1)),
        FenceError::StaleToken { .. }
    );
    let mut ran = false;
    refuse!(
        r,
        "MemoryFence admit_then with a stale token",
        async { memory.admit_then("vol", Token(4), || ran = true) },
        FenceError::StaleToken { .. }
    );
    assert!(!ran, "the effect of a refused admission ran");
    refuse!(
        r,
        "MemoryFence admission with token 0",
        memory.admit("vol", Token(0)),
        FenceError::Invalid { .. }
    );
    refuse!(
        r,
        "MemoryFence admission on an empty resource",
        memory.admit("", Token(9)),
        FenceError::Invalid { .. }
    );
    refuse!(
        r,
        "MemoryFence seen of an over-long resource",
        memory.seen(&too_long()),
        FenceError::Invalid { .. }
    );
    assert_eq!(memory.seen("vol").await.unwrap(), Some(Token(5)));
    for (what, name) in [
        ("an empty collection name", String::new()),
        ("a collection name with '$'", "fen$ces".to_string()),
        ("a system. collection", "system.fences".to_string()),
        (
            "the token counters' collection",
            TOKENS_COLLECTION.to_string(),
        ),
        ("the default OBT collection", OBTS_COLLECTION.to_string()),
        (
            "the transaction records",
            t.store.transactions_collection().to_string(),
        ),
        ("the collection registry", META_COLLECTION.to_string()),
    ] {
        refuse!(
            r,
            &format!("MongoFence::named on {what}"),
            MongoFence::named(&t.store, &name),
            FenceError::Invalid { .. }
        );
    }
    assert!(r.checked() >= 19, "{} refusals checked", r.checked());
}

/// A refusal's message names the collection (or fence), the id and the values involved, and
/// shows an over-long value cut short rather than whole.
#[tokio::test]
async fn refusals_name_the_collection_the_id_and_the_values() {
    let t = TestDb::new().await;
    let obt = obts(&t).await;
    obt.create(NewObt::new("t0", "owner0")).await.unwrap();
    let says = |e: &dyn std::fmt::Display, parts: &[&str]| {
        let text = e.to_string();
        for part in parts {
            assert!(text.contains(part), "{text:?} does not say {part:?}");
        }
        assert!(text.len() < 400, "{} bytes: {text}", text.len());
    };
    let e = obt
        .create(NewObt::new("t1", "o").lease(Duration::ZERO))
        .await
        .unwrap_err();
    says(&e, &["obts", "\"t1\"", "\"o\"", "lease 0ns"]);
    let e = obt.advance("t0", "owner0", -4).await.unwrap_err();
    says(&e, &["obts", "\"t0\"", "-4"]);
    let e = obt.create(NewObt::new(too_long(), "o")).await.unwrap_err();
    says(&e, &["obts", "OBT id", "513 bytes", "éé"]);
    let e = obt.preempt("t0", "someone", "x").await.unwrap_err();
    says(&e, &["obts/t0", "owner0", "someone"]);
    let e = obt.create(NewObt::new("t0", "x")).await.unwrap_err();
    says(&e, &["obts/t0", "owner0"]);
    let e = Obt::with_options(
        &t.store,
        ObtOptions::default().collection(TOKENS_COLLECTION),
    )
    .await
    .unwrap_err();
    says(&e, &["obt_tokens", "token counters"]);
    let fence = MongoFence::open(&t.store).await.unwrap();
    let e = fence.admit("vol", Token(0)).await.unwrap_err();
    says(&e, &[FENCES_COLLECTION, "\"vol\"", "token 0"]);
    let e = MemoryFence::new().admit("", Token(3)).await.unwrap_err();
    says(&e, &["memory fence", "resource name \"\"", "empty"]);
}
