//! Explicit adoption: [`Repository::adopt`] stamps every plain document of a collection (see
//! `repo::plain`) in batches, online, while mongotx and other writers keep working.
//!
//! # The run
//!
//! 1. Count the plain documents (for progress) and the stamped ones already there.
//! 2. Read the plain documents through one cursor, a batch at a time. Each is checked against the
//!    schema as it will read (upgraded from the plain schema version: [`plain::refusal`]); a
//!    refused one stays plain and is reported with its id, field and rule.
//! 3. Stamp the rest with one `update` command per batch, a statement per document, each setting
//!    only `_schema` and `_version`, and each conditional on the document being exactly as read
//!    and checked ([`plain::unchanged`]: same fields, order, types and bytes). (A validator the
//!    store installed is no substitute for that condition: an administrator may set it to warn
//!    or switch it off, or a newer process may install one that lets another schema version
//!    through, and the client never sees either.) The server says how many matched; when some did not, the batch's
//!    documents are read again: those stamped meanwhile (by a lazy write, another adoption) are
//!    counted as already stamped, those changed by another writer are checked and stamped one by
//!    one, those deleted are left.
//!
//! # Why it is safe to repeat, interrupt and run beside anything
//!
//! - Every write matches only a document not yet stamped, adds only system fields, and lands
//!   only on the very content the client checked, so no other writer's change is lost and
//!   nothing the schema refuses is stamped.
//! - A stamped document is no longer plain: no run reads it again, so each document is stamped
//!   once, whatever runs at once (two adoptions, lazy writes, transactions).
//! - Nothing is remembered between runs but the stamps themselves: a run killed at any point
//!   (between a batch's read and its write, or with its write in flight) leaves stamped and plain
//!   documents, and the next run goes on with the plain ones.
//! - A dry run reads and checks the same documents and writes nothing.

use std::sync::Arc;

use bson::{doc, Bson, Document, RawDocumentBuf};
use futures::TryStreamExt;
use mongodb::Collection;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::repo::collection::CollectionSpec;
use crate::repo::error::{show_id, RepoError};
use crate::repo::fields;
use crate::repo::open;
use crate::repo::plain::{self, Stamping};
use crate::repo::repository::Repository;
use crate::repo::store::Store;
use crate::server::codes;

/// The most plain documents' bytes one batch reads.
const BATCH_BYTES: usize = 8 * 1024 * 1024;

/// The most bytes of statements one stamping command carries: well under the 16 MiB a command
/// may have (a single statement may be larger, up to what `plain::unchanged` builds).
const COMMAND_BYTES: usize = 12 * 1024 * 1024;

/// What a run does after each batch: called with the report so far.
pub type AdoptProgress = Arc<dyn Fn(&AdoptReport) + Send + Sync>;

/// How [`Repository::adopt`] runs.
#[derive(Clone)]
#[non_exhaustive]
pub struct AdoptOptions {
    /// Plain documents read and stamped per batch (one command each way); default 1,000.
    pub batch_size: u32,
    /// Read and check, write nothing; the report says what a run would do.
    pub dry_run: bool,
    /// How many refused documents the report lists (all are counted); default 20.
    pub listed_refusals: usize,
    /// Called after every batch with the report so far (a progress bar, a log line).
    pub progress: Option<AdoptProgress>,
}

impl std::fmt::Debug for AdoptOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdoptOptions")
            .field("batch_size", &self.batch_size)
            .field("dry_run", &self.dry_run)
            .field("listed_refusals", &self.listed_refusals)
            .field("progress", &self.progress.is_some())
            .finish()
    }
}

impl Default for AdoptOptions {
    fn default() -> AdoptOptions {
        AdoptOptions {
            batch_size: 1_000,
            dry_run: false,
            listed_refusals: 20,
            progress: None,
        }
    }
}

impl AdoptOptions {
    /// The defaults: batches of 1,000, writing, 20 refusals listed, no progress callback.
    pub fn new() -> AdoptOptions {
        AdoptOptions::default()
    }

    /// Sets how many plain documents go in one batch (at least 1).
    pub fn batch_size(mut self, batch_size: u32) -> AdoptOptions {
        self.batch_size = batch_size;
        self
    }

