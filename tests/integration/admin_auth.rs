//! With an admin token configured, admin calls need it: none is 401 (with
//! WWW-Authenticate), a wrong one 403, and nothing changes; shopping and reading stay
//! public.

use reqwest::{Method, StatusCode};
use serde_json::json;

use crate::support::{TestCluster, free_port, wait_healthy};

const TOKEN: &str = "test-admin-token-0123456789";

#[tokio::test]
async fn admin_calls_need_the_token() {
    let cluster = TestCluster::start(1, &["--admin-token", TOKEN]).await;
    cluster.reset("guarded", 5).await; // the support client sends the token
    let anonymous = crate::support::http_client();
    let calls = [
        (
            Method::PUT,
            "/api/admin/strategy",
            json!({ "strategy": "none" }),
        ),
        (Method::GET, "/api/admin/strategy", json!(null)),
        (
            Method::POST,
            "/api/admin/reset",
            json!({ "sku": "guarded", "stock": 99 }),
        ),
        (
            Method::PUT,
            "/api/admin/fencing",
            json!({ "enabled": true }),
        ),
        (
            Method::PUT,
            "/api/admin/cohort",
            json!({ "enabled": false }),
        ),
        (Method::GET, "/api/admin/cohort", json!(null)),
        (
            Method::POST,
            "/api/admin/fences/reset",
            json!({ "sku": "guarded" }),
        ),
        (Method::POST, "/api/admin/faults", json!({})),
        (
            Method::POST,
            "/api/loadtests",
            json!({ "users": 1, "stock": 1 }),
        ),
        (Method::POST, "/api/runs", json!({})),
    ];
    for (method, path, body) in calls {
        let request = |auth: Option<&str>| {
            let mut request = anonymous
                .request(method.clone(), cluster.url(0, path))
                .json(&body);
            if let Some(auth) = auth {
                request = request.header("authorization", auth);
            }
            request.send()
        };
        let none = request(None).await.expect("sent");
        assert_eq!(none.status(), StatusCode::UNAUTHORIZED, "{method} {path}");
        assert_eq!(none.headers()["www-authenticate"], "Bearer");
        let body: serde_json::Value = none.json().await.expect("JSON error");
        assert_eq!(body["error"], "unauthorized");
        let wrong = request(Some("Bearer not-the-token-at-all"))
            .await
            .expect("sent");
        assert_eq!(wrong.status(), StatusCode::FORBIDDEN, "{method} {path}");
    }
    let stats = cluster.sku_stats("guarded").await;
    assert_eq!(stats["stock_redis"], 5, "nothing changed");
    assert_eq!(
        cluster.get_json(0, "/api/admin/fencing").await["enabled"],
        false,
        "fencing untouched"
    );
    assert_eq!(
        cluster.get_json(0, "/api/admin/cohort").await["enabled"],
        true,
        "cohort untouched"
    );

    let order = anonymous
        .post(cluster.url(0, "/api/orders"))
        .json(&json!({ "sku": "guarded", "user_id": "public", "quantity": 1 }))
        .send()
        .await
        .expect("order");
    assert_eq!(
        order.status(),
        StatusCode::CREATED,
        "shopping needs no token"
    );
    for path in [
        "/api/stats",
        "/api/strategies",
        "/healthz",
        "/api/runs",
        "/",
    ] {
        let response = anonymous
            .get(cluster.url(0, path))
            .send()
            .await
            .expect("GET");
        assert_eq!(response.status(), StatusCode::OK, "GET {path} is public");
    }
}

/// Asks as a page from `origin` would before a cross-origin admin call (a CORS
/// preflight), and returns the origin the replica allows, if any.
async fn preflight(cluster: &TestCluster, origin: &str) -> Option<String> {
    let response = crate::support::http_client()
        .request(Method::OPTIONS, cluster.url(0, "/api/admin/reset"))
        .header("origin", origin)
        .header("access-control-request-method", "POST")
        .header(
            "access-control-request-headers",
            "authorization, content-type",
        )
        .send()
        .await
        .expect("preflight");
    response
        .headers()
        .get("access-control-allow-origin")
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned)
}

/// No CORS unless configured: pages from other origins get no CORS headers, so a
/// browser will not let them call the API; a configured origin is allowed, and only it.
#[tokio::test]
async fn cors_only_for_configured_origins() {
    let closed = TestCluster::start(1, &[]).await;
    assert_eq!(preflight(&closed, "https://shop.example").await, None);
    let shop = TestCluster::start(1, &["--cors-origin", "https://shop.example"]).await;
    assert_eq!(
        preflight(&shop, "https://shop.example").await.as_deref(),
        Some("https://shop.example")
    );
    assert_eq!(preflight(&shop, "https://evil.example").await, None);
}

