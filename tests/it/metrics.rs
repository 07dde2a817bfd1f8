//! What the library reports, read back as a service would see it: the metrics through the
//! Prometheus exporter's text after a known workload, each count checked exactly, and the spans
//! with their fields through a `tracing` layer.
//!
//! Every test of the binary runs in this one process, so nothing here is installed globally:
//! each test builds its own recorder (or subscriber) and runs its workload on a current-thread
//! runtime inside `metrics::with_local_recorder` (or `tracing::subscriber::with_default`), so
//! that everything the workload does, the store's background finishes included, records on
//! this thread, into this test's recorder alone.

use crate::common;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::common::{Account, CrashAt, TestDb};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusRecorder};
use mongotx::metrics as m;
use mongotx::obt::{NewObt, Obt};
use mongotx::options::{Finish, TxnOptions};
use mongotx::queue::{Batches, NewBatch};
use mongotx::quota::{NewProvider, Quota, QuotaError, Request};
use mongotx::ratelimit::{Limit, Priority, RateLimitError, RateLimits};
use mongotx::testkit::failpoint::{self, Failpoint};
use mongotx::{Adjust, CollectionSpec, Query, Repository, Transactions, TxnError, Update};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// Runs `workload` on a current-thread runtime with `recorder` as this thread's recorder. The
/// server is probed first, outside: the probe is shared by every test and records nothing of
/// this one's.
fn recorded<T>(recorder: &PrometheusRecorder, workload: impl std::future::Future<Output = T>) -> T {
    let runtime = runtime();
    runtime.block_on(common::capabilities());
    metrics::with_local_recorder(recorder, || runtime.block_on(workload))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

/// The exporter's text, parsed: each series (name and labels) with its value.
struct Exported(HashMap<(String, BTreeMap<String, String>), f64>);

impl Exported {
    fn of(recorder: &PrometheusRecorder) -> Exported {
        let text = recorder.handle().render();
        let mut series = HashMap::new();
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let (key, value) = line.rsplit_once(' ').expect("a value");
            let (name, labels) = match key.split_once('{') {
                Some((name, labels)) => (name, labels.trim_end_matches('}')),
                None => (key, ""),
            };
            let labels = labels
                .split(',')
                .filter(|l| !l.is_empty())
                .map(|l| {
                    let (k, v) = l.split_once('=').expect("label=value");
                    (k.to_string(), v.trim_matches('"').to_string())
                })
                .collect();
            let value = value.parse().unwrap_or_else(|_| panic!("a number: {line}"));
            series.insert((name.to_string(), labels), value);
        }
        Exported(series)
    }

    /// The value of series `name{labels}`: 0 when it was never recorded (a counter appears on
    /// its first increment).
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let labels = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.0
            .get(&(name.to_string(), labels))
            .copied()
            .unwrap_or(0.0)
    }

    /// How many observations histogram `name{labels}` holds (the exporter renders histograms
    /// without buckets as summaries; both have a `_count`).
    fn count(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(&format!("{name}_count"), labels)
    }
}

fn savings_spec() -> CollectionSpec {
    CollectionSpec::new("savings", 1, include_str!("../../schemas/accounts.json"))
        .expect("savings spec")
}

/// Moves `amount` from `from` to `to` (each in its repository) in one transaction of `txns`.
async fn transfer(
    txns: &Transactions,
    (from_repo, from): (&Repository<Account>, &str),
    (to_repo, to): (&Repository<Account>, &str),
    amount: i64,
) -> Result<mongotx::Outcome, TxnError> {
    let tx = txns.begin();
    let a = from_repo.get(from).await?;
    let b = to_repo.get(to).await?;
    tx.adjust(
        from_repo,
        from,
        a.version,
        &Adjust::new().by("balance", -amount),
    )
    .await?;
    tx.adjust(to_repo, to, b.version, &Adjust::new().by("balance", amount))
        .await?;
    tx.commit().await
}

