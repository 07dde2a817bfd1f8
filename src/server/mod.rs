//! What the server is and whether it keeps the guarantees mongotx builds on: the [`probe`] and
//! its [`verdict`], the deployment's [`Topology`], and the error of reading the server's clock.
//!
//! (Inside the crate, the layer beneath everything else: what time it is on the server, the
//! durability of writes, the behaviours the probe judges. A server to run against when none is
//! given lives in the test rig, `testkit`, a non-default feature.)
//!
//! It knows nothing of repositories or transactions. Its other job is to turn driver errors into
//! the short, clean causes the higher layers put in their messages (`summarize`), keeping the
//! driver error itself as the `source()`.

pub(crate) mod clock;
pub(crate) mod codes;
pub(crate) mod probe;
pub(crate) mod semantics;

#[doc(inline)]
pub use clock::{ClockError, Topology};
#[doc(inline)]
pub use probe::{
    probe, verdict, ProbeError, ServerCapabilities, Verdict, DEFAULT_CONTENTION_TASKS,
};
#[doc(inline)]
pub use semantics::{Semantic, Status};

use mongodb::error::{Error, ErrorKind, WriteFailure};

/// A one-line cause for a driver error, for error messages: never the server's raw reply.
pub(crate) fn summarize(error: &Error) -> String {
    match error.kind.as_ref() {
        ErrorKind::Io(_) => "the connection failed".to_string(),
        ErrorKind::ConnectionPoolCleared { .. } => "the connection pool was cleared".to_string(),
        ErrorKind::ServerSelection { .. } => "no server could be reached".to_string(),
        ErrorKind::Authentication { .. } => "authentication failed".to_string(),
        ErrorKind::Command(e) => format!(
            "the server refused it with error {} ({})",
            e.code, e.code_name
        ),
        ErrorKind::Write(WriteFailure::WriteError(e)) => {
            format!("the server refused the write with error {}", e.code)
        }
        ErrorKind::Write(WriteFailure::WriteConcernError(e)) => {
            format!("the write concern was not satisfied (error {})", e.code)
        }
        ErrorKind::InsertMany(_) | ErrorKind::BulkWrite(_) => {
            "the server refused part of a batch".to_string()
        }
        ErrorKind::InvalidArgument { .. } => "the driver refused an argument".to_string(),
        ErrorKind::BsonDeserialization(_) | ErrorKind::BsonSerialization(_) => {
            "a document could not be converted".to_string()
        }
        ErrorKind::Shutdown => "the client was shut down".to_string(),
        _ => "the driver reported an error".to_string(),
    }
}

/// Whether a driver error may go away when the same operation is sent again.
pub(crate) fn is_transient(error: &Error) -> bool {
    matches!(
        error.kind.as_ref(),
        ErrorKind::Io(_)
            | ErrorKind::ConnectionPoolCleared { .. }
            | ErrorKind::ServerSelection { .. }
    ) || error.contains_label(mongodb::error::RETRYABLE_WRITE_ERROR)
        || error.contains_label(mongodb::error::TRANSIENT_TRANSACTION_ERROR)
}
