//! State every replica must agree on, kept in Redis: the active strategy, the fencing
//! and cohort switches and the sale epoch (published by `sale.rs`), an armed fault, and
//! the registry of live replicas.
//!
//! The settings are read from Redis on each order (one MGET) rather than cached, so a
//! switch takes effect on every replica for the very next request: a load test that
//! switches and then fires never runs a stale strategy.

use std::collections::{BTreeMap, HashMap};

use chrono::Utc;
use std::sync::LazyLock;

use crate::redis_pool::Pool;
use deadpool_redis::redis::{AsyncCommands, Script};

use super::StoreError;
use crate::model::PausePoint;

/// What a replica announces about itself with each heartbeat (a wire type: `/api/stats`
/// lists them).
pub use flashsale_wire::stats::ReplicaInfo;

/// Claims the armed pause if it is armed for this point (`<ms>@<point>`).
static TAKE_PAUSE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local armed = redis.call('GET', KEYS[1])
if armed and string.sub(armed, -string.len(ARGV[1]) - 1) == '@' .. ARGV[1] then
  redis.call('DEL', KEYS[1])
  return armed
end
return false
",
    )
});

/// Events every replica counts, cluster-wide in Redis and per replica in /metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterEvent {
    LockTimeout,
    LockLost,
    FencingRejection,
    OptimisticConflict,
    OptimisticGaveUp,
    PausedHolder,
}

impl ClusterEvent {
    pub const ALL: [ClusterEvent; 6] = [
        ClusterEvent::LockTimeout,
        ClusterEvent::LockLost,
        ClusterEvent::FencingRejection,
        ClusterEvent::OptimisticConflict,
        ClusterEvent::OptimisticGaveUp,
        ClusterEvent::PausedHolder,
    ];

    /// The counter's name in `/api/stats` (`<strategy>.<counter>`).
    pub fn counter(self) -> &'static str {
        self.names().0
    }

    /// One Prometheus metric per event, so each gets its own `# HELP`.
    pub fn metric(self) -> &'static str {
        self.names().1
    }

    pub fn help(self) -> &'static str {
        self.names().2
    }

    /// Counter, metric and help of the event, in one place.
    fn names(self) -> (&'static str, &'static str, &'static str) {
        match self {
            ClusterEvent::LockTimeout => (
                "lock_timeouts",
                "flashsale_lock_timeouts_total",
                "Orders refused because the lock was not acquired in time, by strategy",
            ),
            ClusterEvent::LockLost => (
                "locks_lost",
                "flashsale_locks_lost_total",
                "Orders abandoned because their lock was lost mid-section, by strategy",
            ),
            ClusterEvent::FencingRejection => (
                "fencing_rejections",
                "flashsale_fencing_rejections_total",
                "Stale holders' writes refused by the fence, by strategy",
            ),
            ClusterEvent::OptimisticConflict => (
                "conflicts",
                "flashsale_optimistic_conflicts_total",
                "Optimistic version conflicts (each retried)",
            ),
            ClusterEvent::OptimisticGaveUp => (
                "gave_up",
                "flashsale_optimistic_gave_up_total",
                "Optimistic orders that gave up after their last attempt",
            ),
            ClusterEvent::PausedHolder => (
                "paused_holders",
                "flashsale_paused_holders_total",
                "Lock holders paused by the armed fault",
            ),
        }
    }
}

/// How long the failover fault waits for a holder once replication has resumed.
const RESUMED_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// A replica is considered alive while its last heartbeat is younger than this.
pub const REPLICA_TTL_MS: i64 = 5_000;

#[derive(Clone)]
pub struct ClusterState {
    pool: Pool,
    namespace: String,
}

/// How a switch (fencing) is written in Redis and MySQL.
pub(super) fn switch_value(enabled: bool) -> &'static str {
    if enabled { "on" } else { "off" }
}

/// The cohort layer's switch and how many orders a holder may sell in one critical
/// section (`strategy::combine`; 1: one, no combining).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CohortSetting {
    pub enabled: bool,
    pub combine: u16,
}

