//! The server behaviours mongotx relies on, each judged on its own against a live server.
//!
//! `tests/it/conformance.rs` proves each of them in depth, citing the MongoDB manual; here each is
//! a quick check that the probe runs against any server (`mongotx-probe`, `mongotx::server::verdict`),
//! giving one row per behaviour: it holds, it is lacking (and what the server did instead), or it
//! cannot be judged there. A behaviour the protocol cannot do without is *needed*: a server
//! lacking one is refused, with the sentence [`Semantic::refusal`] gives. The others cost a
//! feature or some fidelity, and each says what mongotx does without it.
//!
//! A [`Store`] runs the protocol's needed checks itself, quickly, when it opens its first
//! collection ([`essentials`]), so that a server that lacks one is refused with that same
//! sentence before any data is written.
//!
//! [`Store`]: crate::Store

mod atomicity;
mod protocol;

use bson::{oid::ObjectId, Document};
use mongodb::{Collection, Database};

pub(crate) use atomicity::Contention;

use crate::server::summarize;

/// How a server showed one behaviour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// It behaved as MongoDB does.
    Holds,
    /// It answered otherwise than MongoDB would (or refused the command).
    Lacks,
    /// The check says nothing on this server (what it examines is absent: details of a validation
    /// failure where validators are not enforced at all).
    NotApplicable,
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `pad`, so that a table can give the word a width.
        f.pad(match self {
            Status::Holds => "holds",
            Status::Lacks => "lacks",
            Status::NotApplicable => "n/a",
        })
    }
}

/// One relied-on behaviour, as a server showed it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Semantic {
    /// Short stable name (`expr_now`, `conditional_updates_atomic`, ...).
    pub name: &'static str,
    /// What it is, in a few words.
    pub what: &'static str,
    /// Whether mongotx refuses a server without it (the others only cost features or fidelity).
    pub needed: bool,
    /// What the check found.
    pub status: Status,
    /// What the server did: what was seen when it held, what it did instead when it is lacking,
    /// why the check says nothing when it does not apply.
    pub evidence: String,
    /// For a behaviour mongotx can do without: what it does instead (the fallback it takes when
    /// the behaviour is lacking).
    pub fallback: Option<&'static str>,
}

impl Semantic {
    /// Whether the server behaved as MongoDB does.
    pub fn holds(&self) -> bool {
        self.status == Status::Holds
    }

    /// The sentence a server is refused with (by the probe and by a `Store`) when it lacks this
    /// behaviour and mongotx needs it; `None` otherwise.
    pub fn refusal(&self) -> Option<String> {
        (self.needed && self.status == Status::Lacks)
            .then(|| refusal(self.name, self.what, &self.evidence))
    }
}

/// The one sentence for a needed behaviour a server lacks, shared by the probe's verdict,
/// [`ProbeError::Lacks`](crate::server::ProbeError) and `RepoError::ServerUnsuitable`.
pub(crate) fn refusal(name: &str, what: &str, evidence: &str) -> String {
    format!("the server lacks `{name}`, which mongotx needs ({what}): {evidence}")
}

/// A behaviour to check: its name, its description, whether it is needed, and for the others
/// what mongotx does without it.
pub(crate) struct Check {
    pub(crate) name: &'static str,
    pub(crate) what: &'static str,
    pub(crate) needed: bool,
    pub(crate) fallback: Option<&'static str>,
}

/// Why a check did not hold: the server answered otherwise than MongoDB would (it lacks the
/// behaviour), the check does not apply to it, or it could not be asked at all (the check says
/// nothing then, and neither does the verdict).
pub(crate) enum Fault {
    Lacks(String),
    NotApplicable(String),
    Unreachable(mongodb::error::Error),
}

impl From<String> for Fault {
    fn from(detail: String) -> Fault {
        Fault::Lacks(detail)
    }
}

impl From<&str> for Fault {
    fn from(detail: &str) -> Fault {
        Fault::Lacks(detail.to_string())
    }
}

/// A check's result: what was seen when it held (see [`Observed`]), or why not.
pub(crate) type Checked<T = ()> = Result<T, Fault>;