#[test]
fn commits_aborts_conflicts_retries_and_background_finishes_are_counted_exactly() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let pending_after_commit = recorded(&recorder, async {
        let t = TestDb::new().await;
        let accounts = common::open_accounts(&t.store).await;
        let savings = t.store.repository::<Account>(savings_spec()).await.unwrap();
        common::seed_accounts(&accounts, &[("a", 100), ("b", 100)]).await;
        savings.insert(&Account::new("s", "S", 100)).await.unwrap();
        let now = Transactions::with_options(
            &t.store,
            TxnOptions::default().finish(Finish::BeforeReturning),
        );

        // Three transfers within `accounts`: 3 commits there.
        for _ in 0..3 {
            transfer(&now, (&accounts, "a"), (&accounts, "b"), 1)
                .await
                .unwrap();
        }

        // A conflict forced: `a` changes between staging and commit.
        let a = accounts.get("a").await.unwrap();
        let tx = now.begin();
        tx.adjust(
            &accounts,
            "a",
            a.version,
            &Adjust::new().by("balance", -1_i64),
        )
        .await
        .unwrap();
        accounts
            .update("a", a.version, &Update::new().set("note", "outside"))
            .await
            .unwrap();
        let refused = tx
            .commit()
            .await
            .expect_err("a changed under the transaction");
        assert!(
            matches!(
                refused.repo_error(),
                Some(mongotx::RepoError::VersionConflict { .. })
            ),
            "{refused:?}"
        );

        // A run whose first attempt meets the same conflict, and whose second commits.
        let attempts = AtomicU32::new(0);
        now.run(|tx| {
            let accounts = accounts.clone();
            let attempt = attempts.fetch_add(1, Ordering::SeqCst);
            async move {
                let a = accounts.get("a").await?;
                tx.adjust(
                    &accounts,
                    "a",
                    a.version,
                    &Adjust::new().by("balance", -1_i64),
                )
                .await?;
                if attempt == 0 {
                    accounts
                        .update("a", a.version, &Update::new().set("note", "again"))
                        .await?;
                }
                Ok(())
            }
        })
        .await
        .unwrap();
        assert_eq!(attempts.load(Ordering::SeqCst), 2);

        // One transaction over two collections: one commit on each.
        transfer(&now, (&accounts, "a"), (&savings, "s"), 5)
            .await
            .unwrap();
        // Nothing staged: nothing counted.
        assert_eq!(now.begin().commit().await.unwrap().txn, None);

        // Returning before the finish: the finish is pending until the store's shutdown waits
        // for it (on this one thread, it cannot start before this task yields).
        let later = Transactions::with_options(
            &t.store,
            TxnOptions::default().finish(Finish::InBackground),
        );
        let outcome = transfer(&later, (&accounts, "b"), (&accounts, "a"), 2)
            .await
            .unwrap();
        assert!(!outcome.finished);
        let pending = Exported::of(&recorder).get(m::BACKGROUND_PENDING, &[]);
        let shutdown = t.store.shutdown(Duration::from_secs(10)).await;
        assert_eq!((shutdown.finished, shutdown.unfinished), (1, 0));
        pending
    });

    let exported = Exported::of(&recorder);
    let accounts = [("collection", "accounts")];
    assert_eq!(pending_after_commit, 1.0);
    assert_eq!(exported.get(m::BACKGROUND_PENDING, &[]), 0.0);
    // 3 transfers, the run's second attempt, the one across collections, the background one.
    assert_eq!(exported.get(m::COMMITS, &accounts), 6.0);
    assert_eq!(exported.get(m::COMMITS, &[("collection", "savings")]), 1.0);
    // The forced conflict and the run's first attempt.
    assert_eq!(exported.get(m::ABORTS, &accounts), 2.0);
    assert_eq!(exported.get(m::CONFLICTS, &accounts), 2.0);
    assert_eq!(exported.get(m::ABORTS, &[("collection", "savings")]), 0.0);
    assert_eq!(exported.get(m::RUN_RETRIES, &[]), 1.0);
    let by = |mode, outcome| [("mode", mode), ("outcome", outcome)];
    assert_eq!(
        exported.count(m::COMMIT_DURATION, &by("before_returning", "committed")),
        5.0
    );
    assert_eq!(
        exported.count(m::COMMIT_DURATION, &by("before_returning", "aborted")),
        2.0
    );
    assert_eq!(
        exported.count(m::COMMIT_DURATION, &by("in_background", "committed")),
        1.0
    );
    // Nobody met a hold: every commit but the last freed its documents before returning.
    for op in ["read", "write"] {
        assert_eq!(
            exported.get(m::HOLDS_MET, &[("collection", "accounts"), ("op", op)]),
            0.0
        );
    }
}

/// Stages a transfer a → b (or c → d) on `accounts` and kills its coordinator at `at`.
async fn crashed(t: &TestDb, accounts: &Repository<Account>, ids: (&str, &str), at: &'static str) {
    let txns = Transactions::with_options(
        &t.store,
        TxnOptions::default()
            .finish(Finish::BeforeReturning)
            .fault_injector(Arc::new(CrashAt(Failpoint { name: at, step: 0 }))),
    );
    let tx = txns.begin();
    tx.adjust(accounts, ids.0, 1, &Adjust::new().by("balance", -10_i64))
        .await
        .unwrap();
    tx.adjust(accounts, ids.1, 1, &Adjust::new().by("balance", 10_i64))
        .await
        .unwrap();
    let err = tx.commit().await.expect_err("crashed");
    assert!(matches!(err, TxnError::Crashed { .. }), "{err:?}");
}

