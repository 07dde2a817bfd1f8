//! `mongotx txn ID`: a transaction's record, its worklist and where each of its documents
//! stands (see `mongotx::admin::TxnReport`).

use bson::oid::ObjectId;
use mongotx::admin::Inspector;

use crate::{output, Context};

/// The arguments of `mongotx txn` (and `mongotx resolve`).
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The transaction's id: 24 hex digits, as a held document's `_txn` and `mongotx status`
    /// show it.
    #[arg(value_parser = txn_id)]
    pub(crate) txn: ObjectId,
}

/// Parses a transaction id (an ObjectId in hex): the key of its record and the `_txn` of the
/// documents it holds.
pub(crate) fn txn_id(text: &str) -> Result<ObjectId, String> {
    ObjectId::parse_str(text.trim()).map_err(|_| {
        format!("{text:?} is not a transaction id: one is 24 hex digits (an ObjectId)")
    })
}

/// Runs `mongotx txn`.
pub(crate) async fn run(ctx: &Context, args: Args) -> Result<(), String> {
    let report = Inspector::new(&ctx.store)
        .transaction(args.txn)
        .await
        .map_err(|e| e.to_string())?;
    output::print(ctx, &report, output::lines)
}
