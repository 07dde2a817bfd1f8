//! Bad command lines: every binary refuses bad flags, bad values and bad connection strings with
//! one clear line on stderr and a non-zero exit code, without panicking or hanging.
//!
//! The rule every case is held to (`assert_refused`):
//!
//! - the process ends within [`LIMIT`] (it is killed otherwise, failing the case) with a non-zero
//!   exit code (clap's is 2; a tool's own refusal is 1 or 2, checked where it is documented);
//! - stderr is not empty, and has no "panicked", no "RUST_BACKTRACE" and none of the marks of a
//!   driver error's debug dump ("Kind:", "labels:", "Error {");
//! - stderr's *meaningful* content is exactly one line. Blank lines do not count, nor do the
//!   hints clap prints after its error line: a line starting "Usage:", one starting "For more
//!   information, try", and clap's indented lists ("  [possible values: ...]",
//!   "  [subcommands: ...]", "  tip: ..."), and the indented flags clap lists under its line
//!   "error: the following required arguments were not provided:" (they are that line's end).
//!   Any other line counts, so a multi-line message or an indented debug dump fails the case;
//! - that line contains what the case expects (the flag or the problem it names).
//!
//! No case needs a server: each is refused while parsing its command line, or by a connection
//! string that does not parse, or by one naming a closed port (127.0.0.1:1) with a short
//! `--connect-timeout` (the demo example: `MONGOTX_CONNECT_TIMEOUT`). `MONGODB_URI`,
//! `MONGOTX_CONNECT_TIMEOUT` and `RUST_LOG` are removed from (or set in) each child's
//! environment, so the runner's own settings change nothing.

use std::time::{Duration, Instant};

use tokio::process::Command;

/// The longest a refusal may take; the unreachable cases wait at most a few seconds.
const LIMIT: Duration = Duration::from_secs(30);

const GC: &str = env!("CARGO_BIN_EXE_mongotx-gc");
const PROBE: &str = env!("CARGO_BIN_EXE_mongotx-probe");
const BENCH: &str = env!("CARGO_BIN_EXE_mongotx-bench");
const TORTURE: &str = env!("CARGO_BIN_EXE_mongotx-torture");
const ADOPT: &str = env!("CARGO_BIN_EXE_mongotx-adopt");

/// Nothing listens on port 1 of the loopback: a connection there is refused at once.
const UNREACHABLE: &str = "mongodb://127.0.0.1:1";

/// One bad command line and what its refusal must say.
struct Case<'a> {
    program: &'a str,
    args: &'a [&'a str],
    /// `MONGODB_URI` for the child (`None`: removed).
    uri_env: Option<&'a str>,
    /// `MONGOTX_CONNECT_TIMEOUT` for the child (`None`: removed).
    timeout_env: Option<&'a str>,
    /// Text the meaningful line must contain.
    says: &'a str,
    /// The exact exit code, where the tool documents one.
    code: Option<i32>,
}

fn case<'a>(program: &'a str, args: &'a [&'a str], says: &'a str) -> Case<'a> {
    Case {
        program,
        args,
        uri_env: None,
        timeout_env: None,
        says,
        code: None,
    }
}

/// Whether `line` is one of the hints clap prints after its error line.
fn clap_hint(line: &str) -> bool {
    line.starts_with("Usage:")
        || line.starts_with("For more information, try")
        || line.starts_with("  [possible values:")
        || line.starts_with("  [subcommands:")
        || line.starts_with("  tip:")
}

