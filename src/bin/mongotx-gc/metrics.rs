//! The GC runner's Prometheus metrics and health endpoint (`--metrics-addr`).
//!
//! The library records the GC's own metrics (rounds, what they resolved, their duration: see
//! `mongotx::metrics`) through the `metrics` facade; this binary installs the Prometheus exporter
//! as the process's recorder and adds what the runner knows: when the last round ended, its
//! quota and rate-limiter sweeps, and the expired records its rounds left to other runners'
//! claims (from each round's summary). `GET /metrics` answers with the exporter's text;
//! `GET /health` answers 200 while the runner's rounds succeed and keep coming, 503 otherwise
//! (before the first round, after a failed one, or when none has ended for three intervals plus
//! a minute), with a one-line JSON body. Served by a bare HTTP/1 server (hyper): a production
//! binary carries no web framework.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use ::metrics::{counter, describe_counter, describe_gauge, gauge, Unit};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use mongotx::gc::RoundSummary;

/// Gauge: when the last successful round ended (Unix time, seconds).
const LAST_ROUND: &str = "mongotx_gc_last_round_timestamp_seconds";
/// Counter: quota sweeps run.
const QUOTA_SWEEPS: &str = "mongotx_gc_quota_sweeps_total";
/// Counter: expired quota reservations returned.
const QUOTA_EXPIRED: &str = "mongotx_gc_quota_expired_total";
/// Counter: quota providers whose remembered released requests were forgotten.
const QUOTA_PRUNED: &str = "mongotx_gc_quota_pruned_total";
/// Counter: rate-limiter sweeps run.
const RATELIMIT_SWEEPS: &str = "mongotx_gc_ratelimit_sweeps_total";
/// Counter: limiters pruned of entries that stopped counting.
const RATELIMIT_PRUNED: &str = "mongotx_gc_ratelimit_pruned_total";
/// Counter: quota or rate-limiter sweeps that failed.
const SWEEP_FAILURES: &str = "mongotx_gc_sweep_failures_total";
/// Counter: expired records rounds left alone because another runner's claim on them had not
/// run out (`RoundSummary::left_to_claims`: each counts once a round).
const LEFT_TO_CLAIMS: &str = "mongotx_gc_left_to_claims_total";

/// The buckets of the histograms the endpoint shows (seconds): from a round of an idle database
/// to a long backlog, and a commit's few milliseconds to a contended one's seconds.
const BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Installs the Prometheus exporter as the process's recorder and describes every metric (the
/// library's and the runner's); returns the handle that renders them.
pub(crate) fn install() -> Result<PrometheusHandle, String> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".to_string()), &BUCKETS)
        .and_then(|builder| builder.install_recorder())
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    mongotx::metrics::describe();
    describe_gauge!(
        LAST_ROUND,
        Unit::Seconds,
        "When the last successful round ended (Unix time)"
    );
    describe_counter!(QUOTA_SWEEPS, Unit::Count, "Quota sweeps run");
    describe_counter!(
        QUOTA_EXPIRED,
        Unit::Count,
        "Expired quota reservations returned"
    );
    describe_counter!(
        QUOTA_PRUNED,
        Unit::Count,
        "Quota providers whose remembered released requests were forgotten"
    );
    describe_counter!(RATELIMIT_SWEEPS, Unit::Count, "Rate-limiter sweeps run");
    describe_counter!(
        RATELIMIT_PRUNED,
        Unit::Count,
        "Limiters pruned of entries that stopped counting"
    );
    describe_counter!(
        SWEEP_FAILURES,
        Unit::Count,
        "Quota or rate-limiter sweeps that failed"
    );
    describe_counter!(
        LEFT_TO_CLAIMS,
        Unit::Count,
        "Expired records rounds left to other runners' claims"
    );
    // The runner's counters are on the page from the start, at zero, so that a rate over them
    // is defined before their first event.
    for name in [
        QUOTA_SWEEPS,
        QUOTA_EXPIRED,
        QUOTA_PRUNED,
        RATELIMIT_SWEEPS,
        RATELIMIT_PRUNED,
        SWEEP_FAILURES,
        LEFT_TO_CLAIMS,
    ] {
        counter!(name).absolute(0);
    }
    Ok(handle)
}

/// What the runner reports beyond the library's metrics, and what the health endpoint judges.
pub(crate) struct Runner {
    health: Mutex<Health>,
    interval: Duration,
}

/// What the health endpoint reports on.
struct Health {
    last_ok: Option<Instant>,
    last_failed: bool,
}

impl Runner {
    /// The state of a runner whose rounds come every `interval`.
    pub(crate) fn new(interval: Duration) -> Runner {
        Runner {
            health: Mutex::new(Health {
                last_ok: None,
                last_failed: false,
            }),
            interval,
        }
    }

