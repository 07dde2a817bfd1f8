//! A worker child process whose report lines are read on a thread of their own, as they come,
//! into a tally the test looks at while the process runs; the line parser may kill the process
//! the moment it reports a chosen event (so that the kill lands at a known step).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// One running worker process and what it has said so far.
pub struct Worker<S> {
    child: Arc<Mutex<Child>>,
    /// What the process has said; the test may also set flags here that the parser reads.
    pub said: Arc<Mutex<S>>,
    reader: Option<JoinHandle<()>>,
}

/// Kills the worker from inside the line parser.
pub struct Killer(Arc<Mutex<Child>>);

impl Killer {
    /// Sends SIGKILL now.
    pub fn kill(&self) {
        let _ = self.0.lock().unwrap().kill();
    }
}

impl<S: Default + Send + 'static> Worker<S> {
    /// Starts `command` with its stdout piped (stderr goes to the test's) and hands every line
    /// it prints, split into words, to `parse`, which panics on a line it does not expect.
    pub fn start<F>(mut command: Command, what: &str, parse: F) -> Worker<S>
    where
        F: Fn(&[&str], &mut S, &Killer) -> bool + Send + 'static,
    {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("start a {what}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let child = Arc::new(Mutex::new(child));
        let said = Arc::new(Mutex::new(S::default()));
        let (sink, killer) = (said.clone(), Killer(child.clone()));
        let what = what.to_string();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let words: Vec<&str> = line.split_whitespace().collect();
                let mut said = sink.lock().unwrap();
                if !parse(&words, &mut said, &killer) {
                    panic!("unexpected line from a {what}: {line}");
                }
            }
        });
        Worker {
            child,
            said,
            reader: Some(reader),
        }
    }

    /// Kills the process and returns what it said, all of it.
    pub fn kill(mut self) -> S {
        self.stop();
        if let Some(reader) = self.reader.take() {
            reader.join().expect("the reader thread");
        }
        std::mem::take(&mut *self.said.lock().unwrap())
    }
}

impl<S> Worker<S> {
    /// Kills the process (if it still runs) and reaps it.
    pub fn stop(&self) {
        let mut child = self.child.lock().unwrap();
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl<S> Drop for Worker<S> {
    fn drop(&mut self) {
        self.stop();
    }
}
