//! `mongotx quota`, `limiter`, `queue` and `obt` (not built yet).

use crate::Context;

/// The arguments of `mongotx quota`.
#[derive(Debug, clap::Args)]
pub(crate) struct QuotaArgs {}
/// The arguments of `mongotx limiter`.
#[derive(Debug, clap::Args)]
pub(crate) struct LimiterArgs {}
/// The arguments of `mongotx queue`.
#[derive(Debug, clap::Args)]
pub(crate) struct QueueArgs {}
/// The arguments of `mongotx obt`.
#[derive(Debug, clap::Args)]
pub(crate) struct ObtArgs {}

/// Runs `mongotx quota`.
pub(crate) async fn quota(_ctx: &Context, _args: QuotaArgs) -> Result<(), String> {
    Err("not built yet".into())
}
/// Runs `mongotx limiter`.
pub(crate) async fn limiter(_ctx: &Context, _args: LimiterArgs) -> Result<(), String> {
    Err("not built yet".into())
}
/// Runs `mongotx queue`.
pub(crate) async fn queue(_ctx: &Context, _args: QueueArgs) -> Result<(), String> {
    Err("not built yet".into())
}
/// Runs `mongotx obt`.
pub(crate) async fn obt(_ctx: &Context, _args: ObtArgs) -> Result<(), String> {
    Err("not built yet".into())
}
