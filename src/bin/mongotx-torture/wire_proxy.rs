//! A MongoDB wire-protocol proxy for fault injection: put between a client and a server, it lets
//! rules rewrite commands, rewrite replies, answer in the server's place, lose replies, drop
//! commands, or deliver a command late: the client's connection is cut at once (the client sees a
//! network error and gives up or retries), and the command reaches the server afterwards on a
//! connection of its own, as a command stuck in a network buffer would.
//!
//! Only `OP_MSG` is interpreted (the driver sends every command that way); anything else, such as
//! a legacy handshake, passes through untouched. Each message is re-encoded with a single body
//! section, merging document sequences into the body as arrays, which every server accepts.
//!
//! Used by the torture run and, through `#[path]`, by the integration tests.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bson::{Bson, Document};
use mongodb::options::{ClientOptions, ServerAddress};
use mongodb::Client;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

const OP_MSG: i32 = 2013;
const CHECKSUM_PRESENT: u32 = 1;
const MORE_TO_COME: u32 = 2;

/// What to do with a command.
pub enum Action {
    /// Send it (possibly rewritten) to the server.
    Forward,
    /// Do not send it; answer the client with this reply instead.
    Respond(Document),
    /// Send it, but close the client's connection instead of relaying the reply: the command
    /// ran, and the client sees a network error (a reply lost in transit).
    LoseReply,
    /// Close the client's connection without sending it: the command never ran, and the client
    /// sees the same network error.
    Drop,
    /// Close the client's connection at once, and send the command to the server this much later
    /// on a connection of its own (its reply goes nowhere): it runs after its sender gave up.
    DeliverLate(Duration),
    /// As `DeliverLate`, at a moment the test chooses: the command is sent once the future
    /// completes, and its reply (`None` if there was none) goes to the sender, so the test knows
    /// the late copy has run and what it did.
    DeliverWhen(
        std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
        tokio::sync::oneshot::Sender<Option<Document>>,
    ),
    /// Send it this much later on the same connection (a slow link on the way out): it runs late
    /// while its sender still waits for the reply, and the connection's next commands queue
    /// behind it.
    Delay(Duration),
    /// Send it once this completes, on the same connection (as `Delay`, for as long as a test
    /// needs to act in between).
    After(std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>),
}

/// How a test tampers with traffic. Both hooks see `OP_MSG` bodies only.
pub trait Rules: Send + Sync + 'static {
    /// Sees (and may rewrite) each command before it goes to the server.
    fn command(&self, _command: &mut Document) -> Action {
        Action::Forward
    }

    /// Sees (and may rewrite) each reply, with the command it answers.
    fn reply(&self, _command: &Document, _reply: &mut Document) {}

    /// Sees (and may overwrite, keeping its length) each reply's encoded message, after
    /// [`Rules::reply`]: where a test needs bytes no `Document` can hold (invalid UTF-8, as a
    /// server returns what an old version stored).
    fn reply_bytes(&self, _command: &Document, _message: &mut [u8]) {}

    /// How long to hold the reply to `command` before relaying it (a slow link, without
    /// blocking the other connections).
    fn reply_delay(&self, _command: &Document) -> Option<Duration> {
        None
    }
}

/// Rules that change nothing.
pub struct PassThrough;

impl Rules for PassThrough {}

/// A running proxy; stops accepting when dropped.
pub struct WireProxy {
    addr: SocketAddr,
    options: ClientOptions,
    acceptor: JoinHandle<()>,
}

impl WireProxy {
    /// Starts a proxy in front of the server of `uri` (its first host) on a free loopback port;
    /// panics (failing the test) if it cannot.
    pub async fn start(uri: &str, rules: impl Rules) -> WireProxy {
        WireProxy::try_start(uri, "127.0.0.1:0", rules)
            .await
            .unwrap_or_else(|e| panic!("wire proxy: {e}"))
    }

