//! Adopts a collection of plain documents (written without mongotx's system fields) online:
//! stamps every document its schema accepts, in batches, with a progress bar, and prints what it
//! did. Idempotent and resumable: run it again after an interruption, or to pick up plain
//! documents other writers added since. `--dry-run` reads and reports without writing anything.
//!
//! The schema given is the one of the plain documents' shape: they are stamped with
//! `--schema-version` (upgrade steps are code, so a collection whose legacy documents need them
//! is adopted from the service, with `Repository::adopt`).

#[path = "shared/cli.rs"]
mod cli;

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use mongotx::adopt::{AdoptOptions, AdoptReport};
use mongotx::{CollectionSpec, Store};

/// Stamps the plain documents of a collection so that mongotx manages them.
#[derive(Debug, Parser)]
#[command(name = "mongotx-adopt", version)]
struct Args {
    /// Connection string of the server.
    #[arg(long, env = "MONGODB_URI")]
    uri: String,
    /// Database of the collection.
    #[arg(long, value_parser = cli::database_name)]
    db: String,
    /// The collection to adopt.
    #[arg(long, value_parser = cli::collection_name)]
    collection: String,
    /// The collection's JSON Schema (system fields declared, as for `CollectionSpec::new`).
    #[arg(long)]
    schema: PathBuf,
    /// The schema version the plain documents are stamped with (the schema file's version).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(i64).range(1..))]
    schema_version: i64,
    /// Plain documents per batch (one read and one stamping command each).
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    batch_size: u32,
    /// Read and check every plain document, write nothing, report what a run would do.
    #[arg(long)]
    dry_run: bool,
    /// How many refused documents to list (all are counted).
    #[arg(long, default_value_t = 20)]
    listed_refusals: usize,
    /// No progress bar (for logs).
    #[arg(long)]
    quiet: bool,
    /// How long to look for the server before giving up (more than zero, at most an hour).
    #[arg(long, default_value = "10s", value_parser = cli::connect_timeout)]
    connect_timeout: Duration,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let fail = |message: String| -> ! {
        eprintln!("mongotx-adopt: {}", cli::one_line(&message));
        std::process::exit(2);
    };
    let schema = std::fs::read_to_string(&args.schema).unwrap_or_else(|e| {
        fail(format!(
            "cannot read --schema {}: {e}",
            args.schema.display()
        ))
    });
    let spec = CollectionSpec::new(args.collection.clone(), args.schema_version, &schema)
        .unwrap_or_else(|e| fail(format!("--schema {}: {e}", args.schema.display())))
        .plain_documents(args.schema_version);
    // Every older version would need an upgrade step, which a command line cannot give: the
    // schema file is the plain documents' own, so their version is the spec's current one.
    let spec = (2..=args.schema_version).fold(spec, |spec, v| spec.upgrade(v - 1, Ok));
    let client = cli::connect(&args.uri, "--uri", "mongotx-adopt", args.connect_timeout)
        .await
        .unwrap_or_else(|message| fail(message));
    let db = client.database(&args.db);
    cli::ping(&db).await.unwrap_or_else(|message| fail(message));

    let bar = if args.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(0)
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} plain documents checked ({per_sec}) {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let progress_bar = bar.clone();
    let options = AdoptOptions::new()
        .batch_size(args.batch_size)
        .dry_run(args.dry_run)
        .listed_refusals(args.listed_refusals)
        .progress(move |report: &AdoptReport| {
            progress_bar.set_length(report.plain_at_start.max(report.examined));
            progress_bar.set_position(report.examined);
            progress_bar.set_message(format!(
                "{} {}, {} refused",
                report.stamped,
                if report.dry_run {
                    "to stamp"
                } else {
                    "stamped"
                },
                report.refused
            ));
        });
    let store = Store::new(db);
    let report = store.adopt(spec, options).await.unwrap_or_else(|e| {
        bar.abandon();
        fail(e.to_string())
    });
    bar.finish_and_clear();
    // Retracts the store's announcement in the registry: a run that exits without it leaves it
    // there for a day, one more per run (the soak run found 116 of them after 10 minutes).
    store.shutdown(Duration::from_secs(2)).await;
    print_report(&args, &report);
}

fn print_report(args: &Args, report: &AdoptReport) {
    let verb = if report.dry_run {
        "would stamp"
    } else {
        "stamped"
    };
    println!(
        "{}{}.{}: {} plain documents at start, {} checked",
        if report.dry_run { "dry run, " } else { "" },
        args.db,
        args.collection,
        report.plain_at_start,
        report.examined
    );
    println!("  {verb}: {}", report.stamped);
    println!("  already stamped: {}", report.already_stamped);
    println!("  refused by the schema (left plain): {}", report.refused);
    for refusal in &report.refusals {
        println!("    {}: `{}` {}", refusal.id, refusal.field, refusal.rule);
    }
    if report.refused > report.refusals.len() as u64 {
        println!(
            "    ... and {} more",
            report.refused - report.refusals.len() as u64
        );
    }
    if report.unreadable > 0 {
        println!(
            "  not plain, not readable (a field named like a system field; rename it first): {}",
            report.unreadable
        );
        for id in &report.unreadable_ids {
            println!("    {id}");
        }
    }
    if report.vanished > 0 {
        println!("  deleted by another writer meanwhile: {}", report.vanished);
    }
}
