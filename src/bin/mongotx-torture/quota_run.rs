//! Quota consumes in a torture run (`run --quota-workers N`): a two-level hierarchy of providers
//! in the bank's own database, and quota-worker processes (the `quota-worker` role) consuming and
//! releasing across it under the run's kills, resets and late deliveries, beside the transfers.
//! Their transactions share the records' collection and the GC runners with the bank's, so a GC
//! round settles both, and with `--previous` both versions consume from the same providers.
//!
//! At the end, once the run's recovery has settled every transaction the kills left (no record,
//! no held provider) and a quota sweep has run, the stored providers must show what
//! `tests/it/quota_crash.rs` checks after its killed workers: in every document the usage is the
//! sum of its entries and within its limit, the stripes of a provider share exactly its limit, a
//! domain's usage is the sum of its projects', and every request is on all six of its providers
//! or on none. The current build's [`Quota::provider`] must also read every provider with the
//! usage stored, whichever version wrote it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use bson::{doc, Document};
use futures::TryStreamExt;
use mongotx::collections::PROVIDERS_COLLECTION;
use mongotx::fields;
use mongotx::quota::{NewProvider, Quota};
use mongotx::Store;

use crate::children::{Kind, Slot, Version};

/// The resources every request takes, one of each.
const RESOURCES: [&str; 3] = ["cores", "ram", "disk"];
/// The projects, each a child of the one domain.
const PROJECTS: [&str; 2] = ["project/a", "project/b"];
const DOMAIN: &str = "domain";
/// A project's limit: a worker takes up to 30 of each resource per request and releases about
/// half as often as it consumes, so the limits are reached within seconds and refusals are part
/// of the run.
const PROJECT_LIMIT: i64 = 400;
/// The domain's limit, below its projects' together: the parent's limit binds too.
const DOMAIN_LIMIT: i64 = 600;

/// The quota of a run: its handle on the run's direct connection (no faults).
pub(crate) struct QuotaRun {
    quota: Quota,
    db: mongodb::Database,
}

impl QuotaRun {
    /// Creates the hierarchy (a domain and two projects, for each resource) in the bank's
    /// database.
    pub(crate) async fn create(store: &Store, db: &mongodb::Database) -> Result<QuotaRun, String> {
        let quota = Quota::open(store)
            .await
            .map_err(|e| format!("open quota: {e}"))?;
        for resource in RESOURCES {
            quota
                .create(NewProvider::new((DOMAIN, resource), DOMAIN_LIMIT))
                .await
                .map_err(|e| format!("create {DOMAIN}:{resource}: {e}"))?;
            for project in PROJECTS {
                quota
                    .create(
                        NewProvider::new((project, resource), PROJECT_LIMIT)
                            .parent((DOMAIN, resource)),
                    )
                    .await
                    .map_err(|e| format!("create {project}:{resource}: {e}"))?;
            }
        }
        Ok(QuotaRun {
            quota,
            db: db.clone(),
        })
    }

    /// The `quota-worker` role's arguments (after the role's name) for a worker reaching the
    /// server at `uri`.
    pub(crate) fn worker_args(uri: &str, db: &str, txn_timeout: Duration) -> Vec<String> {
        vec![
            "quota-worker".into(),
            "--uri".into(),
            uri.into(),
            "--db".into(),
            db.into(),
            "--projects".into(),
            PROJECTS.join(","),
            "--resources".into(),
            RESOURCES.join(","),
            "--txn-timeout".into(),
            format!("{}ms", txn_timeout.as_millis()),
        ]
    }

