//! Guarantees 5 and 6 on the stock cache: a failed cache write drops the SKU's cached
//! stock, and a rebuild of a suspect or stale stock from MySQL lands only within its
//! limits (`src/store/stock_cache.rs`).

use deadpool_redis::redis::AsyncCommands;
use flashsale::model::Sku;
use flashsale::store::StockCache;
use reqwest::StatusCode;

use crate::guarantees_support::{order, sell_out};
use crate::support::{TestCluster, redis_pool};

/// The Redis keys of one SKU's stock and of its row version.
fn stock_keys(cluster: &TestCluster, sku: &str) -> (String, String) {
    (
        format!("{}:stock:{sku}", cluster.namespace),
        format!("{}:stock-version:{sku}", cluster.namespace),
    )
}

/// An order commits in MySQL, then its cache write fails (here the cached row version
/// is not a number, so the write's script errors out while Redis itself answers). The
/// order stands (201), and the SKU's cached stock is dropped: the SKU answers 503
/// `unavailable` to a shopper who would read it until an admin reconciles, then sells
/// exactly what MySQL has left. Run for a lock strategy and for the two strategies
/// with flows of their own, which share `SaleFlow::write_cache`.
///
/// Without the drop in `write_cache` (the failure only logged), Redis kept the stock
/// of before the order, one unit above MySQL, for the next reader to sell from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_cache_write_drops_the_cached_stock() {
    let cluster = TestCluster::start(1, &[]).await;
    let mut redis = redis_pool().get().await.expect("redis");
    for strategy in ["redis-lock", "optimistic", "db-for-update"] {
        cluster.set_strategy(strategy).await;
        let sku = format!("unwritable-{strategy}");
        cluster.reset(&sku, 5).await;
        let (stock_key, version_key) = stock_keys(&cluster, &sku);
        let () = redis
            .set(&version_key, "not-a-version")
            .await
            .expect("SET the version");

        let answer = order(&cluster, 0, &sku, "first").await;
        assert_eq!(answer.0, StatusCode::CREATED, "{strategy}: {answer:?}");
        let cached: Option<i64> = redis.get(&stock_key).await.expect("GET the stock");
        assert_eq!(
            cached, None,
            "{strategy}: the stock whose write failed is still cached"
        );
        let stats = cluster.sku_stats(&sku).await;
        assert_eq!(
            (stats["orders"].as_i64(), stats["stock_mysql"].as_i64()),
            (Some(1), Some(4)),
            "{strategy}: the order stands: {stats}"
        );
        if strategy == "redis-lock" {
            // A lock strategy reads the cache: it refuses rather than sell from nothing.
            let answer = order(&cluster, 0, &sku, "too-early").await;
            assert_eq!(
                answer,
                (StatusCode::SERVICE_UNAVAILABLE, "unavailable".into()),
                "{strategy}: until reconciled"
            );
        }

        cluster.reconcile().await;
        let stats = cluster.sku_stats(&sku).await;
        assert_eq!(
            (stats["stock_redis"].as_i64(), stats["consistent"].as_bool()),
            (Some(4), Some(true)),
            "{strategy}: rebuilt from MySQL: {stats}"
        );
        sell_out(&cluster, &sku, 5, strategy).await;
    }
}

/// The rebuild's limits, on the cache itself: `repair` (a holder that found the stock
/// suspect, or its read stale, rewrites it from the MySQL row it read) lands over the
/// same or an older cached row version, only while its SKU has not changed (a reset,
/// a reconcile, a switch) since the epoch the repairer began in, and never recreates
/// a stock that is not there.
///
/// A rebuild from an older row version than the cached one would put back a stock a
/// newer commit has moved past (with the version check gone from `WRITE_STOCK`, the
/// older rebuild landed); one begun before the SKU's last change would rewrite a stock
/// the change set (without the epoch check, it landed); one over a dropped
/// stock would bring back a value a failed write or a COMMIT of unknown outcome made
/// untrustworthy (without the `EXISTS`, it was recreated).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_lands_only_over_an_older_or_equal_version_of_its_own_epoch() {
    let cluster = TestCluster::start(1, &[]).await;
    let name = "rebuilt";
    cluster.reset(name, 5).await;
    let sku = Sku::parse(name).expect("sku");
    let cache = StockCache::new(redis_pool(), cluster.namespace.clone());
    let mut redis = redis_pool().get().await.expect("redis");
    let (stock_key, version_key) = stock_keys(&cluster, name);
    let epoch: u64 = redis
        .get(format!("{}:epoch", cluster.namespace))
        .await
        .expect("the published epoch");
    let version: i64 = redis.get(&version_key).await.expect("the cached version");
    let pool = redis_pool();
    let cached = || cached_stock(&pool, &stock_key, &version_key);

    let older = cache.repair(&sku, 1, version - 1, "", epoch).await;
    assert!(!older.expect("ran"), "an older row version landed");
    assert_eq!(cached().await, (Some(5), Some(version)));

    // A later epoch (another SKU's change) does not stop a repair: only one begun
    // before this SKU's own change.
    for other in [epoch - 1] {
        let landed = cache.repair(&sku, 2, version + 1, "", other).await;
        assert!(!landed.expect("ran"), "a rebuild of epoch {other} landed");
        assert_eq!(cached().await, (Some(5), Some(version)));
    }

    let same = cache.repair(&sku, 3, version, "", epoch).await;
    assert!(same.expect("ran"), "the same row version is rebuilt");
    assert_eq!(cached().await, (Some(3), Some(version)));

    let newer = cache.repair(&sku, 4, version + 1, "", epoch).await;
    assert!(newer.expect("ran"), "a newer row version is rebuilt");
    assert_eq!(cached().await, (Some(4), Some(version + 1)));

    cache.forget(&sku).await.expect("DEL the stock");
    let dropped = cache.repair(&sku, 4, version + 2, "", epoch).await;
    assert!(!dropped.expect("ran"), "a dropped stock was recreated");
    assert_eq!(cached().await.0, None, "waits for a reconcile");
}

/// The cached stock and row version.
async fn cached_stock(
    pool: &flashsale::redis_pool::Pool,
    stock_key: &str,
    version_key: &str,
) -> (Option<i64>, Option<i64>) {
    let mut redis = pool.get().await.expect("redis");
    let stock: Option<i64> = redis.get(stock_key).await.expect("GET the stock");
    let version: Option<i64> = redis.get(version_key).await.expect("GET the version");
    (stock, version)
}
