//! Chooses the MongoDB server that the demo and the integration tests talk to.
//!
//! Order of preference: `MONGODB_URI` when set; with the `docker` feature on a host whose Docker
//! engine answers, the official `mongo` image through testcontainers; otherwise the local
//! mongo-java-server from `tools/test-server`. Nothing here ever silently degrades to "no server":
//! failure is an error that says how to provide one.

use thiserror::Error;

use crate::testkit::local_server::{LocalServer, LocalServerError};

/// Environment variable holding the connection string of a real MongoDB.
pub const URI_ENV: &str = "MONGODB_URI";

/// Where the server in use came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerKind {
    /// A server given by `MONGODB_URI`.
    External,
    /// The official `mongo` image started through testcontainers.
    Docker,
    /// The local mongo-java-server from `tools/test-server`.
    Local,
}

impl std::fmt::Display for ServerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ServerKind::External => "MONGODB_URI",
            ServerKind::Docker => "mongo container (testcontainers)",
            ServerKind::Local => "local mongo-java-server (tools/test-server)",
        })
    }
}

/// No server could be provided.
#[derive(Debug, Error)]
#[error(
    "no MongoDB server is available: {reason}\n\
     To provide one, either set MONGODB_URI=mongodb://host:port/ to use a real MongoDB, \
     or install Java 17+ and Maven so tools/test-server can be built from Maven Central, \
     or build with `--features docker` on a host with a running Docker engine."
)]
pub struct NoServer {
    /// What was tried and why it failed.
    pub reason: String,
}

/// A server ready for connections; keeps a started server alive until dropped.
pub struct TestServer {
    uri: String,
    kind: ServerKind,
    _guard: Guard,
}

impl std::fmt::Debug for TestServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestServer")
            .field("uri", &self.uri)
            .field("kind", &self.kind)
            .finish()
    }
}

enum Guard {
    None,
    Local(#[allow(dead_code)] LocalServer),
    #[cfg(feature = "docker")]
    Docker(#[allow(dead_code)] Box<docker::Container>),
}

impl TestServer {
    /// Provides a server following the order of preference above (blocking; call it once per process).
    pub fn start() -> Result<TestServer, NoServer> {
        if let Ok(uri) = std::env::var(URI_ENV) {
            if !uri.trim().is_empty() {
                return Ok(TestServer {
                    uri,
                    kind: ServerKind::External,
                    _guard: Guard::None,
                });
            }
        }
        #[cfg(feature = "docker")]
        if docker::engine_available() {
            match docker::start() {
                Ok((uri, container)) => {
                    return Ok(TestServer {
                        uri,
                        kind: ServerKind::Docker,
                        _guard: Guard::Docker(Box::new(container)),
                    })
                }
                Err(reason) => {
                    tracing::warn!(%reason, "Docker engine found but the mongo container did not start; using the local server")
                }
            }
        }
        match LocalServer::start() {
            Ok(server) => Ok(TestServer {
                uri: server.uri(),
                kind: ServerKind::Local,
                _guard: Guard::Local(server),
            }),
            Err(error) => Err(NoServer {
                reason: describe(&error),
            }),
        }
    }

    /// The connection string (without a database name).
    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// Where the server came from.
    pub fn kind(&self) -> ServerKind {
        self.kind
    }
}

fn describe(error: &LocalServerError) -> String {
    format!("MONGODB_URI is unset and the local test server failed: {error}")
}

#[cfg(feature = "docker")]
mod docker {
    use std::process::{Command, Stdio};

    use testcontainers::core::{IntoContainerPort, WaitFor};
    use testcontainers::runners::SyncRunner;
    use testcontainers::{Container as TcContainer, GenericImage};

    pub type Container = TcContainer<GenericImage>;

    /// Whether a Docker engine answers (the CLI alone is not enough).
    pub fn engine_available() -> bool {
        Command::new("docker")
            .args(["version", "--format", "{{.Server.Version}}"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Starts `mongo:7` and returns its URI and the container handle.
    pub fn start() -> Result<(String, Container), String> {
        // SyncRunner owns a runtime, which cannot nest inside a caller's tokio runtime.
        std::thread::spawn(|| {
            let container = GenericImage::new("mongo", "7")
                .with_exposed_port(27017.tcp())
                .with_wait_for(WaitFor::message_on_stdout("Waiting for connections"))
                .start()
                .map_err(|e| e.to_string())?;
            let port = container
                .get_host_port_ipv4(27017.tcp())
                .map_err(|e| e.to_string())?;
            Ok((format!("mongodb://127.0.0.1:{port}/"), container))
        })
        .join()
        .map_err(|_| "the container start thread panicked".to_string())?
    }
}
