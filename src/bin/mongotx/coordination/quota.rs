//! `mongotx quota SCOPE:RESOURCE`: a provider's usage against its limit, stripe by stripe, its
//! outstanding reservations and those past their expiry that wait for the GC's sweep.

use mongotx::quota::{ProviderId, ProviderReport, ReservationReport};

use crate::coordination::{instant, instant_from, one_line};
use crate::{output, Context};

/// The arguments of `mongotx quota`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The provider, as `SCOPE:RESOURCE` (split at the last colon), e.g. `project/42:cores`.
    #[arg(value_parser = provider)]
    provider: ProviderId,
}

/// Clap parser of a provider: `SCOPE:RESOURCE`, neither part empty.
fn provider(text: &str) -> Result<ProviderId, String> {
    match text.rsplit_once(':') {
        Some((scope, resource)) if !scope.is_empty() && !resource.is_empty() => {
            Ok(ProviderId::new(scope, resource))
        }
        _ => Err(format!(
            "{text:?} is not SCOPE:RESOURCE (a provider such as project/42:cores)"
        )),
    }
}

/// Runs `mongotx quota`.
pub(crate) async fn run(ctx: &Context, args: Args) -> Result<(), String> {
    let report = mongotx::quota::inspect(&ctx.store, args.provider)
        .await
        .map_err(one_line)?;
    output::print(ctx, &report, text)
}

fn reservation(r: &ReservationReport, now: chrono::DateTime<chrono::Utc>, word: &str) -> String {
    format!(
        "  {} request {}: {} {word} {}",
        r.consumer,
        r.request,
        r.amount,
        instant_from(r.expires, now)
    )
}

fn text(r: &ProviderReport) -> Vec<String> {
    let yes_no = |b: bool| if b { "yes" } else { "no" };
    let mut lines = vec![
        format!("provider: {}", r.provider),
        format!(
            "parent: {}",
            r.parent
                .as_ref()
                .map_or("-".to_string(), ToString::to_string)
        ),
        format!("limit: {}", r.limit),
        format!("usage: {} (reserved {})", r.usage, r.reserved),
        format!("available: {}", r.available),
        format!(
            "over: {}{}",
            yes_no(r.over),
            if r.over {
                " (the limit was lowered below the usage: every consume is refused until it is back under)"
            } else {
                ""
            }
        ),
        format!("generation: {}", r.generation),
        format!(
            "allocations: {} (consumers: {}, released requests remembered: {})",
            r.allocations, r.consumers, r.remembered
        ),
        format!("stripes: {}", r.stripes.len()),
    ];
    if r.stripes.len() > 1 {
        for s in &r.stripes {
            lines.push(format!(
                "  stripe {} ({} bits): limit {}, usage {}, available {}{}, {} entries",
                s.stripe,
                s.bits,
                s.limit,
                s.usage,
                s.available,
                if s.over { ", over" } else { "" },
                s.entries
            ));
        }
    }
    lines.push(format!("reservations: {}", r.reservations.len()));
    lines.extend(
        r.reservations
            .iter()
            .map(|x| reservation(x, r.now, "until")),
    );
    lines.push(format!(
        "expired: {}{}",
        r.expired.len(),
        if r.expired.is_empty() {
            ""
        } else {
            " (still counted: the GC's sweep returns them; stuck while no mongotx-gc runs)"
        }
    ));
    lines.extend(r.expired.iter().map(|x| reservation(x, r.now, "expired")));
    lines.push(format!("server time: {}", instant(r.now)));
    lines
}
