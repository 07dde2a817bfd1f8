//! The single-document guarantees everything in mongotx rests on: a duplicate `_id` is refused; a
//! conditional update is atomic (two writers conditioned on one value cannot both win);
//! find-and-modify returns each caller the document as *its* change left it, even when many change
//! one document at once (fencing tokens and claims hand out values that way); and the server tells
//! its time, by which every deadline is decided. A server lacking one would corrupt data silently.
//! Also here: whether the server takes a round of writes as one `bulkWrite` (optional).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};

use bson::{doc, Document};
use futures::future::join_all;
use mongodb::options::ReturnDocument;
use mongodb::{Collection, Database};

use super::{fail, outcome, Check, Checked, Fault, Semantic, Unasked};
use crate::server::clock;
use crate::server::codes::{error_code, DUPLICATE_KEY};
use crate::server::summarize;

const DUPLICATE_ID: Check = Check {
    name: "duplicate_id_refused",
    what: "a second insert of an existing _id is refused",
    needed: true,
    fallback: None,
};
const CONDITIONAL_UPDATES: Check = Check {
    name: "conditional_updates_atomic",
    what: "two updates conditioned on one value cannot both win, however many race",
    needed: true,
    fallback: None,
};
const POST_IMAGE: Check = Check {
    name: "find_and_modify_post_image",
    what: "findAndModify returns the document as its change left it",
    needed: true,
    fallback: None,
};
const OWN_POST_IMAGES: Check = Check {
    name: "own_post_images",
    what: "concurrent findAndModify callers each get their own post-image",
    needed: true,
    fallback: None,
};
const SERVER_TIME: Check = Check {
    name: "server_time",
    what: "the server tells its time, localTime in hello, by which every deadline is decided",
    needed: true,
    fallback: None,
};
const BULK_WRITE: Check = Check {
    name: "bulk_write",
    what: "bulkWrite, as from 8.0, runs a round of writes in one message and reports each",
    needed: false,
    fallback: Some(
        "each round of protocol writes goes as one command per write, all sent at once \
         (the same writes; more messages)",
    ),
};

/// How hard the atomicity checks race: how many concurrent callers, and how many compare-and-set
/// attempts lost and went again (which shows the check did contend).
#[derive(Debug)]
pub(crate) struct Contention {
    pub(crate) tasks: usize,
    pub(crate) retries: AtomicU64,
}

impl Contention {
    pub(crate) fn new(tasks: usize) -> Contention {
        Contention {
            tasks: tasks.max(2),
            retries: AtomicU64::new(0),
        }
    }
}

/// A caller that keeps losing this many compare-and-set races in a row gives up: the server never
/// lets a conditional update match, which is a verdict too.
const MAX_ATTEMPTS: u64 = 10_000;

/// The needed single-document guarantees, in the scratch collection `coll`.
pub(super) async fn needed(
    db: &Database,
    coll: &Collection<Document>,
    contention: &Contention,
) -> Result<Vec<Semantic>, Unasked> {
    Ok(vec![
        outcome(&DUPLICATE_ID, duplicate_id(coll).await)?,
        outcome(
            &CONDITIONAL_UPDATES,
            conditional_updates(coll, contention).await,
        )?,
        outcome(&POST_IMAGE, post_image(coll).await)?,
        outcome(&OWN_POST_IMAGES, own_post_images(coll, contention).await)?,
        outcome(&SERVER_TIME, server_time(db).await)?,
    ])
}

/// Whether the server runs a `bulkWrite` of conditional updates and reports each one.
pub(super) async fn bulk_write(
    db: &Database,
    coll: &Collection<Document>,
) -> Result<Semantic, Unasked> {
    outcome(&BULK_WRITE, bulk_write_check(db, coll).await)
}

