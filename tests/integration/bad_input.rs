//! Hostile and broken requests get the right 4xx with a JSON error, and leave the
//! stock and orders exactly as they were.

use reqwest::{Method, StatusCode};
use serde_json::Value;

use crate::support::TestCluster;

struct Case {
    name: &'static str,
    method: Method,
    path: &'static str,
    content_type: Option<&'static str>,
    body: String,
    status: StatusCode,
    code: &'static str,
}

fn case(
    name: &'static str,
    method: Method,
    path: &'static str,
    body: impl Into<String>,
    status: u16,
    code: &'static str,
) -> Case {
    Case {
        name,
        method,
        path,
        content_type: Some("application/json"),
        body: body.into(),
        status: StatusCode::from_u16(status).expect("valid status"),
        code,
    }
}

fn cases() -> Vec<Case> {
    use Method as M;
    let order = "/api/orders";
    let mut cases = vec![
        case(
            "malformed JSON",
            M::POST,
            order,
            r#"{"sku": "bad-input""#,
            400,
            "malformed_request",
        ),
        case("empty body", M::POST, order, "", 400, "malformed_request"),
        case(
            "array body",
            M::POST,
            order,
            "[1,2]",
            400,
            "malformed_request",
        ),
        case(
            "the fields as an array",
            M::POST,
            order,
            r#"["bad-input","u",1]"#,
            400,
            "malformed_request",
        ),
        case(
            "fault armed by an array",
            M::POST,
            "/api/admin/faults",
            "[null]",
            400,
            "malformed_request",
        ),
        case(
            "null body",
            M::POST,
            order,
            "null",
            400,
            "malformed_request",
        ),
        case(
            "missing quantity",
            M::POST,
            order,
            r#"{"sku":"bad-input","user_id":"u"}"#,
            422,
            "invalid_value",
        ),
        case(
            "missing sku",
            M::POST,
            order,
            r#"{"user_id":"u","quantity":1}"#,
            422,
            "invalid_value",
        ),
        case(
            "quantity as string",
            M::POST,
            order,
            r#"{"sku":"bad-input","user_id":"u","quantity":"1"}"#,
            422,
            "invalid_value",
        ),
        case(
            "sku as number",
            M::POST,
            order,
            r#"{"sku":5,"user_id":"u","quantity":1}"#,
            422,
            "invalid_value",
        ),
        case(
            "quantity zero",
            M::POST,
            order,
            r#"{"sku":"bad-input","user_id":"u","quantity":0}"#,
            422,
            "invalid_value",
        ),
        case(
            "quantity negative",
            M::POST,
            order,
            r#"{"sku":"bad-input","user_id":"u","quantity":-5}"#,
            422,
            "invalid_value",
        ),
        case(
            "quantity fractional",
            M::POST,
            order,
            r#"{"sku":"bad-input","user_id":"u","quantity":1.5}"#,
            422,
            "invalid_value",
        ),
        case(
            "quantity absurd",
            M::POST,
            order,
            r#"{"sku":"bad-input","user_id":"u","quantity":1e30}"#,
            422,
            "invalid_value",
        ),
        case(
            "quantity over u64",
            M::POST,
            order,
            r#"{"sku":"bad-input","user_id":"u","quantity":99999999999999999999999}"#,
            422,
            "invalid_value",
        ),
        case(
            "quantity above max",
            M::POST,
            order,
            r#"{"sku":"bad-input","user_id":"u","quantity":11}"#,
            422,
            "invalid_value",
        ),
        case(
            "sku with slash",
            M::POST,
            order,
            r#"{"sku":"../etc","user_id":"u","quantity":1}"#,
            422,
            "invalid_value",
        ),
        case(
            "sku too long",
            M::POST,
            order,
            format!(
                r#"{{"sku":"{}","user_id":"u","quantity":1}}"#,
                "s".repeat(65)
            ),
            422,
            "invalid_value",
        ),
        case(
            "empty user",
            M::POST,
            order,
            r#"{"sku":"bad-input","user_id":"","quantity":1}"#,
            422,
            "invalid_value",
        ),
        case(
            "control char user",
            M::POST,
            order,
            r#"{"sku":"bad-input","user_id":"a\u0000b","quantity":1}"#,
            422,
            "invalid_value",
        ),
        case(
            "unknown SKU",
            M::POST,
            order,
            r#"{"sku":"never-stocked","user_id":"u","quantity":1}"#,
            404,
            "not_found",
        ),
        case(
            "the withdrawn strategy override",
            M::POST,
            "/api/orders?strategy=none",
            r#"{"sku":"bad-input","user_id":"u","quantity":1}"#,
            400,
            "malformed_request",
        ),
        case(
            "1 MiB body",
            M::POST,
            order,
            format!(
                r#"{{"sku":"bad-input","user_id":"{}","quantity":1}}"#,
                "u".repeat(1 << 20)
            ),
            413,
            "payload_too_large",
        ),
        case(
            "reset negative stock",
            M::POST,
            "/api/admin/reset",
            r#"{"sku":"bad-input","stock":-1}"#,
            422,
            "invalid_value",
        ),
        case(
            "reset huge stock",
            M::POST,
            "/api/admin/reset",
            r#"{"sku":"bad-input","stock":1e12}"#,
            422,
            "invalid_value",
        ),
        case(
            "reset bad sku",
            M::POST,
            "/api/admin/reset",
            r#"{"sku":"a b","stock":5}"#,
            422,
            "invalid_value",
        ),
        case(
            "reset missing stock",
            M::POST,
            "/api/admin/reset",
            r#"{"sku":"bad-input"}"#,
            422,
            "invalid_value",
        ),
        case(
            "unknown strategy switch",
            M::PUT,
            "/api/admin/strategy",
            r#"{"strategy":"magic"}"#,
            422,
            "invalid_value",
        ),
        case(
            "strategy as number",
            M::PUT,
            "/api/admin/strategy",
            r#"{"strategy":3}"#,
            422,
            "invalid_value",
        ),
        case(
            "cohort switched by a string",
            M::PUT,
            "/api/admin/cohort",
            r#"{"enabled":"yes"}"#,
            422,
            "invalid_value",
        ),
        case(
            "cohort switch without enabled",
            M::PUT,
            "/api/admin/cohort",
            "{}",
            422,
            "invalid_value",
        ),
        case(
            "cohort switched by an array",
            M::PUT,
            "/api/admin/cohort",
            "[true]",
            400,
            "malformed_request",
        ),
        case(
            "fence reset bad sku",
            M::POST,
            "/api/admin/fences/reset",
            r#"{"sku":"a b"}"#,
            422,
            "invalid_value",
        ),
        case(
            "fence reset unknown sku",
            M::POST,
            "/api/admin/fences/reset",
            r#"{"sku":"never-stocked"}"#,
            404,
            "not_found",
        ),
        case(
            "fence reset sku as number",
            M::POST,
            "/api/admin/fences/reset",
            r#"{"sku":5}"#,
            422,
            "invalid_value",
        ),
        case(
            "stats bad sku",
            M::GET,
            "/api/stats?sku=a%20b",
            "",
            422,
            "invalid_value",
        ),
        case(
            "stats unknown sku",
            M::GET,
            "/api/stats?sku=never-stocked",
            "",
            404,
            "not_found",
        ),
        case(
            "reset limit per user zero",
            M::POST,
            "/api/admin/reset",
            r#"{"sku":"bad-input","stock":5,"limit_per_user":0}"#,
            422,
            "invalid_value",
        ),
        case(
            "reset limit per user negative",
            M::POST,
            "/api/admin/reset",
            r#"{"sku":"bad-input","stock":5,"limit_per_user":-1}"#,
            422,
            "invalid_value",
        ),
        case(
            "a misspelt reset option",
            M::POST,
            "/api/admin/reset",
            r#"{"sku":"bad-input","stock":5,"limt_per_user":1}"#,
            422,
            "unknown_field",
        ),
        case(
            "an order with a field too many",
            M::POST,
            order,
            r#"{"sku":"bad-input","user_id":"u","quantity":1,"coupon":"x"}"#,
            422,
            "unknown_field",
        ),
        case(
            "unknown API route",
            M::GET,
            "/api/nothing-here",
            "",
            404,
            "not_found",
        ),
    ];
    let mut wrong_type = case(
        "wrong content type",
        M::POST,
        order,
        r#"{"sku":"bad-input","user_id":"u","quantity":1}"#,
        415,
        "unsupported_media_type",
    );
    wrong_type.content_type = Some("text/plain");
    let mut no_type = case(
        "no content type",
        M::POST,
        order,
        r#"{"sku":"bad-input","user_id":"u","quantity":1}"#,
        415,
        "unsupported_media_type",
    );
    no_type.content_type = None;
    cases.extend([wrong_type, no_type]);
    cases
}