    /// Notes the end of a round (the library counted it already).
    pub(crate) fn round(&self, outcome: Result<&RoundSummary, ()>) {
        let mut health = self.health.lock().unwrap_or_else(PoisonError::into_inner);
        match outcome {
            Ok(summary) => {
                let left = u64::try_from(summary.left_to_claims).unwrap_or(u64::MAX);
                counter!(LEFT_TO_CLAIMS).increment(left);
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default();
                gauge!(LAST_ROUND).set(now.as_secs_f64());
                health.last_ok = Some(Instant::now());
                health.last_failed = false;
            }
            Err(()) => health.last_failed = true,
        }
    }

    /// Counts one quota sweep.
    pub(crate) fn quota_sweep(&self, expired: u64, pruned: u64) {
        counter!(QUOTA_SWEEPS).increment(1);
        counter!(QUOTA_EXPIRED).increment(expired);
        counter!(QUOTA_PRUNED).increment(pruned);
    }

    /// Counts one rate-limiter sweep.
    pub(crate) fn ratelimit_sweep(&self, pruned: u64) {
        counter!(RATELIMIT_SWEEPS).increment(1);
        counter!(RATELIMIT_PRUNED).increment(pruned);
    }

    /// Counts a sweep that failed.
    pub(crate) fn sweep_failed(&self) {
        counter!(SWEEP_FAILURES).increment(1);
    }

    fn health(&self) -> (StatusCode, String) {
        let health = self.health.lock().unwrap_or_else(PoisonError::into_inner);
        // Saturating: the interval is bounded by the command line, but `Runner` takes any.
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
}

/// What the endpoint serves from.
struct Pages {
    runner: Arc<Runner>,
    exporter: PrometheusHandle,
}

impl Pages {
    fn answer(&self, request: &Request<Incoming>) -> Response<String> {
        let (status, content_type, body) = match (request.method(), request.uri().path()) {
            (&Method::GET, "/metrics") => (
                StatusCode::OK,
                "text/plain; version=0.0.4; charset=utf-8",
                self.exporter.render(),
            ),
            (&Method::GET, "/health") => {
                let (status, body) = self.runner.health();
                (status, "application/json", body)
            }
            (&Method::GET, _) => (
                StatusCode::NOT_FOUND,
                "text/plain; charset=utf-8",
                "not found: the pages are /metrics and /health\n".to_string(),
            ),
            _ => (
                StatusCode::METHOD_NOT_ALLOWED,
                "text/plain; charset=utf-8",
                "only GET\n".to_string(),
            ),
        };
        let mut response = Response::new(body);
        *response.status_mut() = status;
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
        response
    }
}

/// Serves `/metrics` and `/health` on `addr` until the process ends; returns the bound address.
/// The exporter's histograms and idle series are kept in bounds every `upkeep`.
pub(crate) async fn serve(
    addr: SocketAddr,
    runner: Arc<Runner>,
    exporter: PrometheusHandle,
) -> Result<SocketAddr, String> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on --metrics-addr {addr}: {e}"))?;
    let bound = listener
        .local_addr()
        .map_err(|e| format!("--metrics-addr {addr}: {e}"))?;
    let pages = Arc::new(Pages { runner, exporter });
    tokio::spawn({
        let exporter = pages.exporter.clone();
        async move {
            let mut upkeep = tokio::time::interval(Duration::from_secs(5));
            loop {
                upkeep.tick().await;
                exporter.run_upkeep();
            }
        }
    });
    tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, say: the next accept may do.
                    tracing::warn!(error = %e, "the metrics endpoint could not accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let pages = Arc::clone(&pages);
            tokio::spawn(async move {
                let service = service_fn(move |request| {
                    let response = pages.answer(&request);
                    async move { Ok::<_, Infallible>(response) }
                });
                if let Err(e) = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await
                {
                    tracing::debug!(error = %e, "a metrics connection ended with an error");
                }
            });
        }
    });
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_follows_the_rounds() {
        let recorder = PrometheusBuilder::new().build_recorder();
        let runner = Runner::new(Duration::from_secs(1));
        assert_eq!(runner.health().0, StatusCode::SERVICE_UNAVAILABLE);
        assert!(runner.health().1.contains("starting"));
        ::metrics::with_local_recorder(&recorder, || {
            runner.round(Ok(&RoundSummary::default()));
            runner.quota_sweep(2, 1);
            runner.sweep_failed();
        });
        assert_eq!(runner.health().0, StatusCode::OK);
        runner.round(Err(()));
        let (status, body) = runner.health();
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("failing"), "{body}");
        let page = recorder.handle().render();
        assert!(page.contains("mongotx_gc_quota_sweeps_total 1"), "{page}");
        assert!(page.contains("mongotx_gc_quota_expired_total 2"), "{page}");
        assert!(page.contains("mongotx_gc_sweep_failures_total 1"), "{page}");
        assert!(
            page.contains("mongotx_gc_last_round_timestamp_seconds "),
            "{page}"
        );
    }
}