/// What a check that held reports as its evidence.
pub(crate) trait Observed {
    fn evidence(self) -> String;
}

impl Observed for () {
    fn evidence(self) -> String {
        "as MongoDB does".to_string()
    }
}

impl Observed for String {
    fn evidence(self) -> String {
        self
    }
}

/// A check that could not be asked: which one, and the driver's error.
#[derive(Debug)]
pub(crate) struct Unasked {
    pub(crate) check: &'static str,
    pub(crate) source: mongodb::error::Error,
}

/// A driver error in a check: a server's refusal means it lacks the behaviour; anything else (no
/// connection, a timeout, an account without the privilege) means the check could not run.
pub(crate) fn fail(context: &str) -> impl Fn(mongodb::error::Error) -> Fault + '_ {
    use mongodb::error::ErrorKind;
    move |e| match e.kind.as_ref() {
        // A failover or an overloaded server answers too; asking again later may go otherwise.
        _ if crate::server::is_transient(&e) => Fault::Unreachable(e),
        // Refused for the account, not for the behaviour: the server is not judged by it.
        _ if crate::server::codes::error_code(&e) == Some(crate::server::codes::UNAUTHORIZED) => {
            Fault::Unreachable(e)
        }
        ErrorKind::Command(_)
        | ErrorKind::Write(_)
        | ErrorKind::InsertMany(_)
        | ErrorKind::BulkWrite(_) => Fault::Lacks(format!("{context}: {}", summarize(&e))),
        _ => Fault::Unreachable(e),
    }
}

pub(crate) fn outcome<T: Observed>(check: &Check, result: Checked<T>) -> Result<Semantic, Unasked> {
    let (status, evidence) = match result {
        Ok(seen) => (Status::Holds, seen.evidence()),
        Err(Fault::Lacks(detail)) => (Status::Lacks, detail),
        Err(Fault::NotApplicable(why)) => (Status::NotApplicable, why),
        Err(Fault::Unreachable(source)) => {
            return Err(Unasked {
                check: check.name,
                source,
            })
        }
    };
    Ok(Semantic {
        name: check.name,
        what: check.what,
        needed: check.needed,
        status,
        evidence,
        fallback: check.fallback,
    })
}

/// The protocol's needed checks, cheap enough to run when a store opens (a dozen commands on a
/// scratch collection, dropped after). `Ok(Err(_))`: the first that is lacking; `Err(_)`: the
/// server could not be asked (nothing is known then).
///
/// The single-document guarantees are left to the verdict: judging atomicity takes dozens of
/// racing commands, each one more chance for a flaky network to fail a store's opening, and a
/// race that happens to go well proves little; a deployment runs the verdict once instead.
pub(crate) async fn essentials(db: &Database) -> Result<Result<(), Semantic>, Unasked> {
    let name = format!("mongotx_check_{}", ObjectId::new().to_hex());
    let coll: Collection<Document> = db.collection(&name);
    let verdict = protocol::needed(&coll).await;
    let _ = coll.drop().await;
    Ok(verdict?
        .into_iter()
        .find(|s| s.refusal().is_some())
        .map_or(Ok(()), Err))
}

/// Every check, in scratch collections named after `name` (all dropped after), the atomicity
/// checks run by `contention.tasks` concurrent callers.
pub(crate) async fn all(
    db: &Database,
    name: &str,
    contention: &Contention,
) -> Result<Vec<Semantic>, Unasked> {
    let coll: Collection<Document> = db.collection(name);
    let found = all_in(db, name, &coll, contention).await;
    let _ = coll.drop().await;
    found
}

async fn all_in(
    db: &Database,
    name: &str,
    coll: &Collection<Document>,
    contention: &Contention,
) -> Result<Vec<Semantic>, Unasked> {
    let mut found = atomicity::needed(db, coll, contention).await?;
    found.extend(protocol::needed(coll).await?);
    found.extend(protocol::optional(db, name, coll).await?);
    found.push(atomicity::bulk_write(db, coll).await?);
    Ok(found)
}