#[tokio::test]
async fn bad_requests_get_json_4xx_and_change_nothing() {
    let cluster = TestCluster::start(1, &[]).await;
    let sku = "bad-input";
    cluster.reset(sku, 5).await;
    assert_eq!(
        cluster.order(0, sku, "first", 1).await.status(),
        StatusCode::CREATED
    );
    let before = cluster.sku_stats(sku).await;

    for case in cases() {
        let mut request = cluster
            .http
            .request(case.method.clone(), cluster.url(0, case.path))
            .body(case.body.clone());
        if let Some(content_type) = case.content_type {
            request = request.header("content-type", content_type);
        }
        let response = request.send().await.expect("request sent");
        let status = response.status();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        assert_eq!(status, case.status, "{}: status (body {body})", case.name);
        assert_eq!(body["error"], case.code, "{}: error code", case.name);
        assert!(
            body["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{}: a human message",
            case.name
        );
    }

    assert_eq!(
        cluster.sku_stats(sku).await,
        before,
        "nothing stored changed"
    );
    assert_eq!(cluster.count_orders(sku).await, 1);
}

/// Input at the edges of what is valid is served, not refused: any Unicode user id
/// (MariaDB's latin1 default once made "张伟" a 500), whole numbers written as `1.0`
/// (an integer in JSON Schema, so in the OpenAPI document), and SKUs that differ
/// only in case are two products, as they are in Redis.
#[tokio::test]
async fn valid_edge_input_is_served() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.reset("Edge-Sku", 5).await;
    cluster.reset("edge-sku", 3).await;
    let placed = cluster
        .http
        .post(cluster.url(0, "/api/orders"))
        .json(&serde_json::json!({ "sku": "Edge-Sku", "user_id": "张伟 😀", "quantity": 2.0 }))
        .send()
        .await
        .expect("order");
    assert_eq!(placed.status(), StatusCode::CREATED);
    let order: Value = placed.json().await.expect("order JSON");
    assert_eq!(
        (order["user_id"].as_str(), order["quantity"].as_i64()),
        (Some("张伟 😀"), Some(2))
    );

    let upper = cluster.sku_stats("Edge-Sku").await;
    let lower = cluster.sku_stats("edge-sku").await;
    assert_eq!(
        (upper["stock_mysql"].as_i64(), upper["consistent"].as_bool()),
        (Some(3), Some(true))
    );
    assert_eq!(
        (lower["stock_mysql"].as_i64(), lower["orders"].as_i64()),
        (Some(3), Some(0))
    );
}