/// Runs `case` and checks the rule of the module doc; returns how many cases it checked (1).
async fn assert_refused(case: Case<'_>) -> usize {
    let name = case.program.rsplit('/').next().unwrap_or(case.program);
    let what = format!("{name} {:?} (MONGODB_URI {:?})", case.args, case.uri_env);
    let mut command = Command::new(case.program);
    command
        .args(case.args)
        .env_remove("RUST_LOG")
        .env_remove("MONGODB_URI")
        .env_remove("MONGOTX_CONNECT_TIMEOUT")
        .env("RUST_BACKTRACE", "0")
        .kill_on_drop(true);
    if let Some(uri) = case.uri_env {
        command.env("MONGODB_URI", uri);
    }
    if let Some(timeout) = case.timeout_env {
        command.env("MONGOTX_CONNECT_TIMEOUT", timeout);
    }
    let started = Instant::now();
    let output = tokio::time::timeout(LIMIT, command.output())
        .await
        .unwrap_or_else(|_| panic!("{what}: still running after {LIMIT:?}"))
        .unwrap_or_else(|e| panic!("{what}: cannot run: {e}"));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "{what}: exited 0; stderr: {stderr}"
    );
    assert!(
        output.status.code().is_some(),
        "{what}: ended by a signal ({:?}); stderr: {stderr}",
        output.status
    );
    if let Some(code) = case.code {
        assert_eq!(
            output.status.code(),
            Some(code),
            "{what}: wrong exit code; stderr: {stderr}"
        );
    }
    assert!(!stderr.trim().is_empty(), "{what}: nothing on stderr");
    for mark in ["panicked", "RUST_BACKTRACE", "Kind:", "labels:", "Error {"] {
        assert!(
            !stderr.contains(mark),
            "{what}: stderr has {mark:?}: {stderr}"
        );
    }
    let mut meaningful: Vec<&str> = Vec::new();
    let mut listing_missing = false;
    for line in stderr.lines() {
        if line.trim().is_empty() || clap_hint(line) {
            listing_missing = false;
            continue;
        }
        // Clap's list of missing arguments: "  --db <DB>", "  <COMMAND>".
        let listed = line.starts_with("  --") || line.starts_with("  <");
        if listing_missing && listed {
            continue;
        }
        listing_missing = line.ends_with("were not provided:");
        meaningful.push(line);
    }
    assert_eq!(
        meaningful.len(),
        1,
        "{what}: stderr should say one thing on one line, got {meaningful:#?}"
    );
    assert!(
        meaningful[0].contains(case.says),
        "{what}: {:?} does not say {:?}",
        meaningful[0],
        case.says
    );
    eprintln!(
        "{what}: refused in {:?} with {:?}",
        started.elapsed(),
        meaningful[0]
    );
    1
}

