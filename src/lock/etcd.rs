//! An etcd lock: a lease granted per acquisition and kept alive while waiting and
//! holding, and etcd's own Lock service, which queues contenders in revision order
//! (each waits for the key created just before its own, like ZooKeeper's recipe).
//!
//! - The lock key is attached to the lease: if the replica dies, keep-alives stop, the
//!   lease expires after its TTL and etcd deletes the key, waking the next contender.
//! - A holder checks its lease before committing; a lease that is gone, or whose
//!   keep-alives stopped being answered, means the lock may be someone else's and the
//!   order must not be written. Each keep-alive answer is awaited at most a third of
//!   the TTL: a stalled stream is noticed while the lease is still alive.
//! - The blocking Lock call waits as long as the caller's wait and no longer; every
//!   other call is bounded by `CALL_TIMEOUT`. (A per-call timeout on the client would
//!   cut a Lock call that waits its turn longer than that.)
//! - Release revokes the lease, which deletes the key with it.
//! - **Cancellation**: the lease id is chosen here, before the grant is sent, so an
//!   acquisition dropped at any point (even while its grant is in flight) knows what
//!   to revoke. Its keep-alive task dies with it, and its cleanup revokes the lease,
//!   taking any key the Lock call created. Nothing of a dropped acquisition is kept
//!   alive; at worst a grant that lands after its revoke expires after its TTL.
//! - The fencing token is the revision at which the lock was granted: it only grows.
//!
//! One lease per acquisition, not one per replica: etcd's Lock names the key after
//! the lease (`<name>/<lease id>`), so two contenders of one replica sharing a lease
//! would share a key and both be granted the lock; and a key granted to a dropped
//! acquisition would live as long as the replica's lease. Per acquisition, revoking
//! the lease is a complete cleanup.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, ConnectOptions, GetOptions, LeaseGrantOptions, LockOptions, SortOrder, SortTarget,
};
use tokio::sync::OnceCell;
use tokio::time::{Instant, timeout, timeout_at};

use super::task::{AbortOnDrop, Tasks};
use super::{DistributedLock, HeldLock, LockError, LockView};

/// Bound on every call but Lock.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Tries of a background revoke, spread over about a second: a revoke that overtook
/// its own grant finds no lease, and the grant may still land.
const REVOKE_TRIES: u32 = 4;

pub struct EtcdLock {
    endpoints: Vec<String>,
    prefix: String,
    /// Lease time-to-live in whole seconds, as etcd counts it.
    lease_ttl: i64,
    /// Made on first use, without a network round trip (the channel connects lazily):
    /// a replica starts even while etcd is down.
    client: OnceCell<Client>,
    tasks: Tasks,
}

impl EtcdLock {
    pub fn new(endpoints: &str, namespace: &str, lease: Duration) -> EtcdLock {
        EtcdLock {
            endpoints: endpoints.split(',').map(|e| e.trim().to_owned()).collect(),
            prefix: format!("/flashsale/{namespace}/locks"),
            lease_ttl: i64::try_from(lease.as_secs().max(2)).unwrap_or(2),
            client: OnceCell::new(),
            tasks: Tasks::default(),
        }
    }

    /// Background tasks running now: keep-alives of acquisitions and revokes of
    /// dropped ones.
    pub fn background_tasks(&self) -> usize {
        self.tasks.live()
    }

    pub fn lock_name(&self, name: &str) -> String {
        format!("{}/{name}", self.prefix)
    }

    async fn client(&self) -> Result<Client, LockError> {
        let client = self
            .client
            .get_or_try_init(|| async {
                let options = ConnectOptions::new().with_connect_timeout(Duration::from_secs(3));
                Client::connect(&self.endpoints, Some(options)).await
            })
            .await
            .map_err(etcd_error)?;
        Ok(client.clone())
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
        let response =
            bounded(client.get(format!("{}/", self.lock_name(name)), Some(options))).await?;
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
                bounded(client.lease_time_to_live(*lease, None))
                    .await?
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
        let too_late = || LockError::Timeout { waited: wait };
        let mut client = timeout_at(deadline, self.client())
            .await
            .map_err(|_| too_late())??;
        // Positive and not 0 (0 asks etcd to choose).
        let lease = rand::random_range(1..i64::MAX);
        // From here on a drop revokes the lease, whatever was sent.
        let mut pending = Revoker {
            client: client.clone(),
            lease,
            tasks: self.tasks.clone(),
            armed: true,
        };
        let grant = client.lease_grant(
            self.lease_ttl,
            Some(LeaseGrantOptions::new().with_id(lease)),
        );
        timeout_at(deadline.min(Instant::now() + CALL_TIMEOUT), grant)
            .await
            .map_err(|_| too_late())?
            .map_err(etcd_error)?;
        let lost = Arc::new(AtomicBool::new(false));
        // Kept alive while waiting too: a wait may outlast the TTL.
        let open = client.lease_keep_alive(lease);
        let (keeper, responses) = timeout_at(deadline.min(Instant::now() + CALL_TIMEOUT), open)
            .await
            .map_err(|_| too_late())?
            .map_err(etcd_error)?;
        let keep_alive = self.tasks.spawn_owned(keep_alive(
            keeper,
            responses,
            lease,
            self.lease_ttl,
            lost.clone(),
        ));
        let options = LockOptions::new().with_lease(lease);
        let response = timeout_at(deadline, client.lock(self.lock_name(name), Some(options)))
            .await
            .map_err(|_| too_late())?
            .map_err(etcd_error)?;
        pending.armed = false;
        let revision = response.header().map_or(0, |h| h.revision());
        Ok(EtcdGuard {
            client,
            lease,
            revision: u64::try_from(revision).unwrap_or(0),
            lost,
            keep_alive,
            released: false,
            tasks: self.tasks.clone(),
        })
    }

