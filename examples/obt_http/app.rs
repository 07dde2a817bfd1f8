//! The HTTP interface of the reference design for owner-based transactions (a storage volume
//! manager's API servers), backed by `mongotx::obt`: create an OBT, operate on volumes under it
//! (`t_id`, `t_owner`, `t_stage` on every call), preempt it, delete it. Each volume operation
//! checks the caller's ownership and stage, calls the four storage nodes with the ownership's
//! fencing token, moves the OBT to the call's stage, and writes the volume in a transaction owned
//! by the OBT.
//!
//! Shared by the example's `main.rs` and by `tests/it/obt_http.rs`, which drives it with a real
//! HTTP client.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use mongotx::obt::{Fence, FenceError, MemoryFence, NewObt, Obt, ObtError, ObtState, Ownership};
use mongotx::{CollectionSpec, RepoError, Repository, Store, Transactions, TxnError};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// A distributed logical volume, as `schemas/dlvs.json` describes it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Dlv {
    /// The volume name.
    #[serde(rename = "_id")]
    pub name: String,
    /// Its size in bytes.
    pub size: i64,
    /// Where it stands.
    pub status: String,
    /// The token of the ownership that last changed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<i64>,
}

/// What the handlers share.
pub struct App {
    obt: Obt,
    dlvs: Repository<Dlv>,
    txns: Transactions,
    /// The four storage nodes (dpv0-3), each fencing the volumes it serves.
    pub nodes: Vec<MemoryFence>,
}

/// The router, with its state opened in `store`'s database.
pub async fn router(store: &Store) -> Result<(Router, Arc<App>), Box<dyn std::error::Error>> {
    let spec = CollectionSpec::new("dlvs", 1, include_str!("../../schemas/dlvs.json"))?;
    let app = Arc::new(App {
        obt: Obt::open(store).await?,
        dlvs: store.repository(spec).await?,
        txns: Transactions::new(store),
        nodes: (0..4).map(|_| MemoryFence::new()).collect(),
    });
    let router = Router::new()
        .route("/obts", post(create_obt))
        .route(
            "/obts/{t_id}",
            get(get_obt).put(preempt_obt).delete(delete_obt),
        )
        .route("/dlvs", post(create_dlv))
        .route("/dlvs/{name}", get(get_dlv).delete(delete_dlv))
        .with_state(Arc::clone(&app));
    Ok((router, app))
}

/// An error as the API answers it: a status and `{"error": kind, "message": text}`.
pub struct ApiError(StatusCode, &'static str, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(json!({ "error": self.1, "message": self.2 }))).into_response()
    }
}

impl From<ObtError> for ApiError {
    fn from(e: ObtError) -> ApiError {
        let (status, kind) = match &e {
            ObtError::Invalid { .. } => (StatusCode::BAD_REQUEST, "invalid"),
            ObtError::NotFound { .. } => (StatusCode::NOT_FOUND, "not_found"),
            ObtError::Exists { .. } => (StatusCode::CONFLICT, "exists"),
            ObtError::NotOwner { .. } => (StatusCode::CONFLICT, "not_owner"),
            ObtError::Preempted { .. } => (StatusCode::CONFLICT, "preempted"),
            ObtError::StageReplayed { .. } => (StatusCode::CONFLICT, "stage_replayed"),
            e if e.is_retryable() => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        ApiError(status, kind, e.to_string())
    }
}

impl From<FenceError> for ApiError {
    fn from(e: FenceError) -> ApiError {
        match &e {
            FenceError::StaleToken { .. } => {
                ApiError(StatusCode::CONFLICT, "stale_token", e.to_string())
            }
            e if e.is_retryable() => ApiError(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                e.to_string(),
            ),
            _ => ApiError(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()),
        }
    }
}

impl From<RepoError> for ApiError {
    fn from(e: RepoError) -> ApiError {
        match &e {
            RepoError::NotFound { .. } | RepoError::Deleted { .. } => {
                ApiError(StatusCode::NOT_FOUND, "not_found", e.to_string())
            }
            RepoError::DuplicateId { .. } => {
                ApiError(StatusCode::CONFLICT, "exists", e.to_string())
            }
            e if e.is_retryable() => ApiError(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                e.to_string(),
            ),
            _ => ApiError(StatusCode::BAD_REQUEST, "invalid", e.to_string()),
        }
    }
}

impl From<TxnError> for ApiError {
    fn from(e: TxnError) -> ApiError {
        ApiError::from(ObtError::from(e))
    }
}

fn obt_json(state: &ObtState) -> Value {
    json!({ "t_id": state.id, "t_owner": state.owner, "t_stage": state.stage, "token": state.token.get() })
}

/// `POST /obts {"t_id", "t_owner", "t_stage": 0}`
#[derive(Deserialize)]
pub struct CreateObt {
    t_id: String,
    t_owner: String,
    #[serde(default)]
    t_stage: i64,
}

async fn create_obt(
    State(app): State<Arc<App>>,
    Json(body): Json<CreateObt>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    if body.t_stage != 0 {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            "invalid",
            format!("a new OBT starts at stage 0, not {}", body.t_stage),
        ));
    }
    let owned = app.obt.create(NewObt::new(body.t_id, body.t_owner)).await?;
    Ok((
        StatusCode::CREATED,
        Json(
            json!({ "t_id": owned.id, "t_owner": owned.owner, "t_stage": owned.stage, "token": owned.token.get() }),
        ),
    ))
}

