//! Cluster-wide admin state: a reset and a strategy switch made through one replica
//! are seen by all of them, and every replica shows up in the stats.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use crate::support::TestCluster;

#[tokio::test]
async fn reset_and_strategy_are_shared_by_all_replicas() {
    let cluster = TestCluster::start(3, &[]).await;
    let sku = "admin-shared";
    cluster.reset(sku, 7).await;
    for replica in 0..3 {
        let stats = cluster
            .get_json(replica, &format!("/api/stats?sku={sku}"))
            .await;
        assert_eq!(stats["skus"][0]["stock_redis"], 7);
        assert_eq!(stats["skus"][0]["stock_mysql"], 7);
        assert_eq!(stats["skus"][0]["initial_stock"], 7);
    }

    let switched = cluster
        .http
        .put(cluster.url(2, "/api/admin/strategy"))
        .json(&json!({ "strategy": "none" }))
        .send()
        .await
        .expect("PUT strategy");
    assert_eq!(switched.status(), StatusCode::OK);
    for replica in 0..3 {
        let active = cluster.get_json(replica, "/api/admin/strategy").await;
        assert_eq!(active["strategy"], "none");
    }

    // A second reset clears the orders placed since.
    assert_eq!(
        cluster.order(1, sku, "u", 3).await.status(),
        StatusCode::CREATED
    );
    cluster.reset(sku, 5).await;
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(stats["orders"], 0);
    assert_eq!(stats["stock_redis"], 5);
    assert_eq!(cluster.count_orders(sku).await, 0);
}

#[tokio::test]
async fn stats_list_every_live_replica_and_drop_stopped_ones() {
    let mut cluster = TestCluster::start(3, &[]).await;
    let stats = cluster.get_json(0, "/api/stats").await;
    let ids: Vec<&str> = stats["replicas"]
        .as_array()
        .expect("replicas array")
        .iter()
        .filter_map(|r| r["id"].as_str())
        .collect();
    assert_eq!(ids, ["replica-1", "replica-2", "replica-3"]);

    cluster.replicas[2].stop().await;
    let stats = cluster.get_json(0, "/api/stats").await;
    assert_eq!(
        stats["replicas"].as_array().map(Vec::len),
        Some(2),
        "stopped replica deregistered"
    );
}

#[tokio::test]
async fn strategies_are_listed_with_explanations() {
    let cluster = TestCluster::start(1, &[]).await;
    let strategies = cluster.get_json(0, "/api/strategies").await;
    let none = &strategies[0];
    assert_eq!(none["name"], "none");
    assert!(none["summary"].as_str().is_some_and(|s| !s.is_empty()));
    assert!(none["commands"].as_array().is_some_and(|c| !c.is_empty()));
}

#[tokio::test]
async fn healthz_reports_each_backend() {
    let cluster = TestCluster::start(1, &[]).await;
    let health = cluster.get_json(0, "/healthz").await;
    assert_eq!(health["status"], "ok");
    let names: Vec<&str> = health["backends"]
        .as_array()
        .expect("backends")
        .iter()
        .filter_map(|b| b["name"].as_str())
        .collect();
    assert_eq!(names, ["redis", "mysql"]);
}

