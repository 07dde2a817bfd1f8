//! A toxiproxy server in front of a MongoDB server, for benchmarks and fault runs that need a real
//! network shape: latency each way, stalls, resets.
//!
//! `tools/toxiproxy.sh` installs toxiproxy's server from the Go module proxy the first time (into
//! `tools/.bin`); [`Toxiproxy::start`] runs it on a free port with one proxy, `mongo`, listening
//! on another free port and forwarding to the given upstream. Toxics are added and removed over
//! its HTTP API. The server is killed when the handle is dropped.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Why toxiproxy could not be started or driven.
#[derive(Debug, thiserror::Error)]
#[error("toxiproxy: {0}")]
pub struct ToxiproxyError(String);

/// A running toxiproxy server with one proxy named `mongo`.
#[derive(Debug)]
pub struct Toxiproxy {
    child: tokio::process::Child,
    api: SocketAddr,
    listen: SocketAddr,
}

/// The proxy's name in toxiproxy's API.
const PROXY: &str = "mongo";

impl Toxiproxy {
    /// Installs (once) and starts toxiproxy with a proxy from a free local port to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Result<Toxiproxy, ToxiproxyError> {
        let fail = |what: &str, e: &dyn std::fmt::Display| ToxiproxyError(format!("{what}: {e}"));
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let installed = tokio::process::Command::new("bash")
            .arg(root.join("tools/toxiproxy.sh"))
            .output()
            .await
            .map_err(|e| fail("run tools/toxiproxy.sh", &e))?;
        if !installed.status.success() {
            return Err(ToxiproxyError(format!(
                "tools/toxiproxy.sh failed: {}",
                String::from_utf8_lossy(&installed.stderr)
            )));
        }
        let server = String::from_utf8_lossy(&installed.stdout)
            .trim()
            .to_string();
        let api = free_address().map_err(|e| fail("find a free port", &e))?;
        let child = tokio::process::Command::new(&server)
            .args(["-host", "127.0.0.1", "-port", &api.port().to_string()])
            // Fewer collections: toxiproxy shares the cores with the server and the clients.
            .env("GOGC", "1000")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| fail(&format!("start {server}"), &e))?;
        let listen = free_address().map_err(|e| fail("find a free port", &e))?;
        let mut toxiproxy = Toxiproxy { child, api, listen };
        let body = format!(
            r#"{{"name":"{PROXY}","listen":"{listen}","upstream":"{upstream}","enabled":true}}"#
        );
        let started = Instant::now();
        loop {
            match toxiproxy.http("POST", "/proxies", &body).await {
                Ok(201) => return Ok(toxiproxy),
                Ok(status) => {
                    return Err(ToxiproxyError(format!(
                        "the proxy was refused: HTTP {status}"
                    )))
                }
                // Not listening yet.
                Err(_) if started.elapsed() < Duration::from_secs(15) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => {
                    let _ = toxiproxy.child.kill().await;
                    return Err(ToxiproxyError(format!("did not come up: {e}")));
                }
            }
        }
    }

    /// Where clients connect to go through the proxy.
    pub fn listen(&self) -> SocketAddr {
        self.listen
    }

    /// Adds toxic `name` of `kind` (`latency`, `timeout`, `reset_peer`, ...) on `stream`
    /// (`upstream` or `downstream`) to a share `toxicity` of connections, with `attributes` (a
    /// JSON object, such as `{"latency":1}`).
    pub async fn add_toxic(
        &self,
        name: &str,
        kind: &str,
        stream: &str,
        toxicity: f64,
        attributes: &str,
    ) -> Result<(), ToxiproxyError> {
        let body = format!(
            r#"{{"name":"{name}","type":"{kind}","stream":"{stream}","toxicity":{toxicity},"attributes":{attributes}}}"#
        );
        match self
            .http("POST", &format!("/proxies/{PROXY}/toxics"), &body)
            .await
        {
            Ok(200) => Ok(()),
            Ok(status) => Err(ToxiproxyError(format!(
                "toxic {name} ({kind}) refused: HTTP {status}"
            ))),
            Err(e) => Err(ToxiproxyError(e)),
        }
    }

    /// Removes toxic `name` (nothing happens if there is none).
    pub async fn remove_toxic(&self, name: &str) {
        let _ = self
            .http("DELETE", &format!("/proxies/{PROXY}/toxics/{name}"), "")
            .await;
    }

    /// Delays every byte by `one_way` in each direction (so a round trip gains twice that);
    /// zero removes the delay.
    pub async fn set_latency(&self, one_way: Duration) -> Result<(), ToxiproxyError> {
        for stream in ["upstream", "downstream"] {
            let name = format!("latency_{stream}");
            self.remove_toxic(&name).await;
            if !one_way.is_zero() {
                let attributes = format!(r#"{{"latency":{},"jitter":0}}"#, one_way.as_millis());
                self.add_toxic(&name, "latency", stream, 1.0, &attributes)
                    .await?;
            }
        }
        Ok(())
    }

    async fn http(&self, method: &str, path: &str, body: &str) -> Result<u16, String> {
        let mut stream = TcpStream::connect(self.api)
            .await
            .map_err(|e| format!("API: {e}"))?;
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.api,
            body.len()
        );
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| format!("API: {e}"))?;
        let mut response = String::new();
        stream
            .read_to_string(&mut response)
            .await
            .map_err(|e| format!("API: {e}"))?;
        response
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse().ok())
            .ok_or_else(|| format!("API: unreadable reply {response:?}"))
    }
}

fn free_address() -> std::io::Result<SocketAddr> {
    std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()
}
