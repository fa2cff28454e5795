//! A replica announces itself in Redis once a second (id, address, start time,
//! requests served) so `/api/stats` can list the replicas alive. It deregisters on a
//! clean shutdown; a killed replica simply stops beating and ages out.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use chrono::Utc;
use tokio::task::JoinHandle;

use crate::store::{ClusterState, ReplicaInfo};

const INTERVAL: Duration = Duration::from_secs(1);

pub struct Heartbeat {
    cluster: ClusterState,
    info: ReplicaInfo,
    requests: Arc<AtomicU64>,
}

pub struct RunningHeartbeat {
    cluster: ClusterState,
    replica_id: String,
    task: JoinHandle<()>,
}

impl Heartbeat {
    pub fn new(
        cluster: ClusterState,
        id: String,
        address: SocketAddr,
        requests: Arc<AtomicU64>,
    ) -> Self {
        let now = Utc::now();
        let info = ReplicaInfo {
            id,
            address: address.to_string(),
            pid: std::process::id(),
            started_at: now,
            requests: 0,
            last_seen: now,
        };
        Heartbeat {
            cluster,
            info,
            requests,
        }
    }

    /// Beats once right away (so the replica is listed as soon as it serves), then
    /// every second in the background.
    pub async fn start(self) -> RunningHeartbeat {
        let Heartbeat {
            cluster,
            mut info,
            requests,
        } = self;
        let replica_id = info.id.clone();
        let background = cluster.clone();
        beat(&cluster, &mut info, &requests).await;
        let task = tokio::spawn(async move {
            loop {
                tokio::time::sleep(INTERVAL).await;
                beat(&background, &mut info, &requests).await;
            }
        });
        RunningHeartbeat {
            cluster,
            replica_id,
            task,
        }
    }
}

async fn beat(cluster: &ClusterState, info: &mut ReplicaInfo, requests: &AtomicU64) {
    info.requests = requests.load(Ordering::Relaxed);
    info.last_seen = Utc::now();
    if let Err(error) = cluster.heartbeat(info).await {
        tracing::warn!(%error, "heartbeat failed");
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
