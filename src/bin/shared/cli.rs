//! What the command-line tools share about their input: connection strings, database and
//! collection names, and durations, each checked so that bad input ends the tool with one line
//! on stderr that names the problem (never a driver error's debug dump, a panic or a wait for
//! the driver's 30 s server selection).
//!
//! Every binary includes this file with `#[path]` (a directory of `src/bin` without a `main.rs`
//! is no binary of its own); each uses only some of it.
#![allow(dead_code)]

use std::time::Duration;

use bson::doc;
use mongodb::error::{Error, ErrorKind};
use mongodb::options::ClientOptions;
use mongodb::{Client, Database};

/// The longest `--connect-timeout` accepted: waiting longer for a server is taken for a mistake.
pub(crate) const MAX_CONNECT_TIMEOUT: Duration = Duration::from_secs(3600);

/// A driver error in one line: what went wrong, without the error's labels, source and reply
/// (and, for a server that could not be found, the first server's own error rather than the
/// whole topology description).
pub(crate) fn describe(error: &Error) -> String {
    let text = match error.kind.as_ref() {
        ErrorKind::ServerSelection { message, .. } => {
            // "Server selection timeout: No available servers. Topology: { ... Error: Kind: I/O
            // error: Connection refused (os error 111), labels: {} ... }"
            match message
                .split("Error: Kind: ")
                .nth(1)
                .and_then(|rest| rest.split(", labels").next())
            {
                Some(cause) => format!("no server answered ({cause})"),
                None => "no server answered".to_string(),
            }
        }
        kind => kind.to_string(),
    };
    one_line(&text)
}

/// `text` with its line breaks folded into spaces.
pub(crate) fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The hosts a connection string names, for messages (never its credentials).
fn hosts(options: &ClientOptions) -> String {
    options
        .hosts
        .iter()
        .map(|h| h.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Connects to `uri` (named `source` in messages: `--uri`, `MONGODB_URI`) as `app`, looking for
/// a server for at most `timeout`, and pings it; every failure is one line: a connection string
/// that does not parse, or a server that cannot be reached.
pub(crate) async fn connect(
    uri: &str,
    source: &str,
    app: &str,
    timeout: Duration,
) -> Result<Client, String> {
    let mut options = ClientOptions::parse(uri)
        .await
        .map_err(|e| format!("bad {source}: {}", describe(&e)))?;
    options.server_selection_timeout = Some(timeout);
    options.connect_timeout = Some(timeout);
    options.app_name = Some(app.to_string());
    let hosts = hosts(&options);
    let client =
        Client::with_options(options).map_err(|e| format!("bad {source}: {}", describe(&e)))?;
    client
        .database("admin")
        .run_command(doc! { "ping": 1 })
        .await
        .map_err(|e| {
            format!(
                "cannot reach the server at {hosts} within {timeout:?}: {}",
                describe(&e)
            )
        })?;
    Ok(client)
}

/// Pings `db` (a database name the server itself refuses shows up here).
pub(crate) async fn ping(db: &Database) -> Result<(), String> {
    db.run_command(doc! { "ping": 1 })
        .await
        .map(|_| ())
        .map_err(|e| format!("database {:?}: {}", db.name(), describe(&e)))
}

/// Clap parser of a database name: MongoDB refuses empty ones, ones of 64 bytes or more, and
/// ones with `/ \ . " $ *`, `<`, `>`, `:`, `|`, `?`, a space or NUL.
pub(crate) fn database_name(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err("a database name cannot be empty".into());
    }
    if text.len() >= 64 {
        return Err(format!(
            "a database name has fewer than 64 bytes ({} given)",
            text.len()
        ));
    }
    if let Some(c) = text
        .chars()
        .find(|c| "/\\. \"$*<>:|?\0".contains(*c) || c.is_control())
    {
        return Err(format!("a database name cannot contain {c:?}"));
    }
    Ok(text.to_string())
}

/// Clap parser of a collection name: not empty, no `$` or NUL, not in the `system.` namespace.
pub(crate) fn collection_name(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err("a collection name cannot be empty".into());
    }
    if text.starts_with("system.") {
        return Err("the system. prefix is reserved by MongoDB".into());
    }
    if text.contains('$') || text.contains('\0') {
        return Err("a collection name cannot contain '$' or NUL".into());
    }
    Ok(text.to_string())
}

/// Parses a duration as humantime does (`500ms`, `30s`, `5m`, `2h`, `7d`, `1h 30m`); a bare
/// number is seconds (`30`, `1.5`), as the runner's flags always took it.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let plain = !text.is_empty()
        && text.chars().all(|c| c.is_ascii_digit() || c == '.')
        && text.matches('.').count() <= 1
        && text != ".";
    if plain {
        let seconds: f64 = text
            .parse()
            .map_err(|_| format!("{text:?} is not a duration (try 500ms, 30s, 5m, 2h, 7d)"))?;
        return Duration::try_from_secs_f64(seconds)
            .map_err(|e| format!("{text:?} is not a duration: {e}"));
    }
    humantime::parse_duration(text)
        .map_err(|e| format!("{text:?} is not a duration ({e}; try 500ms, 30s, 5m, 2h, 7d)"))
}

/// Clap parser of a duration that must be more than zero and at most `max`.
pub(crate) fn duration_within(text: &str, max: Duration) -> Result<Duration, String> {
    let duration = parse_duration(text)?;
    if duration.is_zero() {
        return Err(format!("{text:?}: must be more than zero"));
    }
    if duration > max {
        return Err(format!("{text:?}: must be at most {max:?}"));
    }
    Ok(duration)
}

/// Clap parser of `--connect-timeout`: more than zero, at most [`MAX_CONNECT_TIMEOUT`].
pub(crate) fn connect_timeout(text: &str) -> Result<Duration, String> {
    duration_within(text, MAX_CONNECT_TIMEOUT)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Refuses what is neither a bare number of seconds nor a humantime duration (negative
    /// numbers, exponents, unknown units, durations too long to represent) with a one-line
    /// message; accepts zero (the flags that cannot be zero refuse it themselves).
    #[test]
    fn durations_parse_or_are_refused_in_one_line() {
        let garbage = [
            "",
            "   ",
            "abc",
            "s",
            "ms",
            ".",
            "-5s",
            "+5s",
            "1e400s",
            "1e3",
            "NaN",
            "inf",
            "0x10s",
            "1.2.3s",
            "1.2.3",
            "5 parsecs",
            "5S",
            "\u{ff15}s",
            "99999999999999999999d",
            "18446744073709551616",
            "1_000s",
        ];
        for text in garbage {
            let refused = parse_duration(text);
            assert!(refused.is_err(), "{text:?} was accepted: {refused:?}");
            let message = refused.unwrap_err();
            assert!(
                message.contains("not a duration") && !message.contains('\n'),
                "{text:?}: {message:?}"
            );
        }
        for (text, expected) in [
            ("0", Duration::ZERO),
            ("30", Duration::from_secs(30)),
            (" 1.5 ", Duration::from_millis(1500)),
            ("5.", Duration::from_secs(5)),
            ("500ms", Duration::from_millis(500)),
            ("5m", Duration::from_secs(300)),
            ("2h", Duration::from_secs(7200)),
            ("7d", Duration::from_secs(604_800)),
            ("1h 30m", Duration::from_secs(5400)),
        ] {
            assert_eq!(parse_duration(text), Ok(expected), "{text:?}");
        }
    }
}
