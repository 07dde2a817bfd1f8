//! Downstream fences, the first of the two fences in the OBT reference design (a storage volume
//! manager's). A resource (a storage node's volume, a host) keeps the highest token it has
//! admitted and refuses any lower one, so once a newer owner has reached it, no call an older
//! owner sends is admitted, however late it arrives. Equal tokens pass: they are the same owner's
//! retries.
//!
//! A fence orders admissions, not effects: a call admitted just before a newer token arrived may
//! still be running. A resource that needs its effects in token order too performs each call's
//! effect while it holds the decision, as [`MemoryFence::admit_then`] does.

use std::collections::HashMap;
use std::sync::Mutex;

use async_trait::async_trait;
use bson::{doc, Document};
use mongodb::Collection;

use crate::collections::FENCES_COLLECTION;
use crate::obt::error::FenceError;
use crate::obt::model::{Token, FENCES_SCHEMA};
use crate::obt::{collection_problem, name_problem, shown};
use crate::repo::error::RepoError;
use crate::repo::format;
use crate::repo::open;
use crate::repo::store::Store;
use crate::retry::LockWait;
use crate::retry::Retry;
use crate::server::is_transient;

/// Admits calls on a resource only in token order.
#[async_trait]
pub trait Fence: Send + Sync {
    /// Admits a call on `resource` carrying `token` if no higher token has been admitted there
    /// (and records it as the highest); otherwise [`FenceError::StaleToken`].
    async fn admit(&self, resource: &str, token: Token) -> Result<(), FenceError>;

    /// The highest token `resource` has admitted, if any.
    async fn seen(&self, resource: &str) -> Result<Option<Token>, FenceError>;
}

/// How a [`MemoryFence`] is named in its errors.
const MEMORY: &str = "memory fence";

/// Refuses a resource name no OBT id could be (empty, over [`MAX_NAME`](crate::fields::MAX_NAME)
/// bytes, with a NUL) in `fence`.
fn check_resource(fence: &str, resource: &str) -> Result<(), FenceError> {
    match name_problem(resource) {
        None => Ok(()),
        Some(problem) => Err(FenceError::Invalid {
            fence: fence.to_string(),
            reason: format!(
                "the resource name {} is unusable: {problem}",
                shown(resource)
            ),
        }),
    }
}

/// Refuses an admission on an unusable resource or with a token no namespace issues.
fn check(fence: &str, resource: &str, token: Token) -> Result<(), FenceError> {
    check_resource(fence, resource)?;
    if token.0 < 1 {
        return Err(FenceError::Invalid {
            fence: fence.to_string(),
            reason: format!(
                "resource {}: token {token} was never issued (tokens start at 1)",
                shown(resource)
            ),
        });
    }
    Ok(())
}

/// A fence kept in this process's memory, for services without a database of their own (a
/// storage node answering RPCs). Its record is lost when the process ends, so a restarted node
/// must not admit calls until it has learned a floor (e.g. the OBT's current token).
#[derive(Debug, Default)]
pub struct MemoryFence {
    seen: Mutex<HashMap<String, Token>>,
}

impl MemoryFence {
    /// An empty fence.
    pub fn new() -> MemoryFence {
        MemoryFence::default()
    }
}

impl MemoryFence {
    /// Admits `token` on `resource` and runs `effect` before any other call on this fence is
    /// decided, so effects happen in admission order: nothing an older owner does can land after
    /// a newer owner's call. Keep `effect` short; it blocks the fence.
    pub fn admit_then<R>(
        &self,
        resource: &str,
        token: Token,
        effect: impl FnOnce() -> R,
    ) -> Result<R, FenceError> {
        check(MEMORY, resource, token)?;
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let highest = seen.entry(resource.to_string()).or_insert(token);
        if *highest > token {
            return Err(FenceError::StaleToken {
                resource: resource.to_string(),
                seen: *highest,
                presented: token,
            });
        }
        *highest = token;
        Ok(effect())
    }
}

#[async_trait]
impl Fence for MemoryFence {
    async fn admit(&self, resource: &str, token: Token) -> Result<(), FenceError> {
        self.admit_then(resource, token, || ())
    }

    async fn seen(&self, resource: &str) -> Result<Option<Token>, FenceError> {
        check_resource(MEMORY, resource)?;
        // A poisoned lock only means another caller panicked mid-admit; the map is still whole.
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        Ok(seen.get(resource).copied())
    }
}

/// A fence kept in MongoDB: one document per resource with the highest token admitted. Each
/// admit is one conditional upsert ("token at most mine"); a higher stored token makes the
/// upsert collide with the existing id, which is the refusal.
///
/// Its documents follow the stored format's rule (see `mongotx::format`): an admit marks the
/// document it writes with the format the store writes (nothing for format 1) and matches only
/// one of a format the store reads, so a document of a newer format collides like a higher
/// token and is refused as such ([`FenceError::Format`]) when the fence reads it.
#[derive(Debug, Clone)]
pub struct MongoFence {
    store: Store,
    coll: Collection<Document>,
}