    /// Sets whether the run only reads and reports.
    pub fn dry_run(mut self, dry_run: bool) -> AdoptOptions {
        self.dry_run = dry_run;
        self
    }

    /// Sets how many refused documents the report lists.
    pub fn listed_refusals(mut self, listed: usize) -> AdoptOptions {
        self.listed_refusals = listed;
        self
    }

    /// Sets a callback run after every batch with the report so far.
    pub fn progress(
        mut self,
        progress: impl Fn(&AdoptReport) + Send + Sync + 'static,
    ) -> AdoptOptions {
        self.progress = Some(Arc::new(progress));
        self
    }
}

/// A plain document the schema refuses: adoption leaves it plain.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AdoptRefusal {
    /// The document's id, as errors show ids.
    pub id: String,
    /// The dotted path of the field the schema refuses (`_schema` when an upgrade step failed).
    pub field: String,
    /// The rule it breaks.
    pub rule: String,
}

/// What a run of [`Repository::adopt`] did (or, in a dry run, would do).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AdoptReport {
    /// Whether this was a dry run (nothing written; `stamped` counts what would be).
    pub dry_run: bool,
    /// Plain documents in the collection when the run began.
    pub plain_at_start: u64,
    /// Plain documents the run read and checked.
    pub examined: u64,
    /// Documents this run stamped.
    pub stamped: u64,
    /// Documents found stamped: before the run (live ones) or by another writer while it ran.
    pub already_stamped: u64,
    /// Plain documents the schema refuses, left plain.
    pub refused: u64,
    /// The first refused documents, with the field and rule.
    pub refusals: Vec<AdoptRefusal>,
    /// Plain documents deleted by another writer between the run's read and its write.
    pub vanished: u64,
    /// Documents that are neither plain nor readable stamped documents: they carry a field
    /// named like a system field (`_version`, `_deleted`...) that is not mongotx's stamp (the
    /// service's own soft-delete flag, say). mongotx cannot read them; adoption leaves them, and
    /// the service must rename such fields first (docs/adoption.md).
    pub unreadable: u64,
    /// The ids of the first unreadable documents (as many as refusals are listed).
    pub unreadable_ids: Vec<String>,
}

impl AdoptReport {
    fn refuse(&mut self, listed: usize, id: &Bson, field: String, rule: String) {
        self.refused += 1;
        if self.refusals.len() < listed {
            self.refusals.push(AdoptRefusal {
                id: show_id(id),
                field,
                rule,
            });
        }
    }
}

/// The body of [`Repository::adopt`].
pub(crate) async fn adopt<T>(
    repo: &Repository<T>,
    options: AdoptOptions,
) -> Result<AdoptReport, RepoError>
where
    T: Serialize + DeserializeOwned + Send + Sync,
{
    Adoption {
        store: &repo.store,
        spec: &repo.spec,
        coll: &repo.coll,
    }
    .run(options)
    .await
}

/// The body of [`Store::adopt`].
pub(crate) async fn open_and_adopt(
    store: &Store,
    spec: CollectionSpec,
    options: AdoptOptions,
) -> Result<AdoptReport, RepoError> {
    if options.dry_run {
        spec.check_upgrades()?;
        open::ensure_server_suits(store).await?;
        let coll = store.database().collection::<Document>(spec.name());
        return Adoption {
            store,
            spec: &spec,
            coll: &coll,
        }
        .run(options)
        .await;
    }
    store
        .repository::<Document>(spec)
        .await?
        .adopt(options)
        .await
}

/// The documents that carry a system field but no stamp mongotx can read (the rules of
/// `fields::SystemFields::read`, as a query).
fn unreadable_filter() -> Document {
    let any_system_field: Vec<Bson> = fields::RESERVED
        .iter()
        .map(|name| Bson::Document(doc! { *name: { "$exists": true } }))
        .collect();
    let mistyped = |name: &str, types: &[&str]| {
        let types: Vec<Bson> = types.iter().map(|t| Bson::from(*t)).collect();
        Bson::Document(doc! { name: { "$exists": true, "$not": { "$type": types } } })
    };
    doc! { "$and": [
        { "$or": any_system_field },
        { "$or": [
            { fields::SCHEMA_VERSION: { "$exists": false } },
            { fields::VERSION: { "$exists": false } },
            mistyped(fields::SCHEMA_VERSION, &["int", "long"]),
            mistyped(fields::VERSION, &["int", "long"]),
            mistyped(fields::ACTIVE_TXN, &["objectId", "null"]),
            mistyped(fields::DELETED, &["date", "null"]),
            mistyped(fields::DELETING, &["bool", "null"]),
        ] },
    ] }
}

