//! Bad-input harness: a call that must be refused with a typed error and leave every collection
//! of the database exactly as it was.
//!
//! `Refusals::check` snapshots every collection (every document, sorted by `_id`), runs the call,
//! checks that it failed with the error the case expects and that the error says something, then
//! snapshots again: any document added, removed or changed fails the case. Set up what a case
//! needs (repositories opened, documents inserted, background finishing over) before the check,
//! since all of that writes.

use std::collections::BTreeMap;
use std::fmt::{Debug, Display};
use std::future::Future;

use bson::{doc, Document};
use futures::TryStreamExt;
use mongodb::Database;

/// Counts the refusals a test checked; see the module doc.
pub struct Refusals {
    db: Database,
    checked: usize,
}

/// Every document of every collection of `db`, by collection, sorted by `_id`; the contention
/// record left out (a refusal at a stale version is a conflict, which the store counts and
/// writes to the record later, in the background, by design: `StoreBuilder::contention_record`).
pub async fn snapshot(db: &Database) -> BTreeMap<String, Vec<Document>> {
    let mut all = BTreeMap::new();
    let names = db
        .list_collection_names()
        .await
        .unwrap_or_else(|e| panic!("cannot list the collections of {}: {e}", db.name()));
    for name in names {
        if name == mongotx::collections::CONTENTION_COLLECTION {
            continue;
        }
        // A store's announcement of the formats it reads is renewed as it works (see
        // `mongotx::format`): its liveness, not data a call wrote.
        let announcements = doc! { "_id": { "$not": { "$regex": "^instance:" } } };
        let all_of = if name == mongotx::collections::META_COLLECTION {
            announcements
        } else {
            doc! {}
        };
        let docs: Vec<Document> = db
            .collection::<Document>(&name)
            .find(all_of)
            .sort(doc! { "_id": 1 })
            .await
            .unwrap_or_else(|e| panic!("cannot read {name}: {e}"))
            .try_collect()
            .await
            .unwrap_or_else(|e| panic!("cannot read {name}: {e}"));
        all.insert(name, docs);
    }
    all
}

impl Refusals {
    /// Checks refusals against every collection of `db`.
    pub fn new(db: &Database) -> Refusals {
        Refusals {
            db: db.clone(),
            checked: 0,
        }
    }

    /// Runs `call` (named `what` in failures), which must fail with an error `expected` accepts
    /// and change no document of the database.
    pub async fn check<T, E>(
        &mut self,
        what: &str,
        call: impl Future<Output = Result<T, E>>,
        expected: impl Fn(&E) -> bool,
    ) where
        T: Debug,
        E: Debug + Display,
    {
        let before = snapshot(&self.db).await;
        let outcome = call.await;
        match &outcome {
            Ok(value) => panic!("{what}: accepted ({value:?}), expected a refusal"),
            Err(e) if !expected(e) => panic!("{what}: refused with the wrong error: {e:?}"),
            Err(e) => assert!(
                !e.to_string().trim().is_empty(),
                "{what}: the error says nothing: {e:?}"
            ),
        }
        let after = snapshot(&self.db).await;
        if before != after {
            let changed: Vec<&String> = before
                .keys()
                .chain(after.keys())
                .filter(|name| before.get(*name) != after.get(*name))
                .collect();
            panic!(
                "{what}: refused, but wrote to {changed:?}\n  before: {:?}\n  after: {:?}",
                changed.iter().map(|n| before.get(*n)).collect::<Vec<_>>(),
                changed.iter().map(|n| after.get(*n)).collect::<Vec<_>>()
            );
        }
        self.checked += 1;
    }

    /// How many refusals were checked so far.
    pub fn checked(&self) -> usize {
        self.checked
    }
}

/// `refuse!(refusals, "what", call, Pattern)`: [`Refusals::check`] with a pattern for the error.
#[macro_export]
macro_rules! refuse {
    ($refusals:expr, $what:expr, $call:expr, $pattern:pat) => {
        $refusals
            .check($what, $call, |e| matches!(e, $pattern))
            .await
    };
}