/// `mongotx-gc`: flags clap refuses (unknown, missing value, not a number, out of range, bad
/// durations, a bad address), values the runner refuses (an empty database name, a zero
/// interval, a collection MongoDB would refuse), a connection string that does not parse, and
/// a server that cannot be reached (exit 1 within the connect timeout, as docs/guarantees.md says).
#[tokio::test]
async fn the_gc_runner_refuses_bad_command_lines() {
    // No database of its own, but it loads the machine: a latency test waits for it.
    let _share = crate::common::machine::share();
    let base = ["--uri", "mongodb://localhost", "--db", "d"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        base.iter().chain(extra.iter()).copied().collect::<Vec<_>>()
    };
    let bogus = with(&["--bogus"]);
    let batch_text = with(&["--batch-size", "abc"]);
    let batch_zero = with(&["--batch-size", "0"]);
    let batch_huge = with(&["--batch-size", "1000000"]);
    let interval_zero = with(&["--interval", "0s"]);
    let interval_negative = with(&["--interval=-5s"]);
    let interval_exponent = with(&["--interval", "1e400s"]);
    let interval_empty = with(&["--interval", ""]);
    let retention_overflow = with(&["--tombstone-retention", "99999999999999999999d"]);
    let connect_zero = with(&["--connect-timeout", "0ms"]);
    let grace_zero = with(&["--version-floor-grace", "0s"]);
    let records_dollar = with(&["--transactions-collection", "a$b"]);
    let metrics_garbage = with(&["--metrics-addr", "nope"]);
    let cases = [
        case(GC, &bogus, "unexpected argument '--bogus'"),
        case(GC, &["--uri"], "a value is required for '--uri"),
        case(
            GC,
            &["--uri", "mongodb://localhost"],
            "the following required arguments were not provided",
        ),
        case(GC, &batch_text, "invalid value 'abc' for '--batch-size"),
        case(GC, &batch_zero, "0 is not in 1..=100000"),
        case(GC, &batch_huge, "1000000 is not in 1..=100000"),
        case(GC, &interval_zero, "must be more than zero"),
        case(GC, &interval_negative, "not a duration"),
        case(GC, &interval_exponent, "\"1e400s\" is not a duration"),
        case(GC, &interval_empty, "not a duration"),
        case(GC, &retention_overflow, "number is too large"),
        case(GC, &connect_zero, "must be more than zero"),
        case(GC, &grace_zero, "must be more than zero"),
        case(GC, &records_dollar, "'$'"),
        case(GC, &metrics_garbage, "invalid socket address"),
        case(
            GC,
            &["--uri", "mongodb://localhost", "--db", ""],
            "a database name cannot be empty",
        ),
        case(
            GC,
            &["--uri", "mongodb://localhost", "--db", "a.b"],
            "cannot contain '.'",
        ),
        Case {
            code: Some(1),
            ..case(GC, &["--uri", "notauri", "--db", "d"], "bad --uri")
        },
        Case {
            code: Some(1),
            ..case(
                GC,
                &["--uri", "mongodb://h:99999", "--db", "d"],
                "the port must be an integer",
            )
        },
        Case {
            code: Some(1),
            ..case(GC, &["--uri", "mongodb://", "--db", "d"], "bad --uri")
        },
        Case {
            code: Some(1),
            ..case(
                GC,
                &[
                    "--uri",
                    UNREACHABLE,
                    "--db",
                    "d",
                    "--once",
                    "--connect-timeout",
                    "300ms",
                ],
                "cannot reach the server at 127.0.0.1:1",
            )
        },
    ];
    let mut checked = 0;
    for c in cases {
        checked += assert_refused(c).await;
    }
    assert!(checked >= 20, "{checked}");
}

/// `mongotx-probe`: an unknown flag, task counts that cannot race (0, 1) or are not numbers, a
/// database name MongoDB refuses, a connection string that does not parse (exit 2) and an
/// unreachable server given a short `--connect-timeout` (exit 2, instead of the driver's 30 s
/// per operation).
#[tokio::test]
async fn the_probe_refuses_bad_command_lines() {
    // No database of its own, but it loads the machine: a latency test waits for it.
    let _share = crate::common::machine::share();
    let cases = [
        case(PROBE, &["--bogus"], "unexpected argument '--bogus'"),
        case(
            PROBE,
            &["--uri", UNREACHABLE, "--tasks", "0"],
            "0 is not in 2..=10000",
        ),
        case(
            PROBE,
            &["--uri", UNREACHABLE, "--tasks", "1"],
            "1 is not in 2..=10000",
        ),
        case(
            PROBE,
            &["--uri", UNREACHABLE, "--tasks", "lots"],
            "invalid value 'lots' for '--tasks",
        ),
        case(
            PROBE,
            &["--uri", UNREACHABLE, "--db", "a/b"],
            "cannot contain '/'",
        ),
        case(
            PROBE,
            &["--uri", UNREACHABLE, "--connect-timeout", "soon"],
            "not a duration",
        ),
        Case {
            code: Some(2),
            ..case(PROBE, &["--uri", "notauri"], "bad --uri")
        },
        Case {
            code: Some(2),
            ..case(
                PROBE,
                &["--uri", UNREACHABLE, "--connect-timeout", "300ms"],
                "cannot reach the server at 127.0.0.1:1",
            )
        },
    ];
    let mut checked = 0;
    for c in cases {
        checked += assert_refused(c).await;
    }
    assert_eq!(checked, 8);
}

