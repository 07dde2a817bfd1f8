//! The repository layer: typed collections of stamped documents.
//!
//! Data flows through it in this order: a [`Store`] holds the database handle and the settings
//! every repository shares (lock waits, durability, the server clock); a [`CollectionSpec`] names a
//! collection, its schema version, its upgrade steps and its JSON Schema; a [`Repository`] reads and
//! writes the collection's documents, each stamped with the system fields in [`fields`].
//!
//! # Layout
//!
//! Three layers; a module imports only from its own layer and the ones before it, never in a
//! cycle:
//!
//! 1. **Base pieces**, one idea per module: [`fields`] names the system fields; `ids` compares ids
//!    as the server does; `schema` validates documents against MongoDB's `$jsonSchema` dialect;
//!    `changes` builds updates and increments; `collection` defines a collection; `outcome` is
//!    what a holder's record says and why a hold could not be resolved; `error` is the
//!    repository's error type; `meta` keeps the registry of managed collections and their version
//!    floors; `store` is the [`Store`], its settings and the seam to the transaction layer;
//!    `names` checks the names callers give the domain modules; `plain` stamps a plain document
//!    (one without system fields, see [`fields`] for what makes one and its fingerprint)
//!    conditionally on its content; `contention` counts conflicts and aborts per collection and
//!    writes them, now and then, to the contention record (and reads it back).
//! 2. **The hold protocol**, in `hold/`: how a document held by a transaction describes itself,
//!    how anyone resolves it, how a staging transaction is decided, and the conditional writes
//!    (tombstones included) all of that uses.
//! 3. **The CRUD layer**: `repository` reads and writes documents by id, with its input checks in
//!    `checks` and, in `write_path`, the conditional write loop that waits for or resolves the
//!    holds it meets; `query` evaluates queries on committed values (`projection` cuts their
//!    results) and `find` runs them; `open` opens collections (definition checks, indexes,
//!    validators); `adopt` stamps a collection's plain documents in batches (explicit adoption).
//!
//! The layer never names the transaction layer: the store is handed a [`HoldResolver`]
//! (by default [`RecordResolver`], which reads transaction records) for the one thing it cannot
//! decide alone, a holder's outcome.
//!
//! [`Store`]: store::Store
//! [`CollectionSpec`]: collection::CollectionSpec
//! [`Repository`]: repository::Repository
//! [`HoldResolver`]: store::HoldResolver
//! [`RecordResolver`]: store::RecordResolver

pub(crate) mod adopt;
pub(crate) mod background;
pub(crate) mod changes;
pub(crate) mod checks;
pub(crate) mod collection;
pub(crate) mod contention;
pub(crate) mod error;
pub mod fields;
pub(crate) mod find;
pub(crate) mod format;
pub(crate) mod hold;
pub(crate) mod ids;
pub(crate) mod meta;
pub(crate) mod names;
pub(crate) mod open;
pub(crate) mod outcome;
pub(crate) mod plain;
pub(crate) mod projection;
pub(crate) mod query;
pub(crate) mod repository;
pub(crate) mod schema;
pub(crate) mod store;
pub(crate) mod write_path;
