//! Serving a small HTTP stand-in (the API simulator, the ledger simulator) on a free local port
//! until its owner drops the handle.

use std::net::SocketAddr;

use axum::Router;
use tokio::sync::oneshot;

/// Serves `app` on a free loopback port. Dropping the returned sender stops the server; `what`
/// names it in the warning logged if it stops on an error.
pub(crate) async fn serve_local(
    app: Router,
    what: &'static str,
) -> std::io::Result<(SocketAddr, oneshot::Sender<()>)> {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
            let _ = stopped.await;
        });
        if let Err(e) = serve.await {
            tracing::warn!(error = %e, "{what} stopped");
        }
    });
    Ok((addr, stop))
}