/// `mongotx-adopt`: missing and unknown flags, names MongoDB refuses, a batch size of 0, a schema
/// file that is missing or not a usable schema (exit 2 before connecting), a connection string
/// that does not parse and an unreachable server (exit 2).
#[tokio::test]
async fn the_adopt_command_refuses_bad_command_lines() {
    // No database of its own, but it loads the machine: a latency test waits for it.
    let _share = crate::common::machine::share();
    const SCHEMA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/schemas/accounts.json");
    const NOT_A_SCHEMA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let cases = [
        case(ADOPT, &["--bogus"], "unexpected argument '--bogus'"),
        case(
            ADOPT,
            &["--uri", UNREACHABLE, "--db", "d", "--schema", SCHEMA],
            "the following required arguments were not provided",
        ),
        case(
            ADOPT,
            &[
                "--uri",
                UNREACHABLE,
                "--db",
                "a.b",
                "--collection",
                "c",
                "--schema",
                SCHEMA,
            ],
            "cannot contain '.'",
        ),
        case(
            ADOPT,
            &[
                "--uri",
                UNREACHABLE,
                "--db",
                "d",
                "--collection",
                "system.x",
                "--schema",
                SCHEMA,
            ],
            "the system. prefix is reserved",
        ),
        case(
            ADOPT,
            &[
                "--uri",
                UNREACHABLE,
                "--db",
                "d",
                "--collection",
                "c",
                "--schema",
                SCHEMA,
                "--batch-size",
                "0",
            ],
            "0 is not in 1..=100000",
        ),
        case(
            ADOPT,
            &[
                "--uri",
                UNREACHABLE,
                "--db",
                "d",
                "--collection",
                "c",
                "--schema",
                SCHEMA,
                "--schema-version",
                "0",
            ],
            "0 is not in 1..",
        ),
        Case {
            code: Some(2),
            ..case(
                ADOPT,
                &[
                    "--uri",
                    UNREACHABLE,
                    "--db",
                    "d",
                    "--collection",
                    "c",
                    "--schema",
                    "/nonexistent.json",
                ],
                "cannot read --schema /nonexistent.json",
            )
        },
        Case {
            code: Some(2),
            ..case(
                ADOPT,
                &[
                    "--uri",
                    UNREACHABLE,
                    "--db",
                    "d",
                    "--collection",
                    "c",
                    "--schema",
                    NOT_A_SCHEMA,
                ],
                "schema is not a JSON object",
            )
        },
        Case {
            code: Some(2),
            ..case(
                ADOPT,
                &[
                    "--uri",
                    "notauri",
                    "--db",
                    "d",
                    "--collection",
                    "c",
                    "--schema",
                    SCHEMA,
                ],
                "bad --uri",
            )
        },
        Case {
            code: Some(2),
            ..case(
                ADOPT,
                &[
                    "--uri",
                    UNREACHABLE,
                    "--db",
                    "d",
                    "--collection",
                    "c",
                    "--schema",
                    SCHEMA,
                    "--connect-timeout",
                    "300ms",
                ],
                "cannot reach the server at 127.0.0.1:1",
            )
        },
    ];
    let mut checked = 0;
    for c in cases {
        checked += assert_refused(c).await;
    }
    assert_eq!(checked, 10);
}

/// The demo example's executable, which `cargo test` builds with the examples:
/// `target/<profile>/examples/demo`, beside this test's `target/<profile>/deps/it-<hash>`.
fn demo_example() -> String {
    let test = std::env::current_exe().expect("the test's own path");
    let profile = test
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test runs from target/<profile>/deps");
    let demo = profile
        .join("examples")
        .join(format!("demo{}", std::env::consts::EXE_SUFFIX));
    assert!(
        demo.is_file(),
        "{} is missing: a plain `cargo test` builds the examples, a filtered one such as \
         `cargo test --test it bad_input_cli::` does not (run `cargo build --examples` first)",
        demo.display()
    );
    demo.to_string_lossy().into_owned()
}

