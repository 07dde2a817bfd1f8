//! Checks of the names callers give the domain modules (ids, owners, headers, collection names)
//! and how errors show them: one rule set, so that every module refuses the same names the same
//! way.

use crate::collections::{kept_elsewhere, server_refuses};
use crate::repo::store::Store;

use crate::repo::fields::MAX_NAME;

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

/// The longest namespace (`database.collection`) the server takes for a sharded collection.
const MAX_NAMESPACE: usize = 235;

/// What is wrong with `name` as the collection where a module keeps its records, if anything:
/// what [`server_refuses`], a namespace longer than a sharded cluster takes, or a collection
/// where mongotx keeps something else (the store's transaction records, or one of the
/// `OWN` defaults other than `home`, the calling module's own), whose
/// validator opening it would replace.
pub(crate) fn collection_problem(store: &Store, name: &str, home: &str) -> Option<String> {
    if let Some(reason) = server_refuses(name) {
        return Some(reason.to_string());
    }
    let database = store.database().name();
    let namespace = database.len() + 1 + name.len();
    if namespace > MAX_NAMESPACE {
        return Some(format!(
            "{database}.{name} has {namespace} bytes, more than the {MAX_NAMESPACE} a namespace may have"
        ));
    }
    if name == store.transactions_collection() && name != home {
        return Some("mongotx keeps the transaction records there".into());
    }
    kept_elsewhere(name, home)
}
