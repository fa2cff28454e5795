//! The load-test history a page at a time: `GET /api/runs?limit&before` and one report
//! by id, against the test's own database.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::support::TestCluster;

/// A report as the load test posts it, told apart by its user count.
fn report(users: u64) -> Value {
    json!({
        "generated_at": "2026-11-28T12:00:00Z",
        "config": {"targets": ["http://127.0.0.1:8081"], "users": users, "stock": 10,
                   "skus": 1, "max_seconds": 5, "grace_ms": 0, "strategies": ["none"]},
        "runs": [{"strategy": "none", "requests": 12, "orders": 10, "orders_acknowledged": 10,
                  "sold_out": 2, "busy": 0, "errors": 0, "duration_s": 1.0, "sell_out_s": 0.5,
                  "rps": 12.0, "orders_per_s": 20.0,
                  "latency_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0, "max": 4.0},
                  "initial_stock": 10, "oversold": 0, "stock_redis": 0, "stock_mysql": 0,
                  "consistent": true}],
    })
}

/// Three reports, two to a page: the newest two with a `Link` to the next page, then
/// the oldest without one, each whole by its id. A limit outside 1-50 is refused, an
/// unknown id is 404. Without the cursor the second page would repeat the first;
/// without the limit every report would come at once (it was 50 whole reports).
#[tokio::test]
async fn history_comes_a_page_at_a_time() {
    let cluster = TestCluster::start(1, &[]).await;
    let http = &cluster.http;
    let mut ids = Vec::new();
    for users in [1, 2, 3] {
        let saved = http
            .post(cluster.url(0, "/api/runs"))
            .json(&report(users))
            .send()
            .await
            .expect("POST /api/runs");
        assert_eq!(saved.status(), StatusCode::CREATED);
        let saved: Value = saved.json().await.expect("JSON");
        ids.push(saved["id"].as_i64().expect("id"));
    }
    let users = |page: &Value| -> Vec<i64> {
        let reports = page.as_array().expect("a list");
        reports
            .iter()
            .map(|r| r["config"]["users"].as_i64().unwrap_or(-1))
            .collect()
    };

    let first = http
        .get(cluster.url(0, "/api/runs?limit=2"))
        .send()
        .await
        .expect("page 1");
    assert_eq!(first.status(), StatusCode::OK);
    let next = first
        .headers()
        .get("link")
        .and_then(|l| l.to_str().ok())
        .map(str::to_owned);
    assert_eq!(users(&first.json().await.expect("JSON")), [3, 2]);
    let next = next.expect("a Link to the next page");
    let path = next
        .trim_start_matches('<')
        .split('>')
        .next()
        .expect("<path>");
    assert_eq!(path, format!("/api/runs?limit=2&before={}", ids[1]));
    let second = http.get(cluster.url(0, path)).send().await.expect("page 2");
    assert!(
        second.headers().get("link").is_none(),
        "the last page links nowhere"
    );
    assert_eq!(users(&second.json().await.expect("JSON")), [1]);

    let one: Value = cluster.get_json(0, &format!("/api/runs/{}", ids[0])).await;
    assert_eq!(one["id"].as_i64(), Some(ids[0]));
    assert_eq!(one["config"]["users"], 1);
    for (path, status) in [
        ("/api/runs?limit=0", StatusCode::UNPROCESSABLE_ENTITY),
        ("/api/runs?limit=51", StatusCode::UNPROCESSABLE_ENTITY),
        ("/api/runs?limit=ten", StatusCode::UNPROCESSABLE_ENTITY),
        ("/api/runs/999999999", StatusCode::NOT_FOUND),
        ("/api/runs/x", StatusCode::UNPROCESSABLE_ENTITY),
    ] {
        let answer = http.get(cluster.url(0, path)).send().await.expect(path);
        assert_eq!(answer.status(), status, "{path}");
        let body: Value = answer.json().await.expect("a JSON error");
        assert!(body["error"].is_string(), "{path}: {body}");
    }
}
