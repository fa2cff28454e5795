//! An etcd lock: a lease granted per acquisition and kept alive while waiting and
//! holding, and etcd's own Lock service, which queues contenders in revision order
//! (each waits for the key created just before its own, like ZooKeeper's recipe).
//!
//! - The lock key is attached to the lease: if the replica dies, keep-alives stop, the
//!   lease expires after its TTL and etcd deletes the key, waking the next contender.
//! - A holder checks its lease before committing; a lease that is gone means the lock
//!   may be someone else's and the order must not be written.
//! - Release unlocks the key and revokes the lease. A wait that times out revokes the
//!   lease too, which withdraws the queued key.
//! - The fencing token is the revision at which the lock was granted: it only grows.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{Client, ConnectOptions, GetOptions, LockOptions, SortOrder, SortTarget};
use tokio::sync::RwLock;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{DistributedLock, HeldLock, LockError};

pub struct EtcdLock {
    endpoints: Vec<String>,
    prefix: String,
    /// Lease time-to-live in whole seconds, as etcd counts it.
    lease_ttl: i64,
    /// Connected on first use: a replica starts even while etcd is down.
    client: RwLock<Option<Client>>,
}

impl EtcdLock {
    pub fn new(endpoints: &str, namespace: &str, lease: Duration) -> EtcdLock {
        EtcdLock {
            endpoints: endpoints.split(',').map(|e| e.trim().to_owned()).collect(),
            prefix: format!("/flashsale/{namespace}/locks"),
            lease_ttl: i64::try_from(lease.as_secs().max(2)).unwrap_or(2),
            client: RwLock::new(None),
        }
    }

    pub fn lock_name(&self, name: &str) -> String {
        format!("{}/{name}", self.prefix)
    }

    async fn client(&self) -> Result<Client, LockError> {
        if let Some(client) = self.client.read().await.as_ref() {
            return Ok(client.clone());
        }
        let mut slot = self.client.write().await;
        if let Some(client) = slot.as_ref() {
            return Ok(client.clone());
        }
        let options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(3))
            .with_timeout(Duration::from_secs(5));
        let client = Client::connect(&self.endpoints, Some(options))
            .await
            .map_err(etcd_error)?;
        *slot = Some(client.clone());
        Ok(client)
    }

    /// The lock's keys in queue order (create revision), each with its lease; the
    /// first holds. Returns the keys and the holder's lease TTL in seconds.
    pub async fn inspect(
        &self,
        name: &str,
    ) -> Result<(Vec<(String, i64, i64)>, Option<i64>), LockError> {
        let mut client = self.client().await?;
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend);
        let response = client
            .get(format!("{}/", self.lock_name(name)), Some(options))
            .await
            .map_err(etcd_error)?;
        let keys: Vec<(String, i64, i64)> = response
            .kvs()
            .iter()
            .map(|kv| {
                (
                    String::from_utf8_lossy(kv.key()).into_owned(),
                    kv.create_revision(),
                    kv.lease(),
                )
            })
            .collect();
        let ttl = match keys.first() {
            Some((_, _, lease)) => Some(
                client
                    .lease_time_to_live(*lease, None)
                    .await
                    .map_err(etcd_error)?
                    .ttl(),
            ),
            None => None,
        };
        Ok((keys, ttl))
    }
}

#[async_trait]
impl DistributedLock for EtcdLock {
    type Guard = EtcdGuard;

