//! State every replica must agree on, kept in Redis: the active strategy, the fencing
//! switch, an armed fault, and the registry of live replicas.
//!
//! The settings are read from Redis on each order (one MGET) rather than cached, so a
//! switch takes effect on every replica for the very next request: a load test that
//! switches and then fires never runs a stale strategy.

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};
use deadpool_redis::Pool;
use deadpool_redis::redis::AsyncCommands;
use serde::{Deserialize, Serialize};

use super::StoreError;

/// A replica is considered alive while its last heartbeat is younger than this.
pub const REPLICA_TTL_MS: i64 = 5_000;

#[derive(Clone)]
pub struct ClusterState {
    pool: Pool,
    namespace: String,
}

fn fencing_value(enabled: bool) -> &'static str {
    if enabled { "on" } else { "off" }
}

/// The settings as found in Redis: `None` where Redis has no value.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CachedSettings {
    pub strategy: Option<String>,
    pub fencing: Option<bool>,
    pub pause_holder_ms: Option<u64>,
}

/// The cluster-wide switches an order needs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClusterSettings {
    /// The active strategy, `None` when nobody has chosen one yet.
    pub strategy: Option<String>,
    /// Whether lock holders' writes are fenced by their tokens.
    pub fencing: bool,
    /// An armed paused-holder fault, in milliseconds.
    pub pause_holder_ms: Option<u64>,
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
    pub last_seen: DateTime<Utc>,
}

impl ClusterState {
    pub fn new(pool: Pool, namespace: String) -> Self {
        ClusterState { pool, namespace }
    }

    fn strategy_key(&self) -> String {
        format!("{}:strategy", self.namespace)
    }

    fn fencing_key(&self) -> String {
        format!("{}:fencing", self.namespace)
    }

    fn pause_key(&self) -> String {
        format!("{}:fault:pause-holder-ms", self.namespace)
    }

    fn counters_key(&self) -> String {
        format!("{}:counters", self.namespace)
    }

    fn replicas_key(&self) -> String {
        format!("{}:replicas", self.namespace)
    }

    /// The cluster-wide settings as Redis holds them, in one round trip. `None` for a
    /// setting Redis does not have (never set, or lost in a restart).
    pub async fn cached_settings(&self) -> Result<CachedSettings, StoreError> {
        let mut conn = self.pool.get().await?;
        let (strategy, fencing, pause): (Option<String>, Option<String>, Option<u64>) = conn
            .mget(&[self.strategy_key(), self.fencing_key(), self.pause_key()])
            .await?;
        Ok(CachedSettings {
            strategy,
            fencing: fencing.map(|f| f == "on"),
            pause_holder_ms: pause,
        })
    }

    pub async fn set_fencing(&self, enabled: bool) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let () = conn.set(self.fencing_key(), fencing_value(enabled)).await?;
        Ok(())
    }

    /// Puts settings rebuilt from MySQL back, unless they were set meanwhile.
    pub async fn restore_settings(&self, strategy: &str, fencing: bool) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let () = deadpool_redis::redis::pipe()
            .set_nx(self.strategy_key(), strategy)
            .ignore()
            .set_nx(self.fencing_key(), fencing_value(fencing))
            .ignore()
            .query_async(&mut conn)
            .await?;
        Ok(())
    }

    /// Arms the paused-holder fault: the next lock holder to claim it stalls `ms`.
    pub async fn arm_pause(&self, ms: u64) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let () = conn.set(self.pause_key(), ms).await?;
        Ok(())
    }

    /// Withdraws an armed pause nobody claimed.
    pub async fn disarm_pause(&self) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let () = conn.del(self.pause_key()).await?;
        Ok(())
    }

    /// Claims the armed pause (only one holder gets it).
    pub async fn take_pause(&self) -> Result<Option<u64>, StoreError> {
        let mut conn = self.pool.get().await?;
        Ok(conn.get_del(self.pause_key()).await?)
    }

    pub async fn set_active_strategy(&self, name: &str) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let () = conn.set(self.strategy_key(), name).await?;
        Ok(())
    }

    /// Adds one to a cluster-wide counter such as `optimistic.conflicts`. Counting is
    /// best effort: a failure is logged and never fails the order being counted.
    pub async fn count(&self, strategy: &str, counter: &str) {
        metrics::counter!("flashsale_events_total",
            "strategy" => strategy.to_owned(), "event" => counter.to_owned())
        .increment(1);
        let counted = async {
            let mut conn = self.pool.get().await?;
            let () = conn
                .hincr(self.counters_key(), format!("{strategy}.{counter}"), 1)
                .await?;
            Ok::<_, StoreError>(())
        };
        if let Err(error) = counted.await {
            tracing::warn!(%error, strategy, counter, "could not count");
        }
    }

    /// Every counter, by `strategy.counter`.
    pub async fn counters(&self) -> Result<BTreeMap<String, i64>, StoreError> {
        let mut conn = self.pool.get().await?;
        Ok(conn.hgetall(self.counters_key()).await?)
    }

    pub async fn heartbeat(&self, replica: &ReplicaInfo) -> Result<(), StoreError> {
        let json = serde_json::to_string(replica).map_err(|e| StoreError::Corrupt {
            what: "replica info",
            detail: e.to_string(),
        })?;
        let mut conn = self.pool.get().await?;
        let () = conn.hset(self.replicas_key(), &replica.id, json).await?;
        Ok(())
    }

    pub async fn deregister(&self, replica_id: &str) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let () = conn.hdel(self.replicas_key(), replica_id).await?;
        Ok(())
    }

    /// Replicas whose heartbeat is fresh, sorted by id. Entries long dead are pruned
    /// on the way, so a replica killed with -9 disappears by itself.
    pub async fn live_replicas(&self) -> Result<Vec<ReplicaInfo>, StoreError> {
        let mut conn = self.pool.get().await?;
        let entries: HashMap<String, String> = conn.hgetall(self.replicas_key()).await?;
        let now = Utc::now();
        let mut alive = Vec::new();
        for (id, json) in entries {
            let fresh = serde_json::from_str::<ReplicaInfo>(&json)
                .ok()
                .filter(|r| (now - r.last_seen).num_milliseconds() < REPLICA_TTL_MS);
            match fresh {
                Some(replica) => alive.push(replica),
                None => {
                    let () = conn.hdel(self.replicas_key(), &id).await?;
                }
            }
        }
        alive.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(alive)
    }
}
