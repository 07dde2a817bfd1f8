//! The OBT HTTP example (`examples/obt_http`) driven by a real HTTP client over TCP: the calls of
//! the reference design's HTTP interface in its order (create the OBT, create a volume under it,
//! preempt, delete the volume, delete the OBT), the old owner refused after the preemption,
//! replays refused, bad input answered 400 with nothing written.

#[path = "../../examples/obt_http/app.rs"]
#[allow(dead_code)]
mod app;

use crate::common::{raw_snapshot, raw_snapshot_when_free, TestDb};
use mongotx::collections::OBTS_COLLECTION;
use mongotx::obt::{Fence, Token};
use serde_json::{json, Value};

struct Api {
    base: String,
    http: reqwest::Client,
}

impl Api {
    async fn call(&self, method: reqwest::Method, path: &str, body: Value) -> (u16, Value) {
        let reply = self
            .http
            .request(method, format!("{}{path}", self.base))
            .json(&body)
            .send()
            .await
            .expect("the example answers");
        let status = reply.status().as_u16();
        let text = reply.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }
}

#[tokio::test]
async fn the_reference_designs_four_calls_over_http() {
    use reqwest::Method;
    let t = TestDb::new().await;
    let (router, state) = app::router(&t.store).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    let api = Api {
        base,
        http: reqwest::Client::new(),
    };

    // Create the OBT, then a volume under it at stage 1.
    let (status, created) = api
        .call(
            Method::POST,
            "/obts",
            json!({"t_id": "t0", "t_owner": "owner0", "t_stage": 0}),
        )
        .await;
    assert_eq!(status, 201, "{created}");
    let first = created["token"].as_i64().unwrap();
    let (status, body) = api
        .call(
            Method::POST,
            "/dlvs",
            json!({"dlv_name": "dlv0", "dlv_size": 3_000_000_000_i64, "init_size": 1_000_000_000_i64,
                   "stripe_number": 1, "dvg_name": "dvg0", "t_id": "t0", "t_owner": "owner0", "t_stage": 1}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["token"], json!(first));
    for node in &state.nodes {
        assert_eq!(node.seen("dlv0").await.unwrap(), Some(Token(first)));
    }

    // Another client preempts; the old owner's calls are refused from then on.
    let (status, preempted) = api
        .call(
            Method::PUT,
            "/obts/t0",
            json!({"t_owner": "owner0", "new_owner": "owner1", "action": "preempt"}),
        )
        .await;
    assert_eq!(status, 200, "{preempted}");
    let second = preempted["token"].as_i64().unwrap();
    assert!(second > first);
    let (status, body) = api
        .call(
            Method::POST,
            "/dlvs",
            json!({"dlv_name": "dlv1", "dlv_size": 10, "t_id": "t0", "t_owner": "owner0", "t_stage": 2}),
        )
        .await;
    assert_eq!(
        (status, body["error"].as_str()),
        (409, Some("not_owner")),
        "{body}"
    );
    let (status, body) = api
        .call(
            Method::PUT,
            "/obts/t0",
            json!({"t_owner": "owner0", "new_owner": "owner2", "action": "preempt"}),
        )
        .await;
    assert_eq!(
        (status, body["error"].as_str()),
        (409, Some("not_owner")),
        "{body}"
    );

    // The new owner deletes the volume at stage 2; a replay of stage 1 is refused.
    let (status, body) = api
        .call(
            Method::DELETE,
            "/dlvs/dlv0",
            json!({"t_id": "t0", "t_owner": "owner1", "t_stage": 2}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["token"], json!(second));
    let (status, body) = api
        .call(
            Method::POST,
            "/dlvs",
            json!({"dlv_name": "dlv9", "dlv_size": 10, "t_id": "t0", "t_owner": "owner1", "t_stage": 1}),
        )
        .await;
    assert_eq!(
        (status, body["error"].as_str()),
        (409, Some("stage_replayed")),
        "{body}"
    );
    let (status, _) = api.call(Method::GET, "/dlvs/dlv0", json!({})).await;
    assert_eq!(status, 404, "the volume is gone");

    // Bad input: 400, nothing written.
    let before = raw_snapshot_when_free(&t.db, OBTS_COLLECTION).await;
    for body in [
        json!({"t_id": "", "t_owner": "x", "t_stage": 0}),
        json!({"t_id": "t1", "t_owner": "", "t_stage": 0}),
        json!({"t_id": "t1", "t_owner": "x", "t_stage": 3}),
    ] {
        let (status, reply) = api.call(Method::POST, "/obts", body.clone()).await;
        assert_eq!(
            (status, reply["error"].as_str()),
            (400, Some("invalid")),
            "{body}: {reply}"
        );
    }
    let (status, _) = api
        .call(Method::POST, "/obts", json!({"t_owner": "x"}))
        .await;
    assert!(
        (400..500).contains(&status),
        "a body without t_id: {status}"
    );
    let (status, reply) = api
        .call(
            Method::PUT,
            "/obts/t0",
            json!({"t_owner": "owner1", "new_owner": "x", "action": "steal"}),
        )
        .await;
    assert_eq!(status, 400, "{reply}");
    assert_eq!(raw_snapshot(&t.db, OBTS_COLLECTION).await, before);

    // Delete the OBT.
    let (status, body) = api
        .call(Method::DELETE, "/obts/t0", json!({"t_owner": "owner0"}))
        .await;
    assert_eq!((status, body["error"].as_str()), (409, Some("not_owner")));
    let (status, _) = api
        .call(Method::DELETE, "/obts/t0", json!({"t_owner": "owner1"}))
        .await;
    assert_eq!(status, 204);
    let (status, body) = api.call(Method::GET, "/obts/t0", json!({})).await;
    assert_eq!((status, body["error"].as_str()), (404, Some("not_found")));
}
