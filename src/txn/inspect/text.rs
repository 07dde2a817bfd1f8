//! The reports as text for people: `field: value` lines, values aligned, times in RFC 3339 with
//! how far they are from the report's `now` ("in 12s", "3s ago"), long values wrapped under
//! their column. What `mongotx` prints without `--json`, and what a service may log.

use std::fmt;

use bson::Bson;

use crate::repo::error::show_id;
use crate::server::clock::{relative, rfc3339, span};
use crate::txn::inspect::model::{DocState, DocumentState, RecordInfo};
use crate::txn::inspect::report::TxnReport;
use crate::txn::inspect::resolve::Resolved;
use crate::txn::inspect::status::Status;
use crate::txn::inspect::why::{CommittedValue, Explanation};

/// How wide a line gets before its value wraps.
const WIDTH: usize = 100;

/// Rows of `label: value`, the values aligned and wrapped.
#[derive(Default)]
struct Rows(Vec<(String, String)>);

impl Rows {
    /// Rows starting with what the report is about and the server's time it was made at.
    fn about(label: &str, value: String, now: bson::DateTime) -> Rows {
        let mut rows = Rows::default();
        rows.row(label, value);
        rows.row("server time", rfc3339(now));
        rows
    }

    /// One row per document under `label`.
    fn documents(&mut self, label: &str, docs: &[DocumentState]) {
        self.list(label, docs.iter().map(ToString::to_string), "none");
    }

    fn row(&mut self, label: impl Into<String>, value: impl Into<String>) {
        self.0.push((label.into(), value.into()));
    }

    /// One row per value under one label (the label on the first).
    fn list(&mut self, label: &str, values: impl IntoIterator<Item = String>, none: &str) {
        let mut first = true;
        for value in values {
            self.row(if first { label } else { "" }, value);
            first = false;
        }
        if first {
            self.row(label, none);
        }
    }

    fn record(&mut self, record: &RecordInfo, now: bson::DateTime) {
        self.row("state", record.state.as_str());
        self.row("created", relative(record.created, now));
        self.row("deadline", relative(record.deadline, now));
        if let Some(claim) = &record.claim {
            self.row(
                "claimed",
                format!(
                    "by GC runner {} until {}",
                    claim.runner,
                    relative(claim.until, now)
                ),
            );
        }
    }
}

impl fmt::Display for Rows {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = self.0.iter().map(|(l, _)| l.len() + 1).max().unwrap_or(0);
        for (label, value) in &self.0 {
            let label = if label.is_empty() {
                String::new()
            } else {
                format!("{label}:")
            };
            let mut line = format!("{label:<width$}");
            let mut words = false;
            for word in value.split(' ') {
                // Never before the first word: a label as wide as the line keeps it.
                if words && line.len() + 1 + word.len() > WIDTH {
                    writeln!(f, "{line}")?;
                    line = format!("{:<width$}", "");
                }
                line.push(' ');
                line.push_str(word);
                words = true;
            }
            writeln!(f, "{line}")?;
        }
        Ok(())
    }
}

fn name(collection: &str, id: &Bson) -> String {
    format!("{collection}/{}", show_id(id))
}

impl fmt::Display for DocState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DocState::Held { version } => write!(f, "held by it (version {version})"),
            DocState::Fenced => f.write_str("fenced: its change can no longer land"),
            DocState::CreatedLate => f.write_str("created after the deadline: never counts"),
            DocState::HeldByOther { txn } => write!(f, "held by transaction {txn}"),
            DocState::Finished { version } => write!(f, "finished (version {version})"),
            DocState::AsRead { version } => write!(f, "free at the version read ({version})"),
            DocState::Changed { version } => {
                write!(f, "free, changed by someone else (version {version})")
            }
            DocState::Free { version } => write!(f, "free (version {version})"),
            DocState::Deleted { version } => write!(f, "deleted (tombstone at version {version})"),
            DocState::Missing => f.write_str("absent"),
            DocState::Unreadable => f.write_str("its system fields cannot be read"),
        }
    }
}

