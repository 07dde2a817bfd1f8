//! The cost claim: a committed transaction of k documents takes at most 2k + 3 writes, counted
//! with the driver's command monitoring on a client of its own; and where the server has
//! `bulkWrite`, those writes travel in five messages whatever k is.

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::common::{Account, TestDb};
use mongodb::event::command::CommandEvent;
use mongodb::event::EventHandler;
use mongodb::options::ClientOptions;
use mongodb::Client;
use mongotx::{Adjust, Store, Update};

const WRITE_COMMANDS: &[&str] = &["insert", "update", "delete", "findAndModify"];

/// How many writes a started command carries: one for each single-write command, each
/// operation of a bulkWrite, none for anything else.
fn writes_in(command_name: &str, command: &bson::Document) -> usize {
    if WRITE_COMMANDS.contains(&command_name) {
        return 1;
    }
    if command_name == "bulkWrite" {
        return command.get_array("ops").map_or(0, Vec::len);
    }
    0
}

#[tokio::test]
async fn a_committed_transaction_of_k_documents_takes_at_most_2k_plus_3_writes() {
    let t = TestDb::new().await;
    let counting = Arc::new(AtomicBool::new(false));
    let writes = Arc::new(AtomicUsize::new(0));
    let messages = Arc::new(AtomicUsize::new(0));
    let mut options = ClientOptions::parse(common::server_uri())
        .await
        .expect("uri");
    {
        let counting = Arc::clone(&counting);
        let writes = Arc::clone(&writes);
        let messages = Arc::clone(&messages);
        options.command_event_handler = Some(EventHandler::callback(move |event| {
            if let CommandEvent::Started(started) = event {
                let carried = writes_in(&started.command_name, &started.command);
                if counting.load(Ordering::SeqCst) && carried > 0 {
                    writes.fetch_add(carried, Ordering::SeqCst);
                    messages.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    let client = Client::with_options(options).expect("client");
    let server_bulk = common::capabilities().await.bulk_write;
    // Each round in one bulkWrite where the server has it, and each write its own command.
    for batch in [true, false] {
        let store = Store::builder(client.database(t.db.name()))
            .batch_writes(batch)
            .build();
        let accounts = store
            .repository::<Account>(common::accounts_spec())
            .await
            .expect("open");
        let txns = common::finishing(&store);
        let bulk = batch && server_bulk;

        for k in 1..=8_usize {
            let ids: Vec<String> = (0..k).map(|i| format!("{batch}-k{k}-{i}")).collect();
            for id in &ids {
                accounts
                    .insert(&Account::new(id, "w", 100))
                    .await
                    .expect("seed");
            }
            let tx = txns.begin();
            // Mix the actions: adjust, update, check, delete in turn.
            for (i, id) in ids.iter().enumerate() {
                match i % 4 {
                    0 => tx
                        .adjust(
                            &accounts,
                            id.as_str(),
                            1,
                            &Adjust::new().by("balance", 1_i64),
                        )
                        .await
                        .expect("stage"),
                    1 => tx
                        .update(&accounts, id.as_str(), 1, &Update::new().set("note", "x"))
                        .await
                        .expect("stage"),
                    2 => tx.check(&accounts, id.as_str(), 1).expect("stage"),
                    _ => tx.delete(&accounts, id.as_str(), 1).expect("stage"),
                }
            }
            writes.store(0, Ordering::SeqCst);
            messages.store(0, Ordering::SeqCst);
            counting.store(true, Ordering::SeqCst);
            let outcome = tx.commit().await.expect("commit");
            counting.store(false, Ordering::SeqCst);
            assert!(outcome.finished);
            let counted = writes.load(Ordering::SeqCst);
            let sent = messages.load(Ordering::SeqCst);
            println!(
                "k = {k}: {counted} writes (bound {}) in {sent} messages",
                2 * k + 3
            );
            assert!(counted <= 2 * k + 3, "k = {k}: {counted} writes");
            // And the monitor really saw the protocol: nothing less is possible either.
            assert_eq!(counted, 2 * k + 3, "k = {k}");
            if bulk {
                // The record, the applies, the commit point, the finishes, the end.
                assert_eq!(sent, 5, "k = {k}: {sent} messages");
            } else {
                assert_eq!(
                    sent, counted,
                    "k = {k}: one message per write without bulkWrite"
                );
            }
        }
    }
}
