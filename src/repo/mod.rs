//! The repository layer: typed collections of stamped documents.
//!
//! Data flows through it in this order: a [`Store`] holds the database handle and the settings
//! every repository shares (lock waits, durability, the server clock); a [`CollectionSpec`] names a
//! collection, its schema version, its upgrade steps and its JSON Schema; a [`Repository`] reads and
//! writes the collection's documents, each stamped with the system fields in [`fields`].
//!
//! Inside, one idea per module: `schema` validates documents against MongoDB's `$jsonSchema`
//! dialect; `changes` builds updates and increments; `ids` compares ids as the server does; `hold`
//! defines how a document held by a transaction describes itself and what it means; `resolve`
//! resolves one held document; `query` evaluates queries on committed values; `meta` keeps the
//! registry of managed collections and their version floors; `write` is one conditional write as
//! data. The layer never names the transaction layer: the store is handed a [`HoldResolver`]
//! (by default [`RecordResolver`], which reads transaction records) for the one thing it cannot
//! decide alone, a holder's outcome.

pub(crate) mod changes;
pub(crate) mod collection;
pub(crate) mod error;
pub mod fields;
pub(crate) mod hold;
pub(crate) mod ids;
pub(crate) mod meta;
pub(crate) mod names;
pub(crate) mod query;
pub(crate) mod repository;
pub(crate) mod resolve;
pub(crate) mod schema;
pub(crate) mod staging;
pub(crate) mod store;
pub(crate) mod write;