impl fmt::Display for DocumentState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}", name(&self.collection, &self.id), self.op)?;
        match (self.expected, self.applied) {
            (Some(e), Some(a)) if e != a => write!(f, " {e}->{a}")?,
            (Some(e), _) => write!(f, " at {e}")?,
            _ => {}
        }
        write!(f, "): {}", self.state)
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rows = Rows::default();
        rows.row("database", &self.database);
        rows.row("records", &self.transactions_collection);
        rows.row("server time", rfc3339(self.now));
        let server = &self.server;
        let about: Vec<&str> = [server.version.as_deref(), server.topology.as_deref()]
            .into_iter()
            .flatten()
            .collect();
        let about = if about.is_empty() {
            String::new()
        } else {
            format!("{}; ", about.join(", "))
        };
        rows.row("server", format!("{about}{}", server.verdict));
        for row in &self.transactions {
            let mut value = row.count.to_string();
            if let (Some(at), Some(age)) = (row.oldest_created, row.oldest_age) {
                value = format!(
                    "{value} ({} expired; oldest written {}, {} ago)",
                    row.expired,
                    rfc3339(at),
                    span(age)
                );
            }
            rows.row(row.state.as_str(), value);
        }
        if self.unreadable_records > 0 {
            rows.row("unreadable", self.unreadable_records.to_string());
        }
        rows.list(
            "held",
            self.held
                .iter()
                .map(|h| format!("{} in {}", h.documents, h.collection)),
            "no managed collection yet",
        );
        match &self.oldest_expired {
            Some(e) => rows.row(
                "oldest expired",
                format!(
                    "{} ({}), deadline {}",
                    e.txn,
                    e.state.map_or("unreadable", |s| s.as_str()),
                    relative(e.deadline, self.now)
                ),
            ),
            None => rows.row("oldest expired", "none"),
        }
        rows.row("GC behind", span(self.gc_behind));
        rows.row("claimed", format!("{} record(s)", self.claimed));
        for c in &self.claims {
            rows.row(
                "",
                format!(
                    "{} ({}) by runner {} until {}",
                    c.txn,
                    c.state.map_or("unreadable", |s| s.as_str()),
                    c.runner,
                    relative(c.until, self.now)
                ),
            );
        }
        write!(f, "{rows}")
    }
}

impl fmt::Display for Explanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rows = Rows::about("document", name(&self.collection, &self.id), self.now);
        rows.row(
            "committed",
            match &self.committed {
                CommittedValue::Live { version, value, .. } => format!(
                    "version {version}: {}",
                    Bson::Document(value.clone()).into_relaxed_extjson()
                ),
                CommittedValue::Deleted { version } => {
                    format!("deleted (tombstone at version {version})")
                }
                CommittedValue::Absent => "absent (reads fail NotFound)".to_string(),
            },
        );
        let Some(hold) = &self.hold else {
            rows.row("held by", "nobody: the document is free");
            return write!(f, "{rows}");
        };
        let mut what = format!("transaction {} ({}", hold.txn, hold.op);
        if hold.fence {
            what.push_str(", a fence");
        }
        if hold.created_late {
            what.push_str(", created after the deadline");
        }
        what.push_str(&format!(", stored version {})", hold.stored_version));
        rows.row("held by", what);
        match &hold.record {
            Some(record) => rows.record(record, self.now),
            None => {
                rows.row("state", "no record");
                if let Some(exp) = hold.hold_deadline {
                    rows.row("deadline", relative(exp, self.now));
                }
            }
        }
        rows.documents("other documents", &hold.others);
        rows.row("next", &hold.next.says);
        if let Some(note) = &hold.note {
            rows.row("note", note);
        }
        write!(f, "{rows}")
    }
}

impl fmt::Display for TxnReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rows = Rows::about("transaction", self.txn.to_hex(), self.now);
        match &self.record {
            Some(record) => rows.record(record, self.now),
            None => rows.row("state", "no record"),
        }
        rows.documents("documents", &self.documents);
        rows.row("next", &self.next.says);
        write!(f, "{rows}")
    }
}

impl fmt::Display for Resolved {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rows = Rows::about("transaction", self.txn.to_hex(), self.now);
        rows.row(
            "was",
            match &self.before {
                Some(r) => format!(
                    "{}, deadline {}",
                    r.state.as_str(),
                    relative(r.deadline, self.now)
                ),
                None => "no record".to_string(),
            },
        );
        rows.row("did", &self.says);
        rows.row(
            "record",
            match &self.record_after {
                Some(r) => format!("{} (still there)", r.state.as_str()),
                None => "deleted".to_string(),
            },
        );
        rows.documents("documents", &self.documents);
        write!(f, "{rows}")
    }
}
