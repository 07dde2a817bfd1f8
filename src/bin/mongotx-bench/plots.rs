//! The network rows as charts (SVG and PNG, with plotters): commit latency against k per protocol
//! mode at each latency, the one-round modes as a ratio to one update (with the floors beside
//! them), and transfer throughput against clients.

use std::path::{Path, PathBuf};

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::network::{AtLatency, CLIENTS, KS, MODES};

/// Gets ready to draw charts into `dir`: the font registered, the directory made.
fn prepare(dir: &Path, font: Option<&Path>) -> Result<(), String> {
    crate::font::load_font(font)?;
    std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))
}

/// Writes the scale rows' charts into `dir` and returns the files written: query cost against
/// held documents, commit latency against k.
pub(crate) fn write_scale(
    dir: &Path,
    font: Option<&Path>,
    run: &crate::scale::ScaleRun,
) -> Result<Vec<PathBuf>, String> {
    prepare(dir, font)?;
    let at = |i: usize| i as f64;
    let held: Vec<String> = run.queries.iter().map(|q| q.held.to_string()).collect();
    let mut written = Vec::new();
    let chart = Chart {
        caption: "a query next to H held documents, / the raw driver's (10,010 documents)".into(),
        x_desc: leak(format!("held documents H: {}", held.join(", "))),
        y_desc: "ratio to raw find; commands per query",
        x_max: at(run.queries.len().saturating_sub(1)),
        log_y: false,
        lines: vec![
            Line {
                label: "find(filter) / raw".into(),
                color: RGBColor(0, 114, 178),
                points: run
                    .queries
                    .iter()
                    .enumerate()
                    .map(|(i, q)| (at(i), q.filter_ratio))
                    .collect(),
            },
            Line {
                label: "find(filter, sort, limit 10) / raw".into(),
                color: RGBColor(0, 158, 115),
                points: run
                    .queries
                    .iter()
                    .enumerate()
                    .map(|(i, q)| (at(i), q.sorted_ratio))
                    .collect(),
            },
            Line {
                label: "commands per query".into(),
                color: VERMILION,
                points: run
                    .queries
                    .iter()
                    .enumerate()
                    .map(|(i, q)| (at(i), q.commands as f64))
                    .collect(),
            },
        ],
    };
    written.extend(chart.render(dir, "scale_queries")?);
    let chart = Chart {
        caption: "commit (the default mode) / one raw update, by k".into(),
        x_desc: "documents per transaction (k)",
        y_desc: "latency / one update",
        x_max: run
            .commits
            .iter()
            .map(|(k, _)| *k as f64)
            .fold(1.0, f64::max),
        log_y: false,
        lines: vec![Line {
            label: "commit / one update".into(),
            color: RGBColor(0, 114, 178),
            points: run
                .commits
                .iter()
                .map(|(k, ratio)| (*k as f64, *ratio))
                .collect(),
        }],
    };
    written.extend(chart.render(dir, "scale_commits")?);
    Ok(written)
}

/// A label built at run time, kept for the life of the process (charts take `&'static str`).
fn leak(text: String) -> &'static str {
    Box::leak(text.into_boxed_str())
}

/// Writes every chart into `dir` and returns the files written.
pub(crate) fn write(
    dir: &Path,
    font: Option<&Path>,
    runs: &[AtLatency],
) -> Result<Vec<PathBuf>, String> {
    prepare(dir, font)?;
    let mut written = Vec::new();
    for at in runs {
        let chart = Chart {
            caption: format!(
                "commit latency vs k, {} ms one-way latency (median)",
                at.one_way_ms
            ),
            x_desc: "documents per transaction (k)",
            y_desc: "median latency (ms, log scale)",
            x_max: KS.iter().copied().max().unwrap_or(1) as f64,
            log_y: true,
            lines: latency_lines(at),
        };
        written.extend(chart.render(dir, &format!("commit_latency_{}ms", at.one_way_ms))?);
        let chart = Chart {
            caption: format!(
                "one-round commit / one update, {} ms one-way latency (median)",
                at.one_way_ms
            ),
            x_desc: "documents per transaction (k)",
            y_desc: "latency / one conditional update",
            x_max: KS.iter().copied().max().unwrap_or(1) as f64,
            log_y: false,
            lines: ratio_lines(at),
        };
        written.extend(chart.render(dir, &format!("commit_ratio_{}ms", at.one_way_ms))?);
    }
    let chart = Chart {
        caption: "2-document transfers per second vs clients".into(),
        x_desc: "clients",
        y_desc: "transfers per second",
        x_max: CLIENTS.iter().copied().max().unwrap_or(1) as f64,
        log_y: false,
        lines: throughput_lines(runs),
    };
    written.extend(chart.render(dir, "transfer_throughput")?);
    Ok(written)
}