async fn get_obt(
    State(app): State<Arc<App>>,
    Path(t_id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(obt_json(&app.obt.get(&t_id).await?)))
}

/// `PUT /obts/{t_id} {"t_owner", "new_owner", "action": "preempt"}`
#[derive(Deserialize)]
pub struct PreemptObt {
    t_owner: String,
    new_owner: String,
    action: String,
}

async fn preempt_obt(
    State(app): State<Arc<App>>,
    Path(t_id): Path<String>,
    Json(body): Json<PreemptObt>,
) -> Result<Json<Value>, ApiError> {
    if body.action != "preempt" {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            "invalid",
            format!("unknown action {:?}", body.action),
        ));
    }
    let owned = app
        .obt
        .preempt(&t_id, &body.t_owner, &body.new_owner)
        .await?;
    Ok(Json(
        json!({ "t_id": owned.id, "t_owner": owned.owner, "t_stage": owned.stage, "token": owned.token.get() }),
    ))
}

/// `DELETE /obts/{t_id} {"t_owner"}`
#[derive(Deserialize)]
pub struct DeleteObt {
    t_owner: String,
}

async fn delete_obt(
    State(app): State<Arc<App>>,
    Path(t_id): Path<String>,
    Json(body): Json<DeleteObt>,
) -> Result<StatusCode, ApiError> {
    app.obt.release(&t_id, &body.t_owner).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The OBT fields every volume call carries.
#[derive(Deserialize)]
pub struct UnderObt {
    t_id: String,
    t_owner: String,
    t_stage: i64,
}

/// `POST /dlvs {"dlv_name", "dlv_size", "t_id", "t_owner", "t_stage"}` (other fields ignored)
#[derive(Deserialize)]
pub struct CreateDlv {
    dlv_name: String,
    dlv_size: i64,
    #[serde(flatten)]
    obt: UnderObt,
}

/// Checks the caller's ownership and stage, reaches every storage node with its token, and
/// records the stage: the steps every volume call makes before its owned write.
async fn under_obt(app: &App, call: &UnderObt, volume: &str) -> Result<Ownership, ApiError> {
    let state = app
        .obt
        .check(&call.t_id, &call.t_owner, call.t_stage)
        .await?;
    for node in &app.nodes {
        node.admit(volume, state.token).await?;
    }
    app.obt
        .advance(&call.t_id, &call.t_owner, call.t_stage)
        .await?;
    Ok(Ownership::from(state))
}

async fn create_dlv(
    State(app): State<Arc<App>>,
    Json(body): Json<CreateDlv>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    if body.dlv_name.is_empty() || body.dlv_size < 1 {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            "invalid",
            "a volume needs a name and a positive size".into(),
        ));
    }
    let owned = under_obt(&app, &body.obt, &body.dlv_name).await?;
    let dlv = Dlv {
        name: body.dlv_name,
        size: body.dlv_size,
        status: "available".into(),
        token: Some(owned.token.get()),
    };
    let tx = app.txns.begin();
    tx.insert(&app.dlvs, &dlv).await?;
    app.obt.commit_owned(tx, &owned).await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "dlv_name": dlv.name, "status": dlv.status, "token": dlv.token })),
    ))
}

async fn get_dlv(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
) -> Result<Json<Dlv>, ApiError> {
    Ok(Json(app.dlvs.get(name).await?.value))
}

async fn delete_dlv(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    Json(body): Json<UnderObt>,
) -> Result<Json<Value>, ApiError> {
    let current = app.dlvs.get(name.as_str()).await?;
    let owned = under_obt(&app, &body, &name).await?;
    let tx = app.txns.begin();
    tx.delete(&app.dlvs, name.as_str(), current.version)?;
    app.obt.commit_owned(tx, &owned).await?;
    Ok(Json(
        json!({ "dlv_name": name, "deleted": true, "token": owned.token.get() }),
    ))
}
