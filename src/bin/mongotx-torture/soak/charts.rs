//! The soak's samples as charts (SVG and PNG, with plotters, as the benchmark draws its own): resident
//! memory per process, p99 per operation and the collections' sizes, each against the minutes of
//! the run. `mongotx-torture soak-charts --samples FILE --out-dir DIR` draws them from any run's
//! `samples.jsonl`; a soak draws its own into its `--out` directory at the end.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::Args;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;

use super::sample::{self, Sample};

/// Arguments of `soak-charts`.
#[derive(Debug, Args)]
pub(crate) struct ChartArgs {
    /// A soak run's samples (its `--out` directory's `samples.jsonl`).
    #[arg(long)]
    samples: PathBuf,
    /// Where to write `soak_rss`, `soak_p99` and `soak_collections` (each `.svg` and `.png`).
    #[arg(long, default_value = "tools/bench-results")]
    out_dir: PathBuf,
    /// A TrueType font for the text (DejaVu Sans is looked for by default).
    #[arg(long)]
    font: Option<PathBuf>,
}

/// `soak-charts`: draws the charts of a samples file.
pub(crate) fn run(args: ChartArgs) -> Result<(), String> {
    let samples = sample::read(&args.samples)?;
    for path in write(&samples, &args.out_dir, args.font.as_deref())? {
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// One line of a chart.
struct Line {
    label: String,
    points: Vec<(f64, f64)>,
}

/// Writes the three charts into `dir`, each as SVG and PNG; returns their paths.
pub(crate) fn write(
    samples: &[Sample],
    dir: &Path,
    font: Option<&Path>,
) -> Result<Vec<PathBuf>, String> {
    crate::font::load_font(font)?;
    std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let minutes = |s: &Sample| s.t / 60.0;
    let lines = |names: BTreeSet<String>, value: &dyn Fn(&Sample, &str) -> Option<f64>| {
        names
            .into_iter()
            .map(|name| Line {
                points: samples
                    .iter()
                    .filter_map(|s| value(s, &name).map(|v| (minutes(s), v)))
                    .collect(),
                label: name,
            })
            .filter(|l| !l.points.is_empty())
            .collect::<Vec<_>>()
    };
    let rss = lines(
        samples
            .iter()
            .flat_map(|s| s.rss_kib.keys().cloned())
            .collect(),
        &|s, name| s.rss_kib.get(name).map(|kib| *kib as f64 / 1024.0),
    );
    let p99 = lines(
        samples
            .iter()
            .flat_map(|s| s.latency.keys().cloned())
            .collect(),
        &|s, name| s.latency.get(name).map(|w| w.p99_us as f64 / 1000.0),
    );
    // The journal holds thousands of entries and would flatten the rest.
    let counted = samples
        .iter()
        .flat_map(|s| s.count.keys().cloned())
        .filter(|name| name != "transfers")
        .collect();
    let counts = lines(counted, &|s, name| s.count.get(name).map(|n| *n as f64));
    let charts = [
        ("soak_rss", "resident memory per process", "MiB", false, rss),
        (
            "soak_p99",
            "p99 per operation, per window",
            "ms (log)",
            true,
            p99,
        ),
        (
            "soak_collections",
            "system collections (the bank's journal, thousands, left out)",
            "documents",
            false,
            counts,
        ),
    ];
    let x_max = samples.last().map_or(1.0, minutes).max(0.1);
    let mut written = Vec::new();
    for (file, caption, y_desc, log_y, lines) in charts {
        let svg = dir.join(format!("{file}.svg"));
        let root = SVGBackend::new(&svg, (1000, 560)).into_drawing_area();
        draw(root, caption, y_desc, log_y, x_max, &lines)?;
        // A PNG beside it, as the benchmark's charts: viewers that show no SVG show that.
        let png = dir.join(format!("{file}.png"));
        let root = BitMapBackend::new(&png, (1000, 560)).into_drawing_area();
        draw(root, caption, y_desc, log_y, x_max, &lines)?;
        written.extend([svg, png]);
    }
    Ok(written)
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    caption: &str,
    y_desc: &str,
    log_y: bool,
    x_max: f64,
    lines: &[Line],
) -> Result<(), String> {
    let ys = || lines.iter().flat_map(|l| l.points.iter().map(|p| p.1));
    let y_max = ys().fold(0.0_f64, f64::max);
    if log_y {
        let y_min = ys().filter(|y| *y > 0.0).fold(f64::INFINITY, f64::min);
        let range = (y_min * 0.8).max(1e-3)..(y_max * 1.5).max(1e-2);
        plot(root, caption, y_desc, x_max, lines, range.log_scale())
    } else {
        let range = 0.0..(y_max * 1.15).max(1.0);
        plot(root, caption, y_desc, x_max, lines, range)
    }
}

/// Colours told apart by most readers (Okabe and Ito), then greys.
const COLORS: [RGBColor; 10] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(117, 112, 179),
    RGBColor(0, 0, 0),
    RGBColor(120, 120, 120),
    RGBColor(180, 180, 60),
];

fn plot<DB, Y>(
    root: DrawingArea<DB, Shift>,
    caption: &str,
    y_desc: &str,
    x_max: f64,
    lines: &[Line],
    y: Y,
) -> Result<(), String>
where
    DB: DrawingBackend,
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let fail = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(fail)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .right_y_label_area_size(0)
        .build_cartesian_2d(0.0..x_max * 1.02, y)
        .map_err(fail)?;
    chart
        .configure_mesh()
        .x_desc("minutes")
        .y_desc(y_desc)
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(fail)?;
    for (i, line) in lines.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        // Past the palette, dashes would be better; a thinner stroke at least tells them apart.
        let width = if i < COLORS.len() { 2 } else { 1 };
        chart
            .draw_series(LineSeries::new(
                line.points.iter().copied(),
                color.stroke_width(width),
            ))
            .map_err(fail)?
            .label(line.label.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(width))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 12))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(fail)?;
    root.present().map_err(fail)
}
