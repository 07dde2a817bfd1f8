//! The user's handle on transactions: [`Transactions`] begins them and reruns bodies on retryable
//! errors; a [`Transaction`] stages actions and commits them (the protocol itself is in
//! `committer`).

use std::future::Future;
use std::sync::{Arc, Mutex};

use bson::{Bson, Document};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::Instrument;

use crate::collections::{kept_elsewhere, server_refuses, TRANSACTIONS_COLLECTION};
use crate::repo::changes::{self, Adjust, Update};
use crate::repo::checks;
use crate::repo::contention;
use crate::repo::error::{show_id, RepoError};
use crate::repo::fields::{self, SystemFields};
use crate::repo::hold::resolve::Committed;
use crate::repo::ids;
use crate::repo::plain;
use crate::repo::repository::Repository;
use crate::repo::store::Store;
use crate::retry::Retry;
use crate::txn::committer::Committer;
use crate::txn::error::TxnError;
use crate::txn::failpoint::Faults;
use crate::txn::observe::{self, CommitReport};
pub use crate::txn::options::{Finish, Outcome, TxnOptions, Written};
use crate::txn::recovery::Env;
use crate::txn::stamps;
use crate::txn::worklist::{keep_order, undo_for, Entry, Op, PathValue};

/// Begins and runs transactions on one store. Cheap to clone.
///
/// ```no_run
/// # async fn demo(accounts: mongotx::Repository<serde_json::Value>, store: mongotx::Store)
/// # -> Result<(), mongotx::TxnError> {
/// use mongotx::{Adjust, Transactions};
///
/// let txns = Transactions::new(&store);
/// txns.run(|tx| {
///     let accounts = accounts.clone();
///     async move {
///         let a = accounts.get("alice").await?;
///         let b = accounts.get("bob").await?;
///         tx.adjust(&accounts, "alice", a.version, &Adjust::new().by("balance", -25_i64)).await?;
///         tx.adjust(&accounts, "bob", b.version, &Adjust::new().by("balance", 25_i64)).await?;
///         Ok(())
///     }
/// })
/// .await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Transactions {
    pub(crate) store: Store,
    pub(crate) env: Env,
    pub(crate) options: Arc<TxnOptions>,
}

impl Transactions {
    /// Transactions on `store` with default options.
    pub fn new(store: &Store) -> Transactions {
        Transactions::with_options(store, TxnOptions::default())
    }

    /// Transactions on `store` with `options`.
    pub fn with_options(store: &Store, options: TxnOptions) -> Transactions {
        Transactions {
            env: Env {
                store: store.clone(),
                faults: Faults::new(options.faults.clone()),
            },
            store: store.clone(),
            options: Arc::new(options),
        }
    }

    /// The options in force.
    pub fn options(&self) -> &TxnOptions {
        &self.options
    }

    /// A new, empty transaction.
    pub fn begin(&self) -> Transaction {
        Transaction {
            txns: self.clone(),
            staged: Arc::new(Mutex::new(Staged::default())),
        }
    }

    /// Refuses options and a store that cannot work (see [`TxnOptions::validate`]), before
    /// anything is read or written.
    pub(crate) fn usable(&self) -> Result<(), TxnError> {
        self.options.validate()?;
        check_records_collection(
            "transactions_collection",
            self.store.transactions_collection(),
        )
    }

    /// Runs `body` on a fresh transaction and commits what it staged; reruns both on retryable
    /// errors (conflicts, holds, expiry) with jittered backoff until `options.retry.max_wait`
    /// has passed. The body gets a handle to stage on; it must not commit it itself.
    pub async fn run<R, F, Fut>(&self, body: F) -> Result<(R, Outcome), TxnError>
    where
        F: FnMut(Transaction) -> Fut,
        Fut: Future<Output = Result<R, TxnError>>,
    {
        let span = observe::run_span();
        let (result, attempts) = self.attempts(body).instrument(span.clone()).await;
        observe::run_ended(&span, attempts, &result);
        result
    }

    /// The retry loop of [`run`](Transactions::run); also returns how many attempts it made.
    async fn attempts<R, F, Fut>(&self, mut body: F) -> (Result<(R, Outcome), TxnError>, u32)
    where
        F: FnMut(Transaction) -> Fut,
        Fut: Future<Output = Result<R, TxnError>>,
    {
        // Refused before the body runs: no attempt could ever commit.
        if let Err(e) = self.usable() {
            return (Err(e), 0);
        }
        let mut retry = Retry::until_deadline(self.options.retry);
        loop {
            let attempts = retry.pauses() + 1;
            let tx = self.begin();
            let result = match body(tx.clone()).await {
                Ok(value) => tx.commit().await.map(|outcome| (value, outcome)),
                Err(e) => Err(e),
            };
            match result {
                Err(e) if e.is_retryable() => {
                    if retry.exhausted() {
                        let gave_up = TxnError::GaveUp {
                            attempts,
                            elapsed: retry.elapsed(),
                            last: Box::new(e),
                        };
                        return (Err(gave_up), attempts);
                    }
                    tracing::debug!(attempts, error = %e, "retrying transaction");
                    observe::run_retry();
                    retry.pause().await;
                }
                other => return (other, attempts),
            }
        }
    }
}

