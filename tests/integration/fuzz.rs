//! Hostile input, generated: hundreds of seeded random requests (methods, paths,
//! content types, bodies with wrong types, unicode, huge and fractional numbers,
//! missing and extra fields) against a replica. None may get a 5xx, and the stock and
//! orders of a SKU no generated request names must be untouched. The seed is printed,
//! so a failure can be replayed.

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use reqwest::Method;
use serde_json::{Value, json};

use crate::support::TestCluster;

const GUARDED: &str = "fuzz-guard";
const CASES: usize = 600;

fn any_string(rng: &mut StdRng) -> String {
    let pieces = [
        "",
        "a",
        "sku-1",
        "../etc/passwd",
        "a b",
        "é",
        "😀",
        "\u{0}",
        "\n",
        "'; DROP TABLE orders; --",
        "%00",
        "{}",
        "null",
        "none",
        "redis-lock",
        "9999999999999999999999",
    ];
    match rng.random_range(0..4) {
        0 => pieces[rng.random_range(0..pieces.len())].to_owned(),
        1 => "x".repeat(rng.random_range(0..300)),
        2 => (0..rng.random_range(1..20))
            .map(|_| char::from_u32(rng.random_range(32..0x2FFF)).unwrap_or('?'))
            .collect(),
        _ => format!("fuzz-{}", rng.random_range(0..1000)),
    }
}

fn any_value(rng: &mut StdRng, depth: u32) -> Value {
    match rng.random_range(0..10) {
        0 => Value::Null,
        1 => json!(rng.random_bool(0.5)),
        2 => json!(rng.random_range(-1_000_000_i64..1_000_000)),
        3 => json!(rng.random::<f64>() * 1e30),
        4 => serde_json::from_str("1e400").unwrap_or(Value::Null),
        5 => json!(u64::MAX),
        6 if depth < 2 => Value::Array(
            (0..rng.random_range(0..4))
                .map(|_| any_value(rng, depth + 1))
                .collect(),
        ),
        7 if depth < 2 => any_object(rng, depth + 1),
        _ => json!(any_string(rng)),
    }
}

fn any_object(rng: &mut StdRng, depth: u32) -> Value {
    let fields = [
        "sku",
        "user_id",
        "quantity",
        "stock",
        "strategy",
        "enabled",
        "pause_holder_ms",
        "users",
        "runs",
    ];
    let mut object = serde_json::Map::new();
    for _ in 0..rng.random_range(0..6) {
        let field = fields[rng.random_range(0..fields.len())];
        object.insert(field.to_owned(), any_value(rng, depth));
    }
    Value::Object(object)
}

fn any_body(rng: &mut StdRng) -> Vec<u8> {
    match rng.random_range(0..6) {
        0 => Vec::new(),
        1 => any_string(rng).into_bytes(),
        2 => (0..rng.random_range(1..200))
            .map(|_| rng.random::<u8>())
            .collect(),
        3 => any_value(rng, 0).to_string().into_bytes(),
        _ => any_object(rng, 0).to_string().into_bytes(),
    }
}

/// A path and, most of the time, the method it takes (so bodies reach handlers).
fn any_route(rng: &mut StdRng) -> (Method, String) {
    let routes = [
        (Method::POST, "/api/orders"),
        (Method::POST, "/api/orders?strategy="),
        (Method::POST, "/api/admin/reset"),
        (Method::PUT, "/api/admin/strategy"),
        (Method::PUT, "/api/admin/fencing"),
        (Method::POST, "/api/admin/faults"),
        (Method::POST, "/api/admin/reconcile"),
        (Method::GET, "/api/stats"),
        (Method::GET, "/api/stats?sku="),
        (Method::POST, "/api/runs"),
        (Method::POST, "/api/loadtests"),
        (Method::GET, "/api/strategies"),
        (Method::GET, "/healthz"),
        (Method::GET, "/metrics"),
        (Method::GET, "/api/"),
        (Method::GET, "/api/%2e%2e/%2e%2e"),
        (Method::GET, "/index.html"),
        (Method::GET, "/vendor/../../Cargo.toml"),
    ];
    let (natural, path) = routes[rng.random_range(0..routes.len())].clone();
    let methods = [
        Method::GET,
        Method::POST,
        Method::PUT,
        Method::DELETE,
        Method::PATCH,
    ];
    let method = if rng.random_bool(0.8) {
        natural
    } else {
        methods[rng.random_range(0..methods.len())].clone()
    };
    let mut path = path.to_owned();
    if path.ends_with('=') {
        let value = any_string(rng);
        path.push_str(&url_encode(&value));
    }
    (method, path)
}

fn url_encode(raw: &str) -> String {
    raw.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_hostile_requests_never_get_a_5xx_nor_change_the_stock() {
    let cluster = TestCluster::start(1, &[]).await;
    cluster.reset(GUARDED, 7).await;
    assert_eq!(cluster.order(0, GUARDED, "first", 1).await.status(), 201);
    let before = cluster.sku_stats(GUARDED).await;

    let seed = std::env::var("FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20261122_u64);
    println!("fuzz seed {seed} (replay with FUZZ_SEED={seed})");
    let mut rng = StdRng::seed_from_u64(seed);
    let content_types = [
        "application/json",
        "text/plain",
        "application/json; charset=utf-8",
        "",
        "multipart/form-data",
    ];
    let mut statuses = std::collections::BTreeMap::new();
    for case in 0..CASES {
        let (method, path) = any_route(&mut rng);
        let body = any_body(&mut rng);
        let content_type = content_types[rng.random_range(0..content_types.len())];
        let mut request = cluster
            .http
            .request(method.clone(), cluster.url(0, &path))
            .body(body.clone());
        if !content_type.is_empty() {
            request = request.header("content-type", content_type);
        }
        let response = request.send().await.expect("the replica answers");
        let status = response.status();
        *statuses.entry(status.as_u16()).or_insert(0) += 1;
        // Judged by the URL actually requested: dot segments are resolved client-side.
        let api = response.url().path().starts_with("/api");
        let error: Value = response.json().await.unwrap_or(Value::Null);
        if api && status.is_client_error() {
            assert!(
                error["error"].is_string() && error["message"].is_string(),
                "case {case}: {method} {path} -> {status} without a JSON error: {error}"
            );
        }
        assert!(
            !status.is_server_error(),
            "case {case}: {method} {path} ({content_type}) {:?} -> {status}",
            String::from_utf8_lossy(&body)
        );
    }
    println!("fuzz: {CASES} requests, statuses {statuses:?}");
    let after = cluster.sku_stats(GUARDED).await;
    for field in [
        "initial_stock",
        "stock_redis",
        "stock_mysql",
        "orders",
        "consistent",
    ] {
        assert_eq!(after[field], before[field], "{GUARDED}.{field} changed");
    }
}
