//! Where mongotx keeps its records by default: every collection name the library itself uses,
//! in one place, so that a service can keep its own collections clear of them and every module
//! refuses to open its records in another one's (see `repo::names`).

/// The transaction records (one per transaction in flight), unless
/// [`StoreBuilder::transactions_collection`](crate::StoreBuilder::transactions_collection) names
/// another.
pub const TRANSACTIONS_COLLECTION: &str = "mongotx_transactions";

/// The collection registry: one document per collection a [`Store`](crate::Store) opened, with
/// its version floor (every kind of document it holds: docs/format.md).
pub const META_COLLECTION: &str = "mongotx_meta";

/// The quota providers, one document per provider (or several, its stripes).
pub const PROVIDERS_COLLECTION: &str = "quota_providers";

/// The default collection of OBTs; each OBT collection is a namespace of its own tokens.
pub const OBTS_COLLECTION: &str = "obts";

/// The OBT token counters, one document per namespace.
pub const TOKENS_COLLECTION: &str = "obt_tokens";

/// The default collection of a [`MongoFence`](crate::obt::MongoFence).
pub const FENCES_COLLECTION: &str = "obt_fences";

/// The default collection of rate limiters.
pub const LIMITERS_COLLECTION: &str = "ratelimits";

/// The default collection of batches.
pub const BATCHES_COLLECTION: &str = "batches";

/// The services collection of a collection of batches is named after it with this suffix.
pub const SERVICES_SUFFIX: &str = "_services";

/// The contention record: conflicts and aborts per collection and minute, summed over every
/// instance (see [`StoreBuilder::contention_record`](crate::StoreBuilder::contention_record)).
pub const CONTENTION_COLLECTION: &str = "mongotx_contention";

/// Every default collection with what mongotx keeps there, for the name checks.
const OWN: [(&str, &str); 9] = [
    (TRANSACTIONS_COLLECTION, "the transaction records"),
    (META_COLLECTION, "the collection registry"),
    (PROVIDERS_COLLECTION, "the quota providers"),
    (OBTS_COLLECTION, "the OBTs of the default namespace"),
    (TOKENS_COLLECTION, "the OBT token counters"),
    (FENCES_COLLECTION, "the default OBT fences"),
    (LIMITERS_COLLECTION, "the default rate limiters"),
    (BATCHES_COLLECTION, "the default batches"),
    (CONTENTION_COLLECTION, "the contention record"),
];

/// What the server refuses in any collection name, if anything: empty, a `$` or a NUL
/// character, a leading or trailing `.`, or the `system.` prefix it keeps to itself. The one
/// rule every collection name mongotx takes is checked against (user collections, transaction
/// records, the domain modules' records).
pub(crate) fn server_refuses(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("it is empty")
    } else if name.contains('$') || name.contains('\0') {
        Some("it contains '$' or a NUL character")
    } else if name.starts_with("system.") {
        Some("the system. prefix is reserved by MongoDB")
    } else if name.starts_with('.') || name.ends_with('.') {
        Some("the server refuses a name starting or ending with '.'")
    } else {
        None
    }
}

/// Which of mongotx's default collections `name` is, other than `home`, as a reason to refuse
/// it (for a check made without a store, such as where the transaction records go).
pub(crate) fn kept_elsewhere(name: &str, home: &str) -> Option<String> {
    OWN.iter()
        .find(|(own, _)| *own == name && *own != home)
        .map(|(_, what)| format!("mongotx keeps {what} there"))
}
