//! The GC runner's Prometheus metrics and health endpoint (`--metrics-addr`).
//!
//! `GET /metrics` answers in the OpenMetrics text format; `GET /health` answers 200 while the
//! runner's rounds succeed and keep coming, 503 otherwise (before the first round, after a failed
//! one, or when none has ended for three intervals plus a minute), with a one-line JSON body.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use mongotx::gc::RoundSummary;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Every metric the runner keeps.
pub(crate) struct Metrics {
    registry: Registry,
    rounds: Counter,
    round_failures: Counter,
    finished: Counter,
    rolled_back: Counter,
    skipped: Counter,
    purged: Counter,
    orphaned_holds: Counter,
    quota_sweeps: Counter,
    quota_expired: Counter,
    quota_pruned: Counter,
    ratelimit_sweeps: Counter,
    ratelimit_pruned: Counter,
    sweep_failures: Counter,
    round_seconds: Histogram,
    last_round: Gauge<f64, std::sync::atomic::AtomicU64>,
    health: Mutex<Health>,
    interval: Duration,
}

/// What the health endpoint reports on.
struct Health {
    last_ok: Option<Instant>,
    last_failed: bool,
}

impl Metrics {
    /// The metrics of a runner whose rounds come every `interval`.
    pub(crate) fn new(interval: Duration) -> Metrics {
        let mut registry = Registry::with_prefix("mongotx_gc");
        let counter = |registry: &mut Registry, name: &str, help: &str| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        };
        let rounds = counter(&mut registry, "rounds", "GC rounds run");
        let round_failures = counter(&mut registry, "round_failures", "GC rounds that failed");
        let finished = counter(
            &mut registry,
            "finished",
            "Committed transactions whose documents were freed",
        );
        let rolled_back = counter(&mut registry, "rolled_back", "Transactions rolled back");
        let skipped = counter(
            &mut registry,
            "skipped",
            "Items that failed and were left for the next round",
        );
        let purged = counter(&mut registry, "purged", "Tombstones purged");
        let orphaned_holds = counter(
            &mut registry,
            "orphaned_holds_resolved",
            "Holds undone one by one because their transaction ended without committing",
        );
        let quota_sweeps = counter(&mut registry, "quota_sweeps", "Quota sweeps run");
        let quota_expired = counter(
            &mut registry,
            "quota_expired",
            "Expired quota reservations returned",
        );
        let quota_pruned = counter(
            &mut registry,
            "quota_pruned",
            "Quota providers whose remembered released requests were forgotten",
        );
        let ratelimit_sweeps =
            counter(&mut registry, "ratelimit_sweeps", "Rate-limiter sweeps run");
        let ratelimit_pruned = counter(
            &mut registry,
            "ratelimit_pruned",
            "Limiters pruned of entries that stopped counting",
        );
        let sweep_failures = counter(
            &mut registry,
            "sweep_failures",
            "Quota or rate-limiter sweeps that failed",
        );
        let round_seconds = Histogram::new([
            0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        ]);
        registry.register(
            "round_duration_seconds",
            "How long a GC round took",
            round_seconds.clone(),
        );
        let last_round = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "last_round_timestamp_seconds",
            "When the last successful round ended (Unix time)",
            last_round.clone(),
        );
        Metrics {
            registry,
            rounds,
            round_failures,
            finished,
            rolled_back,
            skipped,
            purged,
            orphaned_holds,
            quota_sweeps,
            quota_expired,
            quota_pruned,
            ratelimit_sweeps,
            ratelimit_pruned,
            sweep_failures,
            round_seconds,
            last_round,
            health: Mutex::new(Health {
                last_ok: None,
                last_failed: false,
            }),
            interval,
        }
    }

    /// Counts one round that took `took`.
    pub(crate) fn round(&self, took: Duration, outcome: Result<&RoundSummary, ()>) {
        self.rounds.inc();
        self.round_seconds.observe(took.as_secs_f64());
        let mut health = self.health.lock().unwrap_or_else(PoisonError::into_inner);
        match outcome {
            Ok(summary) => {
                self.finished.inc_by(summary.finished as u64);
                self.rolled_back.inc_by(summary.rolled_back as u64);
                self.skipped.inc_by(summary.skipped as u64);
                self.purged.inc_by(summary.purged);
                self.orphaned_holds.inc_by(summary.swept as u64);
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default();
                self.last_round.set(now.as_secs_f64());
                health.last_ok = Some(Instant::now());
                health.last_failed = false;
            }
            Err(()) => {
                self.round_failures.inc();
                health.last_failed = true;
            }
        }
    }

    /// Counts one quota sweep.
    pub(crate) fn quota_sweep(&self, expired: u64, pruned: u64) {
        self.quota_sweeps.inc();
        self.quota_expired.inc_by(expired);
        self.quota_pruned.inc_by(pruned);
    }

    /// Counts one rate-limiter sweep.
    pub(crate) fn ratelimit_sweep(&self, pruned: u64) {
        self.ratelimit_sweeps.inc();
        self.ratelimit_pruned.inc_by(pruned);
    }

    /// Counts a sweep that failed.
    pub(crate) fn sweep_failed(&self) {
        self.sweep_failures.inc();
    }

    fn health(&self) -> (StatusCode, String) {
        let health = self.health.lock().unwrap_or_else(PoisonError::into_inner);
        // Saturating: the interval is bounded by the command line, but `Metrics` takes any.
        let stale_after = self
            .interval
            .saturating_mul(3)
            .saturating_add(Duration::from_secs(60));
        let since = health.last_ok.map(|at| at.elapsed());
        let (status, state) = match since {
            None => (StatusCode::SERVICE_UNAVAILABLE, "starting"),
            Some(_) if health.last_failed => (StatusCode::SERVICE_UNAVAILABLE, "failing"),
            Some(since) if since > stale_after => (StatusCode::SERVICE_UNAVAILABLE, "stalled"),
            Some(_) => (StatusCode::OK, "ok"),
        };
        let since = since.map_or("null".to_string(), |s| format!("{:.3}", s.as_secs_f64()));
        (
            status,
            format!(r#"{{"status":"{state}","seconds_since_last_round":{since}}}"#),
        )
    }

    fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

async fn metrics_page(State(metrics): State<Arc<Metrics>>) -> impl IntoResponse {
    match metrics.encode() {
        Ok(body) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        ),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            format!("encoding the metrics failed: {e}"),
        ),
    }
}

