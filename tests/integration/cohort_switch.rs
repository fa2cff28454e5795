//! The cohort switch (`GET, PUT /api/admin/cohort`): cluster-wide like fencing, on by
//! default, durable in MySQL, shown in `/api/stats`, and a change of the sale: an
//! order begun under one mode never commits under the other.

use deadpool_redis::redis::AsyncCommands;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::support::{TestCluster, redis_pool};

async fn set_cohort(cluster: &TestCluster, replica: usize, body: &Value) -> (StatusCode, Value) {
    let response = cluster
        .http
        .put(cluster.url(replica, "/api/admin/cohort"))
        .json(body)
        .send()
        .await
        .expect("PUT /api/admin/cohort");
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// The switch's durable copy in MySQL, as written.
async fn stored_switch(cluster: &TestCluster) -> String {
    let mysql = cluster.mysql().await;
    let stored = sqlx::query_scalar("SELECT value FROM cluster_settings WHERE name = 'cohort'")
        .fetch_one(&mysql)
        .await
        .expect("the durable copy");
    mysql.close().await;
    stored
}

/// On by default; switched through one replica, every replica reads the new value
/// (GET and `/api/stats`), the sale epoch moved, MySQL holds it, and a Redis that lost
/// the key gets it back from MySQL rather than the default.
///
/// A switch kept per replica (or only in Redis) fails here: replica 2 would still say
/// on, or say on again once Redis lost the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cohort_switch_is_on_by_default_shared_and_durable() {
    let cluster = TestCluster::start(2, &[]).await;
    assert_eq!(
        cluster.get_json(1, "/api/admin/cohort").await,
        json!({ "enabled": true, "combine": 1 }),
        "on by default, without combining"
    );
    let stats = cluster.get_json(1, "/api/stats").await;
    assert_eq!(stats["cohort"], true, "{stats}");
    let epoch = stats["epoch"].as_u64().expect("epoch");

    let (status, body) = set_cohort(&cluster, 0, &json!({ "enabled": false })).await;
    assert_eq!(
        (status, &body),
        (StatusCode::OK, &json!({ "enabled": false, "combine": 1 }))
    );
    assert_eq!(
        cluster.get_json(1, "/api/admin/cohort").await,
        json!({ "enabled": false, "combine": 1 }),
        "the other replica reads the switch"
    );
    let stats = cluster.get_json(1, "/api/stats").await;
    assert_eq!(stats["cohort"], false, "{stats}");
    assert!(
        stats["epoch"].as_u64() > Some(epoch),
        "the switch moved the sale epoch: {epoch} then {}",
        stats["epoch"]
    );

    assert_eq!(stored_switch(&cluster).await, "off");

    let pool = redis_pool();
    let mut redis = pool.get().await.expect("redis");
    let key = format!("{}:cohort", cluster.namespace);
    let removed: i64 = redis.del(&key).await.expect("DEL");
    assert_eq!(removed, 1, "the switch is published in Redis as {key}");
    assert_eq!(
        cluster.get_json(1, "/api/admin/cohort").await,
        json!({ "enabled": false, "combine": 1 }),
        "rebuilt from MySQL, not the default"
    );
    let back: Option<String> = redis.get(&key).await.expect("GET");
    assert_eq!(back.as_deref(), Some("off"), "published again");

    let (status, body) = set_cohort(&cluster, 1, &json!({ "enabled": true, "combine": 8 })).await;
    let combining = json!({ "enabled": true, "combine": 8 });
    assert_eq!((status, &body), (StatusCode::OK, &combining));
    assert_eq!(cluster.get_json(0, "/api/admin/cohort").await, combining);
    let stats = cluster.get_json(0, "/api/stats").await;
    assert_eq!(
        (&stats["cohort"], &stats["combine"]),
        (&json!(true), &json!(8))
    );
    assert_eq!(stored_switch(&cluster).await, "combine:8");
    let removed: i64 = redis.del(&key).await.expect("DEL");
    assert_eq!(removed, 1);
    assert_eq!(
        cluster.get_json(1, "/api/admin/cohort").await,
        combining,
        "combining rebuilt from MySQL"
    );
}

