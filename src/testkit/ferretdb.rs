//! FerretDB 1.24 on SQLite: a MongoDB-wire-compatible server that nobody on this project wrote,
//! for judging mongotx's verdict on a real third-party server (`tests/it/ferretdb.rs`, `.ci/run`).
//!
//! `tools/ferretdb.sh` builds it from the Go module proxy the first time (into `tools/.bin`);
//! [`FerretDb::start`] runs it on a free port with its SQLite files in a temporary directory,
//! both removed when the handle is dropped.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::net::TcpStream;

/// Why FerretDB could not be built or started.
#[derive(Debug, thiserror::Error)]
#[error("FerretDB: {0}")]
pub struct FerretDbError(String);

/// A running FerretDB server on SQLite, killed (and its files removed) when dropped.
#[derive(Debug)]
pub struct FerretDb {
    child: tokio::process::Child,
    addr: SocketAddr,
    dir: PathBuf,
}

impl FerretDb {
    /// Builds FerretDB (once) and starts it on SQLite, on a free local port.
    pub async fn start() -> Result<FerretDb, FerretDbError> {
        let fail = |what: &str, e: &dyn std::fmt::Display| FerretDbError(format!("{what}: {e}"));
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let built = tokio::process::Command::new("bash")
            .arg(root.join("tools/ferretdb.sh"))
            .output()
            .await
            .map_err(|e| fail("run tools/ferretdb.sh", &e))?;
        if !built.status.success() {
            return Err(FerretDbError(format!(
                "tools/ferretdb.sh failed: {}",
                String::from_utf8_lossy(&built.stderr)
            )));
        }
        let server = String::from_utf8_lossy(&built.stdout).trim().to_string();
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| fail("find a free port", &e))?;
        let dir = std::env::temp_dir().join(format!(
            "mongotx-ferretdb-{}-{}",
            std::process::id(),
            addr.port()
        ));
        std::fs::create_dir_all(&dir).map_err(|e| fail("create its data directory", &e))?;
        let child = tokio::process::Command::new(&server)
            .arg("--handler=sqlite")
            .arg(format!("--sqlite-url=file:{}/", dir.display()))
            .arg(format!("--state-dir={}", dir.display()))
            .arg(format!("--listen-addr={addr}"))
            .args(["--telemetry=disable", "--debug-addr=-", "--log-level=error"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| fail(&format!("start {server}"), &e))?;
        let mut ferretdb = FerretDb { child, addr, dir };
        let started = Instant::now();
        while TcpStream::connect(addr).await.is_err() {
            if let Ok(Some(status)) = ferretdb.child.try_wait() {
                return Err(FerretDbError(format!("exited at start: {status}")));
            }
            if started.elapsed() > Duration::from_secs(30) {
                return Err(FerretDbError(format!("not listening on {addr} after 30 s")));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(ferretdb)
    }

    /// A connection string for it.
    pub fn uri(&self) -> String {
        format!("mongodb://{}/?directConnection=true", self.addr)
    }
}

impl Drop for FerretDb {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
