//! Step 1 of the etcd lock: the replica's session (etcd's `concurrency.Session`), one
//! lease kept alive for as long as the replica serves, which every key it queues is
//! put on. If the replica dies, renewals stop, the lease expires and etcd deletes
//! every key on it: that is what frees a dead holder's lock.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use etcd_client::{Client, Compare, CompareOp, LeaseGrantOptions, PutOptions, Txn, TxnOp};
use tokio::time::{Duration, Instant, timeout_at};

use super::calls::bounded;
use super::undo::{CLEANUP_PAUSE, CLEANUP_TRIES};
use crate::lock::LockError;
use crate::lock::task::{AbortOnDrop, Tasks};

/// The lease and its keep-alive, shared by the replica's keys.
pub struct Session {
    client: Client,
    pub id: i64,
    /// The lease's time-to-live in seconds.
    pub ttl: i64,
    /// Set when the keep-alive gave up or a key's fate is unknown: the holders know
    /// their lock is (about to be) gone.
    lost: Arc<AtomicBool>,
    keep_alive: AbortOnDrop,
    /// Set once the lease is being revoked: nothing more to undo.
    revoking: AtomicBool,
    tasks: Tasks,
}

impl Session {
    /// Grants a lease of `ttl` seconds and starts keeping it alive. Run to its answer
    /// in a task of its own: a session granted for a caller that was dropped is
    /// dropped too, which revokes its lease.
    pub async fn grant(client: Client, ttl: i64, tasks: Tasks) -> Result<Session, LockError> {
        let sent = Instant::now();
        let id = grant(&client, ttl).await?;
        // The keep-alive lives as long as the session, not counted among the lock's
        // tasks; it counts its periods from when the grant was sent.
        let lost = Arc::new(AtomicBool::new(false));
        let renewals = keep_alive(client.clone(), id, ttl, sent, lost.clone());
        Ok(Session {
            client,
            id,
            ttl,
            lost,
            keep_alive: AbortOnDrop::spawn(renewals),
            revoking: AtomicBool::new(false),
            tasks,
        })
    }

    pub fn lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// Stops renewing, for a key whose fate is unknown: the holders are told they lost
    /// the lock now, a third of the TTL at least before the lease expires with every
    /// key on it (the unknown one too); the replica's next acquisition opens a new
    /// session.
    pub fn give_up(&self) {
        self.lost.store(true, Ordering::SeqCst);
        self.keep_alive.abort();
    }

    fn revoke(&self) {
        self.keep_alive.abort();
        if self.revoking.swap(true, Ordering::SeqCst) {
            return;
        }
        let (client, id) = (self.client.clone(), self.id);
        // Outside a runtime nothing runs it: the lease expires, unrenewed.
        self.tasks.spawn_detached(async move {
            for _ in 0..CLEANUP_TRIES {
                match bounded(client.clone().lease_revoke(id)).await {
                    Err(LockError::Backend { detail, .. }) if !detail.contains("not found") => {}
                    _ => return, // revoked, or gone already
                }
                tokio::time::sleep(CLEANUP_PAUSE).await;
            }
            tracing::debug!(id, "lease revoke failed; it will expire");
        });
    }
}

/// A session nobody uses any more (replaced, or its lock service dropped) revokes its
/// lease.
impl Drop for Session {
    fn drop(&mut self) {
        self.revoke();
    }
}

/// Grants a lease of `ttl` seconds; its id.
pub async fn grant(client: &Client, ttl: i64) -> Result<i64, LockError> {
    let id = rand::random_range(1..i64::MAX); // positive, and 0 asks etcd to choose
    let options = LeaseGrantOptions::new().with_id(id);
    bounded(client.clone().lease_grant(ttl, Some(options))).await?;
    Ok(id)
}

/// The paused-holder fault: moves `key` (if it still has create revision `revision`,
/// which it keeps, and with it its place in the queue) onto a lease of its own that
/// nobody renews, so it goes after the TTL while the replica's other keys stay.
pub async fn move_to_unrenewed_lease(
    client: &Client,
    key: &str,
    revision: i64,
    ttl: i64,
) -> Result<(), LockError> {
    let lease = grant(client, ttl).await?;
    let txn = Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, revision)])
        .and_then([TxnOp::put(
            key,
            "",
            Some(PutOptions::new().with_lease(lease)),
        )]);
    bounded(client.clone().txn(txn)).await.map(drop)
}

/// Keeps a lease alive: a renewal is due every third of the TTL, counted from when the
/// grant was `sent`, and each must be answered before the next is due. The first renewal
/// opens the keep-alive stream (etcd-client renews as it opens it). Every renewal etcd
/// applied restarted the full TTL no earlier than it was due, so when one is given up
/// the lease still has a third of its TTL to run: the holder learns of the loss before
/// anyone else can take the lock, provided this task runs within a third of the TTL of
/// each deadline. A process paused longer learns nothing here; its check before the
/// commit reads etcd, and only the fencing token covers what comes after that.
async fn keep_alive(mut client: Client, id: i64, ttl: i64, sent: Instant, lost: Arc<AtomicBool>) {
    let period = Duration::from_millis(u64::try_from(ttl * 1000 / 3).unwrap_or(500));
    let mut due = sent + period;
    tokio::time::sleep_until(due).await;
    let why = match timeout_at(due + period, client.lease_keep_alive(id)).await {
        Ok(Ok((mut keeper, mut responses))) => loop {
            due += period;
            tokio::time::sleep_until(due).await;
            let answer = timeout_at(due + period, async {
                keeper.keep_alive().await?;
                responses.message().await
            });
            match answer.await {
                Ok(Ok(Some(response))) if response.ttl() > 0 => {}
                Ok(Ok(Some(_))) => break "the lease is gone".to_owned(),
                Ok(Ok(None)) => break "the stream ended".to_owned(),
                Ok(Err(error)) => break error.to_string(),
                Err(_) => break "a renewal went unanswered".to_owned(),
            }
        },
        Ok(Err(error)) => error.to_string(),
        Err(_) => "opening the stream stalled".to_owned(),
    };
    tracing::warn!(lease = id, %why, "etcd keep-alive failed; the lock may be lost");
    lost.store(true, Ordering::SeqCst);
}
