//! The plain documents a transaction's entries were staged on (no system fields: their expected
//! version is a fingerprint of the content read), made ready for the commit protocol, whose
//! holds, undos and resolvers work on stamped documents.

use crate::repo::error::{show_id, RepoError};
use crate::repo::fields;
use crate::repo::plain;
use crate::repo::store::Store;
use crate::txn::error::TxnError;
use crate::txn::worklist::{Entry, Op};

/// Stamps the plain documents that entries were staged on (their expected version is a
/// fingerprint of the content read), each conditionally on that content being unchanged, and
/// moves the entries onto the stamped versions. The protocol's holds, undos and resolvers work
/// on stamped documents; a stamp adds only system fields, so one that stays after the
/// transaction fails changes nothing a reader sees (a conflict reruns the body, which reads the
/// stamped version). All are sent at once.
pub(crate) async fn stamp_plain(
    store: &Store,
    mut entries: Vec<Entry>,
) -> Result<Vec<Entry>, TxnError> {
    // A rewrite of a plain document stamps it in its apply, at the collection's first version.
    for entry in entries.iter_mut().filter(|e| e.rewrites_plain()) {
        entry.applied = store.first_version(&entry.coll).await.map_err(|e| {
            RepoError::database(
                &entry.coll,
                &show_id(&entry.id),
                "read the version floor",
                e,
            )
        })?;
    }
    let stamps = entries
        .iter()
        .enumerate()
        .filter(|(_, e)| fields::is_plain_version(e.expected) && !e.rewrites_plain())
        .map(|(i, entry)| async move {
            let spec = store
                .spec_of(&entry.coll)
                .ok_or_else(|| RepoError::Malformed {
                    collection: entry.coll.clone(),
                    id: show_id(&entry.id),
                    reason: "a plain document of a collection this store has not opened".into(),
                })?;
            let coll = store
                .protocol_collection(&entry.coll)
                .await
                .map_err(|e| RepoError::database(&entry.coll, &show_id(&entry.id), "stamp", e))?;
            let stamped =
                plain::stamp(store, &coll, &spec, &entry.id, Some(entry.expected)).await?;
            Ok::<_, RepoError>((i, spec.plain_schema_version(), stamped))
        });
    for stamped in futures::future::join_all(stamps).await {
        let (i, schema, stamped) = stamped?;
        let (plain::Stamping::Stamped(version) | plain::Stamping::AlreadyStamped(version)) =
            stamped;
        let entry = &mut entries[i];
        entry.expected = version;
        entry.applied = match entry.op {
            Op::Check => version,
            _ => version.saturating_add(1),
        };
        if let Op::Rewrite { pre, .. } = &mut entry.op {
            pre.insert(fields::SCHEMA_VERSION, schema);
            pre.insert(fields::VERSION, version);
        }
    }
    Ok(entries)
}