    /// Starts a proxy in front of the server of `uri` (its first host), listening on `listen`.
    pub async fn try_start(
        uri: &str,
        listen: &str,
        rules: impl Rules,
    ) -> Result<WireProxy, String> {
        let options = ClientOptions::parse(uri)
            .await
            .map_err(|e| format!("cannot parse {uri}: {e}"))?;
        let upstream = match options.hosts.first() {
            Some(ServerAddress::Tcp { host, port }) => {
                format!("{host}:{}", port.unwrap_or(27017))
            }
            other => return Err(format!("needs a TCP host in {uri}, found {other:?}")),
        };
        let listener = TcpListener::bind(listen)
            .await
            .map_err(|e| format!("cannot bind {listen}: {e}"))?;
        let addr = listener
            .local_addr()
            .map_err(|e| format!("no local address: {e}"))?;
        let rules: Arc<dyn Rules> = Arc::new(rules);
        let acceptor = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let upstream = upstream.clone();
                let rules = Arc::clone(&rules);
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(&upstream).await {
                        relay(client, server, upstream, rules).await;
                    }
                });
            }
        });
        Ok(WireProxy {
            addr,
            options,
            acceptor,
        })
    }

    /// The address the proxy listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A connection string for clients of the proxy.
    pub fn uri(&self) -> String {
        format!("mongodb://{}/?directConnection=true", self.addr)
    }

    /// A client that talks to the server through this proxy only.
    pub async fn client(&self) -> Client {
        let mut options = self.options.clone();
        options.hosts = vec![ServerAddress::Tcp {
            host: self.addr.ip().to_string(),
            port: Some(self.addr.port()),
        }];
        options.direct_connection = Some(true);
        options.repl_set_name = None;
        Client::with_options(options).unwrap_or_else(|e| panic!("wire proxy client: {e}"))
    }
}

impl Drop for WireProxy {
    fn drop(&mut self) {
        self.acceptor.abort();
    }
}

/// Commands awaiting their reply, by request id, and whether that reply is to be lost.
type Pending = Arc<Mutex<HashMap<i32, (Document, bool)>>>;

/// Pumps both directions of one connection until either side closes.
async fn relay(client: TcpStream, server: TcpStream, upstream: String, rules: Arc<dyn Rules>) {
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let client_write = Arc::new(tokio::sync::Mutex::new(client_write));
    let pending: Pending = Arc::new(Mutex::new(HashMap::new()));
    let up = commands(
        client_read,
        server_write,
        Arc::clone(&client_write),
        Arc::clone(&pending),
        upstream,
        Arc::clone(&rules),
    );
    let down = replies(server_read, client_write, pending, rules);
    tokio::select! {
        _ = up => {}
        _ = down => {}
    }
}

async fn commands(
    mut from_client: OwnedReadHalf,
    mut to_server: OwnedWriteHalf,
    to_client: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
    pending: Pending,
    upstream: String,
    rules: Arc<dyn Rules>,
) -> std::io::Result<()> {
    loop {
        let message = read_message(&mut from_client).await?;
        let Some(mut msg) = Msg::parse(&message) else {
            to_server.write_all(&message).await?;
            continue;
        };
        let mut action = rules.command(&mut msg.body);
        match action {
            Action::Delay(delay) => {
                tokio::time::sleep(delay).await;
                action = Action::Forward;
            }
            Action::After(wait) => {
                wait.await;
                action = Action::Forward;
            }
            _ => {}
        }
        match action {
            action
            @ (Action::Forward | Action::LoseReply | Action::Delay(_) | Action::After(_)) => {
                if msg.flags & MORE_TO_COME == 0 {
                    let lose = matches!(action, Action::LoseReply);
                    lock(&pending).insert(msg.request_id, (msg.body.clone(), lose));
                }
                to_server.write_all(&msg.encode()).await?;
            }
            Action::Drop => return Err(std::io::Error::other("command dropped by a proxy rule")),
            Action::DeliverLate(delay) => {
                let late = msg.encode();
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    deliver(&upstream, &late).await;
                });
                return Err(std::io::Error::other("command held back by a proxy rule"));
            }
            Action::DeliverWhen(wait, done) => {
                let late = msg.encode();
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    wait.await;
                    let reply = deliver(&upstream, &late).await;
                    let _ = done.send(reply);
                });
                return Err(std::io::Error::other("command held back by a proxy rule"));
            }
            Action::Respond(reply) => {
                let answer = Msg {
                    request_id: msg.request_id.wrapping_add(1_000_000),
                    response_to: msg.request_id,
                    flags: 0,
                    body: reply,
                };
                to_client.lock().await.write_all(&answer.encode()).await?;
            }
        }
    }
}