    async fn acquire(&self, name: &str, wait: Duration) -> Result<EtcdGuard, LockError> {
        let deadline = Instant::now() + wait;
        let mut client = self.client().await?;
        let lease = client
            .lease_grant(self.lease_ttl, None)
            .await
            .map_err(etcd_error)?
            .id();
        let lost = Arc::new(AtomicBool::new(false));
        // Kept alive while waiting too: a wait may outlast the TTL.
        let keep_alive = match keep_alive(client.clone(), lease, self.lease_ttl, lost.clone()).await
        {
            Ok(task) => task,
            Err(error) => {
                revoke_in_background(client, lease);
                return Err(error);
            }
        };
        let options = LockOptions::new().with_lease(lease);
        let locked =
            tokio::time::timeout_at(deadline, client.lock(self.lock_name(name), Some(options)))
                .await;
        let response = match locked {
            Ok(Ok(response)) => response,
            outcome => {
                keep_alive.abort();
                revoke_in_background(client, lease);
                return Err(match outcome {
                    Ok(Err(error)) => etcd_error(error),
                    _ => LockError::Timeout { waited: wait },
                });
            }
        };
        let revision = response.header().map_or(0, |h| h.revision());
        Ok(EtcdGuard {
            client,
            key: response.key().to_vec(),
            lease,
            revision: u64::try_from(revision).unwrap_or(0),
            lost,
            keep_alive,
            released: AtomicBool::new(false),
        })
    }
}

/// Sends a keep-alive every third of the TTL; marks the hold lost when etcd says the
/// lease is gone or the stream breaks.
async fn keep_alive(
    mut client: Client,
    lease: i64,
    ttl: i64,
    lost: Arc<AtomicBool>,
) -> Result<JoinHandle<()>, LockError> {
    let (mut keeper, mut responses) = client.lease_keep_alive(lease).await.map_err(etcd_error)?;
    let period = Duration::from_millis(u64::try_from(ttl * 1000 / 3).unwrap_or(500));
    Ok(tokio::spawn(async move {
        loop {
            tokio::time::sleep(period).await;
            let alive = match keeper.keep_alive().await {
                Ok(()) => matches!(responses.message().await, Ok(Some(r)) if r.ttl() > 0),
                Err(_) => false,
            };
            if !alive {
                tracing::warn!(lease, "etcd lease keep-alive failed; the lock may be lost");
                lost.store(true, Ordering::SeqCst);
                return;
            }
        }
    }))
}

fn revoke_in_background(mut client: Client, lease: i64) {
    tokio::spawn(async move {
        if let Err(error) = client.lease_revoke(lease).await {
            tracing::warn!(%error, lease, "lease revoke failed; it will expire");
        }
    });
}

/// A held etcd lock: the lock key and the lease it lives on.
pub struct EtcdGuard {
    client: Client,
    key: Vec<u8>,
    lease: i64,
    revision: u64,
    lost: Arc<AtomicBool>,
    keep_alive: JoinHandle<()>,
    released: AtomicBool,
}

#[async_trait]
impl HeldLock for EtcdGuard {
    async fn ensure_held(&self) -> Result<(), LockError> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(LockError::Lost(format!(
                "lease {:x} stopped being kept alive",
                self.lease
            )));
        }
        let ttl = self
            .client
            .clone()
            .lease_time_to_live(self.lease, None)
            .await
            .map_err(etcd_error)?
            .ttl();
        if ttl > 0 {
            Ok(())
        } else {
            self.lost.store(true, Ordering::SeqCst);
            Err(LockError::Lost(format!("lease {:x} expired", self.lease)))
        }
    }

    fn fencing_token(&self) -> Option<u64> {
        Some(self.revision)
    }

    fn suspend_renewal(&self) {
        self.keep_alive.abort();
    }

    async fn release(self) -> Result<(), LockError> {
        self.released.store(true, Ordering::SeqCst);
        self.keep_alive.abort();
        let mut client = self.client.clone();
        let unlocked = client.unlock(self.key.clone()).await;
        let revoked = client.lease_revoke(self.lease).await;
        unlocked.map_err(etcd_error)?;
        revoked.map_err(etcd_error)?;
        Ok(())
    }
}

impl Drop for EtcdGuard {
    fn drop(&mut self) {
        self.keep_alive.abort();
        if !self.released.swap(true, Ordering::SeqCst)
            && tokio::runtime::Handle::try_current().is_ok()
        {
            revoke_in_background(self.client.clone(), self.lease);
        }
    }
}

fn etcd_error(error: etcd_client::Error) -> LockError {
    LockError::backend("etcd", error)
}