/// What stamping one batch came to.
#[derive(Default)]
struct Tally {
    stamped: u64,
    already_stamped: u64,
    vanished: u64,
    /// Documents the server refused, or that changed into ones the schema refuses.
    refused: Vec<(Bson, String, String)>,
}

impl Tally {
    fn add_to(self, report: &mut AdoptReport, listed: usize) {
        report.stamped += self.stamped;
        report.already_stamped += self.already_stamped;
        report.vanished += self.vanished;
        for (id, field, rule) in self.refused {
            report.refuse(listed, &id, field, rule);
        }
    }
}

/// One run of an adoption: the collection, its definition and the store.
struct Adoption<'a> {
    store: &'a Store,
    spec: &'a CollectionSpec,
    coll: &'a Collection<Document>,
}

impl Adoption<'_> {
    fn name(&self) -> &str {
        self.spec.name()
    }

    fn db_error(&self, operation: &'static str, source: mongodb::error::Error) -> RepoError {
        RepoError::database(self.name(), "*", operation, source)
    }

    async fn run(&self, options: AdoptOptions) -> Result<AdoptReport, RepoError> {
        if options.batch_size == 0 {
            return Err(RepoError::InvalidQuery {
                collection: self.name().to_string(),
                reason: "an adoption batch holds at least one document".into(),
            });
        }
        let fail = |operation| move |e| self.db_error(operation, e);
        let mut report = AdoptReport {
            dry_run: options.dry_run,
            ..AdoptReport::default()
        };
        report.plain_at_start = self
            .coll
            .count_documents(plain::plain_filter())
            .await
            .map_err(fail("count plain documents"))?;
        report.already_stamped = self
            .coll
            .count_documents(doc! {
                fields::VERSION: { "$exists": true },
                fields::DELETED: { "$exists": false },
            })
            .await
            .map_err(fail("count stamped documents"))?;
        let unreadable: Vec<Document> = self
            .coll
            .find(unreadable_filter())
            .projection(doc! { "_id": 1 })
            .await
            .map_err(fail("look for unreadable documents"))?
            .try_collect()
            .await
            .map_err(fail("look for unreadable documents"))?;
        report.unreadable = unreadable.len() as u64;
        report.unreadable_ids = unreadable
            .iter()
            .take(options.listed_refusals)
            .map(|d| show_id(d.get("_id").unwrap_or(&Bson::Null)))
            .collect();
        // Raw documents: their size is known without encoding them again.
        let raw = self.coll.clone_with_type::<RawDocumentBuf>();
        let find = raw
            .find(plain::plain_filter())
            .batch_size(options.batch_size);
        let mut cursor = find.await.map_err(fail("read plain documents"))?;
        let limit = usize::try_from(options.batch_size).unwrap_or(usize::MAX);
        let mut pending: Option<Vec<Document>> = None;
        loop {
            // The next batch is read while the last one's stamps are on their way.
            let stamping = async {
                match pending.take() {
                    Some(ready) => Some(self.stamp(ready).await),
                    None => None,
                }
            };
            let (read, stamped) = tokio::join!(self.next_batch(&mut cursor, limit), stamping);
            if let Some(stamped) = stamped {
                stamped?.add_to(&mut report, options.listed_refusals);
                if let Some(progress) = &options.progress {
                    progress(&report);
                }
            }
            let (batch, unconvertible) = read?;
            if batch.is_empty() && unconvertible.is_empty() {
                break;
            }
            // A document the driver cannot convert (a raw writer's invalid UTF-8, say) fails
            // only itself: it stays plain and is reported, and the run goes on.
            for (id, reason) in unconvertible {
                report.examined += 1;
                report.refuse(
                    options.listed_refusals,
                    &id,
                    "(document)".to_string(),
                    reason,
                );
            }
            let ready = self.check(batch, &options, &mut report);
            if options.dry_run || ready.is_empty() {
                if options.dry_run {
                    report.stamped += ready.len() as u64;
                }
                if let Some(progress) = &options.progress {
                    progress(&report);
                }
            } else {
                pending = Some(ready);
            }
        }
        tracing::info!(
            collection = self.name(),
            stamped = report.stamped,
            already_stamped = report.already_stamped,
            refused = report.refused,
            dry_run = report.dry_run,
            "adoption run ended"
        );
        Ok(report)
    }

    /// Why the client's schema refuses plain document `id` as it is now, if it does.
    async fn explain(&self, id: &Bson) -> Result<Option<(String, String)>, RepoError> {
        let now = self
            .coll
            .find_one(doc! { "_id": id.clone() })
            .await
            .map_err(|e| self.db_error("read a refused document", e))?;
        Ok(now
            .and_then(|doc| plain::refusal(self.spec, &doc).err())
            .map(|v| (v.field, v.reason)))
    }

    /// The next batch of plain documents from `cursor`: up to `limit` of them, or
    /// [`BATCH_BYTES`], beside the ids of those that cannot be converted and why; both empty at
    /// the end.
    async fn next_batch(
        &self,
        cursor: &mut mongodb::Cursor<RawDocumentBuf>,
        limit: usize,
    ) -> Result<(Vec<Document>, Vec<(Bson, String)>), RepoError> {
        let mut batch = Vec::new();
        let mut unconvertible = Vec::new();
        let mut bytes = 0;
        while batch.len() + unconvertible.len() < limit && bytes < BATCH_BYTES {
            let Some(raw) = cursor
                .try_next()
                .await
                .map_err(|e| self.db_error("read plain documents", e))?
            else {
                break;
            };
            bytes += raw.as_bytes().len();
            match raw.to_document() {
                Ok(doc) => batch.push(doc),
                Err(e) => {
                    let id = raw
                        .get("_id")
                        .ok()
                        .flatten()
                        .and_then(|id| Bson::try_from(id).ok())
                        .unwrap_or(Bson::Null);
                    unconvertible.push((id, format!("the stored document cannot be read: {e}")));
                }
            }
        }
        Ok((batch, unconvertible))
    }

    /// The documents of `batch` the schema accepts as they will read; the others are counted
    /// and listed as refused.
    fn check(
        &self,
        batch: Vec<Document>,
        options: &AdoptOptions,
        report: &mut AdoptReport,
    ) -> Vec<Document> {
        let mut ready = Vec::with_capacity(batch.len());
        for doc in batch {
            report.examined += 1;
            match plain::refusal(self.spec, &doc) {
                Ok(()) => ready.push(doc),
                Err(v) => {
                    let id = doc.get("_id").cloned().unwrap_or(Bson::Null);
                    report.refuse(options.listed_refusals, &id, v.field, v.reason);
                }
            }
        }
        ready
    }

    /// Stamps the checked documents `ready` (see the module doc) and says what came of each.
    async fn stamp(&self, ready: Vec<Document>) -> Result<Tally, RepoError> {
        let mut outcome = Tally::default();
        let mut kept = Vec::with_capacity(ready.len());
        let version = self
            .store
            .first_version(self.name())
            .await
            .map_err(|e| self.db_error("read the version floor", e))?;
        let set = doc! { "$set": {
            fields::SCHEMA_VERSION: self.spec.plain_schema_version(),
            fields::VERSION: version,
        } };
        let mut statements: Vec<(Bson, usize)> = Vec::with_capacity(ready.len());
        let binary = self.store.binary_collation(self.name());
        for doc in ready {
            let statement = doc! { "q": plain::unchanged(&doc, binary), "u": set.clone() };
            let size = bson::to_vec(&statement).map_or(usize::MAX, |b| b.len());
            if size > COMMAND_BYTES {
                // Its content cannot be compared in one command: stamping it could land on a
                // change nobody checked. It stays plain, and says so.
                let id = doc.get("_id").cloned().unwrap_or(Bson::Null);
                outcome.refused.push((
                    id,
                    "(document)".to_string(),
                    format!(
                        "too large to stamp conditionally on its content: its condition takes {size} bytes, over the {COMMAND_BYTES} a stamping command may carry"
                    ),
                ));
                continue;
            }
            statements.push((Bson::Document(statement), size));
            kept.push(doc);
        }
        let ready = kept;
        // Each condition carries its document and a check per number and string, several times
        // the document's size: the statements go in as many commands as their bytes need.
        let mut matched = 0;
        let mut errors: Vec<Document> = Vec::new();
        let mut start = 0;
        while start < statements.len() {
            let mut end = start;
            let mut bytes = 0;
            while end < statements.len()
                && (end == start || bytes + statements[end].1 <= COMMAND_BYTES)
            {
                bytes += statements[end].1;
                end += 1;
            }
            let reply = self
                .coll
                .client()
                .database(self.coll.namespace().db.as_str())
                .run_command(doc! {
                    "update": self.name(),
                    "updates": statements[start..end].iter().map(|(s, _)| s.clone()).collect::<Vec<_>>(),
                    "ordered": false,
                })
                .await
                .map_err(|e| RepoError::written(self.name(), "*", "stamp plain documents", e))?;
            matched += match reply.get("n") {
                Some(Bson::Int32(n)) => u64::try_from(*n).unwrap_or(0),
                Some(Bson::Int64(n)) => u64::try_from(*n).unwrap_or(0),
                _ => 0,
            };
            // An error names its statement by its index in this command.
            for error in reply.get_array("writeErrors").into_iter().flatten() {
                if let Some(mut error) = error.as_document().cloned() {
                    if let Ok(i) = error.get_i32("index") {
                        let global = i64::from(i) + i64::try_from(start).unwrap_or(0);
                        error.insert("index", i32::try_from(global).unwrap_or(i32::MAX));
                    }
                    errors.push(error);
                }
            }
            start = end;
        }
        outcome.stamped += matched;
        // A statement the server refused (its validator: a schema it holds that this code does
        // not know) names the document by its index.
        let mut refused_at = Vec::new();
        for error in &errors {
            let index = error
                .get_i32("index")
                .ok()
                .and_then(|i| usize::try_from(i).ok());
            let Some(doc) = index.and_then(|i| ready.get(i)) else {
                continue;
            };
            let id = doc.get("_id").cloned().unwrap_or(Bson::Null);
            let (field, rule) = match codes::validation_failure_in(error) {
                // A server before 5.0 does not say why: the client's check of the document does.
                Some((field, _)) if field == "(document)" => self.explain(&id).await?,
                Some(explained) => Some(explained),
                None => None,
            }
            .unwrap_or_else(|| {
                (
                    "(document)".to_string(),
                    error.get_str("errmsg").unwrap_or("refused").to_string(),
                )
            });
            outcome.refused.push((id, field, rule));
            refused_at.extend(index);
        }
        if matched + refused_at.len() as u64 == ready.len() as u64 {
            return Ok(outcome);
        }
        // Some documents changed between the read and the write: read them again.
        let ids: Vec<Bson> = ready
            .iter()
            .enumerate()
            .filter(|(i, _)| !refused_at.contains(i))
            .filter_map(|(_, d)| d.get("_id").cloned())
            .collect();
        let now: Vec<Document> = self
            .coll
            .find(doc! { "_id": { "$in": ids.clone() } })
            .await
            .map_err(|e| self.db_error("read documents again", e))?
            .try_collect()
            .await
            .map_err(|e| self.db_error("read documents again", e))?;
        let stamped_now = now.iter().filter(|d| !fields::is_plain(d)).count() as u64;
        outcome.already_stamped += stamped_now.saturating_sub(matched);
        outcome.vanished += (ids.len() - now.len()) as u64;
        for changed in now.iter().filter(|d| fields::is_plain(d)) {
            let id = changed.get("_id").cloned().unwrap_or(Bson::Null);
            match plain::stamp(self.store, self.coll, self.spec, &id, None).await {
                Ok(Stamping::Stamped(_)) => outcome.stamped += 1,
                Ok(Stamping::AlreadyStamped(_)) => outcome.already_stamped += 1,
                Err(RepoError::NotFound { .. }) => outcome.vanished += 1,
                Err(RepoError::Deleted { .. }) => outcome.already_stamped += 1,
                Err(RepoError::Invalid { field, reason, .. }) => {
                    outcome.refused.push((id, field, reason))
                }
                Err(RepoError::Refused { field, rule, .. }) => {
                    outcome.refused.push((id, field, rule))
                }
                Err(other) => return Err(other),
            }
        }
        Ok(outcome)
    }
}