    async fn view(&self, name: &str) -> Result<LockView, LockError> {
        let (keys, ttl) = self.inspect(name).await?;
        let mut state = vec![format!(
            "get --prefix {}/ ({} key(s), by create revision)",
            self.lock_name(name),
            keys.len()
        )];
        state.extend(keys.iter().enumerate().map(|(i, (key, revision, lease))| {
            let role = if i == 0 { "holds" } else { "waits" };
            format!("{key}  [create revision {revision}, lease {lease:x}, {role}]")
        }));
        Ok(LockView {
            held: !keys.is_empty(),
            holder: keys.first().map(|(_, _, lease)| format!("lease {lease:x}")),
            lease_left_ms: ttl.map(|seconds| seconds * 1000),
            state,
        })
    }
}

/// Bounds a short etcd call by `CALL_TIMEOUT`.
async fn bounded<T>(
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, LockError> {
    timeout(CALL_TIMEOUT, call)
        .await
        .map_err(|_| LockError::backend("etcd", format!("no answer within {CALL_TIMEOUT:?}")))?
        .map_err(etcd_error)
}

/// Sends a keep-alive every third of the TTL and waits at most a third for its
/// answer; marks the hold lost when etcd says the lease is gone, the stream breaks or
/// stalls. The lease then still has a third of its TTL to run: the holder learns of
/// the loss before anyone else can take the lock.
async fn keep_alive(
    mut keeper: etcd_client::LeaseKeeper,
    mut responses: etcd_client::LeaseKeepAliveStream,
    lease: i64,
    ttl: i64,
    lost: Arc<AtomicBool>,
) {
    let period = Duration::from_millis(u64::try_from(ttl * 1000 / 3).unwrap_or(500));
    loop {
        tokio::time::sleep(period).await;
        let answered = timeout(period, async {
            keeper.keep_alive().await?;
            responses.message().await
        })
        .await;
        let alive = matches!(answered, Ok(Ok(Some(ref r))) if r.ttl() > 0);
        if !alive {
            tracing::warn!(
                lease,
                "etcd lease keep-alive failed or stalled; the lock may be lost"
            );
            lost.store(true, Ordering::SeqCst);
            return;
        }
    }
}

/// Revokes a lease when dropped while armed, in the background and bounded.
struct Revoker {
    client: Client,
    lease: i64,
    tasks: Tasks,
    armed: bool,
}

impl Drop for Revoker {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (mut client, lease) = (self.client.clone(), self.lease);
        self.tasks.spawn_detached(async move {
            for attempt in 0..REVOKE_TRIES {
                match bounded(client.lease_revoke(lease)).await {
                    Ok(_) => return,
                    Err(error) if attempt + 1 == REVOKE_TRIES => {
                        tracing::debug!(%error, lease, "lease revoke failed; it will expire");
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(300)).await,
                }
            }
        });
    }
}

/// A held etcd lock: the lease its key lives on.
pub struct EtcdGuard {
    client: Client,
    lease: i64,
    revision: u64,
    lost: Arc<AtomicBool>,
    keep_alive: AbortOnDrop,
    /// Set once etcd confirmed the revoke: nothing left to release.
    released: bool,
    tasks: Tasks,
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
        let ttl = bounded(self.client.clone().lease_time_to_live(self.lease, None))
            .await?
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

    /// Revoking the lease deletes the lock key with it. If the revoke fails, the drop
    /// retries it in the background; the lease otherwise expires, unrenewed.
    async fn release(mut self) -> Result<(), LockError> {
        self.keep_alive.abort();
        match bounded(self.client.clone().lease_revoke(self.lease)).await {
            Ok(_) => {
                self.released = true;
                Ok(())
            }
            Err(error) if error.to_string().contains("lease not found") => {
                self.released = true;
                tracing::warn!(
                    lease = self.lease,
                    "released a lock whose lease had expired"
                );
                Err(LockError::Lost(format!(
                    "lease {:x} had expired before release",
                    self.lease
                )))
            }
            Err(error) => Err(error),
        }
    }
}

impl Drop for EtcdGuard {
    fn drop(&mut self) {
        self.keep_alive.abort();
        drop(Revoker {
            client: self.client.clone(),
            lease: self.lease,
            tasks: self.tasks.clone(),
            armed: !self.released,
        });
    }
}

fn etcd_error(error: etcd_client::Error) -> LockError {
    LockError::backend("etcd", error)
}
