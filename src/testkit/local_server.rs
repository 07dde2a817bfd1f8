//! Builds and runs the local MongoDB-wire-compatible test server from `tools/test-server`.
//!
//! The server is mongo-java-server (in-memory backend) wrapped by a small launcher that announces
//! MongoDB 8.0 (wire version 25: the driver needs at least 9, and sends `bulkWrite`, which the
//! wrapper runs, only to 25 and up; `tools/test-server.sh --no-bulk-write` starts one that plays
//! 4.4 without it). The jar is built with Maven from Maven Central
//! on first use, so a fresh machine needs only Java 17+ and Maven. The child process exits when
//! its stdin closes, so a test process that dies never leaves a server behind.

use std::fs::{self, File};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, SystemTime};

use thiserror::Error;

/// Environment variable naming a prebuilt server jar, which skips the Maven build.
pub const JAR_ENV: &str = "MONGOTX_TEST_SERVER_JAR";
/// Environment variable naming the `tools/test-server` directory, for binaries run outside the source tree.
pub const PROJECT_DIR_ENV: &str = "MONGOTX_TEST_SERVER_DIR";
/// Environment variable with extra arguments for a server started by [`LocalServer::start`],
/// separated by spaces: `--no-bulk-write` plays MongoDB 4.4, `--clock-offset c=+20s,...` gives
/// collections clocks of their own.
pub const ARGS_ENV: &str = "MONGOTX_TEST_SERVER_ARGS";

const READY_PREFIX: &str = "MONGOTX_TEST_SERVER_PORT=";
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);
const STDERR_KEEP: usize = 8 * 1024;

/// Why the local test server could not be built or started.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum LocalServerError {
    /// A required program (java or mvn) is not installed or not on PATH.
    #[error("`{program}` is needed to {purpose} but could not be run: {source}")]
    ToolMissing {
        /// The program that failed to start.
        program: &'static str,
        /// What it was needed for.
        purpose: &'static str,
        /// The spawn error.
        #[source]
        source: std::io::Error,
    },
    /// The Maven build of the server jar failed.
    #[error("building the test server in {dir} failed ({status}); Maven said:\n{output}")]
    Build {
        /// The project directory.
        dir: PathBuf,
        /// Maven's exit status.
        status: ExitStatus,
        /// The tail of Maven's output.
        output: String,
    },
    /// The server project directory does not exist.
    #[error("test server project not found at {0} (set {PROJECT_DIR_ENV} or {JAR_ENV})")]
    ProjectMissing(PathBuf),
    /// The server process started but never reported its port.
    #[error("the test server did not start: {reason}; its stderr:\n{stderr}")]
    Startup {
        /// What went wrong.
        reason: String,
        /// The tail of the server's stderr.
        stderr: String,
    },
    /// A filesystem operation failed.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

impl LocalServerError {
    /// Whether trying again may succeed: never without changing the machine (install the tool, fix the build).
    pub fn is_retryable(&self) -> bool {
        false
    }
}

/// A running local test server; dropping it stops the process.
#[derive(Debug)]
pub struct LocalServer {
    child: Child,
    stdin: Option<ChildStdin>,
    port: u16,
}

impl LocalServer {
    /// Builds the jar if needed and starts a server on a free loopback port (blocking), with the
    /// extra arguments of `MONGOTX_TEST_SERVER_ARGS` if set.
    pub fn start() -> Result<LocalServer, LocalServerError> {
        let args: Vec<String> = std::env::var(ARGS_ENV)
            .map(|a| a.split_whitespace().map(str::to_string).collect())
            .unwrap_or_default();
        Self::start_with(&args)
    }

    /// Builds the jar if needed and starts a server with extra arguments (`--no-bulk-write`,
    /// `--clock-offset <collection>=<offset>,...`; see `tools/test-server.sh`).
    pub fn start_with(args: &[String]) -> Result<LocalServer, LocalServerError> {
        let jar = ensure_built()?;
        Self::start_jar_with(&jar, args)
    }

    /// Starts a server from an already built jar (blocking until it listens).
    pub fn start_jar(jar: &Path) -> Result<LocalServer, LocalServerError> {
        Self::start_jar_with(jar, &[])
    }

    /// Starts a server from an already built jar with extra arguments.
    pub fn start_jar_with(jar: &Path, args: &[String]) -> Result<LocalServer, LocalServerError> {
        let mut child = Command::new("java")
            .arg("-Xss512k")
            .arg("-XX:+UseSerialGC")
            .arg("-jar")
            .arg(jar)
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| LocalServerError::ToolMissing {
                program: "java",
                purpose: "run the local test server",
                source,
            })?;

        let stderr_tail = Arc::new(Mutex::new(String::new()));
        if let Some(stderr) = child.stderr.take() {
            let tail = Arc::clone(&stderr_tail);
            std::thread::spawn(move || drain_into(stderr, &tail));
        }

