//! `mongotx quota`, `limiter`, `queue` and `obt`: the coordination modules' state, read with
//! their `inspect` functions, which open nothing and write nothing. One file each under
//! `coordination/`; what they share for printing (instants, durations, flags) is here.

mod limiter;
mod obt;
mod queue;
mod quota;

use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};

pub(crate) use limiter::{run as limiter, Args as LimiterArgs};
pub(crate) use obt::{run as obt, Args as ObtArgs};
pub(crate) use queue::{run as queue, Args as QueueArgs};
pub(crate) use quota::{run as quota, Args as QuotaArgs};

/// An instant as printed: RFC 3339, milliseconds, UTC.
pub(crate) fn instant(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// A duration in milliseconds for people: `850ms`, `4.2s`, `4m 59s`, `2h 3m`, `3d 4h`.
pub(crate) fn span(ms: u64) -> String {
    let s = ms / 1000;
    match ms {
        0..=999 => format!("{ms}ms"),
        1_000..=59_999 => format!("{}.{}s", s, (ms % 1000) / 100),
        60_000..=3_599_999 => format!("{}m {}s", s / 60, s % 60),
        3_600_000..=86_399_999 => format!("{}h {}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d {}h", s / 86_400, (s % 86_400) / 3600),
    }
}

/// `at` relative to `now`: `in 4.2s` or `12.3s ago`.
pub(crate) fn relative(at: DateTime<Utc>, now: DateTime<Utc>) -> String {
    let ms = (at - now).num_milliseconds();
    let abs = ms.unsigned_abs();
    if ms >= 0 {
        format!("in {}", span(abs))
    } else {
        format!("{} ago", span(abs))
    }
}

/// `at` printed with how far it is from `now`: `2026-11-30T12:00:05.123Z (in 4.2s)`.
pub(crate) fn instant_from(at: DateTime<Utc>, now: DateTime<Utc>) -> String {
    format!("{} ({})", instant(at), relative(at, now))
}

/// A duration as printed by [`span`].
pub(crate) fn duration(d: Duration) -> String {
    span(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// `n` and the word for it: `1 call`, `2 calls`.
pub(crate) fn count(n: impl Into<u64>, one: &str) -> String {
    match n.into() {
        1 => format!("1 {one}"),
        n => format!("{n} {one}s"),
    }
}

/// A library error in one line, for the command's one-line failures.
pub(crate) fn one_line(error: impl std::fmt::Display) -> String {
    crate::cli::one_line(&error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_read_as_people_write_them() {
        assert_eq!(span(850), "850ms");
        assert_eq!(span(4_250), "4.2s");
        assert_eq!(span(299_000), "4m 59s");
        assert_eq!(span(7_380_000), "2h 3m");
        assert_eq!(span(273_600_000), "3d 4h");
        let now = DateTime::<Utc>::from_timestamp_millis(1_000_000).unwrap();
        let later = DateTime::<Utc>::from_timestamp_millis(1_004_200).unwrap();
        assert_eq!(relative(later, now), "in 4.2s");
        assert_eq!(relative(now, later), "4.2s ago");
    }
}