#[test]
fn holds_met_and_what_a_gc_round_resolves_are_counted_exactly() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let round = recorded(&recorder, async {
        let t = TestDb::new().await;
        let accounts = common::open_accounts(&t.store).await;
        common::seed_accounts(&accounts, &[("a", 100), ("b", 100), ("c", 100), ("d", 100)]).await;
        // Committed (its commit point written), its documents still held.
        crashed(&t, &accounts, ("a", "b"), failpoint::COMMIT_AFTER).await;
        // A read by id meets a's hold; a query meets the one transaction holding a and b.
        assert_eq!(accounts.get("a").await.unwrap().balance, 90);
        assert_eq!(accounts.find(Query::new()).await.unwrap().len(), 4);
        // A write meets a's hold, finishes it (committed) and goes on.
        accounts
            .update("a", 2, &Update::new().set("note", "after"))
            .await
            .unwrap();
        // A transaction staged on b reads it through the hold (the staging read) and its apply
        // meets the hold, finishes it (committed) and goes on.
        let txns = Transactions::with_options(
            &t.store,
            TxnOptions::default().finish(Finish::BeforeReturning),
        );
        let tx = txns.begin();
        tx.adjust(&accounts, "b", 2, &Adjust::new().by("balance", 1_i64))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        // Dead before its record went out: holds on c and d, no record.
        crashed(&t, &accounts, ("c", "d"), failpoint::BEGIN_BEFORE).await;

        // A GC round after every deadline: it finishes the first (its record is still there)
        // and sweeps the second's holds.
        let gc = mongotx::gc::Gc::new(&t.store, mongotx::gc::GcOptions::default());
        let round = gc
            .run_round_at(
                chrono::Utc::now() + chrono::Duration::seconds(120),
                &AtomicBool::new(false),
            )
            .await
            .unwrap();
        common::assert_settled(&t, &["accounts"], "after the GC round").await;
        t.store.shutdown(Duration::from_secs(10)).await;
        round
    });

    let exported = Exported::of(&recorder);
    let held = |op| [("collection", "accounts"), ("op", op)];
    assert_eq!(exported.get(m::HOLDS_MET, &held("read")), 3.0);
    assert_eq!(exported.get(m::HOLDS_MET, &held("write")), 2.0);
    // The crashed coordinators counted nothing; the transaction on b, 1.
    assert_eq!(exported.get(m::COMMITS, &[("collection", "accounts")]), 1.0);
    assert_eq!(exported.get(m::ABORTS, &[("collection", "accounts")]), 0.0);

    assert_eq!(
        (
            round.finished,
            round.rolled_back,
            round.swept,
            round.skipped,
            round.purged
        ),
        (1, 0, 2, 0, 0),
        "{round:?}"
    );
    assert_eq!(exported.get(m::GC_ROUNDS, &[("outcome", "ok")]), 1.0);
    assert_eq!(exported.get(m::GC_ROUNDS, &[("outcome", "failed")]), 0.0);
    assert_eq!(exported.count(m::GC_ROUND_DURATION, &[]), 1.0);
    for (result, n) in [
        ("finished", 1.0),
        ("rolled_back", 0.0),
        ("swept", 2.0),
        ("skipped", 0.0),
        ("purged", 0.0),
    ] {
        assert_eq!(
            exported.get(m::GC_RESOLVED, &[("result", result)]),
            n,
            "{result}"
        );
    }
}

/// A quota with provider `team:cores` of 5, and a limiter `api` of `calls` per `window`.
async fn quota_and_limiter(
    store: &mongotx::Store,
    calls: u32,
    window: Duration,
) -> (Quota, RateLimits) {
    let quota = Quota::open(store).await.unwrap();
    quota
        .create(NewProvider::new(("team", "cores"), 5))
        .await
        .unwrap();
    let limits = RateLimits::open(store).await.unwrap();
    limits
        .define("api", Limit::new(calls, window))
        .await
        .unwrap();
    (quota, limits)
}