        let (tx, rx) = mpsc::channel();
        if let Some(stdout) = child.stdout.take() {
            std::thread::spawn(move || {
                let mut reported = false;
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if !reported {
                        if let Some(port) = line.trim().strip_prefix(READY_PREFIX) {
                            reported = true;
                            let _ = tx.send(port.parse::<u16>().map_err(|e| e.to_string()));
                        }
                    }
                }
            });
        }

        let stdin = child.stdin.take();
        let port = match rx.recv_timeout(STARTUP_TIMEOUT) {
            Ok(Ok(port)) => port,
            Ok(Err(parse)) => {
                let reason = format!("it printed an unreadable port: {parse}");
                return Err(startup_failure(&mut child, &stderr_tail, reason));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let reason = format!("no port reported within {}s", STARTUP_TIMEOUT.as_secs());
                return Err(startup_failure(&mut child, &stderr_tail, reason));
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let reason = "it exited before listening".to_string();
                return Err(startup_failure(&mut child, &stderr_tail, reason));
            }
        };
        tracing::info!(port, "local test server listening");
        Ok(LocalServer { child, stdin, port })
    }

    /// The loopback port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A connection string for the server.
    pub fn uri(&self) -> String {
        format!("mongodb://127.0.0.1:{}/", self.port)
    }

    /// Stops the server and waits for the process to exit.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        // Closing stdin asks the launcher to exit; kill is the fallback for a wedged JVM.
        drop(self.stdin.take());
        for _ in 0..50 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn startup_failure(
    child: &mut Child,
    stderr_tail: &Mutex<String>,
    reason: String,
) -> LocalServerError {
    let _ = child.kill();
    let _ = child.wait();
    // Give the stderr thread a moment to collect the JVM's last words.
    std::thread::sleep(Duration::from_millis(100));
    let stderr = stderr_tail.lock().map(|s| s.clone()).unwrap_or_default();
    LocalServerError::Startup { reason, stderr }
}

fn drain_into(mut source: impl Read, tail: &Mutex<String>) {
    let mut buf = [0u8; 4096];
    loop {
        match source.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if let Ok(mut text) = tail.lock() {
                    text.push_str(&String::from_utf8_lossy(&buf[..n]));
                    if text.len() > STDERR_KEEP {
                        let cut = text.len() - STDERR_KEEP;
                        let cut = (cut..text.len())
                            .find(|i| text.is_char_boundary(*i))
                            .unwrap_or(0);
                        text.drain(..cut);
                    }
                }
            }
        }
    }
}

/// The `tools/test-server` project directory.
pub fn project_dir() -> PathBuf {
    match std::env::var_os(PROJECT_DIR_ENV) {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/test-server"),
    }
}

/// Builds the server jar with Maven unless an up-to-date one exists; returns the path of a copy of
/// it that servers run from (see `launch_copy`).
pub fn ensure_built() -> Result<PathBuf, LocalServerError> {
    if let Some(jar) = std::env::var_os(JAR_ENV) {
        return Ok(PathBuf::from(jar));
    }
    let dir = project_dir();
    if !dir.join("pom.xml").is_file() {
        return Err(LocalServerError::ProjectMissing(dir));
    }
    let jar = dir.join("target/mongotx-test-server.jar");

    // Test binaries may start concurrently; only one of them must run Maven at a time.
    let lock_path = dir.join(".build.lock");
    let lock = File::create(&lock_path).map_err(|source| LocalServerError::Io {
        action: "creating",
        path: lock_path.clone(),
        source,
    })?;
    lock.lock().map_err(|source| LocalServerError::Io {
        action: "locking",
        path: lock_path.clone(),
        source,
    })?;

    let result = if is_up_to_date(&dir, &jar) {
        Ok(())
    } else {
        build(&dir)
    };
    let result = result.and_then(|()| launch_copy(&dir, &jar));
    let _ = lock.unlock();
    result
}

/// A copy of `jar` that no later build touches, for servers to run from. Maven rewrites the jar in
/// place, and a server that loads a class after that reads a different file: when a source changed
/// while a suite ran, the next test's rebuild crashed the servers other tests were using. Each
/// build gets its own copy (named by the jar's modification time), and older copies are removed
/// after a while (a running server keeps the file it opened).
fn launch_copy(dir: &Path, jar: &Path) -> Result<PathBuf, LocalServerError> {
    let io = |action: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| LocalServerError::Io {
            action,
            path,
            source,
        }
    };
    let stamp = modified(jar)
        .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let launch = dir.join("target/launch");
    fs::create_dir_all(&launch).map_err(io("creating", &launch))?;
    let copy = launch.join(format!("mongotx-test-server-{stamp}.jar"));
    if !copy.is_file() {
        let partial = launch.join(format!("mongotx-test-server-{stamp}.partial"));
        fs::copy(jar, &partial).map_err(io("copying the jar to", &partial))?;
        fs::rename(&partial, &copy).map_err(io("renaming", &partial))?;
    }
    // A copy replaced a moment ago may be about to start a server (its caller has just been
    // handed its path): only copies older than that are removed.
    let stale = |path: &Path| {
        modified(path)
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > Duration::from_secs(600))
    };
    if let Ok(entries) = fs::read_dir(&launch) {
        for old in entries.flatten().map(|e| e.path()) {
            if old != copy && stale(&old) {
                let _ = fs::remove_file(old);
            }
        }
    }
    Ok(copy)
}

fn build(dir: &Path) -> Result<(), LocalServerError> {
    tracing::info!(dir = %dir.display(), "building the local test server with Maven");
    let output = Command::new("mvn")
        .args(["-B", "-q", "-DskipTests", "package"])
        .current_dir(dir)
        .output()
        .map_err(|source| LocalServerError::ToolMissing {
            program: "mvn",
            purpose: "build the local test server (tools/test-server)",
            source,
        })?;
    if output.status.success() {
        return Ok(());
    }
    let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&output.stderr));
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(40)..].join("\n");
    Err(LocalServerError::Build {
        dir: dir.to_path_buf(),
        status: output.status,
        output: tail,
    })
}

fn is_up_to_date(dir: &Path, jar: &Path) -> bool {
    let Some(built) = modified(jar) else {
        return false;
    };
    let mut sources = vec![dir.join("pom.xml")];
    collect_files(&dir.join("src"), &mut sources);
    sources
        .iter()
        .all(|source| modified(source).is_some_and(|changed| changed <= built))
}

fn modified(path: &Path) -> Option<SystemTime> {
    fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect_files(&path, out);
        } else {
            out.push(path);
        }
    }
}