/// How many times an admit retries after losing a race to create the resource's document.
const CREATE_RACES: usize = 8;

impl MongoFence {
    /// The fence in [`FENCES_COLLECTION`](crate::collections::FENCES_COLLECTION) of `store`'s database.
    pub async fn open(store: &Store) -> Result<MongoFence, FenceError> {
        MongoFence::named(store, FENCES_COLLECTION).await
    }

    /// The fence in collection `name`. Tokens are comparable only within one OBT namespace, so
    /// resources fenced by OBTs of different namespaces need fences of their own.
    ///
    /// Writes and reads use the store's protocol concerns (majority on replica sets): an
    /// admitted token that a failover rolled back would let a lower one in.
    ///
    /// A collection name MongoDB refuses, or one that holds something else (the OBTs of the
    /// default namespace, the token counters, the transaction records, the collection registry),
    /// is [`FenceError::Invalid`], before anything is created.
    pub async fn named(store: &Store, name: &str) -> Result<MongoFence, FenceError> {
        if let Some(reason) = collection_problem(store, name, FENCES_COLLECTION) {
            return Err(FenceError::Invalid {
                fence: shown(name),
                reason: format!("cannot keep a fence there: {reason}"),
            });
        }
        let coll = open::validated_protocol_collection(store, name, FENCES_SCHEMA)
            .await
            .map_err(|e| RepoError::database(name, "*", "open", e))?;
        Ok(MongoFence {
            store: store.clone(),
            coll,
        })
    }

    fn db_error(
        &self,
        resource: &str,
        operation: &'static str,
        e: mongodb::error::Error,
    ) -> FenceError {
        RepoError::database(self.coll.name(), resource, operation, e).into()
    }
}

/// Pauses between retries of a fence's first upsert after a race: 2 ms doubling to 64 ms.
const RACE_PACE: LockWait = LockWait {
    max_wait: std::time::Duration::MAX,
    initial_backoff: std::time::Duration::from_millis(2),
    max_backoff: std::time::Duration::from_millis(64),
};

pub(crate) fn is_duplicate_key(e: &mongodb::error::Error) -> bool {
    crate::server::codes::error_code(e) == Some(crate::server::codes::DUPLICATE_KEY)
}

#[async_trait]
impl Fence for MongoFence {
    async fn admit(&self, resource: &str, token: Token) -> Result<(), FenceError> {
        check(self.coll.name(), resource, token)?;
        let writes = self.store.writes_format().await?;
        let filter = format::guard(
            doc! { "_id": resource, "token": { "$lte": token.0 } },
            self.store.reads_format(),
        );
        let update = format::mark_update(doc! { "$set": { "token": token.0 } }, writes);
        let mut last = None;
        let mut pace = Retry::until_deadline(RACE_PACE);
        for attempt in 0..CREATE_RACES {
            if attempt > 0 {
                pace.pause().await;
            }
            let written = self
                .coll
                .update_one(filter.clone(), update.clone())
                .upsert(true)
                .await;
            match written {
                Ok(_) => return Ok(()),
                Err(e) if is_duplicate_key(&e) => {
                    // Either a higher token is stored, or a document of a newer format (refused
                    // by the look), or another admit created the document between our filter
                    // and our insert: look.
                    match self.seen(resource).await? {
                        Some(seen) if seen > token => {
                            return Err(FenceError::StaleToken {
                                resource: resource.to_string(),
                                seen,
                                presented: token,
                            })
                        }
                        _ => continue,
                    }
                }
                Err(e) if is_transient(&e) => {
                    // Admitting is idempotent for the same token: send it again.
                    tracing::debug!(resource, error = %e, "fence: admit send failed, resending");
                    last = Some(e);
                }
                Err(e) => return Err(self.db_error(resource, "admit", e)),
            }
        }
        Err(match last {
            Some(e) => self.db_error(resource, "admit", e),
            None => FenceError::Invalid {
                fence: self.coll.name().to_string(),
                reason: format!("resource {resource}: kept losing the race to create its fence"),
            },
        })
    }

    async fn seen(&self, resource: &str) -> Result<Option<Token>, FenceError> {
        check_resource(self.coll.name(), resource)?;
        let found = self
            .coll
            .find_one(doc! { "_id": resource })
            .await
            .map_err(|e| self.db_error(resource, "read", e))?;
        if let Some(found) = &found {
            format::check_doc(found, self.store.reads_format(), self.coll.name())?;
        }
        Ok(found.and_then(|d| d.get_i64("token").ok()).map(Token))
    }
}
