//! Projections of committed-value queries: which ones a caller may give, and the stages that
//! cut results while keeping what the results are read by (the system fields, the first pass's
//! tag on held candidates, a plain document's copy of itself for its fingerprint). The passes
//! themselves are `repo::query`'s.

use bson::{doc, Bson, Document};

use crate::repo::fields;
use crate::repo::query::{HIDDEN, KNOWN_TAG};

/// Why a projection cannot be used, if it cannot: only inclusions (`1`/`true`) or only
/// exclusions (`0`/`false`) of the caller's own fields; no computed fields, no system fields, and
/// never an excluded `_id` (every result carries its id).
pub(crate) fn projection_problem(projection: &Document) -> Option<String> {
    let mut including = None;
    for (key, value) in projection {
        let name = key.split('.').next().unwrap_or(key);
        if key.is_empty() || key.split('.').any(str::is_empty) || key.starts_with('$') {
            return Some(format!(
                "the projection names `{key}`, which is not a field path"
            ));
        }
        if HIDDEN.contains(&name) || name.starts_with("_mongotx") || fields::ALL.contains(&name) {
            return Some(format!(
                "the projection names `{key}`, a system field (mongotx reads those itself)"
            ));
        }
        let include = match value {
            Bson::Boolean(b) => *b,
            Bson::Int32(1) | Bson::Int64(1) => true,
            Bson::Int32(0) | Bson::Int64(0) => false,
            Bson::Double(d) if *d == 1.0 || *d == 0.0 => *d == 1.0,
            other => {
                return Some(format!(
                    "the projection gives `{key}` the value {other}; use 1 to include a field or 0 to exclude it"
                ))
            }
        };
        if key == "_id" {
            if !include {
                return Some("the projection excludes `_id`; every result carries its id".into());
            }
            continue;
        }
        match including {
            Some(mode) if mode != include => {
                return Some(
                    "the projection mixes inclusions and exclusions; use one or the other".into(),
                )
            }
            _ => including = Some(include),
        }
    }
    None
}

/// Field a projected plain document carries its whole stored self in: its version is a
/// fingerprint of all its fields, not of the projected ones (see `repo::plain`).
pub(crate) const ROOT_TAG: &str = "_mongotx_root";

/// Whether a projection value includes its field (`1`, `true`, `1.0`); [`projection_problem`]
/// has refused every other value but `0`, `false` and `0.0`.
fn includes(value: &Bson) -> bool {
    match value {
        Bson::Boolean(b) => *b,
        Bson::Int32(n) => *n == 1,
        Bson::Int64(n) => *n == 1,
        Bson::Double(d) => *d == 1.0,
        _ => false,
    }
}

/// Whether a checked projection keeps only the fields it names: one that includes a field,
/// `_id` alone included (`{_id: 1}` keeps nothing else, as in the driver), rather than one that
/// drops the fields it names.
fn is_inclusion(projection: &Document) -> bool {
    let mut named = projection.iter().filter(|(key, _)| key.as_str() != "_id");
    match named.next() {
        Some((_, value)) => includes(value),
        // `_id` alone, or nothing: an exclusion of `_id` was refused, so `_id: 1` keeps only it.
        None => projection.contains_key("_id"),
    }
}

/// The stages of a checked projection: a plain document keeps a copy of itself whole (for its
/// fingerprint), then the `$project` (see [`projection_stage`]). An empty projection cuts
/// nothing, as in the driver, and adds no stage.
pub(crate) fn projection_stages(projection: &Document) -> Vec<Document> {
    if projection.is_empty() {
        return Vec::new();
    }
    let plain =
        doc! { "$eq": [{ "$ifNull": [format!("${}", fields::VERSION), Bson::Null] }, Bson::Null] };
    vec![
        // Null for a stamped document (`$$REMOVE` would leave the field out, but not every
        // server knows it); the field is dropped when the row is read.
        doc! { "$addFields": { ROOT_TAG: { "$cond": [plain, "$$ROOT", Bson::Null] } } },
        projection_stage(projection),
    ]
}

/// The `$project` stage of a checked projection: an inclusion keeps the system fields, the
/// first pass's tag and a plain document's copy of itself too, which the results are read by
/// (`{_id: 1}` alone is an inclusion: without them every row would read as a plain document of
/// one field, and a held candidate's holder would be lost); an exclusion drops only the named
/// fields (an `_id: 1` beside them says what the exclusion does anyway, and is left out).
pub(crate) fn projection_stage(projection: &Document) -> Document {
    let mut stage = projection.clone();
    if is_inclusion(projection) {
        for name in fields::ALL.into_iter().chain([KNOWN_TAG, ROOT_TAG]) {
            stage.insert(name, 1);
        }
    } else {
        stage.remove("_id");
    }
    doc! { "$project": stage }
}
