//! One rate-limiter reservation across several limiters (a tenant's own and the global one):
//! granted on all of them or on none, so a request refused by the tenant's limiter takes
//! nothing from the global one; settling a reservation with fewer calls made than reserved
//! returns the unused calls at once.
//!
//! ```sh
//! cargo run --example ratelimit_multi                             # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example ratelimit_multi
//! ```

mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::time::Duration;

use mongotx::ratelimit::{Attempt, Limit, Priority, RateLimits};
use mongotx::Store;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = local_server::start()?;
    let client = mongodb::Client::with_uri_str(&server.uri).await?;
    let db = client.database("mongotx_example_ratelimit_multi");
    db.drop().await?;
    let store = Store::new(db);
    run(&store).await?;
    store.shutdown(Duration::from_secs(10)).await;
    Ok(())
}

/// The tour, on `store`'s database (limiters `tenant-7` and `global`).
pub async fn run(store: &Store) -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "\n-- Rate limiter: one reservation on a tenant's limiter and the global one, or none"
    );
    let limits = RateLimits::open(store).await?;
    let minute = Duration::from_secs(60);
    limits.define("tenant-7", Limit::new(3, minute)).await?;
    limits.define("global", Limit::new(100, minute)).await?;
    let both = ["tenant-7", "global"];
    let Attempt::Granted(first) = limits.try_reserve(&both, 3, Priority::Bulk).await? else {
        return Err("the first request should be granted".into());
    };
    println!("  3 calls on both: granted");
    match limits.try_reserve(&both, 1, Priority::Bulk).await? {
        Attempt::Wait { after, .. } => println!("  1 more: refused, room again in {after:?}"),
        Attempt::Granted(_) => return Err("tenant-7 has no room left".into()),
    }
    let global = limits.usage("global").await?.bulk;
    println!("  global counts {global}: the refused request took nothing from it");
    assert_eq!(global, 3, "only the granted request counts");

    let settled = limits.settle(&first, 1).await?;
    let global = limits.usage("global").await?.bulk;
    println!("  settled with 1 call made: {settled:?}; global counts {global}");
    assert_eq!(global, 1, "the unused calls returned at once");
    Ok(())
}