/// Every route that reads a JSON body, as the OpenAPI document lists them, refuses a
/// field it does not know with 422 `unknown_field` naming it, and changes nothing: a
/// misspelt option (`"limt_per_user": 1`) is never silently dropped. Without
/// `deny_unknown_fields` on a route's body (or the cohort switch's own check), that
/// route answers 400 or 422 `invalid_value` for a missing field, or acts on the body.
#[tokio::test]
async fn every_body_refuses_an_unknown_field_by_name() {
    const TOKEN: &str = "unknown-field-token";
    let cluster = TestCluster::start(
        1,
        &["--admin-token", TOKEN, "--loadtest-bin", "/usr/bin/true"],
    )
    .await;
    let sku = "unknown-field";
    cluster.reset(sku, 5).await;
    let before = cluster.sku_stats(sku).await;
    let document = cluster.get_json(0, "/api/openapi.json").await;
    let paths = document["paths"].as_object().expect("paths");
    let mut checked = Vec::new();
    for (path, item) in paths {
        for (method, operation) in item.as_object().expect("path item") {
            if operation.get("requestBody").is_none() {
                continue;
            }
            let method = Method::from_bytes(method.to_uppercase().as_bytes()).expect("method");
            // A field of the body as sent by a client that misspelt one: alone, so
            // the answer cannot be about another field.
            let response = cluster
                .http
                .request(method.clone(), cluster.url(0, path))
                .json(&serde_json::json!({ "zz_not_a_field": 1 }))
                .send()
                .await
                .expect("request sent");
            let status = response.status();
            let body: Value = response.json().await.unwrap_or(Value::Null);
            assert_eq!(
                (status, body["error"].as_str()),
                (StatusCode::UNPROCESSABLE_ENTITY, Some("unknown_field")),
                "{method} {path}: {body}"
            );
            assert!(
                body["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("zz_not_a_field")),
                "{method} {path} names the field: {body}"
            );
            let documented = &operation["responses"]["422"];
            assert!(documented.is_object(), "{method} {path} documents its 422");
            checked.push(format!("{method} {path}"));
        }
    }
    // The routes with a body this build has; a new one is checked as it is documented.
    assert!(checked.len() >= 12, "{checked:?}");
    assert_eq!(
        cluster.sku_stats(sku).await,
        before,
        "nothing stored changed"
    );
}