/// One line of a chart: its label, colour and points.
struct Line {
    label: String,
    color: RGBColor,
    points: Vec<(f64, f64)>,
}

/// Writes the GC chart into `dir` and returns the files written: transactions cleared per second
/// against the backlog (log axis), one line per place the coordinators died, and the two-runner
/// points beside them.
pub(crate) fn write_gc(
    dir: &Path,
    font: Option<&Path>,
    rows: &[crate::gc::GcRow],
) -> Result<Vec<PathBuf>, String> {
    prepare(dir, font)?;
    let colors = [
        RGBColor(213, 94, 0),
        RGBColor(0, 114, 178),
        RGBColor(0, 158, 115),
    ];
    let log = |n: usize| (n as f64).log10();
    let mut lines: Vec<Line> = Vec::new();
    for (death, color) in crate::gc::Death::ALL.into_iter().zip(colors) {
        for runners in [1, 2] {
            let points: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r.death == death && r.runners == runners)
                .map(|r| (log(r.backlog), r.per_second))
                .collect();
            if points.is_empty() {
                continue;
            }
            let who = if runners == 1 {
                "one runner"
            } else {
                "two runners"
            };
            lines.push(Line {
                label: format!("{}, {who}", death.label()),
                color: if runners == 1 { color } else { lighter(color) },
                points,
            });
        }
    }
    let sizes = crate::gc::SIZES;
    lines.push(Line {
        label: format!("target: {:.0} per second", crate::gc::TARGET),
        color: GREY,
        points: sizes.iter().map(|&n| (log(n), crate::gc::TARGET)).collect(),
    });
    let shown: Vec<String> = sizes.iter().map(|n| n.to_string()).collect();
    let chart = Chart {
        caption: "GC: expired 4-document transactions cleared per second".into(),
        x_desc: leak(format!(
            "expired transactions, log10 scale ({})",
            shown.join(", ")
        )),
        y_desc: "transactions per second",
        x_max: log(sizes[sizes.len() - 1]),
        log_y: false,
        lines,
    };
    chart.render(dir, "gc_throughput")
}

/// `color` halfway to white.
fn lighter(color: RGBColor) -> RGBColor {
    let half = |c: u8| u8::try_from((u16::from(c) + 255) / 2).unwrap_or(255);
    RGBColor(half(color.0), half(color.1), half(color.2))
}

/// Writes the rate limiter's charts into `dir` and returns the files written: reserve and settle
/// as ratios to one conditional update, against calls per window N and against the reservations
/// left outstanding (log axes), with the 2x the issue sets.
pub(crate) fn write_ratelimit(
    dir: &Path,
    font: Option<&Path>,
    rows: &[crate::ratelimit::SizeRow],
) -> Result<Vec<PathBuf>, String> {
    prepare(dir, font)?;
    let mut written = Vec::new();
    let log = |n: f64| n.max(1.0).log10();
    let by_n: Vec<&crate::ratelimit::SizeRow> =
        rows.iter().filter(|r| r.outstanding == 0).collect();
    let largest = rows.iter().map(|r| r.calls).max().unwrap_or(1);
    let by_l: Vec<&crate::ratelimit::SizeRow> =
        rows.iter().filter(|r| r.calls == largest).collect();
    let charts = [
        (
            "rate limiter / one update, by calls per window N (nothing outstanding)",
            "calls per window N, log10 scale",
            "ratelimit_by_calls",
            by_n.iter()
                .map(|r| (log(f64::from(r.calls)), r.reserve, r.settle))
                .collect::<Vec<_>>(),
        ),
        (
            "rate limiter / one update, by reservations outstanding (N = the largest)",
            "granted, unsettled reservations, log10 scale (0 drawn at 1)",
            "ratelimit_by_outstanding",
            by_l.iter()
                .map(|r| (log(r.outstanding as f64), r.reserve, r.settle))
                .collect(),
        ),
    ];
    for (caption, x_desc, stem, points) in charts {
        let x_max = points.iter().map(|p| p.0).fold(1.0, f64::max);
        let chart = Chart {
            caption: caption.into(),
            x_desc,
            y_desc: "latency / one conditional update",
            x_max,
            log_y: false,
            lines: vec![
                Line {
                    label: "reserve (high priority)".into(),
                    color: RGBColor(0, 114, 178),
                    points: points.iter().map(|p| (p.0, p.1)).collect(),
                },
                Line {
                    label: "settle".into(),
                    color: RGBColor(0, 158, 115),
                    points: points.iter().map(|p| (p.0, p.2)).collect(),
                },
                Line {
                    label: "target: 2x".into(),
                    color: GREY,
                    points: points.iter().map(|p| (p.0, 2.0)).collect(),
                },
            ],
        };
        written.extend(chart.render(dir, stem)?);
    }
    Ok(written)
}

