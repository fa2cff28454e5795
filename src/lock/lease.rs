//! The holder's side of a lease lock, shared by every lease-based backend (Redis,
//! Redlock, the lock table): a watchdog that renews the lease while the holder works,
//! a check the holder makes before committing, and a release that also happens when
//! the guard is dropped (a cancelled request must not keep the lock for a whole lease).
//!
//! A backend provides only the two operations on its storage, both conditional on the
//! hold still being ours: `renew` and `delete`.
//!
//! The release is only done once the backend said so. If the delete fails (a Redis or
//! MySQL blip) or the release itself is dropped halfway, the guard's drop retries it in
//! the background a few times; after that the lease runs out on its own.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;

use super::task::{AbortOnDrop, Tasks};
use super::{HeldLock, LockError, jittered_backoff};

/// Tries of a background release before leaving the hold to its lease, and the
/// bound on each.
const RELEASE_TRIES: u32 = 5;
const RELEASE_TRY_TIMEOUT: Duration = Duration::from_secs(2);

/// One acquisition as stored by a backend (its key or row and its token).
#[async_trait]
pub trait LeaseHold: Clone + Send + Sync + 'static {
    /// Extends the lease to `lease` from now if the hold is still ours; `false` if not.
    async fn renew(&self, lease: Duration) -> Result<bool, LockError>;
    /// The holder's last check before it writes: is the hold still ours, with enough
    /// of its lease left to write in? The backend answers, never the local clock. By
    /// default this renews, which also gives the write a whole lease.
    async fn confirm(&self, lease: Duration) -> Result<bool, LockError> {
        self.renew(lease).await
    }
    /// Deletes the hold if it is still ours; `false` if it was already gone.
    async fn delete(&self) -> Result<bool, LockError>;
    /// For logs and errors: the key, path or row.
    fn describe(&self) -> String;
    /// This acquisition's fencing token, if it took one.
    fn fencing_token(&self) -> Option<u64>;
}

/// A held lease lock.
pub struct LeaseGuard<H: LeaseHold> {
    hold: H,
    lease: Duration,
    lost: Arc<AtomicBool>,
    /// Set once the backend answered the delete: nothing left to release.
    released: bool,
    watchdog: AbortOnDrop,
    tasks: Tasks,
}

impl<H: LeaseHold> LeaseGuard<H> {
    /// Wraps a fresh acquisition and starts its watchdog (renewal every `lease / 3`),
    /// counted among `tasks`. Synchronous, so that nothing can cut in between the
    /// backend granting the hold and the guard owning it.
    pub fn start(hold: H, lease: Duration, tasks: &Tasks) -> Self {
        let lost = Arc::new(AtomicBool::new(false));
        let watchdog = tasks.spawn_owned(watchdog(hold.clone(), lease, lost.clone()));
        LeaseGuard {
            hold,
            lease,
            lost,
            released: false,
            watchdog,
            tasks: tasks.clone(),
        }
    }

    /// Renews the lease to a whole one now, for a hold that may have been granted with
    /// part of it spent. `Lost` if it is no longer ours.
    pub async fn renew_now(&self) -> Result<(), LockError> {
        if self.hold.renew(self.lease).await? {
            return Ok(());
        }
        self.lost.store(true, Ordering::SeqCst);
        Err(LockError::Lost(format!(
            "{} expired before it was granted",
            self.hold.describe()
        )))
    }
}

#[async_trait]
impl<H: LeaseHold> HeldLock for LeaseGuard<H> {
    /// Asks the server (`LeaseHold::confirm`), so the answer is the backend's, not a
    /// local guess.
    async fn ensure_held(&self) -> Result<(), LockError> {
        if !self.lost.load(Ordering::SeqCst) && self.hold.confirm(self.lease).await? {
            return Ok(());
        }
        self.lost.store(true, Ordering::SeqCst);
        Err(LockError::Lost(format!(
            "{} expired or was taken over",
            self.hold.describe()
        )))
    }

    fn fencing_token(&self) -> Option<u64> {
        self.hold.fencing_token()
    }

    fn known_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// The lease runs out and another contender can take the lock.
    fn suspend_renewal(&self) {
        self.watchdog.abort();
    }

    async fn release(mut self) -> Result<(), LockError> {
        self.watchdog.abort();
        let deleted = self.hold.delete().await;
        // A failed delete leaves `released` unset: the drop below retries it.
        self.released = deleted.is_ok();
        if deleted? {
            Ok(())
        } else {
            let what = self.hold.describe();
            tracing::warn!(lock = %what, "released a lock that had already expired");
            Err(LockError::Lost(format!(
                "{what} had expired before release"
            )))
        }
    }
}

impl<H: LeaseHold> Drop for LeaseGuard<H> {
    fn drop(&mut self) {
        self.watchdog.abort();
        if self.released {
            return;
        }
        let hold = self.hold.clone();
        self.tasks.spawn_detached(async move {
            for attempt in 0..RELEASE_TRIES {
                match tokio::time::timeout(RELEASE_TRY_TIMEOUT, hold.delete()).await {
                    Ok(Ok(_)) => return,
                    Ok(Err(error)) => {
                        tracing::warn!(%error, lock = %hold.describe(), attempt, "background release failed")
                    }
                    Err(_) => {
                        tracing::warn!(lock = %hold.describe(), attempt, "background release timed out")
                    }
                }
                let base = Duration::from_millis(50);
                tokio::time::sleep(jittered_backoff(attempt, base, base * 16)).await;
            }
            tracing::warn!(lock = %hold.describe(), "release given up; the lease will expire");
        });
    }
}

/// Renews every `lease / 3` until aborted; marks the hold lost when it is no longer
/// ours. Transient backend errors are retried: the lease itself bounds the damage.
async fn watchdog<H: LeaseHold>(hold: H, lease: Duration, lost: Arc<AtomicBool>) {
    let period = lease / 3;
    loop {
        tokio::time::sleep(period).await;
        let renewed = tokio::time::timeout(period, hold.renew(lease)).await;
        let outcome = match &renewed {
            Ok(Ok(true)) => "renewed",
            Ok(Ok(false)) => "lost",
            _ => "error",
        };
        metrics::counter!("flashsale_lease_renewals_total", "outcome" => outcome).increment(1);
        match renewed {
            Ok(Ok(true)) => {}
            Ok(Ok(false)) => {
                lost.store(true, Ordering::SeqCst);
                tracing::warn!(lock = %hold.describe(), "lock lost: lease expired or taken over");
                return;
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, lock = %hold.describe(), "lease renewal failed; retrying")
            }
            Err(_) => tracing::warn!(lock = %hold.describe(), "lease renewal timed out; retrying"),
        }
    }
}