/// `/metrics` in Prometheus's text format, with the series of what this test did and
/// their exact values. The replica runs as a process of its own: the recorder is
/// process-wide, so an in-process replica would also show what every test running
/// beside it did, and a series or a count could come from any of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_exposed_in_prometheus_format() {
    let cluster = TestCluster::start(0, &[]).await;
    let replica = cluster
        .spawn_process_replica(env!("CARGO_BIN_EXE_flashsale"), &[])
        .await;
    let http = &cluster.http;
    let url = |path: &str| format!("{}{path}", replica.base_url);
    let sku = "measured";
    let reset = http
        .post(url("/api/admin/reset"))
        .json(&json!({ "sku": sku, "stock": 1 }))
        .send()
        .await
        .expect("reset");
    assert_eq!(reset.status(), StatusCode::OK);
    let order = |user: &'static str| async move {
        http.post(url("/api/orders"))
            .json(&json!({ "sku": sku, "user_id": user, "quantity": 1 }))
            .send()
            .await
            .expect("order")
            .status()
    };
    assert_eq!(order("a").await, StatusCode::CREATED);
    assert_eq!(order("b").await, StatusCode::CONFLICT);
    let switched = http
        .put(url("/api/admin/strategy"))
        .json(&json!({ "strategy": "redis-lock" }))
        .send()
        .await
        .expect("switch");
    assert_eq!(switched.status(), StatusCode::OK);
    assert_eq!(order("c").await, StatusCode::CONFLICT);
    // A batch of redis-atomic's group commit, counted in orders (buckets up to 512).
    cluster_strategy(http, &url("/api/admin/strategy"), "redis-atomic").await;
    let batch = http
        .post(url("/api/admin/reset"))
        .json(&json!({ "sku": "batched", "stock": 5 }))
        .send()
        .await
        .expect("reset");
    assert_eq!(batch.status(), StatusCode::OK);
    let batched = http
        .post(url("/api/orders"))
        .json(&json!({ "sku": "batched", "user_id": "d", "quantity": 1 }))
        .send()
        .await
        .expect("order");
    assert_eq!(batched.status(), StatusCode::CREATED);
    // Redis loses the SKU's stock (after the switch, which rewrites it from MySQL): its gauge has no value, not the last one (0, which
    // would say Redis still agrees with MySQL).
    let mut redis = crate::support::redis_client()
        .get_multiplexed_async_connection()
        .await
        .expect("redis");
    let stock_key = format!("{}:stock:{sku}", cluster.namespace);
    let _: i64 = deadpool_redis::redis::cmd("DEL")
        .arg(&stock_key)
        .query_async(&mut redis)
        .await
        .expect("DEL");
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .expect("git");
    let commit = String::from_utf8_lossy(&commit.stdout).trim().to_owned();
    let build_info = format!(
        "flashsale_build_info{{version=\"{}\",commit=\"{commit}\"}} 1\n",
        env!("CARGO_PKG_VERSION")
    );
    let expected = [
        "flashsale_http_requests_total{route=\"/api/orders\",method=\"POST\",status=\"201\"} 2\n",
        "flashsale_http_requests_total{route=\"/api/orders\",method=\"POST\",status=\"409\"} 2\n",
        "flashsale_http_request_duration_seconds_count{route=\"/api/orders\"} 4\n",
        "flashsale_orders_total{strategy=\"none\",outcome=\"created\"} 1\n",
        "flashsale_orders_total{strategy=\"none\",outcome=\"sold_out\"} 1\n",
        "flashsale_orders_total{strategy=\"redis-lock\",outcome=\"sold_out\"} 1\n",
        "flashsale_lock_acquire_seconds_count{strategy=\"redis-lock\",outcome=\"acquired\"} 1\n",
        "flashsale_order_seconds_count{strategy=\"none\",outcome=\"created\"} 1\n",
        "flashsale_order_seconds_count{strategy=\"redis-lock\",outcome=\"sold_out\"} 1\n",
        "flashsale_oversold{sku=\"measured\"} 0\n",
        "flashsale_stock{sku=\"measured\",store=\"mysql\"} 0\n",
        "flashsale_stock{sku=\"measured\",store=\"redis\"} NaN\n",
        "flashsale_group_commit_orders_bucket{le=\"1\"} 1\n",
        "flashsale_group_commit_orders_bucket{le=\"512\"} 1\n",
        &build_info,
        "process_cpu_seconds_total ",
        "flashsale_orders_in_flight 0\n",
        "flashsale_pool_connections{pool=\"mysql\",state=\"idle\"} ",
        "flashsale_pool_connections{pool=\"redis\",state=\"in_use\"} ",
        "flashsale_pool_waiters{pool=\"redis\"} 0\n",
        "process_resident_memory_bytes ",
        "# HELP flashsale_orders_total",
        "# TYPE flashsale_orders_total counter",
    ];
    // The per-SKU gauges come from an audit the first scrape starts: scrape until they
    // are there, then every series must be.
    let scrape = || async {
        let response = http.get(url("/metrics")).send().await.expect("GET");
        assert_eq!(response.status(), StatusCode::OK);
        response.text().await.expect("body")
    };
    let mut text = scrape().await;
    let audited = "flashsale_stock{sku=\"measured\",store=\"redis\"} NaN\n";
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !text.contains(audited) && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        text = scrape().await;
    }
    for expected in expected {
        assert!(
            text.contains(expected),
            "/metrics lacks {expected}:\n{text}"
        );
    }
}