impl CohortSetting {
    /// On, without combining: the default (MySQL has no row until the first switch).
    pub const ON: CohortSetting = CohortSetting {
        enabled: true,
        combine: 1,
    };

    /// As written in Redis and MySQL: `off`, `on`, or `combine:N` (on, combining).
    pub fn encode(self) -> String {
        match (self.enabled, self.combine) {
            (false, _) => "off".to_owned(),
            (true, 0 | 1) => "on".to_owned(),
            (true, n) => format!("combine:{n}"),
        }
    }

    /// Anything but `off` and a well-formed `combine:N` reads as on, as before
    /// combining existed.
    pub fn decode(value: &str) -> CohortSetting {
        if value == "off" {
            return CohortSetting {
                enabled: false,
                combine: 1,
            };
        }
        let combine = value
            .strip_prefix("combine:")
            .and_then(|n| n.parse::<u16>().ok())
            .unwrap_or(1)
            .max(1);
        CohortSetting {
            enabled: true,
            combine,
        }
    }
}

/// The settings as found in Redis: `None` where Redis has no value.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CachedSettings {
    pub strategy: Option<String>,
    pub fencing: Option<bool>,
    pub cohort: Option<CohortSetting>,
    pub epoch: Option<u64>,
    pub pause: Option<PauseFault>,
}

/// Strategy, fencing, epoch, pause and cohort as one MGET returns them.
type RawSettings = (
    Option<String>,
    Option<String>,
    Option<u64>,
    Option<String>,
    Option<String>,
);

/// The cluster-wide switches an order needs.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterSettings {
    pub strategy: String,
    /// Whether lock holders' writes are fenced by their tokens.
    pub fencing: bool,
    /// Whether lock strategies run under the cohort layer (a replica's requests queue
    /// locally and the lock is handed on within the replica).
    pub cohort: bool,
    /// With the cohort layer on: how many queued orders a holder may sell in one
    /// critical section (1: no combining).
    pub combine: u16,
    /// The sale epoch the order runs under; its commit requires that no change of its
    /// SKU came after it.
    pub epoch: u64,
    /// An armed paused-holder fault.
    pub pause: Option<PauseFault>,
}

/// The paused-holder fault: the next lock holder reaching `at` stalls for `ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PauseFault {
    pub ms: u64,
    pub at: PausePoint,
}

impl PauseFault {
    fn encode(self) -> String {
        format!("{}@{}", self.ms, self.at.as_str())
    }

    fn decode(raw: &str) -> Option<PauseFault> {
        let (ms, at) = raw.split_once('@')?;
        Some(PauseFault {
            ms: ms.parse().ok()?,
            at: PausePoint::parse(at)?,
        })
    }
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

    fn cohort_key(&self) -> String {
        format!("{}:cohort", self.namespace)
    }

    fn pause_key(&self) -> String {
        format!("{}:fault:pause-holder-ms", self.namespace)
    }

    /// Where the sale epoch is published (each SKU's is beside its stock,
    /// `stock_cache.rs`).
    fn epoch_key(&self) -> String {
        format!("{}:epoch", self.namespace)
    }

    /// The strategy, fencing, epoch and cohort keys, in that order (for `sale.rs`,
    /// which publishes them with the stocks in one script).
    pub(super) fn settings_keys(&self) -> [String; 4] {
        [
            self.strategy_key(),
            self.fencing_key(),
            self.epoch_key(),
            self.cohort_key(),
        ]
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
        let (strategy, fencing, epoch, pause, cohort): RawSettings = conn
            .mget(&[
                self.strategy_key(),
                self.fencing_key(),
                self.epoch_key(),
                self.pause_key(),
                self.cohort_key(),
            ])
            .await?;
        Ok(CachedSettings {
            strategy,
            fencing: fencing.map(|f| f == "on"),
            cohort: cohort.as_deref().map(CohortSetting::decode),
            epoch,
            pause: pause.as_deref().and_then(PauseFault::decode),
        })
    }