    /// After the run's recovery: sweeps, then checks the stored providers (see the module doc).
    /// Returns the lines of the results and the invariants broken.
    pub(crate) async fn verify(
        &self,
        slots: &[Slot],
    ) -> Result<(Vec<String>, Vec<String>), String> {
        // Nothing expires here (the workers consume, they do not reserve), but the sweep is
        // what a GC runner does next, and it must find the providers as the workers left them.
        let swept = self
            .quota
            .sweep()
            .await
            .map_err(|e| format!("quota sweep: {e}"))?;
        let docs: Vec<Document> = self
            .db
            .collection::<Document>(PROVIDERS_COLLECTION)
            .find(doc! {})
            .await
            .map_err(|e| format!("read the providers: {e}"))?
            .try_collect()
            .await
            .map_err(|e| format!("read the providers: {e}"))?;
        let mut found = check(&docs);
        for (key, stored) in &found.usage {
            match self.quota.provider((key.0.as_str(), key.1.as_str())).await {
                Ok(read) if read.usage == *stored => {}
                Ok(read) => found.problems.push(format!(
                    "{}:{}: the current build reads usage {}, stored {stored}",
                    key.0, key.1, read.usage
                )),
                Err(e) => found.problems.push(format!(
                    "{}:{}: the current build cannot read it: {e}",
                    key.0, key.1
                )),
            }
        }

        // Consumers are named `w<pid>-<n>` by the worker that made them.
        let versions: HashMap<u32, Version> = slots
            .iter()
            .filter(|s| s.recipe.kind == Kind::Quota)
            .flat_map(|s| s.pids.iter().map(|pid| (*pid, s.recipe.version)))
            .collect();
        let mut holders = BTreeMap::<Option<Version>, usize>::new();
        for consumer in &found.consumers {
            let version = consumer
                .strip_prefix('w')
                .and_then(|rest| rest.split_once('-'))
                .and_then(|(pid, _)| pid.parse::<u32>().ok())
                .and_then(|pid| versions.get(&pid).copied());
            *holders.entry(version).or_default() += 1;
        }
        let count = |version| holders.get(&version).copied().unwrap_or(0);
        let mut lines = vec![format!(
            "  quota: {} providers in {} documents; consumers holding quota at the end: {} (current version {}, previous version {}, unknown {}); sweep: {} expired",
            found.usage.len(),
            docs.len(),
            found.consumers.len(),
            count(Some(Version::Current)),
            count(Some(Version::Previous)),
            count(None),
            swept.expired
        )];
        // A broken invariant usually breaks it for many requests: the first few say enough.
        if found.problems.len() > 5 {
            let more = found.problems.len() - 5;
            found.problems.truncate(5);
            found.problems.push(format!("and {more} more"));
        }
        lines.push(if found.problems.is_empty() {
            "  quota invariants: held (usage = allocations, domains = sum of projects, within every limit, each request on all its providers or none)".to_string()
        } else {
            format!("  quota invariants: broken: {}", found.problems.join("; "))
        });
        let problems = found
            .problems
            .iter()
            .map(|p| format!("quota: {p}"))
            .collect();
        Ok((lines, problems))
    }
}

/// What the stored providers show.
#[derive(Debug, Default)]
struct Found {
    /// Usage per provider (scope, resource), its stripes' summed.
    usage: BTreeMap<(String, String), i64>,
    /// Every consumer holding something.
    consumers: BTreeSet<String>,
    problems: Vec<String>,
}

/// Checks the stored provider documents against the invariants of the module doc (no I/O).
fn check(docs: &[Document]) -> Found {
    let mut found = Found::default();
    let mut limits = BTreeMap::<(String, String), i64>::new();
    // The documents each (consumer, request) holds a positive amount in.
    let mut places = BTreeMap::<(String, String), usize>::new();
    for doc in docs {
        match entries(doc) {
            Ok((key, limit, usage, held)) => {
                if doc.contains_key(fields::ACTIVE_TXN) {
                    found.problems.push(format!("left held: {doc}"));
                }
                let sum: i64 = held.iter().map(|(_, n)| n).sum();
                if usage != sum {
                    found
                        .problems
                        .push(format!("usage {usage} is not its entries' {sum}: {doc}"));
                }
                if sum > limit {
                    found.problems.push(format!("over its limit: {doc}"));
                }
                for (holder, n) in held {
                    if n > 0 {
                        found.consumers.insert(holder.0.clone());
                        *places.entry(holder).or_default() += 1;
                    }
                }
                *limits.entry(key.clone()).or_default() += limit;
                *found.usage.entry(key).or_default() += sum;
            }
            Err(why) => found.problems.push(format!("{why}: {doc}")),
        }
    }
    for resource in RESOURCES {
        let scopes = std::iter::once((DOMAIN, DOMAIN_LIMIT))
            .chain(PROJECTS.iter().map(|p| (*p, PROJECT_LIMIT)));
        for (scope, limit) in scopes {
            let key = (scope.to_string(), resource.to_string());
            match limits.get(&key) {
                Some(shares) if *shares == limit => {}
                Some(shares) => found.problems.push(format!(
                    "{scope}:{resource}: its stripes' limits add up to {shares}, not {limit}"
                )),
                None => found
                    .problems
                    .push(format!("{scope}:{resource}: no such provider")),
            }
        }
        let usage = |scope: &str| {
            found
                .usage
                .get(&(scope.to_string(), resource.to_string()))
                .copied()
                .unwrap_or(0)
        };
        let children: i64 = PROJECTS.iter().map(|p| usage(p)).sum();
        if usage(DOMAIN) != children {
            found.problems.push(format!(
                "{resource}: the domain's usage {} is not its projects' {children}",
                usage(DOMAIN)
            ));
        }
    }
    // A request takes every resource of one project, so it is on its project's providers and
    // the domain's: 2 per resource.
    let providers = 2 * RESOURCES.len();
    for ((consumer, request), n) in &places {
        if *n != providers {
            found.problems.push(format!(
                "request {consumer}/{request} is on {n} of its {providers} providers"
            ));
        }
    }
    found
}