/// Writes the quota's chart into `dir` and returns the files written: a consume as a ratio to one
/// conditional update of a bare counter, against the allocations live on the provider (log axis),
/// beside the same update of a document the provider's size, and the 1.3x the issue sets.
pub(crate) fn write_quota(
    dir: &Path,
    font: Option<&Path>,
    rows: &[crate::quota::LiveRow],
) -> Result<Vec<PathBuf>, String> {
    prepare(dir, font)?;
    let log = |n: usize| (n as f64).max(1.0).log10();
    let x_max = rows.iter().map(|r| log(r.live)).fold(1.0, f64::max);
    let chart = Chart {
        caption: "quota consume / one conditional update, by live allocations on the provider"
            .into(),
        x_desc: "live allocations, log10 scale (0 drawn at 1)",
        y_desc: "latency / one conditional update",
        x_max,
        log_y: true,
        lines: vec![
            Line {
                label: "consume (one provider)".into(),
                color: RGBColor(0, 114, 178),
                points: rows.iter().map(|r| (log(r.live), r.consume)).collect(),
            },
            Line {
                label: "update of a document the provider's size".into(),
                color: RGBColor(230, 159, 0),
                points: rows.iter().map(|r| (log(r.live), r.same_size)).collect(),
            },
            Line {
                label: "target: 1.3x".into(),
                color: GREY,
                points: rows.iter().map(|r| (log(r.live), 1.3)).collect(),
            },
        ],
    };
    chart.render(dir, "quota_by_allocations")
}

/// A line chart.
struct Chart {
    caption: String,
    x_desc: &'static str,
    y_desc: &'static str,
    x_max: f64,
    /// A logarithmic y axis (for lines that differ by orders of magnitude).
    log_y: bool,
    lines: Vec<Line>,
}

impl Chart {
    /// Draws the chart as `stem.svg` and `stem.png` in `dir`.
    fn render(&self, dir: &Path, stem: &str) -> Result<Vec<PathBuf>, String> {
        let size = (860, 520);
        let svg = dir.join(format!("{stem}.svg"));
        let png = dir.join(format!("{stem}.png"));
        draw(SVGBackend::new(&svg, size).into_drawing_area(), self)?;
        draw(BitMapBackend::new(&png, size).into_drawing_area(), self)?;
        Ok(vec![svg, png])
    }
}

/// The commit modes charted, in the order of `MODES`, with their labels and colours; the first
/// three return after one round.
const MODE_LINES: [(&str, RGBColor); 4] = [
    (
        "parallel commit, returns before finishing (spread)",
        RGBColor(0, 114, 178),
    ),
    (
        "parallel commit, returns before finishing (one collection)",
        RGBColor(86, 180, 233),
    ),
    (
        "as the first, one command per write (servers before 8.0)",
        RGBColor(230, 159, 0),
    ),
    (
        "parallel commit, finishes first (spread)",
        RGBColor(0, 158, 115),
    ),
];

/// The first `count` modes of [`MODE_LINES`], each median divided by `per`.
fn mode_lines(at: &AtLatency, count: usize, per: f64) -> Vec<Line> {
    MODE_LINES
        .iter()
        .zip(MODES)
        .take(count)
        .map(|(&(label, color), mode)| Line {
            label: label.into(),
            color,
            points: KS
                .iter()
                .filter_map(|&k| at.commit(k, mode).map(|us| (k as f64, us / per)))
                .collect(),
        })
        .collect()
}