/// A transaction being staged: add actions, then [`commit`](Transaction::commit). Clones are
/// handles on the same transaction. Once `commit` has been called on any of them, every handle
/// refuses to stage or commit again ([`TxnError::Closed`]): a change staged after the commit took
/// its entries would otherwise be dropped without a word, and a second commit would report an
/// empty success for changes that were never written.
#[derive(Debug, Clone)]
pub struct Transaction {
    txns: Transactions,
    staged: Arc<Mutex<Staged>>,
}

/// What a transaction has staged so far.
#[derive(Debug, Default)]
struct Staged {
    entries: Vec<Entry>,
    /// What the entries take in the record, as [`entry_size`] counts them.
    bytes: usize,
    /// `commit` was called: nothing more may be staged or committed.
    sealed: bool,
}

/// The most the entries of one record may take: a MongoDB document holds at most 16 MiB, and the
/// record needs room for its other fields, a GC runner's claim and the command around it.
pub(crate) const RECORD_ENTRIES_LIMIT: usize = 16 * 1024 * 1024 - 64 * 1024;

/// What `entry` adds to the record: its serialized size plus its array element's type byte,
/// index key and terminator.
fn entry_size(entry: &Entry) -> Result<usize, RepoError> {
    bson::to_vec(entry)
        .map(|bytes| bytes.len() + 8)
        .map_err(|e| RepoError::Encode {
            collection: entry.coll.clone(),
            reason: e.to_string(),
        })
}

impl Transaction {
    /// How many documents are staged.
    pub fn len(&self) -> usize {
        self.staged().entries.len()
    }

    /// Whether nothing is staged.
    pub fn is_empty(&self) -> bool {
        self.staged().entries.is_empty()
    }