async fn cluster_strategy(http: &reqwest::Client, url: &str, strategy: &str) {
    let switched = http
        .put(url)
        .json(&json!({ "strategy": strategy }))
        .send()
        .await
        .expect("switch");
    assert_eq!(switched.status(), StatusCode::OK);
}

/// While Redis is unreachable `/metrics` still answers 200, so the graphs show the
/// outage, and says the records could not be read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_answer_while_redis_is_down() {
    let nowhere = format!("redis://127.0.0.1:{}", crate::support::free_port());
    let cluster = TestCluster::start(1, &["--redis-url", &nowhere]).await;
    // The audit the first scrape starts says 0 soon after. The recorder is shared by
    // every replica of this test process: another test's replica may set the gauge
    // back to 1 between our audit and our render, so look for the 0 a while.
    let seen_down = crate::support::eventually(Duration::from_secs(15), || async {
        let response = cluster
            .http
            .get(cluster.url(0, "/metrics"))
            .send()
            .await
            .expect("GET");
        assert_eq!(response.status(), StatusCode::OK);
        let text = response.text().await.expect("body");
        text.contains("# HELP flashsale_records_up") && text.contains("flashsale_records_up 0")
    })
    .await;
    assert!(seen_down, "flashsale_records_up never said 0");
}

/// A scrape never waits for the records: with the orders table locked (as a long
/// migration or a backup would), `/metrics` still answers at once, and Prometheus,
/// which gives up on a scrape after 10 s by default, keeps the process, pool and
/// request series. Without the audit beside the scrape (the records read inside it),
/// the scrape waits for the lock and this test times out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_does_not_wait_for_the_records() {
    use sqlx::Connection;
    let cluster = TestCluster::start(1, &[]).await;
    cluster.reset("audited", 3).await;
    let mut locker = sqlx::MySqlConnection::connect(&cluster.database_url)
        .await
        .expect("MySQL");
    sqlx::query("LOCK TABLES orders WRITE")
        .execute(&mut locker)
        .await
        .expect("LOCK TABLES");
    for _ in 0..2 {
        let scrape = cluster.http.get(cluster.url(0, "/metrics")).send();
        let response = tokio::time::timeout(Duration::from_secs(3), scrape)
            .await
            .expect("the scrape waited for the locked records")
            .expect("GET");
        assert_eq!(response.status(), StatusCode::OK);
    }
    sqlx::query("UNLOCK TABLES")
        .execute(&mut locker)
        .await
        .expect("UNLOCK TABLES");
}

/// A load test started from the dashboard ends with the replica that started it: it
/// also targets that replica, and left running it would hold the shutdown up and
/// outlive it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_a_replica_stops_its_load_test() {
    let scratch = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let pid_file = scratch.join(format!("loadtest-{}.pid", std::process::id()));
    let fake = scratch.join(format!("slow-loadtest-{}.sh", std::process::id()));
    std::fs::write(
        &fake,
        format!(
            "#!/bin/sh\necho $$ > {}\nexec sleep 60\n",
            pid_file.display()
        ),
    )
    .expect("write the stand-in load test");
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("make it executable");
    let fake = fake.display().to_string();
    let mut cluster = TestCluster::start(1, &["--loadtest-bin", &fake]).await;

    let started = cluster
        .http
        .post(cluster.url(0, "/api/loadtests"))
        .json(&json!({ "users": 1, "stock": 1 }))
        .send()
        .await
        .expect("start a load test");
    assert_eq!(started.status(), StatusCode::ACCEPTED);
    let mut pid = None;
    for _ in 0..50 {
        pid = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok());
        if pid.is_some() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let pid = pid.expect("the load test wrote its pid");
    let alive = || std::path::Path::new(&format!("/proc/{pid}")).exists();
    assert!(alive(), "the load test runs");

    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        cluster.replicas[0].stop(),
    )
    .await
    .expect("the replica stops promptly");
    for _ in 0..50 {
        if !alive() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(!alive(), "the load test was stopped with its replica");
    let _ = std::fs::remove_file(&pid_file);
}