/// The demo example (`examples/demo/`) and `mongotx-bench` take their server
/// from `MONGODB_URI` (or start the local one): bad arguments are refused before any server is
/// started; a `MONGODB_URI` that does not parse, or names a server that cannot be reached within
/// the connect timeout (the example's `MONGOTX_CONNECT_TIMEOUT`, the bench's `--connect-timeout`),
/// is one line and exit 1 (the bench once printed its errors' Debug form, from `main` returning
/// them).
#[tokio::test]
async fn the_demo_and_the_bench_refuse_bad_command_lines() {
    // No database of its own, but it loads the machine: a latency test waits for it.
    let _share = crate::common::machine::share();
    let demo = demo_example();
    let demo = demo.as_str();
    let cases = [
        Case {
            code: Some(1),
            ..case(demo, &["--bogus"], "unexpected argument \"--bogus\"")
        },
        Case {
            code: Some(1),
            ..case(demo, &["--db"], "--db needs a value")
        },
        Case {
            code: Some(1),
            ..case(demo, &["--db", ""], "a database name has 1 to 63 bytes")
        },
        Case {
            code: Some(1),
            ..case(demo, &["--db", "a/b"], "cannot contain '/'")
        },
        Case {
            timeout_env: Some("-"),
            code: Some(1),
            ..case(demo, &[], "EXAMPLE FAILED: bad MONGOTX_CONNECT_TIMEOUT")
        },
        Case {
            uri_env: Some("notauri"),
            code: Some(1),
            ..case(demo, &[], "EXAMPLE FAILED: bad MONGODB_URI")
        },
        Case {
            uri_env: Some(UNREACHABLE),
            timeout_env: Some("300ms"),
            code: Some(1),
            ..case(
                demo,
                &[],
                "EXAMPLE FAILED: cannot reach the server at 127.0.0.1:1",
            )
        },
        case(BENCH, &["--n", "0"], "0 is not in 1..=10000000"),
        case(BENCH, &["--n", "many"], "invalid value 'many' for '--n"),
        case(BENCH, &["--seconds", "0"], "0 is not in 1..=3600"),
        case(BENCH, &["--net-samples=-1"], "invalid value '-1'"),
        case(BENCH, &["--latencies", "1,x"], "invalid value 'x'"),
        case(
            BENCH,
            &["--latencies", "99999999"],
            "99999999 is not in 0..=10000",
        ),
        case(
            BENCH,
            &["--only", "everything"],
            "invalid value 'everything'",
        ),
        Case {
            uri_env: Some("mongodb://:27017"),
            code: Some(1),
            ..case(BENCH, &[], "mongotx-bench: bad MONGODB_URI")
        },
        Case {
            uri_env: Some(UNREACHABLE),
            code: Some(1),
            ..case(
                BENCH,
                &["--connect-timeout", "300ms"],
                "cannot reach the server at 127.0.0.1:1",
            )
        },
    ];
    let mut checked = 0;
    for c in cases {
        checked += assert_refused(c).await;
    }
    assert_eq!(checked, 16);
}

