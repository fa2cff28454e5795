//! The answer of `GET /api/stats` (`docs/api.md`): what the service's records say
//! about the sale, read by the dashboard, the load test and the fault explorer.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::{PausePoint, Sku, StrategyName};

/// The answer of `GET /api/stats`; clients (the load test) read it with these types.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Stats {
    #[schema(value_type = StrategyName)]
    pub strategy: String,
    /// Whether lock holders' writes are fenced.
    pub fencing: bool,
    /// Whether lock strategies run under the cohort layer (a replica's requests for a
    /// SKU queue locally and the lock is handed on within the replica); `None` from
    /// replicas older than the switch.
    #[serde(default)]
    pub cohort: Option<bool>,
    /// The sale epoch: moved forward by every admin change of the sale.
    #[serde(default)]
    pub epoch: u64,
    /// A paused-holder fault waiting for the next lock holder, in ms.
    pub pause_armed_ms: Option<u64>,
    /// Where in the critical section that holder will pause.
    #[serde(default)]
    pub pause_armed_at: Option<PausePoint>,
    /// This replica's lock lease (`FLASHSALE_LOCK_LEASE_MS`), so the dashboard can time
    /// its paused-holder walkthrough; 0 from replicas older than this field.
    #[serde(default)]
    pub lock_lease_ms: u64,
    /// How long this replica's orders wait for a lock (`FLASHSALE_LOCK_WAIT_MS`).
    #[serde(default)]
    pub lock_wait_ms: u64,
    /// This replica's simulated work inside the critical section (`FLASHSALE_WORK_MS`).
    #[serde(default)]
    pub work_ms: u64,
    /// The commit this replica was built from; `None` from older replicas.
    #[serde(default)]
    pub commit: Option<String>,
    pub replicas: Vec<ReplicaInfo>,
    pub skus: Vec<SkuStats>,
    /// Cluster-wide event counts by `strategy.counter` (lock timeouts, locks lost,
    /// optimistic conflicts and give-ups).
    pub counters: BTreeMap<String, i64>,
}

#[derive(Debug, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct SkuStats {
    pub sku: Sku,
    pub initial_stock: i64,
    /// `None` when Redis has no stock for this SKU (flushed or restarted).
    pub stock_redis: Option<i64>,
    pub stock_mysql: i64,
    pub orders: i64,
    pub ordered_quantity: i64,
    pub oversold: i64,
    pub consistent: bool,
    pub updated_at: DateTime<Utc>,
    /// The most units one user may buy of this SKU in this sale (set by its last
    /// reset); `None`: no limit (and from replicas older than the limit).
    #[serde(default)]
    pub limit_per_user: Option<i64>,
}

/// What a replica announces about itself with each heartbeat.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReplicaInfo {
    pub id: String,
    pub address: String,
    pub pid: u32,
    pub started_at: DateTime<Utc>,
    pub requests: u64,
    /// Orders of this replica waiting for a lock at the last heartbeat.
    #[serde(default)]
    pub lock_waiters: u64,
    /// How often the supervisor (`flashsale cluster`) has restarted this replica.
    #[serde(default)]
    pub restarts: u32,
    pub last_seen: DateTime<Utc>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_of_a_replica_without_the_timing_fields_still_parse() {
        // What a replica answered before the lease, wait and work were part of it.
        let old = r#"{"strategy": "none", "fencing": false, "pause_armed_ms": null,
                      "replicas": [], "skus": [], "counters": {}}"#;
        let stats: Stats = serde_json::from_str(old).expect("old stats parse");
        assert_eq!(
            (stats.lock_lease_ms, stats.lock_wait_ms, stats.work_ms),
            (0, 0, 0)
        );
        assert_eq!(stats.cohort, None);
    }
}
