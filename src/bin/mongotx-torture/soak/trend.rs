//! The trend rules a soak run is judged by, on its samples (no I/O):
//!
//! - **memory**: the resident memory of each long-lived process must not grow through the
//!   second half of the run by more than [`RSS_SHARE`] of its level there or [`RSS_FLOOR_KIB`],
//!   whichever is larger;
//! - **collections**: every judged series of [`sample::count_collections`] likewise, by more than
//!   [`DOCS_SHARE`] of its level or [`DOCS_FLOOR`] documents;
//! - **latency**: the p99 of an operation must not rise by more than [`P99_RISE`] from the first
//!   third of the run to the last, unless both are under [`P99_FLOOR_US`].
//!
//! "Grow through the second half" is the least-squares slope over the samples of the second
//! half, times the half's length: a line fitted through them, not the last sample against the
//! first, so that one busy moment (a GC pass, a batch of adopted documents) at either end is not
//! a trend, while a steady leak of any size is. A third's p99 is the median of its windows' p99s,
//! over windows with at least [`MIN_OPS`] operations; with fewer than [`MIN_WINDOWS`] such
//! windows in either third the operation is not judged (said so, not failed).
//!
//! [`sample::count_collections`]: super::sample::count_collections

use std::collections::BTreeSet;

use super::sample::Sample;

/// Memory growth through the second half allowed, as a share of the level there.
pub(crate) const RSS_SHARE: f64 = 0.20;
/// Memory growth through the second half always allowed (an allocator's arenas, a pool's
/// connections opened late).
pub(crate) const RSS_FLOOR_KIB: f64 = 16.0 * 1024.0;
/// Collection growth through the second half allowed, as a share of the level there.
pub(crate) const DOCS_SHARE: f64 = 0.20;
/// Collection growth through the second half always allowed (the records of the transactions
/// in flight, tombstones within their retention, open batches come and go by tens).
pub(crate) const DOCS_FLOOR: f64 = 100.0;
/// The rise of an operation's p99 from the first third to the last allowed.
pub(crate) const P99_RISE: f64 = 0.50;
/// Below this in both thirds a p99 is not judged: a rise from 2 to 4 ms is noise on a loaded
/// machine, not a trend.
pub(crate) const P99_FLOOR_US: f64 = 20_000.0;
/// Windows of an operation needed in each third for it to be judged.
pub(crate) const MIN_WINDOWS: usize = 3;
/// Operations a window needs for its p99 to count.
pub(crate) const MIN_OPS: u64 = 5;

/// Processes whose memory is reported but not judged: the soak itself holds the API and ledger
/// simulators, whose logs of every call and batch grow by design.
const RSS_NOT_JUDGED: [&str; 1] = ["soak"];
/// Series counted but not judged: an instance's announcement in the registry is kept a day after
/// its last renewal when it is not retracted, and every killed process leaves one (by design:
/// the gate must not forget an instance that may still be running an older build); the bank's
/// journal is the rig's data, not mongotx's, and holds the last 20 s of transfers, so its size
/// follows the transfer rate (lower while the kills keep workers starting).
const COUNT_NOT_JUDGED: [&str; 2] = ["mongotx_meta.instances", "transfers"];

/// What the rules found.
#[derive(Debug, Default)]
pub(crate) struct Verdict {
    /// Broken rules, each naming its series.
    pub(crate) failures: Vec<String>,
    /// Series not judged, and why.
    pub(crate) notes: Vec<String>,
}

