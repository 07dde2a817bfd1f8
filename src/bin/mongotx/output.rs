//! Printing a report: `field: value` lines for people, one JSON object with `--json`.

use serde::Serialize;

use crate::Context;

/// Prints `report` as JSON when `--json` is set, else the lines `text` gives for it.
pub(crate) fn print<T: Serialize>(
    ctx: &Context,
    report: &T,
    text: impl FnOnce(&T) -> Vec<String>,
) -> Result<(), String> {
    if ctx.json {
        let json = serde_json::to_string_pretty(report)
            .map_err(|e| format!("cannot print the report as JSON: {e}"))?;
        println!("{json}");
    } else {
        for line in text(report) {
            println!("{line}");
        }
    }
    Ok(())
}

/// The lines of a report that prints itself (`Display`): the `text` argument of [`print`] for
/// the reports of `mongotx::admin`.
pub(crate) fn lines<T: std::fmt::Display>(report: &T) -> Vec<String> {
    report.to_string().lines().map(String::from).collect()
}