    fn staged(&self) -> std::sync::MutexGuard<'_, Staged> {
        // Never held across an await; a panic while staging leaves a usable list.
        self.staged.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Refuses to go on once `commit` was called (checked first, so that a closed transaction
    /// reads nothing; `push` checks again for a commit that came meanwhile).
    fn open(&self, action: impl FnOnce() -> String) -> Result<(), TxnError> {
        if self.staged().sealed {
            return Err(TxnError::Closed { action: action() });
        }
        Ok(())
    }

    /// Stages the insert of a new document; returns its id (generated if the value has none).
    pub async fn insert<T>(&self, repo: &Repository<T>, value: &T) -> Result<Bson, TxnError>
    where
        T: Serialize + DeserializeOwned + Send + Sync,
    {
        self.open(|| format!("stage an insert into {}", repo.name()))?;
        self.same_database(repo)?;
        let (id, doc) = repo.prepare_insert(value)?;
        let shown = show_id(&id);
        let version = repo.first_version(&shown).await?;
        let mut check = doc.clone();
        checks::stamp(repo, &mut check, version);
        checks::validate(repo, &shown, &check)?;
        self.push(Entry {
            coll: repo.name().to_string(),
            id: id.clone(),
            expected: 0,
            applied: version,
            schema: repo.spec().schema_version(),
            op: Op::Insert { doc },
        })?;
        Ok(id)
    }

    /// Stages setting and unsetting fields of the document at `expected_version`.
    pub async fn update<T>(
        &self,
        repo: &Repository<T>,
        id: impl Into<Bson>,
        expected_version: i64,
        update: &Update,
    ) -> Result<(), TxnError>
    where
        T: Serialize + DeserializeOwned + Send + Sync,
    {
        let id = id.into();
        let shown = show_id(&id);
        self.open(|| format!("stage an update of {}/{shown}", repo.name()))?;
        checks::check_update(repo, &shown, update)?;
        self.stage_change(
            repo,
            id,
            expected_version,
            |doc| update.apply_to(doc).map_err(|v| repo.invalid(&shown, v)),
            |stored| Op::Update {
                set: pairs(update.sets()),
                unset: update.unsets().to_vec(),
                undo: keep_order(
                    undo_for(stored, update.paths()),
                    stored,
                    update.unsets().iter().map(String::as_str),
                ),
            },
        )
        .await
    }

    /// Stages numeric increments of the document at `expected_version`.
    pub async fn adjust<T>(
        &self,
        repo: &Repository<T>,
        id: impl Into<Bson>,
        expected_version: i64,
        adjust: &Adjust,
    ) -> Result<(), TxnError>
    where
        T: Serialize + DeserializeOwned + Send + Sync,
    {
        let id = id.into();
        let shown = show_id(&id);
        self.open(|| format!("stage an adjust of {}/{shown}", repo.name()))?;
        checks::check_adjust(repo, &shown, adjust)?;
        self.stage_change(
            repo,
            id,
            expected_version,
            // The stored value is the one the apply will meet (the apply is conditional on its
            // version), so an increment that cannot be added is refused here, before anything
            // is written, whatever the server would do with it.
            |doc| match checks::increment_refused(repo, &shown, adjust, doc) {
                Some(refused) => Err(refused),
                None => adjust.apply_to(doc).map_err(|v| repo.invalid(&shown, v)),
            },
            |stored| Op::Adjust {
                inc: pairs(adjust.increments()),
                undo: undo_for(stored, adjust.increments().iter().map(|(p, _)| p.as_str())),
            },
        )
        .await
    }

    /// Stages a field-level change, already checked, of the document at `expected`: as `op` on a
    /// document in the current shape, or as a rewrite (`apply` to its upgraded form) on an older one.
    /// `apply` runs on a copy of the stored document either way, so a change that cannot be
    /// applied to it is refused before anything is written.
    async fn stage_change<T>(
        &self,
        repo: &Repository<T>,
        id: Bson,
        expected: i64,
        apply: impl FnOnce(&mut Document) -> Result<(), RepoError>,
        op: impl FnOnce(&Document) -> Op,
    ) -> Result<(), TxnError>
    where
        T: Serialize + DeserializeOwned + Send + Sync,
    {
        self.same_database(repo)?;
        let shown = show_id(&id);
        checks::check_write(repo, &id, expected)?;
        let applied = next_version(repo, &id, expected)?;
        let (stored, sys) = read_for_change(repo, &id, &shown, expected).await?;
        // A plain document the schema refuses cannot be stamped as it is: the change rewrites it
        // whole (and must leave it valid), in the apply itself.
        let refused_plain = sys.plain && plain::refusal(repo.spec(), &stored).is_err();
        let op = if sys.schema_version < repo.spec().schema_version() || refused_plain {
            let mut post = repo.upgrade(&shown, stored.clone(), sys.schema_version)?;
            apply(&mut post)?;
            // A plain document is stamped first and changed at the version after its stamp.
            let checked = if fields::is_plain_version(expected) {
                crate::repo::fields::FIRST_VERSION + 1
            } else {
                applied
            };
            rewrite(repo, &shown, checked, post, stored)?
        } else {
            apply(&mut stored.clone())?;
            op(&stored)
        };
        self.push(Entry {
            coll: repo.name().to_string(),
            id,
            expected,
            applied,
            schema: repo.spec().schema_version(),
            op,
        })
    }

    /// Stages the deletion of the document at `expected_version` (a tombstone once committed).
    pub fn delete<T>(
        &self,
        repo: &Repository<T>,
        id: impl Into<Bson>,
        expected_version: i64,
    ) -> Result<(), TxnError>
    where
        T: Serialize + DeserializeOwned + Send + Sync,
    {
        let id = id.into();
        self.open(|| format!("stage a delete of {}/{}", repo.name(), show_id(&id)))?;
        self.same_database(repo)?;
        checks::check_write(repo, &id, expected_version)?;
        let applied = next_version(repo, &id, expected_version)?;
        self.push(Entry {
            coll: repo.name().to_string(),
            id,
            expected: expected_version,
            applied,
            schema: repo.spec().schema_version(),
            op: Op::Delete,
        })
    }

    /// Stages a check: the document must still be at `expected_version` at commit, and is held
    /// unchanged until the transaction ends (read validation).
    pub fn check<T>(
        &self,
        repo: &Repository<T>,
        id: impl Into<Bson>,
        expected_version: i64,
    ) -> Result<(), TxnError>
    where
        T: Serialize + DeserializeOwned + Send + Sync,
    {
        let id = id.into();
        self.open(|| format!("stage a check of {}/{}", repo.name(), show_id(&id)))?;
        self.same_database(repo)?;
        checks::check_write(repo, &id, expected_version)?;
        self.push(Entry {
            coll: repo.name().to_string(),
            id,
            expected: expected_version,
            applied: expected_version,
            schema: repo.spec().schema_version(),
            op: Op::Check,
        })
    }

    /// Stages a guard: at the commit point document `id` must match `condition` (equality on
    /// user fields, e.g. `{"owner": "api-2", "token": 17_i64}`), whatever its version, and it is
    /// held unchanged until the transaction ends, so nothing changes it in between. Unlike
    /// [`check`](Transaction::check), changes of other fields before the commit do not fail it.
    /// A document that no longer matches fails the commit with
    /// [`RepoError::ConditionFailed`]; a missing one with [`RepoError::NotFound`].
    pub fn guard<T>(
        &self,
        repo: &Repository<T>,
        id: impl Into<Bson>,
        condition: Document,
    ) -> Result<(), TxnError>
    where
        T: Serialize + DeserializeOwned + Send + Sync,
    {
        let id = id.into();
        self.open(|| format!("stage a guard on {}/{}", repo.name(), show_id(&id)))?;
        self.same_database(repo)?;
        checks::check_id(repo, &id)?;
        let invalid = |reason: String| RepoError::InvalidQuery {
            collection: repo.name().to_string(),
            reason,
        };
        if condition.is_empty() {
            return Err(invalid("a guard needs at least one field".into()).into());
        }
        for (path, value) in &condition {
            if path.is_empty() || path.starts_with('$') || fields::is_system_path(path) {
                return Err(
                    invalid(format!("a guard names user fields by path, not {path:?}")).into(),
                );
            }
            // The condition joins the apply's filter: an `_id` in it would replace the filter's
            // own and put the guard's hold on another document than the one staged.
            if path == "_id" || path.starts_with("_id.") {
                return Err(invalid(format!(
                    "a guard is on the document it is staged for; it cannot name {path:?}"
                ))
                .into());
            }
            // A path the filter and the commit's own check could read differently (an empty
            // component, an array position) would make the guard mean two things.
            if let Some(reason) = changes::path_problem(path) {
                return Err(invalid(format!("guard path {path:?}: {reason}")).into());
            }
            // Values the server would not compare for plain equality: operators, arrays (which
            // match any element), patterns and code.
            let operator = match value {
                Bson::Document(d) => d.keys().any(|k| k.starts_with('$')),
                Bson::Array(_)
                | Bson::RegularExpression(_)
                | Bson::JavaScriptCode(_)
                | Bson::JavaScriptCodeWithScope(_) => true,
                _ => false,
            };
            if operator {
                return Err(invalid(format!(
                    "a guard compares {path} for equality with a plain value, not {value}"
                ))
                .into());
            }
        }
        self.push(Entry {
            coll: repo.name().to_string(),
            id,
            expected: 0,
            applied: 0,
            schema: repo.spec().schema_version(),
            op: Op::Guard { condition },
        })
    }

    /// Refuses a repository whose documents live in another database than the transaction's
    /// record: the protocol resolves holds through records of the document's own database.
    fn same_database<T>(&self, repo: &Repository<T>) -> Result<(), TxnError>
    where
        T: Serialize + DeserializeOwned + Send + Sync,
    {
        let expected = self.txns.store.database().name();
        let database = repo.store().database().name();
        let same_records =
            repo.store().transactions_collection() == self.txns.store.transactions_collection();
        if database == expected && same_records {
            // The commit stamps plain documents it meets, which needs their collection's spec.
            self.txns.store.remember_spec(repo.spec_arc());
            return Ok(());
        }
        Err(TxnError::ForeignRepository {
            collection: repo.name().to_string(),
            database: if same_records {
                database.to_string()
            } else {
                format!(
                    "{database} (transaction records in {})",
                    repo.store().transactions_collection()
                )
            },
            expected: expected.to_string(),
        })
    }

    fn push(&self, entry: Entry) -> Result<(), TxnError> {
        let size = entry_size(&entry)?;
        let mut staged = self.staged();
        if staged.sealed {
            return Err(TxnError::Closed {
                action: format!("stage a change of {}/{}", entry.coll, show_id(&entry.id)),
            });
        }
        if staged
            .entries
            .iter()
            .any(|e| e.coll == entry.coll && ids::same(&e.id, &entry.id))
        {
            return Err(TxnError::DuplicateEntry {
                collection: entry.coll,
                id: show_id(&entry.id),
            });
        }
        // Refused here rather than at commit: a record the server cannot store would fail the
        // round after its applies were sent, and they would have to be rolled back.
        let bytes = staged.bytes.saturating_add(size);
        if bytes > RECORD_ENTRIES_LIMIT {
            return Err(TxnError::TooLarge {
                collection: entry.coll,
                id: show_id(&entry.id),
                entries: staged.entries.len() + 1,
                bytes,
                limit: RECORD_ENTRIES_LIMIT,
            });
        }
        staged.bytes = bytes;
        staged.entries.push(entry);
        Ok(())
    }

    /// Commits: all staged changes become visible together, or none does. Options or a store
    /// that cannot work are refused first ([`TxnError::InvalidOptions`]) and leave the
    /// transaction as it was; otherwise this handle and its clones are closed for good, whatever
    /// the outcome ([`TxnError::Closed`] for a second commit). Committing nothing succeeds and
    /// writes nothing (`Outcome::txn` is `None`).
    pub async fn commit(self) -> Result<Outcome, TxnError> {
        self.txns.usable()?;
        let entries = {
            let mut staged = self.staged();
            if staged.sealed {
                return Err(TxnError::Closed {
                    action: "commit".to_string(),
                });
            }
            staged.sealed = true;
            staged.bytes = 0;
            std::mem::take(&mut staged.entries)
        };
        let report = CommitReport::start(&entries, self.txns.options.finish);
        let txns = &self.txns;
        let result = async {
            let entries = stamps::stamp_plain(&txns.store, entries).await?;
            let committer = Committer {
                store: &txns.store,
                env: &txns.env,
                options: &txns.options,
            };
            committer.commit_entries(entries).await
        }
        .instrument(report.span())
        .await;
        report.ended(&result);
        result
    }
}

/// Reads the committed value of the document a field-level change is staged on, refusing what
/// can never succeed. The undo is taken from the committed value: the apply lands only on the
/// document at `expected`, whose committed content is unique, whatever holds it meanwhile.
async fn read_for_change<T>(
    repo: &Repository<T>,
    id: &Bson,
    shown: &str,
    expected: i64,
) -> Result<(Document, SystemFields), TxnError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    let not_found = || RepoError::NotFound {
        collection: repo.name().to_string(),
        id: shown.to_string(),
    };
    let stored = repo.read_raw(id, shown).await?.ok_or_else(not_found)?;
    let committed = match repo.committed(shown, stored).await? {
        Committed::Live(doc) => doc,
        Committed::Deleted(version) => {
            return Err(RepoError::Deleted {
                collection: repo.name().to_string(),
                id: shown.to_string(),
                version,
            }
            .into())
        }
        Committed::Absent => return Err(not_found().into()),
    };
    let sys = repo.system_fields(shown, &committed)?;
    if sys.schema_version > repo.spec().schema_version() {
        return Err(repo.too_new(shown, sys.schema_version).into());
    }
    if sys.version != expected {
        contention::conflict(repo.store(), repo.name(), id);
        return Err(RepoError::VersionConflict {
            collection: repo.name().to_string(),
            id: shown.to_string(),
            expected,
            actual: sys.version,
        }
        .into());
    }
    Ok((committed, sys))
}

