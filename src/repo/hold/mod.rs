//! Holds: a document held by a transaction describes itself, so that any reader, writer or GC can
//! resolve it without the transaction's coordinator and without its ActiveTransaction record.
//!
//! # What a held document carries
//!
//! Besides the transaction's change itself (the post-image is stored in the document's own fields,
//! so unique indexes judge it while it is still undecided), a held document has:
//!
//! - `_txn`: the transaction id;
//! - `_hold.exp`: the transaction's deadline, in the server's time;
//! - `_hold.op`: `insert`, `update` (also adjust and whole-document rewrites), `delete` or `check`;
//! - `_hold.restore` and `_hold.unset`: the undo. Setting the `restore` fields (the original
//!   top-level values, `_version` and, for rewrites, `_schema`) and removing the `unset` fields
//!   (those that did not exist before, plus `_txn`, `_hold` and `_deleting`) gives back exactly the
//!   document as it was before the transaction. An insert's undo is removing the document.
//!
//! # Who decides
//!
//! A transaction's outcome is decided by its record (the ActiveTransaction document), written in
//! the same round as the applies, in state `staging`, listing its participants. It is committed as
//! soon as the record and every participant's apply are in place (an *implicit* commit: nobody has
//! to write anything more for it to be final). Anyone who meets a staging record decides it for
//! good with one write conditional on the record still being `staging`: `committed` when every
//! participant is held by the transaction, or, once its deadline has passed, `aborted` after
//! putting a *fence* on every participant whose apply is missing, so that it can never land (see
//! `staging`). Exactly one conditional write wins.
//!
//! A hold whose record is absent is not committed (an implicit commit needs the record): either
//! its record has not arrived yet, or its transaction ended and this hold was put back by a late
//! copy of an apply. Nobody undoes it before its deadline; after that, a resolver first writes an
//! `aborted` record in its place (so that no late copy of the record can still arrive as
//! `staging`), then undoes the hold. A record can only be created as `staging` while the server's
//! clock is before its deadline, and an aborted record is deleted only once that has passed (or
//! by a coordinator that knows no copy of its record is still in flight), so a transaction that
//! was aborted can never come back.
//!
//! # What readers see
//!
//! The committed value: for a holder that is undecided, aborted or gone, the undo applied to the
//! stored document (an insert reads as absent); for a committed holder, the stored document (a
//! delete reads as deleted). A fence reads as the document it sits on (a placeholder as absent),
//! whatever its holder's state. Queries evaluate filter, sort and limit on the same committed values
//! (see `repo::query`).
//!
//! # Why every resolution step is safe to repeat, race or arrive late
//!
//! Undo and finish writes are conditional on `_txn` still naming the transaction. While a
//! transaction holds a document nobody else may change it, so the undo restores exactly what was
//! there; after the hold is gone the same write matches nothing. A late duplicate of an apply can
//! only match the document at the version the transaction read, i.e. before its own change: it
//! puts the same hold back, which resolves the same way again.
//!
//! # Files
//!
//! The protocol sits between the repository's base pieces (system fields, the [`Store`]'s
//! settings, the error types) and the CRUD layer (`repository`, `find`), which uses it; nothing
//! here names the CRUD layer, and inside, imports go one way, top to bottom:
//!
//! - `write`: one conditional single-document write as data, run alone or with others in one
//!   round (one `bulkWrite` where the server has it);
//! - `held`: the hold itself (`_hold`): its stored form, the pre-image it describes, and the
//!   writes that undo or finish it;
//! - `tombstone`: tombstones and fence placeholders, and the writes that put them in place;
//! - `record`: the ActiveTransaction record as the protocol reads it (its state, its
//!   participants) and the conditional writes that decide it;
//! - `resolve`: resolving one held document, for readers (its committed value) and for writers
//!   (getting it out of the way);
//! - `staging`: deciding a staging transaction (checking its participants, fencing the missing
//!   ones after its deadline), and [`RecordResolver`], the store's standard resolver, which
//!   answers this way.
//!
//! [`Store`]: crate::repo::store::Store
//! [`RecordResolver`]: crate::repo::store::RecordResolver

pub(crate) mod held;
pub(crate) mod record;
pub(crate) mod resolve;
pub(crate) mod staging;
pub(crate) mod tombstone;
pub(crate) mod write;