#[test]
fn quota_refusals_rate_limiter_waits_and_queue_claims_are_counted_exactly() {
    let recorder = PrometheusBuilder::new().build_recorder();
    recorded(&recorder, async {
        let t = TestDb::new().await;

        // One call a second: a second reservation right after the first waits for its window
        // (a second is far more than the settlement between them takes).
        let (quota, limits) = quota_and_limiter(&t.store, 1, Duration::from_secs(1)).await;
        quota
            .consume(&Request::new("vm-1").take(("team", "cores"), 3))
            .await
            .unwrap();
        let refused = quota
            .consume(&Request::new("vm-2").take(("team", "cores"), 3))
            .await;
        assert!(
            matches!(refused, Err(QuotaError::QuotaExceeded { .. })),
            "{refused:?}"
        );

        let first = limits.reserve(&["api"], 1, Priority::High).await.unwrap();
        limits.settle(&first, 1).await.unwrap();
        let second = limits.reserve(&["api"], 1, Priority::High).await.unwrap();
        limits.settle(&second, 1).await.unwrap();
        // One call an hour: a reservation after the first gives up waiting.
        limits
            .define("hourly", Limit::new(1, Duration::from_secs(3600)))
            .await
            .unwrap();
        let only = limits
            .reserve(&["hourly"], 1, Priority::Bulk)
            .await
            .unwrap();
        limits.settle(&only, 1).await.unwrap();
        let late = limits
            .reserve_within(&["hourly"], 1, Priority::Bulk, Duration::from_millis(20))
            .await;
        assert!(
            matches!(late, Err(RateLimitError::TimedOut { .. })),
            "{late:?}"
        );

        // A claim taken, then two refused by the service's slot it holds.
        let batches = Batches::open(&t.store).await.unwrap();
        batches
            .add(&NewBatch::new("svc", "h1", "one"))
            .await
            .unwrap();
        let h2 = batches
            .add(&NewBatch::new("svc", "h2", "two"))
            .await
            .unwrap();
        let queued = batches.round().await.unwrap();
        assert_eq!(queued.len(), 1);
        let ttl = Duration::from_secs(30);
        assert!(batches.claim(&queued[0], "x", ttl).await.unwrap().is_some());
        assert!(batches.claim(&queued[0], "y", ttl).await.unwrap().is_none());
        assert!(batches.claim(&h2, "y", ttl).await.unwrap().is_none());
        t.store.shutdown(Duration::from_secs(10)).await;
    });

    let exported = Exported::of(&recorder);
    let refusal = |reason| [("op", "consume"), ("reason", reason)];
    assert_eq!(exported.get(m::QUOTA_REFUSALS, &refusal("exceeded")), 1.0);
    assert_eq!(exported.get(m::QUOTA_REFUSALS, &refusal("contended")), 0.0);
    assert_eq!(
        exported.get(m::RATELIMIT_WAITS, &[("outcome", "granted")]),
        1.0
    );
    assert_eq!(
        exported.get(m::RATELIMIT_WAITS, &[("outcome", "timed_out")]),
        1.0
    );
    assert_eq!(exported.count(m::RATELIMIT_WAIT_DURATION, &[]), 2.0);
    assert!(exported.get(&format!("{}_sum", m::RATELIMIT_WAIT_DURATION), &[]) > 0.0);
    assert_eq!(
        exported.get(m::QUEUE_CLAIMS, &[("outcome", "claimed")]),
        1.0
    );
    assert_eq!(
        exported.get(m::QUEUE_CLAIMS, &[("outcome", "slot_taken")]),
        2.0
    );
    assert_eq!(exported.get(m::QUEUE_CLAIMS, &[("outcome", "error")]), 0.0);
}

#[test]
fn describe_gives_every_metric_its_help_text() {
    let recorder = PrometheusBuilder::new().build_recorder();
    metrics::with_local_recorder(&recorder, || {
        m::describe();
        metrics::counter!(m::COMMITS, "collection" => "x").increment(1);
        metrics::gauge!(m::BACKGROUND_PENDING).set(0.0);
    });
    let text = recorder.handle().render();
    assert!(
        text.contains(&format!("# HELP {} Committed transactions", m::COMMITS)),
        "{text}"
    );
    assert!(
        text.contains(&format!("# HELP {} ", m::BACKGROUND_PENDING)),
        "{text}"
    );
}

// ----- spans -----

/// One span as a subscriber saw it: its name, its parent's, and its fields as recorded.
#[derive(Debug, Clone)]
struct Seen {
    name: &'static str,
    parent: Option<&'static str>,
    fields: BTreeMap<String, String>,
}

/// A layer keeping every span it sees.
#[derive(Clone, Default)]
struct Spans(Arc<Mutex<Vec<Seen>>>);

/// Where a span's record is kept in [`Spans`] (stored in the span's extensions).
struct Slot(usize);

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().to_string(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_string(), value.to_string());
    }
}