/// Judges `samples` (in time order).
pub(crate) fn judge(samples: &[Sample]) -> Verdict {
    let mut verdict = Verdict::default();
    let names = |get: &dyn Fn(&Sample) -> Vec<String>| -> BTreeSet<String> {
        samples.iter().flat_map(get).collect()
    };
    for name in names(&|s| s.rss_kib.keys().cloned().collect()) {
        if RSS_NOT_JUDGED.contains(&name.as_str()) {
            continue;
        }
        let points = series(samples, |s| s.rss_kib.get(&name).map(|v| *v as f64));
        if let Some(g) = second_half_growth(&points) {
            let bound = (RSS_SHARE * g.level).max(RSS_FLOOR_KIB);
            if g.growth > bound {
                verdict.failures.push(format!(
                    "memory of {name} grew {:.1} MiB through the second half (from about {:.1} MiB; bound {:.1} MiB)",
                    g.growth / 1024.0,
                    g.level / 1024.0,
                    bound / 1024.0
                ));
            }
        }
    }
    for name in names(&|s| s.count.keys().cloned().collect()) {
        if COUNT_NOT_JUDGED.contains(&name.as_str()) {
            continue;
        }
        let points = series(samples, |s| s.count.get(&name).map(|v| *v as f64));
        if let Some(g) = second_half_growth(&points) {
            let bound = (DOCS_SHARE * g.level).max(DOCS_FLOOR);
            if g.growth > bound {
                verdict.failures.push(format!(
                    "collection series {name} grew by {:.0} documents through the second half (from about {:.0}; bound {bound:.0})",
                    g.growth, g.level
                ));
            }
        }
    }
    for op in names(&|s| s.latency.keys().cloned().collect()) {
        let points = series(samples, |s| {
            s.latency
                .get(&op)
                .filter(|w| w.n >= MIN_OPS)
                .map(|w| w.p99_us as f64)
        });
        match p99_thirds(samples, &points) {
            None => verdict.notes.push(format!(
                "p99 of {op} not judged: fewer than {MIN_WINDOWS} windows of {MIN_OPS} operations or more in the first or last third"
            )),
            Some((first, last)) => {
                if last > first * (1.0 + P99_RISE) && last >= P99_FLOOR_US {
                    verdict.failures.push(format!(
                        "p99 of {op} rose from {:.1} ms in the first third to {:.1} ms in the last (bound +{:.0} %)",
                        first / 1000.0,
                        last / 1000.0,
                        P99_RISE * 100.0
                    ));
                }
            }
        }
    }
    verdict
}

/// `(t, value)` of every sample that has a value.
fn series(samples: &[Sample], value: impl Fn(&Sample) -> Option<f64>) -> Vec<(f64, f64)> {
    samples
        .iter()
        .filter_map(|s| value(s).map(|v| (s.t, v)))
        .collect()
}

/// How much a series grows through the second half of the run, and its level there.
#[derive(Debug)]
struct Growth {
    /// Fitted slope times the half's length.
    growth: f64,
    /// The mean over the half.
    level: f64,
}