/// The version a change of the document at `expected` leaves: refused for the one version that
/// has no successor (no document reaches it, and the addition would overflow).
fn next_version<T>(repo: &Repository<T>, id: &Bson, expected: i64) -> Result<i64, RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    expected
        .checked_add(1)
        .ok_or_else(|| RepoError::InvalidVersion {
            collection: repo.name().to_string(),
            id: show_id(id),
            version: expected,
        })
}

/// Refuses a name the transaction records (or a GC) cannot use: one MongoDB refuses, or one where
/// mongotx keeps something else (the registry of collections, a domain module's records).
pub(crate) fn check_records_collection(option: &'static str, name: &str) -> Result<(), TxnError> {
    let reason = match server_refuses(name) {
        Some(reason) => Some(reason.to_string()),
        None => kept_elsewhere(name, TRANSACTIONS_COLLECTION),
    };
    match reason {
        Some(reason) => Err(TxnError::InvalidOptions {
            option,
            value: format!("{name:?}"),
            reason: format!("not a collection for transaction records: {reason}"),
        }),
        None => Ok(()),
    }
}

/// The rewrite of an older-shape document into its upgraded, changed form (version `applied`).
fn rewrite<T>(
    repo: &Repository<T>,
    shown: &str,
    applied: i64,
    post: Document,
    pre: Document,
) -> Result<Op, TxnError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    let mut check = post.clone();
    checks::stamp(repo, &mut check, applied);
    checks::validate(repo, shown, &check)?;
    Ok(Op::Rewrite { post, pre })
}

fn pairs(list: &[(String, Bson)]) -> Vec<PathValue> {
    list.iter()
        .map(|(path, value)| PathValue {
            path: path.clone(),
            value: value.clone(),
        })
        .collect()
}