impl<S> Layer<S> for Spans
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut fields = BTreeMap::new();
        attrs.record(&mut Fields(&mut fields));
        let mut seen = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        seen.push(Seen {
            name: span.name(),
            parent: span.parent().map(|p| p.name()),
            fields,
        });
        span.extensions_mut().insert(Slot(seen.len() - 1));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let extensions = span.extensions();
        let Some(Slot(at)) = extensions.get::<Slot>() else {
            return;
        };
        let mut seen = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        values.record(&mut Fields(&mut seen[*at].fields));
    }
}

impl Spans {
    /// The one span named `name`, failing if there is none or several.
    fn one(&self, name: &str) -> Seen {
        let seen = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let found: Vec<&Seen> = seen.iter().filter(|s| s.name == name).collect();
        assert_eq!(found.len(), 1, "spans named {name}: {found:?}");
        found[0].clone()
    }
}

fn fields(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn transactions_and_module_operations_run_in_spans_carrying_their_ids() {
    let spans = Spans::default();
    let subscriber = tracing_subscriber::registry().with(spans.clone());
    let runtime = runtime();
    runtime.block_on(common::capabilities());
    let txn_id = tracing::subscriber::with_default(subscriber, || {
        runtime.block_on(async {
            let t = TestDb::new().await;
            let accounts = common::open_accounts(&t.store).await;
            common::seed_accounts(&accounts, &[("a", 100), ("b", 100)]).await;
            let txns = Transactions::with_options(
                &t.store,
                TxnOptions::default().finish(Finish::BeforeReturning),
            );
            let (_, outcome) = txns
                .run(|tx| {
                    let accounts = accounts.clone();
                    async move {
                        for (id, by) in [("a", -5_i64), ("b", 5)] {
                            let doc = accounts.get(id).await?;
                            tx.adjust(&accounts, id, doc.version, &Adjust::new().by("balance", by))
                                .await?;
                        }
                        Ok(())
                    }
                })
                .await
                .unwrap();

            let (quota, limits) = quota_and_limiter(&t.store, 10, Duration::from_secs(1)).await;
            quota
                .consume(&Request::with_id("vm-1", "start-1").take(("team", "cores"), 1))
                .await
                .unwrap();
            let obts = Obt::open(&t.store).await.unwrap();
            obts.create(NewObt::new("volume-7", "server-a"))
                .await
                .unwrap();
            let r = limits.reserve(&["api"], 1, Priority::High).await.unwrap();
            limits.settle(&r, 1).await.unwrap();
            let batches = Batches::open(&t.store).await.unwrap();
            let batch = batches
                .add(&NewBatch::new("svc", "h1", "one"))
                .await
                .unwrap();
            batches
                .claim(&batch, "x", Duration::from_secs(30))
                .await
                .unwrap();
            mongotx::gc::Gc::new(&t.store, mongotx::gc::GcOptions::default())
                .run_round()
                .await
                .unwrap();
            t.store.shutdown(Duration::from_secs(10)).await;
            outcome.txn.expect("a transaction id").to_hex()
        })
    });

    let run = spans.one("mongotx.txn.run");
    assert_eq!(
        run.fields,
        fields(&[("attempts", "1"), ("outcome", "committed")])
    );
    let commit = spans.one("mongotx.txn.commit");
    assert_eq!(commit.parent, Some("mongotx.txn.run"));
    assert_eq!(
        commit.fields,
        fields(&[
            ("txn", &txn_id),
            ("collections", "accounts"),
            ("documents", "2"),
            ("mode", "before_returning"),
            ("attempts", "1"),
            ("outcome", "committed"),
        ])
    );
    let modules: [(&str, &[(&str, &str)]); 7] = [
        (
            "mongotx.quota.consume",
            &[("consumer", "vm-1"), ("request", "start-1")],
        ),
        ("mongotx.quota.create", &[("provider", "team:cores")]),
        (
            "mongotx.obt.create",
            &[("obt", "volume-7"), ("owner", "server-a")],
        ),
        ("mongotx.ratelimit.define", &[("limiter", "api")]),
        (
            "mongotx.ratelimit.reserve",
            &[("limiters", "api"), ("calls", "1"), ("priority", "High")],
        ),
        (
            "mongotx.queue.claim",
            &[("service", "svc"), ("batch", "h1"), ("claimant", "x")],
        ),
        ("mongotx.gc.round", &[]),
    ];
    for (name, expected) in modules {
        assert_eq!(spans.one(name).fields, fields(expected), "{name}");
    }
    let settle = spans.one("mongotx.ratelimit.settle");
    assert_eq!(settle.fields.get("made").map(String::as_str), Some("1"));
}