/// The least-squares growth over the points of the second half of `points`' time span; `None`
/// with fewer than three points there.
fn second_half_growth(points: &[(f64, f64)]) -> Option<Growth> {
    let (first, last) = (points.first()?.0, points.last()?.0);
    let middle = (first + last) / 2.0;
    let half: Vec<(f64, f64)> = points.iter().copied().filter(|p| p.0 >= middle).collect();
    if half.len() < 3 {
        return None;
    }
    let n = half.len() as f64;
    let (mean_t, mean_v) = (
        half.iter().map(|p| p.0).sum::<f64>() / n,
        half.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let spread: f64 = half.iter().map(|p| (p.0 - mean_t).powi(2)).sum();
    if spread <= 0.0 {
        return None;
    }
    let slope = half
        .iter()
        .map(|p| (p.0 - mean_t) * (p.1 - mean_v))
        .sum::<f64>()
        / spread;
    Some(Growth {
        growth: slope * (last - middle),
        level: mean_v,
    })
}

/// The median p99 of the first and the last third of the run (thirds of the samples' whole time
/// span, so that an operation missing at the start is not judged on a shorter run of its own).
fn p99_thirds(samples: &[Sample], points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let (start, end) = (samples.first()?.t, samples.last()?.t);
    let third = (end - start) / 3.0;
    let median_of = |keep: &dyn Fn(f64) -> bool| -> Option<f64> {
        let mut values: Vec<f64> = points.iter().filter(|p| keep(p.0)).map(|p| p.1).collect();
        if values.len() < MIN_WINDOWS {
            return None;
        }
        values.sort_by(f64::total_cmp);
        Some(values[values.len() / 2])
    };
    Some((
        median_of(&|t| t <= start + third)?,
        median_of(&|t| t >= end - third)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::super::sample::Window;
    use super::*;

    /// 60 samples 10 s apart: `rss` (KiB), `count` and `p99` (µs) of each given by its index.
    fn run(
        rss: impl Fn(usize) -> u64,
        count: impl Fn(usize) -> u64,
        p99: impl Fn(usize) -> u64,
    ) -> Vec<Sample> {
        (0..60)
            .map(|i| {
                let mut s = Sample {
                    t: i as f64 * 10.0,
                    ..Sample::default()
                };
                s.rss_kib.insert("gc-0".into(), rss(i));
                s.rss_kib.insert("soak".into(), 10_000 + 5_000 * i as u64);
                s.count.insert("records".into(), count(i));
                s.count
                    .insert("mongotx_meta.instances".into(), 1_000 * i as u64);
                s.latency.insert(
                    "transfer.commit".into(),
                    Window {
                        n: 50,
                        p50_us: p99(i) / 4,
                        p99_us: p99(i),
                    },
                );
                s
            })
            .collect()
    }

    /// Noise that a flat series shows on a busy machine: up and down by `amplitude`.
    fn noisy(base: u64, amplitude: u64, i: usize) -> u64 {
        base + (i as u64 * 7919 % 13) * amplitude / 12
    }

    #[test]
    fn flat_noisy_series_pass_and_the_growth_by_design_is_not_judged() {
        let samples = run(
            |i| noisy(40_000, 3_000, i),
            |i| noisy(10, 40, i),
            |i| noisy(30_000, 15_000, i),
        );
        let verdict = judge(&samples);
        assert!(verdict.failures.is_empty(), "{:?}", verdict.failures);
        assert!(verdict.notes.is_empty(), "{:?}", verdict.notes);
    }

    #[test]
    fn memory_growing_through_the_second_half_fails_naming_the_process() {
        // Flat for the first half, then 1 MiB a sample: 30 MiB over the half, well over the
        // 16 MiB floor and 20 % of about 55 MiB.
        let leak = |i: usize| 40_000 + 1024 * i.saturating_sub(30) as u64;
        let verdict = judge(&run(leak, |_| 5, |_| 30_000));
        assert_eq!(verdict.failures.len(), 1, "{:?}", verdict.failures);
        assert!(verdict.failures[0].contains("memory of gc-0"));
        // Growth in the first half only (a warm-up) is no trend.
        let warm_up = |i: usize| 40_000 + 1024 * i.min(30) as u64;
        assert!(judge(&run(warm_up, |_| 5, |_| 30_000)).failures.is_empty());
        // Under the floor: 8 MiB over the half.
        let small = |i: usize| 40_000 + 280 * i as u64;
        assert!(judge(&run(small, |_| 5, |_| 30_000)).failures.is_empty());
    }

    #[test]
    fn a_collection_growing_through_the_second_half_fails() {
        let verdict = judge(&run(|_| 40_000, |i| 20 + 10 * i as u64, |_| 30_000));
        assert_eq!(verdict.failures.len(), 1, "{:?}", verdict.failures);
        assert!(verdict.failures[0].contains("series records"));
    }

    #[test]
    fn a_p99_rising_by_more_than_half_fails_unless_both_thirds_are_under_the_floor() {
        let rising = |i: usize| 30_000 + 1_000 * i as u64;
        let verdict = judge(&run(|_| 40_000, |_| 5, rising));
        assert_eq!(verdict.failures.len(), 1, "{:?}", verdict.failures);
        assert!(verdict.failures[0].contains("p99 of transfer.commit"));
        // The same shape under the floor: 2 to 5 ms.
        let small = |i: usize| 2_000 + 50 * i as u64;
        assert!(judge(&run(|_| 40_000, |_| 5, small)).failures.is_empty());
        // A rise of 40 %: within the bound.
        let mild = |i: usize| 30_000 + 200 * i as u64;
        assert!(judge(&run(|_| 40_000, |_| 5, mild)).failures.is_empty());
    }

    #[test]
    fn an_operation_with_too_few_windows_is_noted_not_judged() {
        let mut samples = run(|_| 40_000, |_| 5, |_| 30_000);
        for s in samples.iter_mut().skip(5) {
            s.latency.get_mut("transfer.commit").unwrap().n = 1;
        }
        let verdict = judge(&samples);
        assert!(verdict.failures.is_empty());
        assert_eq!(verdict.notes.len(), 1);
    }

    #[test]
    fn least_squares_growth_of_a_line_is_its_rise_over_the_half() {
        let points: Vec<(f64, f64)> = (0..=10).map(|i| (i as f64, 3.0 * i as f64)).collect();
        let g = second_half_growth(&points).unwrap();
        assert!((g.growth - 15.0).abs() < 1e-9, "{g:?}");
        assert!(second_half_growth(&points[..3]).is_none());
    }
}