/// A provider document's (scope, resource), limit, usage, and its entries' (consumer, request)
/// and amount.
type Entries = ((String, String), i64, i64, Vec<((String, String), i64)>);

fn entries(doc: &Document) -> Result<Entries, String> {
    let bad = |what: &str| format!("a provider document without {what}");
    let id = doc
        .get_document("_id")
        .map_err(|_| bad("an _id document"))?;
    let key = (
        id.get_str("scope").map_err(|_| bad("a scope"))?.to_string(),
        id.get_str("resource")
            .map_err(|_| bad("a resource"))?
            .to_string(),
    );
    let limit = doc.get_i64("limit").map_err(|_| bad("a limit"))?;
    let usage = doc.get_i64("usage").map_err(|_| bad("a usage"))?;
    let mut held = Vec::new();
    for entry in doc.get_array("held").map_err(|_| bad("held entries"))? {
        let entry = entry.as_document().ok_or_else(|| bad("entry documents"))?;
        let holder = (
            entry.get_str("c").map_err(|_| bad("an entry's consumer"))?,
            entry.get_str("r").map_err(|_| bad("an entry's request"))?,
        );
        let n = entry.get_i64("n").map_err(|_| bad("an entry's amount"))?;
        held.push(((holder.0.to_string(), holder.1.to_string()), n));
    }
    Ok((key, limit, usage, held))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn provider(scope: &str, resource: &str, limit: i64, held: &[(&str, i64)]) -> Document {
        let entries: Vec<Document> = held
            .iter()
            .map(|(c, n)| doc! { "c": *c, "r": "r1", "n": *n })
            .collect();
        doc! {
            "_id": { "scope": scope, "resource": resource },
            "limit": limit,
            "usage": held.iter().map(|(_, n)| n).sum::<i64>(),
            "held": entries,
        }
    }

    fn hierarchy(domain: &[(&str, i64)], project_a: &[(&str, i64)]) -> Vec<Document> {
        let mut docs = Vec::new();
        for resource in RESOURCES {
            docs.push(provider(DOMAIN, resource, DOMAIN_LIMIT, domain));
            docs.push(provider(PROJECTS[0], resource, PROJECT_LIMIT, project_a));
            docs.push(provider(PROJECTS[1], resource, PROJECT_LIMIT, &[]));
        }
        docs
    }

    #[test]
    fn a_request_mirrored_in_its_parents_passes() {
        let found = check(&hierarchy(&[("w1-0", 5)], &[("w1-0", 5)]));
        assert!(found.problems.is_empty(), "{:?}", found.problems);
        assert_eq!(found.consumers.len(), 1);
    }

    #[test]
    fn a_parent_that_does_not_mirror_its_child_fails() {
        let found = check(&hierarchy(&[], &[("w1-0", 5)]));
        assert!(
            found
                .problems
                .iter()
                .any(|p| p.contains("not its projects'")),
            "{:?}",
            found.problems
        );
        assert!(found
            .problems
            .iter()
            .any(|p| p.contains("of its 6 providers")));
    }

    #[test]
    fn usage_off_its_entries_a_held_provider_and_a_missing_one_fail() {
        let mut docs = hierarchy(&[], &[]);
        docs[0].insert("usage", 7_i64);
        docs[1].insert(fields::ACTIVE_TXN, "t1");
        docs.pop();
        let problems = check(&docs).problems.join("\n");
        assert!(problems.contains("is not its entries'"), "{problems}");
        assert!(problems.contains("left held"), "{problems}");
        assert!(problems.contains("no such provider"), "{problems}");
    }

    #[test]
    fn a_document_over_its_limit_fails() {
        let over = [("w1-0", PROJECT_LIMIT + 1)];
        let found = check(&hierarchy(&over, &over));
        assert!(found.problems.iter().any(|p| p.contains("over its limit")));
    }
}
