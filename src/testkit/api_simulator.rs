//! A stand-in for a third-party API with a rate limit, for tests and the torture run: an HTTP
//! server that logs every call's arrival on its own monotonic clock and answers `429 Too Many
//! Requests` to a call that makes more than `limit` arrivals in an interval of `window` (any
//! interval, not only aligned ones; rejected calls count, as they do at most real APIs).
//!
//! `GET /call` (or `POST /call`) is one call; `GET /report` is the [`Report`] as JSON. A call can
//! be given a latency, as a real API's calls take time: it is logged when it arrives and
//! answered that much later.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

/// What the simulator saw.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Report {
    /// Its limit.
    pub limit: u32,
    /// Its window, in milliseconds.
    pub window_ms: u64,
    /// Calls that arrived (answered or not).
    pub calls: u64,
    /// Calls answered 429.
    pub rejected: u64,
    /// The most arrivals in any interval of one window.
    pub max_in_any_window: u32,
    /// Arrivals in consecutive windows from the first arrival (the last may be partial).
    pub per_window: Vec<u32>,
}

#[derive(Debug)]
struct Log {
    started: Instant,
    /// Arrivals of the last window.
    recent: VecDeque<Instant>,
    /// Every arrival, as time since `started`.
    arrivals: Vec<Duration>,
    rejected: u64,
}

#[derive(Debug)]
struct Shared {
    limit: u32,
    window: Duration,
    latency: Duration,
    log: Mutex<Log>,
}

impl Shared {
    fn log(&self) -> MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Logs one arrival; whether it is within the limit.
    fn arrive(&self) -> bool {
        let mut log = self.log();
        let now = Instant::now();
        // An interval of one window ending now holds the arrivals at or after now - window.
        while let Some(&first) = log.recent.front() {
            if now.duration_since(first) > self.window {
                log.recent.pop_front();
            } else {
                break;
            }
        }
        log.recent.push_back(now);
        let since = now.duration_since(log.started);
        log.arrivals.push(since);
        let within = log.recent.len() <= self.limit as usize;
        if !within {
            log.rejected += 1;
        }
        within
    }

    fn report(&self) -> Report {
        let log = self.log();
        let arrivals = &log.arrivals;
        let mut max = 0usize;
        let mut first = 0usize;
        for (last, &at) in arrivals.iter().enumerate() {
            while at - arrivals[first] > self.window {
                first += 1;
            }
            max = max.max(last - first + 1);
        }
        let mut per_window = Vec::new();
        if let Some(&start) = arrivals.first() {
            for &at in arrivals {
                let index = ((at - start).as_nanos() / self.window.as_nanos().max(1)) as usize;
                if per_window.len() <= index {
                    per_window.resize(index + 1, 0u32);
                }
                per_window[index] += 1;
            }
        }
        Report {
            limit: self.limit,
            window_ms: u64::try_from(self.window.as_millis()).unwrap_or(u64::MAX),
            calls: arrivals.len() as u64,
            rejected: log.rejected,
            max_in_any_window: u32::try_from(max).unwrap_or(u32::MAX),
            per_window,
        }
    }
}

/// A running simulator; it stops when dropped.
#[derive(Debug)]
pub struct Simulator {
    addr: SocketAddr,
    shared: Arc<Shared>,
    _stop: oneshot::Sender<()>,
}

impl Simulator {
    /// Starts one on a free local port, allowing `limit` calls per `window`, answering at once.
    pub async fn start(limit: u32, window: Duration) -> std::io::Result<Simulator> {
        Simulator::start_with_latency(limit, window, Duration::ZERO).await
    }

    /// Starts one that answers each call `latency` after it arrived.
    pub async fn start_with_latency(
        limit: u32,
        window: Duration,
        latency: Duration,
    ) -> std::io::Result<Simulator> {
        let shared = Arc::new(Shared {
            limit,
            window,
            latency,
            log: Mutex::new(Log {
                started: Instant::now(),
                recent: VecDeque::new(),
                arrivals: Vec::new(),
                rejected: 0,
            }),
        });
        let app = Router::new()
            .route("/call", get(call).post(call))
            .route("/report", get(report))
            .with_state(shared.clone());
        let (addr, stop) = crate::testkit::http::serve_local(app, "the API simulator").await?;
        Ok(Simulator {
            addr,
            shared,
            _stop: stop,
        })
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The URL of one call.
    pub fn call_url(&self) -> String {
        format!("http://{}/call", self.addr)
    }

    /// What it saw so far.
    pub fn report(&self) -> Report {
        self.shared.report()
    }
}

async fn call(State(shared): State<Arc<Shared>>) -> StatusCode {
    let within = shared.arrive();
    if !shared.latency.is_zero() {
        tokio::time::sleep(shared.latency).await;
    }
    if within {
        StatusCode::OK
    } else {
        StatusCode::TOO_MANY_REQUESTS
    }
}

async fn report(State(shared): State<Arc<Shared>>) -> Json<Report> {
    Json(shared.report())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared(limit: u32, window_ms: u64) -> Shared {
        Shared {
            limit,
            window: Duration::from_millis(window_ms),
            latency: Duration::ZERO,
            log: Mutex::new(Log {
                started: Instant::now(),
                recent: VecDeque::new(),
                arrivals: Vec::new(),
                rejected: 0,
            }),
        }
    }

    #[test]
    fn the_report_finds_the_busiest_interval_across_window_boundaries() {
        let s = shared(3, 100);
        {
            let mut log = s.log();
            for ms in [10, 95, 105, 150, 190, 400] {
                log.arrivals.push(Duration::from_millis(ms));
            }
        }
        let report = s.report();
        // 95, 105, 150 and 190 fit in one 100 ms interval that no aligned window holds whole.
        assert_eq!(report.max_in_any_window, 4);
        assert_eq!(report.per_window, vec![3, 2, 0, 1]);
    }

    #[test]
    fn a_call_beyond_the_limit_is_rejected() {
        let s = shared(2, 60_000);
        assert!(s.arrive());
        assert!(s.arrive());
        assert!(!s.arrive());
        assert_eq!(s.report().rejected, 1);
        assert_eq!(s.report().calls, 3);
    }
}