async fn duplicate_id(coll: &Collection<Document>) -> Checked<String> {
    coll.insert_one(doc! { "_id": "dup" })
        .await
        .map_err(fail("insert"))?;
    match coll.insert_one(doc! { "_id": "dup" }).await {
        Ok(_) => Err("a second document with _id \"dup\" was stored".into()),
        Err(e) if error_code(&e) == Some(DUPLICATE_KEY) => {
            Ok("a second insert of _id \"dup\" was refused with code 11000".to_string())
        }
        Err(e) => match fail("the second insert")(e) {
            Fault::Lacks(detail) => Err(Fault::Lacks(format!(
                "{detail} (not a duplicate-key error, code 11000)"
            ))),
            other => Err(other),
        },
    }
}

async fn read_counter(coll: &Collection<Document>, id: &str) -> mongodb::error::Result<i64> {
    Ok(coll
        .find_one(doc! { "_id": id })
        .await?
        .and_then(|d| d.get_i64("n").ok())
        .unwrap_or(-1))
}

async fn conditional_updates(
    coll: &Collection<Document>,
    contention: &Contention,
) -> Checked<String> {
    coll.insert_one(doc! { "_id": "counter", "n": 0_i64 })
        .await
        .map_err(fail("insert"))?;
    let tasks = contention.tasks;
    let results = join_all((0..tasks).map(|_| cas_increment(coll, &contention.retries))).await;
    for result in results {
        result?;
    }
    let found = read_counter(coll, "counter")
        .await
        .map_err(fail("reading the counter"))?;
    let retries = contention.retries.load(Ordering::Relaxed);
    if found == tasks as i64 {
        Ok(format!(
            "{tasks} concurrent compare-and-set increments, the counter reached {found} \
             ({retries} lost races retried)"
        ))
    } else {
        Err(Fault::Lacks(format!(
            "{tasks} compare-and-set increments each reported success, but the counter \
             reached {found}"
        )))
    }
}

async fn cas_increment(coll: &Collection<Document>, retries: &AtomicU64) -> Checked {
    for _ in 0..MAX_ATTEMPTS {
        let current = read_counter(coll, "counter")
            .await
            .map_err(fail("reading the counter"))?
            .max(0);
        let result = coll
            .update_one(
                doc! { "_id": "counter", "n": current },
                doc! { "$set": { "n": current + 1 } },
            )
            .await
            .map_err(fail("a conditional update"))?;
        if result.matched_count == 1 {
            return Ok(());
        }
        retries.fetch_add(1, Ordering::Relaxed);
        tokio::task::yield_now().await;
    }
    Err(Fault::Lacks(format!(
        "a conditional update on the value just read matched nothing {MAX_ATTEMPTS} times in a row"
    )))
}

async fn post_image(coll: &Collection<Document>) -> Checked<String> {
    coll.insert_one(doc! { "_id": "post_image", "n": 41_i64 })
        .await
        .map_err(fail("insert"))?;
    let after = coll
        .find_one_and_update(
            doc! { "_id": "post_image" },
            doc! { "$inc": { "n": 1_i64 } },
        )
        .return_document(ReturnDocument::After)
        .await
        .map_err(fail("findAndModify"))?;
    match after.as_ref().and_then(|d| d.get_i64("n").ok()) {
        Some(42) => Ok("an increment of 41 returned 42".to_string()),
        _ => Err(Fault::Lacks(format!(
            "an increment of 41 asking for the new document returned {}",
            after.map_or_else(|| "no document".to_string(), |d| d.to_string())
        ))),
    }
}

