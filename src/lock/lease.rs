//! The holder's side of a lease lock, shared by every lease-based backend (Redis,
//! the lock table): a watchdog that renews the lease while the holder works, a check
//! the holder makes before committing, re-entrancy, and a release that also happens
//! when the guard is dropped (a cancelled request must not keep the lock for a whole
//! lease).
//!
//! A backend provides only the two operations on its storage, both conditional on the
//! hold still being ours: `renew` and `delete`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use tokio::task::JoinHandle;

use super::{HeldLock, LockError};

/// One acquisition as stored by a backend (its key or row and its token).
#[async_trait]
pub trait LeaseHold: Clone + Send + Sync + 'static {
    /// Extends the lease to `lease` from now if the hold is still ours; `false` if not.
    async fn renew(&self, lease: Duration) -> Result<bool, LockError>;
    /// Deletes the hold if it is still ours; `false` if it was already gone.
    async fn delete(&self) -> Result<bool, LockError>;
    /// For logs and errors: the key, path or row.
    fn describe(&self) -> String;
    /// This acquisition's fencing token.
    fn fencing_token(&self) -> u64;
}

struct HoldState {
    lost: AtomicBool,
    released: AtomicBool,
    /// 1 + the re-entries not yet left.
    holds: AtomicU32,
}

/// A held lease lock.
pub struct LeaseGuard<H: LeaseHold> {
    hold: H,
    lease: Duration,
    state: Arc<HoldState>,
    watchdog: JoinHandle<()>,
}

impl<H: LeaseHold> LeaseGuard<H> {
    /// Wraps a fresh acquisition and starts its watchdog (renewal every `lease / 3`).
    pub fn start(hold: H, lease: Duration) -> Self {
        let state = Arc::new(HoldState {
            lost: AtomicBool::new(false),
            released: AtomicBool::new(false),
            holds: AtomicU32::new(1),
        });
        let watchdog = tokio::spawn(watchdog(hold.clone(), lease, state.clone()));
        LeaseGuard {
            hold,
            lease,
            state,
            watchdog,
        }
    }

    /// Behaves like a holder that crashed: stops renewing and never releases. The
    /// lock frees itself when its lease runs out.
    pub fn abandon(self) {
        self.watchdog.abort();
        self.state.released.store(true, Ordering::SeqCst);
    }

    /// Takes the lock again as the same owner (a nested critical section), verified
    /// on the server. Returns the number of holds now.
    pub async fn reenter(&self) -> Result<u32, LockError> {
        self.ensure_held().await?;
        Ok(self.state.holds.fetch_add(1, Ordering::SeqCst) + 1)
    }

    /// Leaves one re-entry; the outermost hold stays until `release`. Returns the
    /// holds left.
    pub fn leave(&self) -> u32 {
        let left = self
            .state
            .holds
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |h| {
                (h > 1).then(|| h - 1)
            });
        match left {
            Ok(before) => before - 1,
            Err(current) => current,
        }
    }
}

#[async_trait]
impl<H: LeaseHold> HeldLock for LeaseGuard<H> {
    /// Renews on the server, so the answer is the backend's, not a local guess.
    async fn ensure_held(&self) -> Result<(), LockError> {
        if !self.state.lost.load(Ordering::SeqCst) && self.hold.renew(self.lease).await? {
            return Ok(());
        }
        self.state.lost.store(true, Ordering::SeqCst);
        Err(LockError::Lost(format!(
            "{} expired or was taken over",
            self.hold.describe()
        )))
    }

    fn fencing_token(&self) -> Option<u64> {
        Some(self.hold.fencing_token())
    }

    /// The lease runs out and another contender can take the lock.
    fn suspend_renewal(&self) {
        self.watchdog.abort();
    }

    async fn release(self) -> Result<(), LockError> {
        self.state.released.store(true, Ordering::SeqCst);
        self.watchdog.abort();
        if self.hold.delete().await? {
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
        if self.state.released.swap(true, Ordering::SeqCst) {
            return;
        }
        let hold = self.hold.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(error) = hold.delete().await {
                    tracing::warn!(%error, lock = %hold.describe(), "background release failed; the lease will expire");
                }
            });
        }
    }
}

/// Renews every `lease / 3` until aborted; marks the hold lost when it is no longer
/// ours. Transient backend errors are retried: the lease itself bounds the damage.
async fn watchdog<H: LeaseHold>(hold: H, lease: Duration, state: Arc<HoldState>) {
    let period = lease / 3;
    loop {
        tokio::time::sleep(period).await;
        let renewed = hold.renew(lease).await;
        let outcome = match &renewed {
            Ok(true) => "renewed",
            Ok(false) => "lost",
            Err(_) => "error",
        };
        metrics::counter!("flashsale_lease_renewals_total", "outcome" => outcome).increment(1);
        match renewed {
            Ok(true) => {}
            Ok(false) => {
                state.lost.store(true, Ordering::SeqCst);
                tracing::warn!(lock = %hold.describe(), "lock lost: lease expired or taken over");
                return;
            }
            Err(error) => {
                tracing::warn!(%error, lock = %hold.describe(), "lease renewal failed; retrying")
            }
        }
    }
}
