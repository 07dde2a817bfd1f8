//! Latencies a child process measures for the soak run (`soak`): each operation's durations,
//! printed every `--latency-every` as one line per operation,
//!
//! ```text
//! latencies <op> <µs> <µs> ...
//! ```
//!
//! every duration of the window since the last line, so that the parent pools the windows of
//! every process doing the same operation and takes exact percentiles of them (percentiles of
//! several processes' percentiles would not be). A window holds a few thousand values at most,
//! a line of some tens of kilobytes. Without the flag nothing is recorded or printed: the torture
//! run and the tests that start these roles see the lines they always saw.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Every duration in µs of the current window, per operation.
type Window = BTreeMap<&'static str, Vec<u64>>;

/// The durations of a window, per operation; a no-op when the process was not asked for them.
#[derive(Clone, Default)]
pub(crate) struct Latencies {
    window: Option<Arc<Mutex<Window>>>,
}

impl Latencies {
    /// Records and prints every `every` when given; otherwise does nothing at all.
    pub(crate) fn every(every: Option<Duration>) -> Latencies {
        let Some(every) = every else {
            return Latencies::default();
        };
        let latencies = Latencies {
            window: Some(Arc::default()),
        };
        let printer = latencies.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                printer.flush();
            }
        });
        latencies
    }

    /// Records that `op` took since `started`.
    pub(crate) fn since(&self, op: &'static str, started: Instant) {
        if let Some(window) = &self.window {
            let us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
            if let Ok(mut window) = window.lock() {
                window.entry(op).or_default().push(us);
            }
        }
    }

    /// Prints the window's lines now and starts a new window (a value measured once per
    /// incarnation, say, goes out before the process can be killed).
    pub(crate) fn flush(&self) {
        let Some(window) = &self.window else {
            return;
        };
        let taken = match window.lock() {
            Ok(mut window) => std::mem::take(&mut *window),
            Err(_) => return,
        };
        let mut out = std::io::stdout().lock();
        for (op, values) in taken.into_iter().filter(|(_, v)| !v.is_empty()) {
            let mut line = format!("latencies {op}");
            for v in values {
                line.push(' ');
                line.push_str(&v.to_string());
            }
            let _ = writeln!(out, "{line}");
        }
        let _ = out.flush();
    }
}

/// The `latencies` line's operation and values, or `None` for any other line.
pub(crate) fn parse_line(line: &str) -> Option<(String, Vec<u64>)> {
    let mut words = line.strip_prefix("latencies ")?.split_whitespace();
    let op = words.next()?.to_string();
    Some((op, words.filter_map(|w| w.parse().ok()).collect()))
}