/// `mongotx-torture`: no role at all, counts that would make a role panic (one account, no
/// processes), a share outside 0..1, durations that are zero or would overflow a deadline, an
/// opening total past 64 bits, a previous version's directory without its binaries, a connection
/// string that does not parse, and a server that cannot be reached (the roles give up after 5 s,
/// as the run expects of them).
#[tokio::test]
async fn the_torture_refuses_bad_command_lines() {
    // No database of its own, but it loads the machine: a latency test waits for it.
    let _share = crate::common::machine::share();
    let bank = |extra: &[&'static str]| -> Vec<&'static str> {
        [
            "worker",
            "--uri",
            UNREACHABLE,
            "--db",
            "d",
            "--accounts",
            "3",
        ]
        .iter()
        .chain(extra.iter())
        .copied()
        .collect::<Vec<_>>()
    };
    let txn_timeout_zero = bank(&["--txn-timeout", "0s"]);
    let collections_zero = bank(&["--collections", "0"]);
    let unreachable_worker = bank(&[]);
    let cases = [
        case(TORTURE, &[], "requires a subcommand"),
        case(TORTURE, &["sideways"], "unrecognized subcommand 'sideways'"),
        case(
            TORTURE,
            &[
                "worker",
                "--uri",
                UNREACHABLE,
                "--db",
                "d",
                "--accounts",
                "1",
            ],
            "1 is not in 2..=100000",
        ),
        case(
            TORTURE,
            &[
                "checker",
                "--uri",
                UNREACHABLE,
                "--db",
                "d",
                "--accounts",
                "x",
                "--total",
                "1",
            ],
            "\"x\" is not a whole number",
        ),
        case(TORTURE, &txn_timeout_zero, "must be more than zero"),
        case(TORTURE, &collections_zero, "0 is not in 1..=64"),
        case(
            TORTURE,
            &["run", "--late-rate", "2"],
            "is not between 0 and 1",
        ),
        case(
            TORTURE,
            &["run", "--late-rate", "NaN"],
            "is not between 0 and 1",
        ),
        case(TORTURE, &["run", "--workers", "0"], "0 is not in 1..=64"),
        case(TORTURE, &["run", "--seconds", "0"], "0 is not in 1..="),
        case(
            TORTURE,
            &["run", "--kill-every", "0ms"],
            "must be more than zero",
        ),
        Case {
            code: Some(1),
            ..case(
                TORTURE,
                &[
                    "run",
                    "--balance",
                    "9223372036854775807",
                    "--accounts",
                    "10",
                ],
                "does not fit in 64 bits",
            )
        },
        case(
            TORTURE,
            &["run", "--quota-workers", "65"],
            "65 is not in 0..=64",
        ),
        Case {
            code: Some(1),
            ..case(
                TORTURE,
                &["run", "--previous", "/nonexistent/previous"],
                "mongotx-torture not found in /nonexistent/previous",
            )
        },
        case(
            TORTURE,
            &[
                "queue-worker",
                "--uri",
                UNREACHABLE,
                "--db",
                "d",
                "--ledger",
                "http://x",
                "--name",
                "n",
                "--for",
                "99999999999d",
            ],
            "must be at most",
        ),
        case(
            TORTURE,
            &[
                "rate-worker",
                "--uri",
                UNREACHABLE,
                "--db",
                "d",
                "--limiter",
                "l",
                "--api",
                "http://x",
                "--chunk",
                "0",
            ],
            "0 is not in 1..",
        ),
        case(
            TORTURE,
            &[
                "obt-owner",
                "--uri",
                UNREACHABLE,
                "--db",
                "d",
                "--id",
                "x",
                "--owner",
                "o",
                "--lease",
                "0s",
            ],
            "must be more than zero",
        ),
        Case {
            code: Some(1),
            ..case(
                TORTURE,
                &["worker", "--uri", "notauri", "--db", "d", "--accounts", "3"],
                "mongotx-torture: bad --uri",
            )
        },
        Case {
            code: Some(1),
            ..case(
                TORTURE,
                &[
                    "quota-worker",
                    "--uri",
                    "mongodb://h:0",
                    "--db",
                    "d",
                    "--projects",
                    "p",
                    "--resources",
                    "r",
                ],
                "the port must be an integer",
            )
        },
        Case {
            code: Some(1),
            ..case(
                TORTURE,
                &unreachable_worker,
                "cannot reach the server at 127.0.0.1:1 within 5s",
            )
        },
    ];
    let mut checked = 0;
    for c in cases {
        checked += assert_refused(c).await;
    }
    assert_eq!(checked, 20);
}
