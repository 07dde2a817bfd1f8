//! ===== EXAMPLE SCAFFOLDING: NOT PART OF MONGOTX =====
//!
//! The only part of an example that is neither mongotx's public API nor the MongoDB driver
//! (apart from the test rig's failpoints that `holds`, `crash_recovery` and `orphan_hold` use to
//! simulate a crash, marked where they are imported): it finds a server to run against. With
//! your own MongoDB you do not need it: drop the `mod local_server;` line and connect with your
//! connection string (`MONGODB_URI`) instead.
//!
//! `MONGODB_URI` when it is set; otherwise the local test server of mongotx's test rig
//! (`tools/test-server`, Java 17+ and Maven; feature `testkit`), started for the run and
//! stopped when the returned [`Server`] is dropped.

use mongotx::testkit::test_server::TestServer;

/// The server an example runs against.
pub struct Server {
    /// Its connection string.
    pub uri: String,
    /// The local test server when one was started (`None` with `MONGODB_URI`): keep the
    /// `Server` alive while you use it, dropping it stops that server.
    _local: Option<TestServer>,
}

/// `MONGODB_URI` when set, otherwise a local test server started now (blocking, seconds).
pub fn start() -> Result<Server, Box<dyn std::error::Error>> {
    match std::env::var("MONGODB_URI") {
        Ok(uri) if !uri.trim().is_empty() => Ok(Server { uri, _local: None }),
        _ => {
            let local = TestServer::start()?;
            let uri = local.uri().to_string();
            Ok(Server {
                uri,
                _local: Some(local),
            })
        }
    }
}
