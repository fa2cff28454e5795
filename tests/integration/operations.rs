//! What an operator relies on, checked on the real binary: it serves its dashboard from
//! any directory, every answer carries a request id, JSON logs follow one order through
//! its spans, and each cluster event has a metric of its own.

use std::process::Stdio;
use std::time::Duration;

use reqwest::StatusCode;
use reqwest::header::{CACHE_CONTROL, ETAG, IF_NONE_MATCH};
use tokio::io::AsyncReadExt;

use crate::support::{TestCluster, free_port, wait_healthy};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_started_elsewhere_serves_the_dashboard_and_logs_an_order_in_json() {
    let cluster = TestCluster::start(0, &[]).await;
    let port = free_port();
    let scratch = tempdir();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_flashsale"))
        .args(["serve", "--bind", "127.0.0.1", "--port", &port.to_string()])
        .args(["--database-url", &cluster.database_url])
        .args(["--namespace", &cluster.namespace])
        .args(["--log-format", "json"])
        // Nothing beside it: the page must come from the binary itself.
        .current_dir(&scratch)
        .env_remove("FLASHSALE_STATIC_DIR")
        .env("RUST_LOG", "warn,flashsale=debug")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the replica");
    let base = format!("http://127.0.0.1:{port}");
    assert!(wait_healthy(&base).await, "the replica did not start");
    let http = crate::support::http_client();

    let page = http.get(format!("{base}/")).send().await.expect("GET /");
    assert_eq!(page.status(), StatusCode::OK);
    let etag = page.headers()[ETAG].clone();
    assert_eq!(page.headers()[CACHE_CONTROL], "no-cache");
    assert!(page.text().await.expect("body").contains("<html"));
    let again = http
        .get(format!("{base}/"))
        .header(IF_NONE_MATCH, etag)
        .send()
        .await
        .expect("GET / again");
    assert_eq!(again.status(), StatusCode::NOT_MODIFIED);
    let vendored = http
        .get(format!("{base}/vendor/uplot/uPlot.min.css"))
        .send()
        .await
        .expect("GET vendored");
    assert!(
        vendored.headers()[CACHE_CONTROL]
            .to_str()
            .is_ok_and(|c| c.contains("immutable"))
    );

    // An answer without an id of the caller's gets one; the caller's is kept.
    let stats = http
        .get(format!("{base}/api/stats"))
        .send()
        .await
        .expect("stats");
    assert!(stats.headers().contains_key("x-request-id"));
    let sku = "logged";
    let reset = http
        .post(format!("{base}/api/admin/reset"))
        .json(&serde_json::json!({"sku": sku, "stock": 5}))
        .send()
        .await
        .expect("reset");
    assert_eq!(reset.status(), StatusCode::OK);
    let switched = http
        .put(format!("{base}/api/admin/strategy"))
        .json(&serde_json::json!({"strategy": "redis-lock"}))
        .send()
        .await
        .expect("switch");
    assert_eq!(switched.status(), StatusCode::OK);
    let order = http
        .post(format!("{base}/api/orders"))
        .header("x-request-id", "order-under-the-lens")
        .json(&serde_json::json!({"sku": sku, "user_id": "u", "quantity": 1}))
        .send()
        .await
        .expect("order");
    assert_eq!(order.status(), StatusCode::CREATED);
    assert_eq!(order.headers()["x-request-id"], "order-under-the-lens");

    // The log, once the replica is gone: JSON lines, and the order's spans under its id.
    // Stopped as an operator would (SIGTERM): it finishes what it was doing, the
    // order's last spans included, and exits.
    let pid = child
        .id()
        .and_then(|id| i32::try_from(id).ok())
        .expect("pid");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let mut log = String::new();
    let mut stdout = child.stdout.take().expect("piped stdout");
    tokio::time::timeout(Duration::from_secs(10), stdout.read_to_string(&mut log))
        .await
        .expect("the log ends")
        .expect("read the log");
    let exit = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("the replica stopped")
        .expect("exit status");
    assert!(exit.success(), "a clean exit: {exit}");
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|_| panic!("not JSON: {line}")))
        .collect();
    let closed_in_order = |span: &str| {
        lines.iter().any(|line| {
            line["span"]["name"] == span
                && line["fields"]["message"] == "close"
                && line["spans"]
                    .as_array()
                    .is_some_and(|spans| spans.iter().any(|s| s["id"] == "order-under-the-lens"))
        })
    };
    for span in ["acquire", "read", "commit", "cache_write", "release"] {
        assert!(
            closed_in_order(span),
            "no closed {span} span for the order:\n{log}"
        );
    }
}

#[tokio::test]
async fn each_cluster_event_has_a_metric_of_its_own_with_help() {
    let cluster = TestCluster::start(1, &[]).await;
    let text = cluster
        .http
        .get(cluster.url(0, "/metrics"))
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("body");
    for metric in flashsale::store::ClusterEvent::ALL.map(|event| event.metric()) {
        assert!(
            text.contains(&format!("# HELP {metric} ")),
            "{metric} lacks HELP:\n{text}"
        );
    }
    assert!(!text.contains("flashsale_events_total"));
}

fn tempdir() -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("elsewhere-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch directory");
    dir
}
