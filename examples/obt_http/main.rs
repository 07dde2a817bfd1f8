//! The OBT HTTP interface of the reference design the OBT module follows (an OBT owns a long
//! operation; volumes are created and deleted under its fence), served by axum on `mongotx::obt`.
//!
//! ```sh
//! cargo run --example obt_http            # MONGODB_URI, or a local test server it starts
//! curl -H "Content-Type: application/json" -X POST -d '{"t_id":"t0","t_owner":"owner0","t_stage":0}' http://localhost:9521/obts
//! curl -H "Content-Type: application/json" -X POST -d '{"dlv_name":"dlv0","dlv_size":3000000000,"t_id":"t0","t_owner":"owner0","t_stage":1}' http://localhost:9521/dlvs
//! curl -H "Content-Type: application/json" -X PUT -d '{"t_owner":"owner0","new_owner":"owner1","action":"preempt"}' http://localhost:9521/obts/t0
//! curl -H "Content-Type: application/json" -X DELETE -d '{"t_id":"t0","t_owner":"owner1","t_stage":2}' http://localhost:9521/dlvs/dlv0
//! curl -H "Content-Type: application/json" -X DELETE -d '{"t_owner":"owner1"}' http://localhost:9521/obts/t0
//! ```
//!
//! `OBT_HTTP_ADDR` sets the listening address (default `127.0.0.1:9521`).

mod app;
#[path = "../local_server/mod.rs"]
mod local_server; // finds a server: MONGODB_URI, or a local test server (not mongotx)

use std::time::Duration;

use mongodb::Client;
use mongotx::Store;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = local_server::start()?;
    let client = Client::with_uri_str(&server.uri).await?;
    let db = client.database("mongotx_example_obt_http");
    db.drop().await?; // start empty on every run
    let store = Store::new(db);
    let (router, _) = app::router(&store).await?;
    let addr = std::env::var("OBT_HTTP_ADDR").unwrap_or_else(|_| "127.0.0.1:9521".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("OBT API on http://{addr}");
    axum::serve(listener, router)
        .with_graceful_shutdown(stop_signal())
        .await?;
    // The requests are answered; wait for the background finishes of their transactions.
    let report = store.shutdown(Duration::from_secs(10)).await;
    println!(
        "stopped: {} background finishes waited for, {} left for the GC",
        report.finished, report.unfinished
    );
    Ok(())
}

/// Completes on ctrl-c, or on SIGTERM (what a deploy sends).
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