async fn replies(
    mut from_server: OwnedReadHalf,
    to_client: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
    pending: Pending,
    rules: Arc<dyn Rules>,
) -> std::io::Result<()> {
    loop {
        let message = read_message(&mut from_server).await?;
        let mut delay = None;
        let out = match Msg::parse(&message) {
            Some(mut msg) => {
                let command = {
                    let mut pending = lock(&pending);
                    if msg.flags & MORE_TO_COME == 0 {
                        pending.remove(&msg.response_to)
                    } else {
                        pending.get(&msg.response_to).cloned()
                    }
                };
                match command {
                    Some((_, true)) => {
                        return Err(std::io::Error::other("reply lost by a proxy rule"))
                    }
                    Some((command, false)) => {
                        rules.reply(&command, &mut msg.body);
                        delay = rules.reply_delay(&command);
                        let mut encoded = msg.encode();
                        rules.reply_bytes(&command, &mut encoded);
                        encoded
                    }
                    None => message,
                }
            }
            None => message,
        };
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
        to_client.lock().await.write_all(&out).await?;
    }
}

/// Sends one command on a fresh connection and waits for its reply, which it returns (`None`
/// if the server could not be reached or did not answer in 30 s).
async fn deliver(upstream: &str, message: &[u8]) -> Option<Document> {
    let server = TcpStream::connect(upstream).await.ok()?;
    let (mut read, mut write) = server.into_split();
    write.write_all(message).await.ok()?;
    let reply = tokio::time::timeout(Duration::from_secs(30), read_message(&mut read))
        .await
        .ok()?
        .ok()?;
    Msg::parse(&reply).map(|msg| msg.body)
}

fn lock(pending: &Pending) -> std::sync::MutexGuard<'_, HashMap<i32, (Document, bool)>> {
    pending
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

async fn read_message(from: &mut OwnedReadHalf) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    from.read_exact(&mut len).await?;
    let total = i32::from_le_bytes(len);
    if !(16..=48 * 1024 * 1024).contains(&total) {
        return Err(std::io::Error::other(format!("bad message length {total}")));
    }
    let mut message = vec![0u8; total as usize];
    message[..4].copy_from_slice(&len);
    from.read_exact(&mut message[4..]).await?;
    Ok(message)
}

/// An `OP_MSG` with its sections merged into one body document.
struct Msg {
    request_id: i32,
    response_to: i32,
    flags: u32,
    body: Document,
}

