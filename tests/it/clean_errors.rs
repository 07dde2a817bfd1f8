//! Every error a user sees is one clean sentence naming the collection, the id and the step or
//! transaction involved; the driver's error (with the server's own words) stays available as the
//! `source()`. The server here answers with a long, raw error message through the wire proxy.

use crate::common;

use crate::common::wire_proxy::{command_name, Action, Rules, WireProxy};
use crate::common::{Account, TestDb};
use bson::{doc, Document};
use mongotx::collections::TRANSACTIONS_COLLECTION;
use mongotx::gc::{Gc, GcOptions};
use mongotx::testkit::failpoint::BEGIN_BEFORE;
use mongotx::{Adjust, Query, Store, Transactions, Update};

const RAW: &str = "E11000-ish raw reply { 0x7f3a9c: 62 61 64 20 72 65 70 6c 79 } driver internals";

/// Fails every command named `name` on collection `coll` with a raw server message.
struct Fail {
    name: &'static str,
    coll: &'static str,
}

impl Rules for Fail {
    fn command(&self, command: &mut Document) -> Action {
        if command_name(command) == self.name && command.get_str(self.name).ok() == Some(self.coll)
        {
            Action::Respond(doc! { "ok": 0.0, "errmsg": RAW, "code": 2, "codeName": "BadValue" })
        } else {
            Action::Forward
        }
    }
}

/// Asserts the error's message is clean and names `names`, and its source chain keeps the raw text.
fn assert_clean(err: &dyn std::error::Error, names: &[&str]) {
    let message = err.to_string();
    assert!(
        !message.contains("0x7f3a9c") && !message.contains("raw reply"),
        "{message}"
    );
    assert!(!message.contains('\n'), "one sentence: {message}");
    for name in names {
        assert!(message.contains(name), "{message} does not name {name}");
    }
    let mut source = err.source();
    let mut kept = false;
    while let Some(inner) = source {
        kept |= inner.to_string().contains("raw reply");
        source = inner.source();
    }
    assert!(
        kept,
        "the driver error is not kept as a source of: {message}"
    );
}

async fn through(t: &TestDb, rules: Fail) -> (WireProxy, Store, mongotx::Repository<Account>) {
    let proxy = WireProxy::start(&common::server_uri(), rules).await;
    let store = Store::new(proxy.client().await.database(t.db.name()));
    let accounts = common::open_accounts(&store).await;
    (proxy, store, accounts)
}

#[tokio::test]
async fn repository_errors_are_clean_sentences_with_the_driver_error_as_source() {
    let t = TestDb::new().await;
    let direct = common::open_accounts(&t.store).await;
    common::seed_accounts(&direct, &[("a1", 5)]).await;

    let (_p, _s, accounts) = through(
        &t,
        Fail {
            name: "find",
            coll: "accounts",
        },
    )
    .await;
    let err = accounts.get("a1").await.expect_err("find fails");
    assert_clean(&err, &["accounts", "a1", "find"]);

    let (_p, _s, accounts) = through(
        &t,
        Fail {
            name: "update",
            coll: "accounts",
        },
    )
    .await;
    let err = accounts
        .update("a1", 1, &Update::new().set("owner", "x"))
        .await
        .expect_err("update fails");
    assert_clean(&err, &["accounts", "a1", "update"]);

    let (_p, _s, accounts) = through(
        &t,
        Fail {
            name: "insert",
            coll: "accounts",
        },
    )
    .await;
    let err = accounts
        .insert(&Account::new("a2", "B", 1))
        .await
        .expect_err("insert fails");
    assert_clean(&err, &["accounts", "a2", "insert"]);

    let (_p, _s, accounts) = through(
        &t,
        Fail {
            name: "aggregate",
            coll: "accounts",
        },
    )
    .await;
    let err = accounts.find(Query::new()).await.expect_err("find fails");
    assert_clean(&err, &["accounts", "find"]);
}

#[tokio::test]
async fn transaction_and_gc_errors_are_clean_sentences_with_the_driver_error_as_source() {
    let t = TestDb::new().await;
    let direct = common::open_accounts(&t.store).await;
    common::seed_accounts(&direct, &[("a", 5), ("b", 5)]).await;

    let (_p, store, accounts) = through(
        &t,
        Fail {
            name: "findAndModify",
            coll: TRANSACTIONS_COLLECTION,
        },
    )
    .await;
    let tx = Transactions::new(&store).begin();
    tx.adjust(&accounts, "a", 1, &Adjust::new().by("balance", 1_i64))
        .await
        .expect("stage");
    let err = tx.commit().await.expect_err("the record cannot be written");
    assert_clean(&err, &["transaction", "write the record"]);

    // A document held by a stalled transaction whose record cannot be read.
    let repo = direct.clone();
    let txn = common::stalled_at(&t.store, BEGIN_BEFORE, |tx| async move {
        tx.adjust(&repo, "b", 1, &Adjust::new().by("balance", 1_i64))
            .await
    })
    .await;
    let (_p, store, accounts) = through(
        &t,
        Fail {
            name: "find",
            coll: TRANSACTIONS_COLLECTION,
        },
    )
    .await;
    let err = accounts
        .get("b")
        .await
        .expect_err("the holder cannot be looked up");
    assert_clean(&err, &["accounts", "\"b\"", &txn.to_hex()]);

    let err = Gc::new(&store, GcOptions::default())
        .run_round()
        .await
        .expect_err("the GC cannot list expired transactions");
    assert_clean(&err, &["find expired transactions"]);
}
