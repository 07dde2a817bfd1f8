//! The ledger simulator over HTTP, so that submitter and monitor processes share one ledger:
//! [`LedgerServer`] serves a [`Ledger`], [`HttpLedger`] is the [`LedgerApi`] that calls it.
//!
//! - `POST /submit` with `{"service", "header", "content"}` answers `{"answer": "accepted" |
//!   "delayed"}`;
//! - `POST /status` with `{"header"}` answers `{"status": "pending" | "invalid" | "committed" |
//!   "unknown"}`.

use std::net::SocketAddr;

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::queue::{Answer, LedgerApi, LedgerStatus};
use crate::testkit::ledger::Ledger;

#[derive(Debug, Serialize, Deserialize)]
struct SubmitBody {
    service: String,
    header: String,
    content: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct AnswerBody {
    answer: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct HeaderBody {
    header: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct StatusBody {
    status: String,
}

/// A running ledger server; it stops when dropped.
#[derive(Debug)]
pub struct LedgerServer {
    addr: SocketAddr,
    ledger: Ledger,
    _stop: oneshot::Sender<()>,
}

impl LedgerServer {
    /// Serves `ledger` on a free local port.
    pub async fn start(ledger: Ledger) -> std::io::Result<LedgerServer> {
        let app = Router::new()
            .route("/submit", post(submit))
            .route("/status", post(status))
            .with_state(ledger.clone());
        let (addr, stop) = crate::testkit::http::serve_local(app, "the ledger server").await?;
        Ok(LedgerServer {
            addr,
            ledger,
            _stop: stop,
        })
    }

    /// Its base URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The ledger it serves.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }
}

async fn submit(State(ledger): State<Ledger>, Json(body): Json<SubmitBody>) -> Json<AnswerBody> {
    let answer = match ledger.submit(&body.service, &body.header, &body.content) {
        Answer::Accepted => "accepted",
        Answer::Delayed => "delayed",
    };
    Json(AnswerBody {
        answer: answer.to_string(),
    })
}

async fn status(State(ledger): State<Ledger>, Json(body): Json<HeaderBody>) -> Json<StatusBody> {
    let status = match ledger.status(&body.header) {
        LedgerStatus::Pending => "pending",
        LedgerStatus::Invalid => "invalid",
        LedgerStatus::Committed => "committed",
        LedgerStatus::Unknown => "unknown",
    };
    Json(StatusBody {
        status: status.to_string(),
    })
}

/// A ledger server, called over HTTP.
#[derive(Debug, Clone)]
pub struct HttpLedger {
    base: String,
    http: reqwest::Client,
}

impl HttpLedger {
    /// The ledger served at `base` (a [`LedgerServer::url`]).
    pub fn new(base: impl Into<String>) -> HttpLedger {
        HttpLedger {
            base: base.into(),
            http: reqwest::Client::new(),
        }
    }
}

impl HttpLedger {
    /// Posts `body` as JSON to `path` and reads the JSON answer.
    async fn post<B: Serialize, R: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<R, String> {
        self.http
            .post(format!("{}/{path}", self.base))
            .json(body)
            .send()
            .await
            .map_err(|e| e.to_string())?
            .json()
            .await
            .map_err(|e| e.to_string())
    }
}

impl LedgerApi for HttpLedger {
    async fn submit(&self, service: &str, header: &str, content: &str) -> Result<Answer, String> {
        let body = SubmitBody {
            service: service.to_string(),
            header: header.to_string(),
            content: content.to_string(),
        };
        let reply: AnswerBody = self.post("submit", &body).await?;
        match reply.answer.as_str() {
            "accepted" => Ok(Answer::Accepted),
            "delayed" => Ok(Answer::Delayed),
            other => Err(format!("the ledger answered {other:?}")),
        }
    }

    async fn status(&self, header: &str) -> Result<LedgerStatus, String> {
        let reply: StatusBody = self
            .post(
                "status",
                &HeaderBody {
                    header: header.to_string(),
                },
            )
            .await?;
        match reply.status.as_str() {
            "pending" => Ok(LedgerStatus::Pending),
            "invalid" => Ok(LedgerStatus::Invalid),
            "committed" => Ok(LedgerStatus::Committed),
            "unknown" => Ok(LedgerStatus::Unknown),
            other => Err(format!("the ledger answered {other:?}")),
        }
    }
}
