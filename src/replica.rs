//! A replica announces itself in Redis once a second (id, address, start time,
//! requests served, orders waiting for a lock) so `/api/stats` and the dashboard can
//! list the replicas alive, and checks that Redis holds the sale's epoch. It
//! deregisters on a clean shutdown; a killed replica simply stops beating and ages
//! out.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use chrono::Utc;
use tokio::task::JoinHandle;

use crate::store::{ClusterState, ReplicaInfo};
use crate::strategy::SaleFlow;

const INTERVAL: Duration = Duration::from_secs(1);

pub struct Heartbeat {
    cluster: ClusterState,
    info: ReplicaInfo,
    requests: Arc<AtomicU64>,
    flow: Arc<SaleFlow>,
    beats: u64,
}

/// Every this many beats (ten minutes) a replica purges idempotency keys past their
/// 24 hours; any replica may, the deletes are idempotent.
const PURGE_EVERY: u64 = 600;

pub struct RunningHeartbeat {
    cluster: ClusterState,
    replica_id: String,
    task: JoinHandle<()>,
}

impl Heartbeat {
    pub fn new(
        cluster: ClusterState,
        address: String,
        restarts: u32,
        requests: Arc<AtomicU64>,
        flow: Arc<SaleFlow>,
    ) -> Self {
        let now = Utc::now();
        let info = ReplicaInfo {
            id: flow.replica_id.clone(),
            address,
            pid: std::process::id(),
            started_at: now,
            requests: 0,
            lock_waiters: 0,
            restarts,
            last_seen: now,
        };
        Heartbeat {
            cluster,
            info,
            requests,
            flow,
            beats: 0,
        }
    }

    /// Beats once right away (so the replica is listed as soon as it serves), then
    /// every second in the background.
    pub async fn start(mut self) -> RunningHeartbeat {
        self.beat().await;
        let cluster = self.cluster.clone();
        let replica_id = self.info.id.clone();
        let task = tokio::spawn(async move {
            loop {
                tokio::time::sleep(INTERVAL).await;
                self.beat().await;
            }
        });
        RunningHeartbeat {
            cluster,
            replica_id,
            task,
        }
    }

    async fn beat(&mut self) {
        self.info.requests = self.requests.load(Ordering::Relaxed);
        self.info.lock_waiters = self.flow.lock_waiters.load(Ordering::Relaxed);
        self.info.last_seen = Utc::now();
        if let Err(error) = self.cluster.heartbeat(&self.info).await {
            tracing::warn!(%error, "heartbeat failed");
        }
        // A change whose publication never reached Redis (Redis was down just then)
        // would leave every order on the old epoch's stock: republish from MySQL.
        // Bounded, so a silent database cannot stop the beat (the replica would age
        // out of the list).
        match tokio::time::timeout(INTERVAL * 2, self.flow.store.resync_settings()).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::debug!(%error, "could not compare the sale's epochs"),
            Err(_) => tracing::debug!("comparing the sale's epochs took too long"),
        }
        if self.beats.is_multiple_of(PURGE_EVERY) {
            let purge = self.flow.store.records.purge_keys(10_000);
            match tokio::time::timeout(INTERVAL * 2, purge).await {
                Ok(Ok(0)) => {}
                Ok(Ok(purged)) => tracing::info!(purged, "idempotency keys past 24 h purged"),
                Ok(Err(error)) => tracing::debug!(%error, "could not purge idempotency keys"),
                Err(_) => tracing::debug!("purging idempotency keys took too long"),
            }
        }
        self.beats += 1;
    }
}

impl RunningHeartbeat {
    pub async fn stop(self) {
        self.task.abort();
        if let Err(error) = self.cluster.deregister(&self.replica_id).await {
            tracing::warn!(%error, "could not deregister the replica");
        }
    }
}
