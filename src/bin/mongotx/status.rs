//! `mongotx status`: what mongotx is doing in the database (see `mongotx::admin::Status`).

use mongotx::admin::Inspector;

use crate::{output, Context};

/// The arguments of `mongotx status`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {}

/// Runs `mongotx status`.
pub(crate) async fn run(ctx: &Context, _args: Args) -> Result<(), String> {
    let status = Inspector::new(&ctx.store)
        .status()
        .await
        .map_err(|e| e.to_string())?;
    output::print(ctx, &status, output::lines)
}