fn le_i32(bytes: &[u8], at: usize) -> Option<i32> {
    Some(i32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

impl Msg {
    fn parse(message: &[u8]) -> Option<Msg> {
        if le_i32(message, 12)? != OP_MSG {
            return None;
        }
        let request_id = le_i32(message, 4)?;
        let response_to = le_i32(message, 8)?;
        let flags = le_i32(message, 16)? as u32;
        let end = if flags & CHECKSUM_PRESENT != 0 {
            message.len() - 4
        } else {
            message.len()
        };
        let mut at = 20;
        let mut body: Option<Document> = None;
        let mut sequences: Vec<(String, Vec<Bson>)> = Vec::new();
        while at < end {
            let kind = *message.get(at)?;
            at += 1;
            match kind {
                0 => {
                    let size = le_i32(message, at)? as usize;
                    body = Some(Document::from_reader(message.get(at..at + size)?).ok()?);
                    at += size;
                }
                1 => {
                    let size = le_i32(message, at)? as usize;
                    let section_end = at + size;
                    let mut cursor = at + 4;
                    let name_end = cursor
                        + message
                            .get(cursor..section_end)?
                            .iter()
                            .position(|b| *b == 0)?;
                    let name = String::from_utf8(message.get(cursor..name_end)?.to_vec()).ok()?;
                    cursor = name_end + 1;
                    let mut docs = Vec::new();
                    while cursor < section_end {
                        let doc_size = le_i32(message, cursor)? as usize;
                        let doc =
                            Document::from_reader(message.get(cursor..cursor + doc_size)?).ok()?;
                        docs.push(Bson::Document(doc));
                        cursor += doc_size;
                    }
                    sequences.push((name, docs));
                    at = section_end;
                }
                _ => return None,
            }
        }
        let mut body = body?;
        for (name, docs) in sequences {
            body.insert(name, docs);
        }
        Some(Msg {
            request_id,
            response_to,
            flags: flags & !CHECKSUM_PRESENT,
            body,
        })
    }

    fn encode(&self) -> Vec<u8> {
        let mut body = Vec::new();
        self.body
            .to_writer(&mut body)
            .unwrap_or_else(|e| panic!("wire proxy: cannot encode {}: {e}", self.body));
        let total = 16 + 4 + 1 + body.len();
        let mut out = Vec::with_capacity(total);
        out.extend_from_slice(&(total as i32).to_le_bytes());
        out.extend_from_slice(&self.request_id.to_le_bytes());
        out.extend_from_slice(&self.response_to.to_le_bytes());
        out.extend_from_slice(&OP_MSG.to_le_bytes());
        out.extend_from_slice(&self.flags.to_le_bytes());
        out.push(0);
        out.extend_from_slice(&body);
        out
    }
}

/// The command name of a command body (its first key).
pub fn command_name(command: &Document) -> &str {
    command.keys().next().map(String::as_str).unwrap_or("")
}

/// The single-document writes `command` carries, each as the command that would carry it alone.
///
/// A `bulkWrite` (MongoDB 8.0: many writes on any collections in one message, sent to `admin`)
/// becomes one `insert`, `update` or `delete` per operation, on the operation's own database and
/// collection, with the bulk's write concern; any other command is itself. Rules that pick out a
/// kind of write then see it the same way however the client sent it.
pub fn writes_in(command: &Document) -> Vec<Document> {
    if command_name(command) != "bulkWrite" {
        return vec![command.clone()];
    }
    let namespaces: Vec<(String, String)> = command
        .get_array("nsInfo")
        .map(|list| {
            list.iter()
                .filter_map(|ns| ns.as_document()?.get_str("ns").ok())
                .map(|ns| match ns.split_once('.') {
                    Some((db, coll)) => (db.to_string(), coll.to_string()),
                    None => (String::new(), ns.to_string()),
                })
                .collect()
        })
        .unwrap_or_default();
    let ops = command.get_array("ops").map(Vec::as_slice).unwrap_or(&[]);
    ops.iter()
        .filter_map(Bson::as_document)
        .filter_map(|op| {
            let (kind, index) =
                ["insert", "update", "delete"]
                    .into_iter()
                    .find_map(|kind| match op.get(kind)? {
                        Bson::Int32(n) => Some((kind, i64::from(*n))),
                        Bson::Int64(n) => Some((kind, *n)),
                        _ => None,
                    })?;
            let (db, coll) = namespaces.get(usize::try_from(index).ok()?)?;
            let filter = op.get_document("filter").cloned().unwrap_or_default();
            let mut single = Document::new();
            match kind {
                "insert" => {
                    single.insert("insert", coll.as_str());
                    single.insert("documents", vec![op.get("document")?.clone()]);
                }
                "update" => {
                    let mut statement =
                        bson::doc! { "q": filter, "u": op.get("updateMods")?.clone() };
                    if let Some(upsert) = op.get("upsert") {
                        statement.insert("upsert", upsert.clone());
                    }
                    single.insert("update", coll.as_str());
                    single.insert("updates", vec![Bson::Document(statement)]);
                }
                _ => {
                    single.insert("delete", coll.as_str());
                    single.insert(
                        "deletes",
                        vec![Bson::Document(bson::doc! { "q": filter, "limit": 1 })],
                    );
                }
            }
            if let Some(concern) = command.get("writeConcern") {
                single.insert("writeConcern", concern.clone());
            }
            single.insert("$db", db.as_str());
            Some(single)
        })
        .collect()
}
