//! The font the tools' charts (the benchmark's and the soak's, drawn with plotters) write their
//! text in: plotters draws text only with a registered TrueType font, and none ships with it.
//!
//! Included with `#[path]` by each binary that draws charts.

use std::path::{Path, PathBuf};

use plotters::style::{register_font, FontStyle};

/// Where a TrueType font for the charts' text is usually found.
pub(crate) const FONTS: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

/// Registers the font (`font`, or the first of [`FONTS`] found) as the charts' sans-serif.
pub(crate) fn load_font(font: Option<&Path>) -> Result<(), String> {
    let path = match font {
        Some(path) => path.to_path_buf(),
        None => FONTS
            .iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .ok_or_else(|| format!("no TrueType font found (looked for {FONTS:?}; pass --font)"))?,
    };
    let bytes = std::fs::read(&path).map_err(|e| format!("read {}: {e}", path.display()))?;
    // plotters keeps the font for the life of the process.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| format!("{} is not a usable TrueType font", path.display()))
}
