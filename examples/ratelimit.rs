//! The rate limiter: a bulk collector (three tasks) and two high-priority updaters share a
//! third-party API allowing 40 calls in any second, through one limiter with 6 calls reserved
//! for the updaters: no call is refused, no second sees more than 40, and the updaters wait
//! milliseconds. One reservation across several limiters: `ratelimit_multi.rs`.
//!
//! ```sh
//! cargo run --example ratelimit                                   # the local test server
//! MONGODB_URI=mongodb://localhost:27017 cargo run --example ratelimit
//! ```

mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mongotx::ratelimit::{Limit, Priority, RateLimits};
use mongotx::Store;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = local_server::start()?;
    let client = mongodb::Client::with_uri_str(&server.uri).await?;
    let db = client.database("mongotx_example_ratelimit");
    db.drop().await?;
    let store = Store::new(db);
    run(&store).await?;
    store.shutdown(Duration::from_secs(10)).await;
    Ok(())
}

/// A stand-in for the third-party API: it counts the calls, and the most that arrived within
/// any one second (a real API would answer 429 to a call making that more than 40).
#[derive(Clone, Default)]
struct Api(Arc<Mutex<Log>>);

#[derive(Default)]
struct Log {
    recent: Vec<Instant>,
    calls: usize,
    busiest: usize,
}

impl Api {
    async fn call(&self) {
        {
            let mut log = self.0.lock().unwrap();
            let now = Instant::now();
            log.recent.retain(|&at| now - at <= Duration::from_secs(1));
            log.recent.push(now);
            log.calls += 1;
            log.busiest = log.busiest.max(log.recent.len());
        }
        tokio::time::sleep(Duration::from_millis(2)).await; // the call's own latency
    }
}

/// The tour, on `store`'s database (about 5 s).
pub async fn run(store: &Store) -> Result<(), Box<dyn std::error::Error>> {
    println!("\n-- Rate limiter: bulk and priority callers of an API allowing 40 calls a second, for 4 s");
    let limits = RateLimits::open(store).await?;
    let limit = Limit::new(40, Duration::from_secs(1))
        .reserved(6)
        .hold(Duration::from_millis(300));
    limits.define("maps-api", limit).await?;
    let (api, until) = (Api::default(), Instant::now() + Duration::from_secs(4));
    let collectors = (0..3).map(|_| {
        let (limits, api) = (limits.clone(), api.clone());
        tokio::spawn(async move {
            let mut made = 0;
            while Instant::now() < until {
                let r = limits.reserve(&["maps-api"], 4, Priority::Bulk).await?;
                let mut used = 0;
                while used < r.calls() && r.usable() {
                    api.call().await;
                    used += 1;
                }
                limits.settle(&r, used).await?;
                made += used;
            }
            Ok::<u32, BoxError>(made)
        })
    });
    let updaters = (0..2u64).map(|i| {
        let (limits, api) = (limits.clone(), api.clone());
        tokio::spawn(async move {
            let mut waits = Vec::new();
            while Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(300 + 70 * i)).await;
                let asked = Instant::now();
                let r = limits.reserve(&["maps-api"], 1, Priority::High).await?;
                waits.push(asked.elapsed());
                api.call().await;
                limits.settle(&r, 1).await?;
            }
            Ok::<_, BoxError>(waits)
        })
    });
    let (collectors, updaters): (Vec<_>, Vec<_>) = (collectors.collect(), updaters.collect());
    let mut bulk = 0;
    for task in collectors {
        bulk += task.await?.map_err(|e| e.to_string())?;
    }
    let mut waits = Vec::new();
    for task in updaters {
        waits.extend(task.await?.map_err(|e| e.to_string())?);
    }
    waits.sort();
    let Log { calls, busiest, .. } = *api.0.lock().unwrap();
    let high = waits.len();
    println!("  the API saw {calls} calls ({bulk} bulk, {high} high priority), at most {busiest} in any second");
    let (median, max) = (waits[waits.len() / 2], waits[waits.len() - 1]);
    println!("  high-priority reserve latency while bulk saturates the limit: median {median:?}, max {max:?}");
    assert!(
        busiest <= 40,
        "no more than 40 calls in any second: no call refused"
    );

    Ok(())
}