/// A shop's page on another origin can send an order's `Idempotency-Key` (the
/// preflight allows the header) and read the answer's `Location`, `Retry-After` and
/// `x-request-id` (exposed). Without them in the CORS layer, the browser drops the
/// header from the preflight's answer and hides the three from the page.
#[tokio::test]
async fn cors_lets_a_shop_send_its_key_and_read_the_answer() {
    let shop = TestCluster::start(1, &["--cors-origin", "https://shop.example"]).await;
    let http = crate::support::http_client();
    let preflight = http
        .request(Method::OPTIONS, shop.url(0, "/api/orders"))
        .header("origin", "https://shop.example")
        .header("access-control-request-method", "POST")
        .header(
            "access-control-request-headers",
            "content-type, idempotency-key",
        )
        .send()
        .await
        .expect("preflight");
    let allowed = header_of(&preflight, "access-control-allow-headers");
    assert!(allowed.contains("idempotency-key"), "allowed: {allowed}");
    shop.reset("cors", 5).await;
    let order = http
        .post(shop.url(0, "/api/orders"))
        .header("origin", "https://shop.example")
        .header("idempotency-key", "cors-1")
        .json(&json!({ "sku": "cors", "user_id": "u1", "quantity": 1 }))
        .send()
        .await
        .expect("order");
    assert_eq!(order.status(), StatusCode::CREATED);
    let exposed = header_of(&order, "access-control-expose-headers");
    for header in ["location", "retry-after", "x-request-id"] {
        assert!(exposed.contains(header), "{header} not in {exposed}");
    }
}

fn header_of(response: &reqwest::Response, name: &str) -> String {
    let value = response.headers().get(name);
    value
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase()
}

/// With an admin token set, replicas' process ids are the admins' (who may kill them):
/// `/api/stats` leaves them out for anyone else, and shows them with the token.
#[tokio::test]
async fn replica_pids_only_for_admins() {
    let cluster = TestCluster::start(1, &["--admin-token", TOKEN]).await;
    let stats = |token: Option<&'static str>| {
        // A client of its own: the cluster's sends the token with every request.
        let mut request = crate::support::http_client().get(cluster.url(0, "/api/stats"));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        async move {
            let stats: serde_json::Value = request
                .send()
                .await
                .expect("stats")
                .json()
                .await
                .expect("JSON");
            stats["replicas"].as_array().cloned().unwrap_or_default()
        }
    };
    let anonymous = stats(None).await;
    assert!(!anonymous.is_empty());
    assert!(
        anonymous.iter().all(|r| r.get("pid").is_none()),
        "{anonymous:?}"
    );
    let admin = stats(Some(TOKEN)).await;
    assert!(
        admin
            .iter()
            .all(|r| r["pid"].as_u64().is_some_and(|pid| pid > 0)),
        "{admin:?}"
    );
}

/// Secrets never reach the logs, even at debug level: not the admin token, not a
/// wrong token someone presented, not the database password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_stay_out_of_the_logs() {
    let cluster = TestCluster::start(1, &[]).await;
    let port = free_port();
    let wrong = "someone-elses-token-9876543210";
    let replica = tokio::process::Command::new(env!("CARGO_BIN_EXE_flashsale"))
        .args(["serve", "--port", &port.to_string()])
        .args(["--database-url", &cluster.database_url])
        .args(["--namespace", &cluster.namespace, "--admin-token", TOKEN])
        .env("RUST_LOG", "debug")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the replica");
    let base = format!("http://127.0.0.1:{port}");
    assert!(wait_healthy(&base).await, "the replica started");
    let http = crate::support::http_client();
    for (token, status) in [(TOKEN, StatusCode::OK), (wrong, StatusCode::FORBIDDEN)] {
        let answer = http
            .post(format!("{base}/api/admin/reset"))
            .bearer_auth(token)
            .json(&json!({ "sku": "logged", "stock": 3 }))
            .send()
            .await
            .expect("reset");
        assert_eq!(answer.status(), status);
    }

    let pid = nix::unistd::Pid::from_raw(
        replica
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .expect("pid"),
    );
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let output = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        replica.wait_with_output(),
    )
    .await
    .expect("the replica stopped")
    .expect("its output");
    let logs = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(logs.contains("stock reset"), "the logs were captured");
    let password = cluster
        .database_url
        .split_once("://")
        .and_then(|(_, rest)| rest.split_once('@'))
        .and_then(|(credentials, _)| credentials.split_once(':'))
        .map(|(_, password)| format!(":{password}@"))
        .expect("the test database URL has a password");
    for secret in [TOKEN, wrong, &password] {
        assert!(!logs.contains(secret), "{secret:?} appears in the logs");
    }
}