/// A replica listening on a wildcard address announces the address others reach it
/// at, which the load tests its dashboard starts then target.
#[tokio::test]
async fn replicas_announce_their_advertised_address() {
    let cluster = TestCluster::start(1, &["--advertise", "app1:8080"]).await;
    let stats = cluster.get_json(0, "/api/stats").await;
    assert_eq!(stats["replicas"][0]["address"], "app1:8080");
}

/// The dashboard's crowd is played by the server, over every live replica at once:
/// under `none` it oversells, under a lock it sells exactly the stock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_plays_a_crowd_over_every_replica() {
    let cluster = TestCluster::start(2, &["--work-ms", "30", "--lock-wait-ms", "30000"]).await;
    for (strategy, sku) in [("none", "crowd-none"), ("redis-lock", "crowd-locked")] {
        cluster.set_strategy(strategy).await;
        cluster.reset(sku, 5).await;
        let response = cluster
            .http
            .post(cluster.url(0, "/api/admin/crowd"))
            .json(&serde_json::json!({ "sku": sku, "shoppers": 24 }))
            .send()
            .await
            .expect("crowd");
        assert_eq!(response.status(), StatusCode::OK);
        let done: serde_json::Value = response.json().await.expect("JSON");
        assert_eq!(done["replicas"].as_array().map(Vec::len), Some(2), "{done}");
        let answered: u64 = done["outcomes"]
            .as_object()
            .expect("outcomes")
            .values()
            .filter_map(serde_json::Value::as_u64)
            .sum();
        assert_eq!(answered, 24, "{done}");
        let stats = cluster.sku_stats(sku).await;
        assert_eq!(
            stats["orders"], done["outcomes"]["created"],
            "{done} {stats}"
        );
        if strategy == "none" {
            assert!(stats["oversold"].as_i64() > Some(0), "{stats}");
        } else {
            assert_eq!(
                (stats["orders"].as_i64(), stats["consistent"].as_bool()),
                (Some(5), Some(true)),
                "{stats}"
            );
        }
    }
}

/// The dashboard's double-clicking crowd: every shopper sends their order twice at
/// once. Without keys each shopper owns two orders, and `GET /api/stats` counts the
/// second ones from MySQL (`duplicates.repeat_orders`); with keys (under `none`: no
/// lock) each owns one. Fails without the double click (no duplicates to count) or
/// without the count (0 whatever MySQL holds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_double_clicking_crowd_buys_twice_without_keys_and_once_with_them() {
    let cluster = TestCluster::start(2, &["--work-ms", "30"]).await;
    cluster.set_strategy("none").await;
    let mysql = cluster.mysql().await;
    for (sku, keys) in [("clicks-bare", false), ("clicks-keyed", true)] {
        cluster.reset(sku, 50).await;
        let body = serde_json::json!({
            "sku": sku, "shoppers": 10, "double_click": true, "idempotency_key": keys,
        });
        let response = cluster
            .http
            .post(cluster.url(0, "/api/admin/crowd"))
            .json(&body)
            .send()
            .await
            .expect("crowd");
        assert_eq!(response.status(), StatusCode::OK);
        let done: serde_json::Value = response.json().await.expect("JSON");
        let answered: u64 = done["outcomes"]
            .as_object()
            .expect("outcomes")
            .values()
            .filter_map(serde_json::Value::as_u64)
            .sum();
        assert_eq!(answered, 20, "two answers per shopper: {done}");
        let repeats: i64 = sqlx::query_scalar(
            "SELECT CAST(COALESCE(SUM(n - 1), 0) AS SIGNED)
             FROM (SELECT COUNT(*) AS n FROM orders WHERE sku = ? GROUP BY user_id) u",
        )
        .bind(sku)
        .fetch_one(&mysql)
        .await
        .expect("repeat orders");
        let stats = cluster.sku_stats(sku).await;
        assert_eq!(stats["duplicates"]["repeat_orders"], repeats, "{stats}");
        assert_eq!(stats["duplicates"]["orders_sharing_key"], 0, "{stats}");
        if keys {
            assert_eq!(
                (stats["orders"].as_i64(), repeats),
                (Some(10), 0),
                "{done} {stats}"
            );
        } else {
            assert_eq!(
                (stats["orders"].as_i64(), repeats),
                (Some(20), 10),
                "{done} {stats}"
            );
        }
    }
}
