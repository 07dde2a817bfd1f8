//! A service exporting mongotx's metrics to Prometheus: mongotx records through the `metrics`
//! facade (nothing is recorded until a service installs a recorder), the service installs
//! `metrics-exporter-prometheus` once at start, names the metrics' units and help texts with
//! `mongotx::metrics::describe`, and serves the rendered text on its `/metrics` page (here it is
//! printed after a small workload: transfers, a conflict that `run` retries, a quota refusal, a
//! GC round). Every name and label is documented in `mongotx::metrics`; the ids involved are in
//! the `tracing` spans (`mongotx.txn.commit`, `mongotx.quota.consume`, ...), never in labels.
//!
//! ```sh
//! cargo run --example metrics_prometheus                                    # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example metrics_prometheus
//! ```

mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use mongotx::gc::{Gc, GcOptions};
use mongotx::quota::{NewProvider, Quota, QuotaError, Request};
use mongotx::{Adjust, CollectionSpec, Repository, Store, Transactions, Update};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct Account {
    #[serde(rename = "_id")]
    id: String,
    owner: String,
    balance: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    note: Option<String>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Once, at start: durations as Prometheus histograms (buckets in seconds), the rest as is.
    let prometheus = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Suffix("_seconds".into()),
            &[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0],
        )?
        .install_recorder()?;
    mongotx::metrics::describe();

    let server = local_server::start()?;
    let client = mongodb::Client::with_uri_str(&server.uri).await?;
    let db = client.database("mongotx_example_metrics");
    db.drop().await?;
    let store = Store::new(db);
    workload(&store).await?;
    store.shutdown(Duration::from_secs(10)).await;

    // What a scrape of the service's `/metrics` page returns (mongotx's part of it).
    let page = prometheus.render();
    println!("\n-- GET /metrics (mongotx's series; histogram buckets left out here)");
    for line in page
        .lines()
        .filter(|l| l.contains("mongotx_") && !l.contains("_bucket"))
    {
        println!("  {line}");
    }
    assert!(page.contains(r#"mongotx_commits_total{collection="accounts"} 3"#));
    assert!(page.contains(r#"mongotx_conflicts_total{collection="accounts"} 1"#));
    assert!(page.contains("mongotx_run_retries_total 1"));
    assert!(page.contains(r#"mongotx_quota_refusals_total{op="consume",reason="exceeded"} 1"#));
    Ok(())
}

/// Two transfers, a third that meets a conflict and is rerun, a refused quota, a GC round.
async fn workload(store: &Store) -> Result<(), Box<dyn std::error::Error>> {
    let spec = CollectionSpec::new("accounts", 1, include_str!("../schemas/accounts.json"))?;
    let accounts: Repository<Account> = store.repository(spec).await?;
    for (id, owner) in [("ann", "Ann"), ("bob", "Bob")] {
        let (id, owner, note) = (id.into(), owner.into(), None);
        let balance = 100;
        accounts
            .insert(&Account {
                id,
                owner,
                balance,
                note,
            })
            .await?;
    }
    let txns = Transactions::new(store);
    let mut attempts = 0;
    for round in 0..3 {
        txns.run(|tx| {
            attempts += 1;
            // The last transfer's first attempt: another writer changes ann under it.
            let interfere = round == 2 && attempts == 3;
            let accounts = accounts.clone();
            async move {
                let ann = accounts.get("ann").await?;
                let bob = accounts.get("bob").await?;
                let by = |amount: i64| Adjust::new().by("balance", amount);
                tx.adjust(&accounts, "ann", ann.version, &by(-10)).await?;
                tx.adjust(&accounts, "bob", bob.version, &by(10)).await?;
                if interfere {
                    // Between staging and commit: the commit meets a conflict, `run` reruns.
                    let audit = Update::new().set("note", "audited");
                    accounts.update("ann", ann.version, &audit).await?;
                }
                Ok(())
            }
        })
        .await?;
    }
    println!("-- 3 transfers in {attempts} attempts (the last one's first met a conflict)");

    let quota = Quota::open(store).await?;
    quota.create(NewProvider::new(("team", "seats"), 2)).await?;
    quota
        .consume(&Request::new("alice").take(("team", "seats"), 2))
        .await?;
    match quota
        .consume(&Request::new("carol").take(("team", "seats"), 1))
        .await
    {
        Err(QuotaError::QuotaExceeded { .. }) => println!("-- carol's seat refused: quota full"),
        other => return Err(format!("expected a refusal, got {other:?}").into()),
    }

    let round = Gc::new(store, GcOptions::default()).run_round().await?;
    println!("-- a GC round: {round:?}");
    Ok(())
}
