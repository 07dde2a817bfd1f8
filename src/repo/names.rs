//! Checks of the names callers give the domain modules (ids, owners, headers, collection names)
//! and how errors show them: one rule set, so that every module refuses the same names the same
//! way.

use crate::repo::meta::META_COLLECTION;
use crate::repo::store::Store;

/// The longest id or name a caller may give (they become document ids and indexed values).
pub(crate) const MAX_NAME: usize = 512;

/// What is wrong with `value` as an id or a name, if anything: empty, longer than [`MAX_NAME`]
/// bytes, or holding a NUL character.
pub(crate) fn name_problem(value: &str) -> Option<String> {
    if value.is_empty() {
        Some("it is empty".into())
    } else if value.len() > MAX_NAME {
        Some(format!(
            "it has {} bytes, more than the {MAX_NAME} allowed",
            value.len()
        ))
    } else if value.contains('\0') {
        Some("it contains a NUL character".into())
    } else {
        None
    }
}

/// `value` for an error message: quoted and escaped (a NUL or a newline stays visible), and cut
/// after 64 characters, since a name refused for its length may be megabytes long.
pub(crate) fn shown(value: &str) -> String {
    const SHOWN: usize = 64;
    match value.char_indices().nth(SHOWN) {
        None => format!("{value:?}"),
        Some((cut, _)) => format!("{:?}... ({} bytes)", &value[..cut], value.len()),
    }
}

/// What is wrong with `name` as the collection of a module's own records, if anything: a name
/// MongoDB refuses, or one where mongotx keeps its transaction records or collection registry
/// (opening the module there would replace their validator).
pub(crate) fn collection_problem(store: &Store, name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("the collection name is empty")
    } else if name.contains('$') || name.contains('\0') {
        Some("a collection name cannot contain '$' or a NUL character")
    } else if name.starts_with("system.") {
        Some("the system. prefix is reserved by MongoDB")
    } else if name == store.transactions_collection() || name == META_COLLECTION {
        Some("mongotx keeps its transaction records or collection registry there")
    } else {
        None
    }
}
