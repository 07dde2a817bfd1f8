//! Quotas shared through one database: two consumers race for the last units of a provider
//! (never over its limit, one write for a single-provider consume); a claim on three resources
//! that fails on one takes nothing from the others; a child project stopped by its parent's
//! limit; a reservation that expires and is returned by the GC's quota sweep.
//!
//! ```sh
//! cargo run --example quota                                       # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example quota
//! ```

mod common;

use std::time::Duration;

use common::{expect, step, TourResult};
use mongotx::quota::{NewProvider, Quota, QuotaError, Request};
use mongotx::Store;

#[tokio::main]
async fn main() {
    common::main("quota", |example| async move { run(&example.store).await }).await;
}

/// Every step of this example, on `store`'s database.
pub async fn run(store: &Store) -> TourResult {
    let quota = Quota::open(store).await?;
    step("Quota: two consumers race for the last units of a provider");
    quota
        .create(NewProvider::new(("project/42", "cores"), 16))
        .await?;
    quota
        .consume(&Request::new("vm-0").take(("project/42", "cores"), 12))
        .await?;
    let (a, b) = (
        Request::new("vm-a").take(("project/42", "cores"), 3),
        Request::new("vm-b").take(("project/42", "cores"), 3),
    );
    let (ra, rb) = tokio::join!(quota.consume(&a), quota.consume(&b));
    for (name, result) in [("vm-a", &ra), ("vm-b", &rb)] {
        match result {
            Ok(done) => println!("  {name}: consumed 3 cores in {} write", done.writes),
            Err(e) => println!("  {name}: {e}"),
        }
    }
    expect(
        ra.is_ok() != rb.is_ok(),
        "exactly one of the two to get 3 of the last 4 cores",
    )?;
    let p = quota.provider(("project/42", "cores")).await?;
    println!(
        "  project/42 cores: usage {} of {}, generation {}",
        p.usage, p.limit, p.generation
    );
    expect(p.usage == 15, "usage 15")?;
    let last = quota
        .consume(&Request::new("vm-c").take(("project/42", "cores"), 1))
        .await?;
    let released = quota.release_consumed(&last).await?;
    println!(
        "  {} takes the last core and gives it back by what its consume returned: {:?}",
        released.consumer, released.returned
    );
    expect(
        quota.provider(("project/42", "cores")).await?.usage == 15,
        "usage 15 again after vm-c gave its core back",
    )?;

    step("Quota: a claim on three resources that fails on one leaves the other two untouched");
    quota
        .create(NewProvider::new(("project/42", "ram_gb"), 64))
        .await?;
    quota
        .create(NewProvider::new(("project/42", "disk_gb"), 100))
        .await?;
    let before = (
        quota.provider(("project/42", "ram_gb")).await?.generation,
        quota.provider(("project/42", "disk_gb")).await?.generation,
    );
    let claim = Request::new("db-1")
        .take(("project/42", "ram_gb"), 32)
        .take(("project/42", "disk_gb"), 50)
        .take(("project/42", "cores"), 4);
    match quota.consume(&claim).await {
        Err(e @ QuotaError::QuotaExceeded { .. }) => println!("  refused: {e}"),
        other => return Err(format!("expected QuotaExceeded, got {other:?}").into()),
    }
    let after = (
        quota.provider(("project/42", "ram_gb")).await?.generation,
        quota.provider(("project/42", "disk_gb")).await?.generation,
    );
    println!("  ram and disk generations before {before:?}, after {after:?}: nothing taken");
    expect(before == after, "ram and disk unchanged")?;

    step("Quota: a child project is stopped by its parent's limit");
    quota
        .create(NewProvider::new(("domain/7", "seats"), 10))
        .await?;
    for project in ["project/a", "project/b"] {
        quota
            .create(NewProvider::new((project, "seats"), 8).parent(("domain/7", "seats")))
            .await?;
    }
    quota
        .consume(&Request::new("team-a").take(("project/a", "seats"), 7))
        .await?;
    match quota
        .consume(&Request::new("team-b").take(("project/b", "seats"), 5))
        .await
    {
        Err(e @ QuotaError::QuotaExceeded { .. }) => println!("  project/b asks 5: {e}"),
        other => return Err(format!("expected the domain to refuse, got {other:?}").into()),
    }
    let released = quota.release("team-a").await?;
    let returned: Vec<String> = released
        .returned
        .iter()
        .map(|(p, n)| format!("{n} to {p}"))
        .collect();
    println!("  team-a releases: {}", returned.join(", "));
    quota
        .consume(&Request::new("team-b").take(("project/b", "seats"), 5))
        .await?;
    let domain = quota.provider(("domain/7", "seats")).await?;
    println!(
        "  now project/b gets its 5; domain/7 usage {}",
        domain.usage
    );
    expect(domain.usage == 5, "the domain counts its children")?;

    step("Quota: a reservation expires and the GC returns it");
    let reservation = quota
        .reserve(
            &Request::new("batch-job").take(("project/42", "ram_gb"), 48),
            Duration::from_millis(300),
        )
        .await?;
    let p = quota.provider(("project/42", "ram_gb")).await?;
    println!(
        "  reserved 48 GB until {} (server time): usage {}, reserved {}",
        reservation.expires, p.usage, p.reserved
    );
    println!("  the job dies without confirming; 300 ms pass");
    tokio::time::sleep(Duration::from_millis(500)).await;
    match quota.confirm(&reservation).await {
        Err(e @ QuotaError::ReservationExpired { .. }) => println!("  a late confirm: {e}"),
        other => return Err(format!("expected ReservationExpired, got {other:?}").into()),
    }
    let swept = quota.sweep().await?;
    let p = quota.provider(("project/42", "ram_gb")).await?;
    println!(
        "  GC quota sweep: expired={} -> ram usage {}, reserved {}",
        swept.expired, p.usage, p.reserved
    );
    expect(
        swept.expired == 1 && p.usage == 0,
        "the reservation returned",
    )
}