/// An order begun with the cohort layer on stalls before its commit, holding its lock;
/// the layer is switched off; the order is refused with `sale_changed` and writes
/// nothing, and the next order sells under the new mode.
///
/// Without the epoch move in the switch (the switch's epoch UPDATE left out), the
/// stalled order commits after the switch: the two modes overlap on the SKU.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_begun_under_the_other_mode_is_refused() {
    let cluster = TestCluster::start(1, &["--lock-lease-ms", "30000"]).await;
    cluster.set_strategy("redis-lock").await;
    let sku = "cohort-switched";
    cluster.reset(sku, 3).await;
    cluster.arm_pause(0, 4000, Some("before_commit")).await;
    let (http, url) = (cluster.http.clone(), cluster.url(0, "/api/orders"));
    let stalled = tokio::spawn(async move {
        let response = http
            .post(url)
            .json(&json!({ "sku": sku, "user_id": "stalled", "quantity": 1 }))
            .send()
            .await
            .expect("order");
        let status = response.status();
        (
            status,
            response.json::<Value>().await.unwrap_or(Value::Null),
        )
    });
    assert!(cluster.wait_until_pause_claimed().await, "never stalled");

    let (status, body) = set_cohort(&cluster, 0, &json!({ "enabled": false })).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body) = crate::lock_primitives::bounded("the stalled order", stalled)
        .await
        .expect("stalled order");
    assert_eq!(
        (status, body["error"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("sale_changed")),
        "{body}"
    );
    assert_eq!(cluster.count_orders(sku).await, 0, "nothing written");
    let placed = cluster.order(0, sku, "after", 1).await;
    assert_eq!(
        placed.status(),
        StatusCode::CREATED,
        "sells under the new mode"
    );
    let stats = cluster.sku_stats(sku).await;
    assert_eq!(
        (
            &stats["orders"],
            &stats["stock_mysql"],
            &stats["consistent"]
        ),
        (&json!(1), &json!(2), &json!(true)),
        "{stats}"
    );
}

/// A body that is not `{"enabled": bool, "combine": 1..=64}` is refused with a JSON
/// error naming the field (422: a JSON object the route does not take,
/// `docs/api.md`), and the switch stays as it was. Combining with the layer off is no
/// combining: answered as 1.
#[tokio::test]
async fn a_bad_cohort_body_names_what_is_wrong_and_changes_nothing() {
    let cluster = TestCluster::start(1, &[]).await;
    let epoch = cluster.get_json(0, "/api/stats").await["epoch"].clone();
    let before = cluster.get_json(0, "/api/admin/cohort").await;
    for body in [
        json!({ "enabled": "yes" }),
        json!({ "enabled": 1 }),
        json!({ "enabled": null }),
        json!({}),
        json!({ "on": true }),
        json!({ "enabled": true, "combine": 0 }),
        json!({ "enabled": true, "combine": 65 }),
        json!({ "enabled": true, "combine": "8" }),
        json!({ "enabled": true, "combine": 2.5 }),
    ] {
        let (status, answer) = set_cohort(&cluster, 0, &body).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}: {answer}");
        let code = if body.get("on").is_some() {
            "unknown_field"
        } else {
            "invalid_value"
        };
        assert_eq!(answer["error"], code, "{body}");
        let field = if body.get("combine").is_some() {
            "`combine`"
        } else {
            "`enabled`"
        };
        assert!(
            answer["message"]
                .as_str()
                .is_some_and(|m| m.contains(field)),
            "{body}: the message names the field: {answer}"
        );
    }
    assert_eq!(cluster.get_json(0, "/api/admin/cohort").await, before);
    assert_eq!(
        cluster.get_json(0, "/api/stats").await["epoch"],
        epoch,
        "no change of the sale"
    );
    let (status, answer) =
        set_cohort(&cluster, 0, &json!({ "enabled": false, "combine": 8 })).await;
    assert_eq!(
        (status, answer),
        (StatusCode::OK, json!({ "enabled": false, "combine": 1 })),
        "no combining without the layer"
    );
}

/// The switch reaches the locks: with the layer on, 20 buyers at once on one replica
/// get holds handed over within the replica (the timeline marks them); switched off,
/// every one of 20 takes the lock from the lock service.
///
/// With the order's `cohort` not read from the switch (it was `true` for every order
/// before the switch existed), the second crowd's holds are handed over too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_switch_reaches_the_locks() {
    let cluster = TestCluster::start(1, &["--work-ms", "20", "--lock-wait-ms", "20000"]).await;
    cluster.set_strategy("redis-lock").await;
    let mut handed = Vec::new();
    for (enabled, sku) in [(true, "cohort-on"), (false, "cohort-off")] {
        let (status, body) = set_cohort(&cluster, 0, &json!({ "enabled": enabled })).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        cluster.reset(sku, 100).await;
        let statuses = cluster.crowd(sku, 20).await;
        assert!(
            statuses.iter().all(|s| *s == StatusCode::CREATED),
            "{sku}: {statuses:?}"
        );
        // The timeline is written by a task of its own: wait for every section.
        let path = format!("/api/timeline?sku={sku}");
        let recorded = crate::support::eventually(std::time::Duration::from_secs(10), || async {
            cluster.get_json(0, &path).await["sections"]
                .as_array()
                .is_some_and(|s| s.len() == 20)
        })
        .await;
        assert!(recorded, "{sku}: 20 sections in the timeline");
        let sections = cluster.get_json(0, &path).await["sections"].clone();
        let count = sections
            .as_array()
            .into_iter()
            .flatten()
            .filter(|s| s["handed_over"] == true)
            .count();
        handed.push(count);
    }
    assert!(handed[0] > 0, "on: some holds handed over: {handed:?}");
    assert_eq!(handed[1], 0, "off: none handed over: {handed:?}");
}
