//! `mongotx resolve ID`: settles one expired transaction now, as the GC would (the one
//! subcommand that writes); refuses a live one, saying how long it has left (see
//! `mongotx::admin::Resolved`).

use mongotx::admin::Inspector;

use crate::{output, Context};

/// The arguments of `mongotx resolve`: a transaction id, as `mongotx txn` takes it.
pub(crate) use crate::txn::Args;

/// Runs `mongotx resolve`.
pub(crate) async fn run(ctx: &Context, args: Args) -> Result<(), String> {
    let resolved = Inspector::new(&ctx.store)
        .resolve(args.txn)
        .await
        .map_err(|e| e.to_string())?;
    output::print(ctx, &resolved, output::lines)
}
