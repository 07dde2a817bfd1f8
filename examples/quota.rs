//! Quotas shared through one database: two consumers race for the last units of a provider
//! (never over its limit, one write for a single-provider consume); a claim on three resources
//! that fails on one takes nothing from the others; a child project stopped by its parent's
//! limit; a reservation that expires and is returned by the GC's quota sweep.
//!
//! ```sh
//! cargo run --example quota                                       # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example quota
//! ```

mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::time::Duration;

use mongotx::quota::{NewProvider, Quota, QuotaError, Request};
use mongotx::Store;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = local_server::start()?;
    let client = mongodb::Client::with_uri_str(&server.uri).await?;
    let db = client.database("mongotx_example_quota");
    db.drop().await?;
    let store = Store::new(db);
    run(&store).await?;
    store.shutdown(Duration::from_secs(10)).await;
    Ok(())
}

/// The tour, on `store`'s database.
pub async fn run(store: &Store) -> Result<(), Box<dyn std::error::Error>> {
    let quota = Quota::open(store).await?;
    let cores = ("project/42", "cores");
    let (ram, disk) = (("project/42", "ram_gb"), ("project/42", "disk_gb"));
    println!("\n-- Quota: two consumers race for the last units of a provider");
    quota.create(NewProvider::new(cores, 16)).await?;
    quota.consume(&Request::new("vm-0").take(cores, 12)).await?;
    let a = Request::new("vm-a").take(cores, 3);
    let b = Request::new("vm-b").take(cores, 3);
    let (ra, rb) = tokio::join!(quota.consume(&a), quota.consume(&b));
    for (name, result) in [("vm-a", &ra), ("vm-b", &rb)] {
        match result {
            Ok(done) => println!("  {name}: consumed 3 cores in {} write", done.writes),
            Err(e) => println!("  {name}: {e}"),
        }
    }
    assert!(ra.is_ok() != rb.is_ok(), "exactly one gets 3 of the last 4");
    let p = quota.provider(cores).await?;
    println!(
        "  cores: usage {} of {}, generation {}",
        p.usage, p.limit, p.generation
    );
    assert_eq!(p.usage, 15);
    let last = quota.consume(&Request::new("vm-c").take(cores, 1)).await?;
    let released = quota.release_consumed(&last).await?;
    println!(
        "  {} takes the last core and gives it back by what its consume returned: {:?}",
        released.consumer, released.returned
    );
    let usage = quota.provider(cores).await?.usage;
    assert_eq!(usage, 15, "vm-c's core is back");

    println!("\n-- Quota: a claim on three resources that fails on one takes nothing");
    quota.create(NewProvider::new(ram, 64)).await?;
    quota.create(NewProvider::new(disk, 100)).await?;
    let generations = || async {
        let (r, d) = (quota.provider(ram).await?, quota.provider(disk).await?);
        Ok::<_, QuotaError>((r.generation, d.generation))
    };
    let before = generations().await?;
    let claim = Request::new("db-1").take(ram, 32).take(disk, 50);
    let claim = claim.take(cores, 4); // 4 cores: one more than is left
    match quota.consume(&claim).await {
        Err(e @ QuotaError::QuotaExceeded { .. }) => println!("  refused: {e}"),
        other => return Err(format!("expected QuotaExceeded, got {other:?}").into()),
    }
    let after = generations().await?;
    println!("  ram and disk generations before {before:?}, after {after:?}: nothing taken");
    assert_eq!(before, after, "ram and disk unchanged");

    println!("\n-- Quota: a child project is stopped by its parent's limit");
    let domain = ("domain/7", "seats");
    quota.create(NewProvider::new(domain, 10)).await?;
    let child = |project| NewProvider::new((project, "seats"), 8).parent(domain);
    quota.create(child("project/a")).await?;
    quota.create(child("project/b")).await?;
    let team_a = Request::new("team-a").take(("project/a", "seats"), 7);
    quota.consume(&team_a).await?;
    let ask = Request::new("team-b").take(("project/b", "seats"), 5);
    match quota.consume(&ask).await {
        Err(e @ QuotaError::QuotaExceeded { .. }) => println!("  project/b asks 5: {e}"),
        other => return Err(format!("expected the domain to refuse, got {other:?}").into()),
    }
    let released = quota.release("team-a").await?;
    let returned = released.returned.iter().map(|(p, n)| format!("{n} to {p}"));
    println!(
        "  team-a releases: {}",
        returned.collect::<Vec<_>>().join(", ")
    );
    quota.consume(&ask).await?;
    let usage = quota.provider(domain).await?.usage;
    println!("  now project/b gets its 5; domain/7 usage {usage}");
    assert_eq!(usage, 5, "the domain counts its children");

    println!("\n-- Quota: a reservation expires and the GC returns it");
    let job = Request::new("batch-job").take(ram, 48);
    let reservation = quota.reserve(&job, Duration::from_millis(300)).await?;
    let p = quota.provider(ram).await?;
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
    let p = quota.provider(ram).await?;
    let (expired, usage, reserved) = (swept.expired, p.usage, p.reserved);
    println!("  the GC's quota sweep: expired={expired} -> ram usage {usage}, reserved {reserved}");
    assert_eq!((expired, usage), (1, 0), "the reservation returned");
    Ok(())
}
