//! Reading the server's answer out of a driver error: its error code, the index a duplicate key
//! hit, and which rule a server-side validator applied. Every layer uses these, and the probe
//! and the clock below them, so they sit in a file of their own that imports nothing of the
//! crate.

use bson::{Bson, Document};

/// Error code MongoDB uses for a duplicate key.
pub(crate) const DUPLICATE_KEY: i32 = 11000;
/// Error code MongoDB uses when the user lacks a privilege the command needs (`Unauthorized`).
pub(crate) const UNAUTHORIZED: i32 = 13;
/// Error code MongoDB uses when a server-side validator rejects a document.
pub(crate) const VALIDATION_FAILED: i32 = 121;

/// The server error code inside a driver error, if any.
pub(crate) fn error_code(error: &mongodb::error::Error) -> Option<i32> {
    use mongodb::error::{ErrorKind, WriteFailure};
    match error.kind.as_ref() {
        ErrorKind::Write(WriteFailure::WriteError(e)) => Some(e.code),
        ErrorKind::Write(WriteFailure::WriteConcernError(e)) => Some(e.code),
        ErrorKind::Command(e) => Some(e.code),
        ErrorKind::InsertMany(e) => e
            .write_errors
            .as_ref()
            .and_then(|errors| errors.first().map(|w| w.code)),
        _ => None,
    }
}

/// The name of the index a duplicate-key error names (`_id_` for the id), if it can be read.
pub(crate) fn duplicate_key_index(error: &mongodb::error::Error) -> Option<String> {
    use mongodb::error::{ErrorKind, WriteFailure};
    let message = match error.kind.as_ref() {
        ErrorKind::Write(WriteFailure::WriteError(e)) => e.message.as_str(),
        ErrorKind::Command(e) => e.message.as_str(),
        _ => return None,
    };
    let rest = message.split("index: ").nth(1)?;
    Some(rest.split_whitespace().next()?.to_string())
}

/// The field and rule a server's validation failure (code 121) names, from its explanation
/// (`errInfo.details`, MongoDB 5.0+): the first property that failed, followed through nested
/// objects and array items, with the rule it broke. `None` when the error is not a validation
/// failure; `("(document)", ...)` when the server gave no details (before 5.0).
pub(crate) fn validation_failure(error: &mongodb::error::Error) -> Option<(String, String)> {
    use mongodb::error::{ErrorKind, WriteFailure};
    if error_code(error) != Some(VALIDATION_FAILED) {
        return None;
    }
    let info = match error.kind.as_ref() {
        ErrorKind::Write(WriteFailure::WriteError(e)) => e.details.as_ref(),
        _ => None,
    };
    let explained = info
        .and_then(|info| info.get_document("details").ok())
        .and_then(|details| explain(details, ""));
    Some(explained.unwrap_or_else(|| {
        (
            "(document)".to_string(),
            "Document failed validation (the server gave no details)".to_string(),
        )
    }))
}

/// [`validation_failure`] for one entry of a write command's `writeErrors` (a statement of a
/// command run whole, whose reply the driver does not turn into an error).
pub(crate) fn validation_failure_in(write_error: &Document) -> Option<(String, String)> {
    let code = match write_error.get("code") {
        Some(Bson::Int32(code)) => Some(*code),
        Some(Bson::Int64(code)) => i32::try_from(*code).ok(),
        _ => None,
    };
    if code != Some(VALIDATION_FAILED) {
        return None;
    }
    let explained = write_error
        .get_document("errInfo")
        .ok()
        .and_then(|info| info.get_document("details").ok())
        .and_then(|details| explain(details, ""));
    Some(explained.unwrap_or_else(|| {
        (
            "(document)".to_string(),
            "Document failed validation (the server gave no details)".to_string(),
        )
    }))
}

fn joined(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

fn shown(prefix: &str) -> String {
    if prefix.is_empty() {
        "(document)".to_string()
    } else {
        prefix.to_string()
    }
}

/// One operator's explanation: `$jsonSchema` and the logical operators lead to the rules.
fn explain(details: &Document, prefix: &str) -> Option<(String, String)> {
    let operator = details.get_str("operatorName").unwrap_or("");
    match operator {
        "$jsonSchema" => rules(details.get_array("schemaRulesNotSatisfied").ok()?, prefix),
        "$and" | "$or" => {
            let clauses: Vec<&Document> = details
                .get_array("clausesNotSatisfied")
                .ok()?
                .iter()
                .filter_map(|c| c.as_document()?.get_document("details").ok())
                .collect();
            // A `$jsonSchema` clause says the most (mongotx's validator is `$or` of the tombstone
            // and fence branches and the schema).
            let best = clauses
                .iter()
                .find(|c| c.get_str("operatorName").ok() == Some("$jsonSchema"))
                .or_else(|| clauses.first())?;
            explain(best, prefix)
        }
        _ => Some((shown(prefix), describe(details))),
    }
}

fn rules(failed: &[Bson], prefix: &str) -> Option<(String, String)> {
    let first = failed.iter().filter_map(Bson::as_document).next()?;
    rule(first, prefix)
}

fn rule(rule: &Document, prefix: &str) -> Option<(String, String)> {
    if let Ok(properties) = rule.get_array("propertiesNotSatisfied") {
        let property = properties.iter().filter_map(Bson::as_document).next()?;
        let name = property.get_str("propertyName").unwrap_or("?");
        let at = joined(prefix, name);
        return match property.get_array("details") {
            Ok(inner) => rules(inner, &at).or(Some((at, describe(rule)))),
            Err(_) => Some((at, describe(rule))),
        };
    }
    if let Ok(missing) = rule.get_array("missingProperties") {
        let name = missing.first().and_then(Bson::as_str).unwrap_or("?");
        return Some((joined(prefix, name), "is required".to_string()));
    }
    if let Ok(extra) = rule.get_array("additionalProperties") {
        let name = extra.first().and_then(Bson::as_str).unwrap_or("?");
        return Some((
            joined(prefix, name),
            "is not allowed (additionalProperties)".to_string(),
        ));
    }
    if let (Ok(index), Ok(inner)) = (rule.get_i32("itemIndex"), rule.get_array("details")) {
        let at = joined(prefix, &index.to_string());
        return rules(inner, &at).or(Some((at, describe(rule))));
    }
    if let Ok(schemas) = rule.get_array("schemasNotSatisfied") {
        if let Some(inner) = schemas
            .iter()
            .filter_map(Bson::as_document)
            .find_map(|s| s.get_array("details").ok())
        {
            if let Some(found) = rules(inner, prefix) {
                return Some(found);
            }
        }
    }
    Some((shown(prefix), describe(rule)))
}

/// A rule in words: its keyword, what it specified and why it failed.
fn describe(rule: &Document) -> String {
    let operator = rule.get_str("operatorName").unwrap_or("rule");
    let mut text = operator.to_string();
    if let Ok(specified) = rule.get_document("specifiedAs") {
        text.push_str(&format!(" {specified}"));
    }
    if let Ok(reason) = rule.get_str("reason") {
        text.push_str(&format!(": {reason}"));
    }
    if let Some(value) = rule.get("consideredValue") {
        text.push_str(&format!(" (found {value})"));
    }
    text
}
