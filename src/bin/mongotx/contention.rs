//! `mongotx contention` (not built yet).

use crate::Context;

/// The arguments of `mongotx contention`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {}

/// Runs `mongotx contention`.
pub(crate) async fn run(_ctx: &Context, _args: Args) -> Result<(), String> {
    Err("not built yet".into())
}