    /// Arms the paused-holder fault for the next lock holder reaching `fault.at`.
    pub async fn arm_pause(&self, fault: PauseFault) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let () = conn.set(self.pause_key(), fault.encode()).await?;
        Ok(())
    }

    /// Where this replica's Redis is (one server, or behind Sentinel).
    pub fn redis_source(&self) -> &crate::redis_pool::Source {
        self.pool.manager().source()
    }

    fn failover_key(&self) -> String {
        format!("{}:fault:failover", self.namespace)
    }

    /// Held while a failover fault runs, so that a second one waits for it.
    fn failover_claim_key(&self) -> String {
        format!("{}:fault:failover-running", self.namespace)
    }

    /// Claims the failover fault for at most `bound`; false if one is under way.
    pub async fn claim_failover(&self, bound: std::time::Duration) -> Result<bool, StoreError> {
        let mut conn = self.pool.get().await?;
        let ms = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX);
        let set: Option<String> = deadpool_redis::redis::cmd("SET")
            .arg(self.failover_claim_key())
            .arg(1)
            .arg("NX")
            .arg("PX")
            .arg(ms)
            .query_async(&mut conn)
            .await?;
        Ok(set.is_some())
    }

    /// Ends the failover fault's claim: the task, once it undid its cut, or an admin
    /// withdrawing the fault (the task sees the claim gone and stops). Best effort: the
    /// claim expires anyway.
    pub async fn release_failover(&self) {
        if let Ok(mut conn) = self.pool.get().await {
            let _: Result<(), _> = conn.del(self.failover_claim_key()).await;
        }
    }

    async fn failover_claimed(&self) -> Result<bool, StoreError> {
        let mut conn = self.pool.get().await?;
        Ok(conn.exists(self.failover_claim_key()).await?)
    }

    /// The failover fault, from the cut to the restore, in one task that the admin
    /// request only waits for until `armed` says the plan (a request dropped halfway
    /// leaves nothing cut). The replica to promote stops receiving the primary's
    /// writes, `pause` is armed for the next holder, and once that holder holds `sku`'s
    /// redis-lock key on the primary, the Redis fails over. Replication stays cut for
    /// at most `within` (a lock with `WAIT` is not held meanwhile), then resumes while
    /// the fault waits as long again, and at least `RESUMED_WAIT`, for a holder;
    /// without one, or once an admin withdrew the fault, the pause is withdrawn. Every
    /// way out undoes the cut. The outcome is kept (on the new primary) for the
    /// timeline.
    pub async fn fail_over_when_held(
        &self,
        sentinel: &crate::redis_pool::SentinelSource,
        pause: PauseFault,
        sku: &crate::model::Sku,
        within: std::time::Duration,
        armed: tokio::sync::oneshot::Sender<
            Result<crate::redis_failover::Plan, crate::redis_failover::FailoverError>,
        >,
    ) -> anyhow::Result<crate::redis_failover::Outcome> {
        use crate::redis_failover::{FailoverError, cut, plan, restore};
        let plan = match plan(sentinel).await {
            Ok(plan) => plan,
            Err(error) => {
                let _ = armed.send(Err(error));
                anyhow::bail!("no failover plan");
            }
        };
        if let Err(error) = cut(sentinel, &plan).await {
            let _ = armed.send(Err(error));
            anyhow::bail!("replication not cut");
        }
        // Armed after the cut: the promoted replica never hears of it, so the next
        // holder there does not stall as well.
        if let Err(error) = self.arm_pause(pause).await {
            let _ = restore(&plan).await;
            let _ = armed.send(Err(FailoverError::Sentinel(format!(
                "the pause could not be armed: {error}"
            ))));
            anyhow::bail!("pause not armed");
        }
        tracing::warn!(%sku, primary = %plan.primary, promoted = %plan.promoted,
            "fault armed: the Redis fails over while the next holder holds the lock");
        let _ = armed.send(Ok(plan.clone()));
        let outcome = self
            .fail_over_once_held(sentinel, plan.clone(), sku, within)
            .await;
        if outcome.is_err() {
            let _ = restore(&plan).await;
            let _ = self.disarm_pause().await;
        }
        outcome
    }

    async fn fail_over_once_held(
        &self,
        sentinel: &crate::redis_pool::SentinelSource,
        plan: crate::redis_failover::Plan,
        sku: &crate::model::Sku,
        within: std::time::Duration,
    ) -> anyhow::Result<crate::redis_failover::Outcome> {
        let lock_key = format!("{}:lock:{}", self.namespace, sku.as_str());
        let cut_until = tokio::time::Instant::now() + within;
        // After the resume the replica reconnects (its retry runs once a second) and
        // a holder that waits for it has to come round again: seconds, not `within`.
        let deadline = cut_until + within.max(RESUMED_WAIT);
        let mut resumed = false;
        loop {
            let held = async {
                let claimed = self.cached_settings().await?.pause.is_none();
                let mut conn = self.pool.get().await?;
                let exists: bool = conn.exists(&lock_key).await?;
                Ok::<_, StoreError>(claimed && exists)
            };
            if matches!(held.await, Ok(true)) {
                break;
            }
            if !resumed && tokio::time::Instant::now() >= cut_until {
                crate::redis_failover::resume(&plan).await?;
                resumed = true;
            }
            let withdrawn = matches!(self.failover_claimed().await, Ok(false));
            if withdrawn || tokio::time::Instant::now() >= deadline {
                crate::redis_failover::restore(&plan).await?;
                self.disarm_pause().await?;
                return Ok(crate::redis_failover::Outcome {
                    plan,
                    failed_over: false,
                    lock_lost: false,
                    failover_at_ms: None,
                    promoted_at_ms: None,
                });
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let outcome = crate::redis_failover::fail_over(sentinel, plan, &lock_key).await?;
        let record = serde_json::json!({ "sku": sku.as_str(), "outcome": &outcome }).to_string();
        // Until Sentinel has seen the promotion (its next INFO of the replica, within a
        // second or so) it names no usable primary, and the pool's connections may
        // still be the old primary's (refused or closed): try for a while.
        let mut last = None;
        for _ in 0..100 {
            let written = async {
                let mut conn = self.pool.get().await?;
                let () = conn.set(self.failover_key(), &record).await?;
                Ok::<_, StoreError>(())
            };
            match written.await {
                Ok(()) => return Ok(outcome),
                Err(error) => last = Some(error),
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        Err(anyhow::anyhow!(
            "failed over, but the outcome was not recorded: {last:?}"
        ))
    }

    /// The last failover fault's record, `{"sku", "outcome"}` (JSON), if any.
    pub async fn last_failover(&self) -> Result<Option<String>, StoreError> {
        let mut conn = self.pool.get().await?;
        Ok(conn.get(self.failover_key()).await?)
    }

    /// Withdraws an armed pause nobody claimed.
    pub async fn disarm_pause(&self) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let () = conn.del(self.pause_key()).await?;
        Ok(())
    }

    /// Claims the armed pause if it is armed for `at` (only one holder gets it).
    pub async fn take_pause(&self, at: PausePoint) -> Result<Option<PauseFault>, StoreError> {
        let mut conn = self.pool.get().await?;
        let taken: Option<String> = TAKE_PAUSE
            .key(self.pause_key())
            .arg(at.as_str())
            .invoke_async(&mut conn)
            .await?;
        Ok(taken.as_deref().and_then(PauseFault::decode))
    }

    /// Adds one to the cluster-wide count of `event` under `strategy` (the counters
    /// `/api/stats` shows) and to this replica's Prometheus counter. Counting is best
    /// effort: a failure is logged and never fails the order being counted.
    pub async fn count(&self, strategy: &str, event: ClusterEvent) {
        metrics::counter!(event.metric(), "strategy" => strategy.to_owned()).increment(1);
        let counter = event.counter();
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
