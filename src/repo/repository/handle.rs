//! What a [`Repository`] is made of, and the values it reads ([`Stamped`]); the repository's
//! methods are all in `repository/mod.rs`.

use std::collections::BTreeSet;
use std::marker::PhantomData;
use std::ops::Deref;
use std::sync::Arc;

use bson::{oid::ObjectId, Bson, Document};
use mongodb::Collection;

use crate::repo::changes::{Adjust, Update};
use crate::repo::collection::CollectionSpec;
use crate::repo::fields::{self};
use crate::repo::schema::BsonType;
use crate::repo::store::Store;
use crate::retry::LockWait;
use crate::retry::Retry;
use crate::server::codes;

/// A document as read: the caller's value plus its id, version and schema version.
#[derive(Debug, Clone, PartialEq)]
pub struct Stamped<T> {
    /// The document's `_id`.
    pub id: Bson,
    /// The version read: pass it to the next write as the expected version. For a plain document
    /// (stored without system fields) it is a fingerprint of its content, a negative number no
    /// stamped document has: a write at it goes through only while the content is unchanged, and
    /// stamps the document (see [`is_plain`](Stamped::is_plain)).
    pub version: i64,
    /// The schema version the document was stored with (before any in-memory upgrade); for a
    /// plain document, the one its collection declares for plain documents.
    pub stored_schema_version: i64,
    /// The caller's value (upgraded to the current schema version).
    pub value: T,
}

impl<T> Deref for Stamped<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T> Stamped<T> {
    /// Whether the document was read without system fields (written by something other than
    /// mongotx, or before the collection was adopted): its version is then a fingerprint of its
    /// content, and its first write stamps it.
    pub fn is_plain(&self) -> bool {
        fields::is_plain_version(self.version)
    }

    /// The caller's value, dropping the stamp.
    pub fn into_inner(self) -> T {
        self.value
    }
}

/// A typed collection of stamped documents.
///
/// ```no_run
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct Account { #[serde(rename = "_id")] id: String, balance: i64 }
/// # async fn demo(accounts: mongotx::Repository<Account>) -> Result<(), mongotx::RepoError> {
/// use mongotx::{Adjust, Query, RepoError};
///
/// let alice = accounts.get("alice").await?;
/// match accounts.adjust("alice", alice.version, &Adjust::new().by("balance", -5_i64)).await {
///     Ok(version) => println!("now at version {version}"),
///     Err(RepoError::VersionConflict { actual, .. }) => println!("changed meanwhile: {actual}"),
///     Err(other) => return Err(other),
/// }
/// let _rich = accounts
///     .find(Query::new().filter(bson::doc! { "balance": { "$gt": 100_i64 } }).limit(10))
///     .await?;
/// # Ok(()) }
/// ```
pub struct Repository<T> {
    pub(in crate::repo) store: Store,
    pub(in crate::repo) spec: Arc<CollectionSpec>,
    pub(in crate::repo) coll: Collection<Document>,
    pub(in crate::repo) id_types: Arc<BTreeSet<BsonType>>,
    pub(in crate::repo) _type: PhantomData<fn() -> T>,
}

impl<T> Clone for Repository<T> {
    fn clone(&self) -> Self {
        Repository {
            store: self.store.clone(),
            spec: Arc::clone(&self.spec),
            coll: self.coll.clone(),
            id_types: Arc::clone(&self.id_types),
            _type: PhantomData,
        }
    }
}

impl<T> std::fmt::Debug for Repository<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Repository")
            .field("collection", &self.spec.name())
            .field("schema_version", &self.spec.schema_version())
            .finish()
    }
}

/// The change a conditional write applies.
pub(in crate::repo) enum Change<'a> {
    Update(&'a Update),
    Adjust(&'a Adjust),
    Replace(Document),
    Delete,
}

/// Waiting for holders, paced and bounded by the store's lock-wait policy.
pub(in crate::repo) struct Waiter {
    pub(in crate::repo) retry: Retry,
    pub(in crate::repo) last_holder: Option<ObjectId>,
}

impl Waiter {
    pub(in crate::repo) fn new(policy: LockWait) -> Waiter {
        Waiter {
            retry: Retry::until_deadline(policy),
            last_holder: None,
        }
    }
}

impl Change<'_> {
    pub(in crate::repo) fn verb(&self) -> &'static str {
        match self {
            Change::Update(_) => "update",
            Change::Adjust(_) => "adjust",
            Change::Replace(_) => "replace",
            Change::Delete => "delete",
        }
    }
}

/// The index a duplicate-key error names, when it is not the `_id` index.
pub(in crate::repo) fn other_index(error: &mongodb::error::Error) -> Option<String> {
    codes::duplicate_key_index(error).filter(|index| index != "_id_")
}
