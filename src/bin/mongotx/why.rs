//! `mongotx why` (not built yet).

use crate::Context;

/// The arguments of `mongotx why`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {}

/// Runs `mongotx why`.
pub(crate) async fn run(_ctx: &Context, _args: Args) -> Result<(), String> {
    Err("not built yet".into())
}