async fn own_post_images(coll: &Collection<Document>, contention: &Contention) -> Checked<String> {
    coll.insert_one(doc! { "_id": "tokens", "n": 0_i64 })
        .await
        .map_err(fail("insert"))?;
    let tasks = contention.tasks;
    let handed_out = join_all((0..tasks).map(|_| async {
        coll.find_one_and_update(doc! { "_id": "tokens" }, doc! { "$inc": { "n": 1_i64 } })
            .return_document(ReturnDocument::After)
            .await
            .map(|d| d.and_then(|d| d.get_i64("n").ok()))
    }))
    .await;
    let mut distinct = BTreeSet::new();
    for value in handed_out {
        distinct.extend(value.map_err(fail("concurrent findAndModify"))?);
    }
    if distinct.len() != tasks {
        return Err(Fault::Lacks(format!(
            "{tasks} concurrent increments returned only {} distinct values",
            distinct.len()
        )));
    }
    // A counter the first increment creates (an OBT token counter is made so): the caller whose
    // upsert inserted it must get it as it inserted it, not as the next increment left it.
    let racers = tasks.min(8);
    for round in 0..UPSERT_ROUNDS {
        let id = format!("created-{round}");
        let handed_out = join_all((0..racers).map(|_| async {
            loop {
                let result = coll
                    .find_one_and_update(doc! { "_id": &id }, doc! { "$inc": { "n": 1_i64 } })
                    .upsert(true)
                    .return_document(ReturnDocument::After)
                    .await;
                match result {
                    // Two upserts raced to insert: the loser sends again, as MongoDB advises.
                    Err(e) if error_code(&e) == Some(DUPLICATE_KEY) => continue,
                    other => return other.map(|d| d.and_then(|d| d.get_i64("n").ok())),
                }
            }
        }))
        .await;
        let mut distinct = BTreeSet::new();
        for value in handed_out {
            distinct.extend(value.map_err(fail("concurrent upserting findAndModify"))?);
        }
        if distinct.len() != racers {
            return Err(Fault::Lacks(format!(
                "{racers} concurrent increments of a counter the first of them created returned \
                 only {} distinct values (round {round})",
                distinct.len()
            )));
        }
    }
    Ok(format!(
        "{tasks} concurrent increments returned {tasks} distinct values, and so did {racers} \
         racing to create a counter, {UPSERT_ROUNDS} times"
    ))
}

/// Rounds of the race to create a counter: the window in which a server may answer the creator
/// with a later increment is short, so it takes many rounds to show (the local server's did in
/// 3 to 49 rounds of 8).
const UPSERT_ROUNDS: usize = 100;

async fn server_time(db: &Database) -> Checked<String> {
    let hello = clock::hello(db).await.map_err(fail("hello"))?;
    match hello.local_time {
        Some(time) => Ok(format!("hello reports localTime {time}")),
        None => Err("its hello reply carries no localTime".into()),
    }
}

/// Two conditional updates in one `bulkWrite`: the first matches, the second cannot.
async fn bulk_write_check(db: &Database, coll: &Collection<Document>) -> Checked<String> {
    use mongodb::options::UpdateOneModel;
    coll.insert_one(doc! { "_id": "bulk", "n": 1_i64 })
        .await
        .map_err(fail("insert"))?;
    let bump = |filter: Document| {
        UpdateOneModel::builder()
            .namespace(coll.namespace())
            .filter(filter)
            .update(doc! { "$inc": { "bulk": 1_i64 } })
            .build()
    };
    let models = [
        bump(doc! { "_id": "bulk", "n": 1_i64 }),
        bump(doc! { "_id": "bulk", "n": -1_i64 }),
    ];
    let done = db
        .client()
        .bulk_write(models)
        .ordered(false)
        .verbose_results()
        .await
        .map_err(|e| {
            // The driver itself refuses bulkWrite below 8.0, before asking the server: that is
            // the server lacking it too.
            if crate::server::is_transient(&e) {
                Fault::Unreachable(e)
            } else {
                Fault::Lacks(match e.kind.as_ref() {
                    mongodb::error::ErrorKind::Command(_) => {
                        format!("bulkWrite: {}", summarize(&e))
                    }
                    kind => format!("bulkWrite: {kind}"),
                })
            }
        })?;
    let matched = |i: usize| done.update_results.get(&i).map(|r| r.matched_count);
    if matched(0) == Some(1) && matched(1) == Some(0) {
        Ok("two conditional updates in one message, each reported".to_string())
    } else {
        Err(Fault::Lacks(format!(
            "it reported matches {:?} and {:?} for a write that matches and one that cannot",
            matched(0),
            matched(1)
        )))
    }
}