async fn health_page(State(metrics): State<Arc<Metrics>>) -> impl IntoResponse {
    let (status, body) = metrics.health();
    (status, [(header::CONTENT_TYPE, "application/json")], body)
}

/// Serves `/metrics` and `/health` on `addr` until the process ends; returns the bound address.
pub(crate) async fn serve(addr: SocketAddr, metrics: Arc<Metrics>) -> Result<SocketAddr, String> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on --metrics-addr {addr}: {e}"))?;
    let bound = listener
        .local_addr()
        .map_err(|e| format!("--metrics-addr {addr}: {e}"))?;
    let app = Router::new()
        .route("/metrics", get(metrics_page))
        .route("/health", get(health_page))
        .with_state(metrics);
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "the metrics endpoint stopped");
        }
    });
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_follows_the_rounds() {
        let metrics = Metrics::new(Duration::from_secs(1));
        assert_eq!(metrics.health().0, StatusCode::SERVICE_UNAVAILABLE);
        assert!(metrics.health().1.contains("starting"));
        metrics.round(Duration::from_millis(3), Ok(&RoundSummary::default()));
        assert_eq!(metrics.health().0, StatusCode::OK);
        metrics.round(Duration::from_millis(3), Err(()));
        let (status, body) = metrics.health();
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("failing"), "{body}");
        let page = metrics.encode().expect("encode");
        assert!(page.contains("mongotx_gc_rounds_total 2"), "{page}");
        assert!(page.contains("mongotx_gc_round_failures_total 1"), "{page}");
        assert!(
            page.contains("mongotx_gc_round_duration_seconds_count 2"),
            "{page}"
        );
    }
}
