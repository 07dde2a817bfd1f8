//! `mongotx status` (not built yet).

use crate::Context;

/// The arguments of `mongotx status`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {}

/// Runs `mongotx status`.
pub(crate) async fn run(_ctx: &Context, _args: Args) -> Result<(), String> {
    Err("not built yet".into())
}