/// The floors that were measured (no mongotx at all), each median divided by `per`.
fn floor_lines(at: &AtLatency, per: f64) -> Vec<Line> {
    let floors = [
        (
            &at.floor,
            "floor: k + 1 concurrent driver updates (no mongotx)",
            RGBColor(204, 121, 167),
        ),
        (
            &at.floor_bulk,
            "floor: k updates in one bulkWrite beside 1 update (no mongotx)",
            RGBColor(117, 112, 179),
        ),
    ];
    floors
        .into_iter()
        .filter(|(floor, _, _)| !floor.is_empty())
        .map(|(floor, label, color)| Line {
            label: label.into(),
            color,
            points: floor.iter().map(|(k, us)| (*k as f64, us / per)).collect(),
        })
        .collect()
}

/// A flat line at `y` across every k.
fn level(label: &str, color: RGBColor, y: f64) -> Line {
    Line {
        label: label.into(),
        color,
        points: KS.iter().map(|&k| (k as f64, y)).collect(),
    }
}

const GREY: RGBColor = RGBColor(120, 120, 120);
const VERMILION: RGBColor = RGBColor(213, 94, 0);

/// Every mode, the native equivalent, the floors and one update, in milliseconds.
fn latency_lines(at: &AtLatency) -> Vec<Line> {
    let mut lines = mode_lines(at, MODE_LINES.len(), 1000.0);
    lines.push(Line {
        label: "native transaction equivalent (k + 1 round trips)".into(),
        color: VERMILION,
        points: at
            .native
            .iter()
            .map(|(k, us)| (*k as f64, us / 1000.0))
            .collect(),
    });
    lines.extend(floor_lines(at, 1000.0));
    lines.push(level("one conditional update", GREY, at.update_us / 1000.0));
    lines
}

/// The one-round modes and the floors, each as a ratio to one conditional update, and the target.
fn ratio_lines(at: &AtLatency) -> Vec<Line> {
    let mut lines = mode_lines(at, 3, at.update_us);
    lines.extend(floor_lines(at, at.update_us));
    lines.push(level("target: 1.5x one update", VERMILION, 1.5));
    lines.push(level("one conditional update", GREY, 1.0));
    lines
}

fn throughput_lines(runs: &[AtLatency]) -> Vec<Line> {
    let colors = [
        RGBColor(0, 114, 178),
        RGBColor(213, 94, 0),
        RGBColor(0, 158, 115),
        RGBColor(204, 121, 167),
    ];
    runs.iter()
        .zip(colors.iter().cycle())
        .map(|(at, color)| Line {
            label: format!("{} ms one way", at.one_way_ms),
            color: *color,
            points: at
                .throughput
                .iter()
                .map(|(c, rate, _)| (*c as f64, *rate))
                .collect(),
        })
        .collect()
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, spec: &Chart) -> Result<(), String> {
    let ys = || spec.lines.iter().flat_map(|l| l.points.iter().map(|p| p.1));
    let y_max = ys().fold(0.0_f64, f64::max);
    if spec.log_y {
        let y_min = ys().filter(|y| *y > 0.0).fold(f64::INFINITY, f64::min);
        let range = (y_min * 0.8).max(1e-9)..(y_max * 1.5).max(1e-9);
        plot(root, spec, range.log_scale())
    } else {
        plot(root, spec, 0.0..(y_max * 1.15).max(1e-9))
    }
}

fn plot<DB, Y>(root: DrawingArea<DB, Shift>, spec: &Chart, y: Y) -> Result<(), String>
where
    DB: DrawingBackend,
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let (lines, x_max) = (&spec.lines, spec.x_max);
    let fail = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(fail)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(&spec.caption, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max * 1.05, y)
        .map_err(fail)?;
    chart
        .configure_mesh()
        .x_desc(spec.x_desc)
        .y_desc(spec.y_desc)
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(fail)?;
    for line in lines.iter() {
        let color = line.color;
        chart
            .draw_series(LineSeries::new(
                line.points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(fail)?
            .label(line.label.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart
            .draw_series(
                line.points
                    .iter()
                    .map(|&p| Circle::new(p, 3, color.filled())),
            )
            .map_err(fail)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 13))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(fail)?;
    root.present().map_err(fail)
}
