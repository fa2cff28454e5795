//! Distributed lock primitives, one module per backend.
//!
//! A primitive knows nothing about orders or HTTP: it acquires a named lock with a
//! bounded wait, tells its holder whether the lock is still held, and releases it.
//! The strategies in `crate::strategy` wire a primitive around the order flow.
//!
//! "Still held" matters because every lease-based lock can be lost under a slow holder
//! (an expired lease, an expired session). A holder checks `ensure_held` right before
//! its irreversible write and aborts if the lock is gone. That narrows the window but
//! cannot close it: only a fencing token checked by the storage itself does.
//!
//! Every `acquire` may be dropped at any await point (a shopper hangs up, a request
//! times out) and every guard may be dropped instead of released. Neither may leave a
//! key, row, znode or lease that nobody owns, nor a watchdog or keep-alive running:
//! each backend undoes a dropped attempt from a cleanup that owns what the attempt
//! sent (`task` counts them, and tests check they end).

pub mod cohort;
pub mod etcd;
pub mod fence_floor;
pub mod lease;
pub mod local_queue;
pub mod redis;
pub mod redlock;
pub mod table;
pub mod task;
pub mod zookeeper;

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// The lock stayed held by others for the whole wait.
    #[error("lock not acquired within {waited:?}")]
    Timeout { waited: Duration },
    /// The holder's lease or session is gone; someone else may hold the lock now.
    #[error("lock lost: {0}")]
    Lost(String),
    /// The lock's backend failed or could not be reached.
    #[error("{backend}: {detail}")]
    Backend {
        backend: &'static str,
        detail: String,
    },
}

impl LockError {
    pub fn backend(backend: &'static str, error: impl std::fmt::Display) -> Self {
        LockError::Backend {
            backend,
            detail: error.to_string(),
        }
    }
}

/// A lock service: hands out exclusive holds on named locks.
#[async_trait]
pub trait DistributedLock: Send + Sync {
    type Guard: HeldLock + 'static;

    /// Waits at most `wait` for the lock named `name`.
    async fn acquire(&self, name: &str, wait: Duration) -> Result<Self::Guard, LockError>;

    /// The same, for a caller that will not use the fencing token (fencing is off). A
    /// lock whose token costs round trips of its own (Redlock's counter rounds) skips
    /// them; its guard then has no token.
    async fn acquire_unfenced(&self, name: &str, wait: Duration) -> Result<Self::Guard, LockError> {
        self.acquire(name, wait).await
    }

    /// The lock named `name` as anyone can see it from outside (the dashboard).
    async fn view(&self, name: &str) -> Result<LockView, LockError>;

    /// Whether the lock service serves its waiters in the order they came (a queue of
    /// nodes or keys), so a holder's replica cannot cut in ahead of the others after
    /// releasing; the cohort layer holds back a replica whose run ended otherwise.
    fn queues_waiters(&self) -> bool {
        false
    }
}

/// A lock as the dashboard shows it, the same shape for every mechanism.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LockView {
    pub held: bool,
    /// The replica holding it, when the mechanism records one.
    pub holder: Option<String>,
    pub lease_left_ms: Option<i64>,
    /// The raw state in the mechanism's own terms: the key and token, the lock row,
    /// the znodes in order.
    pub state: Vec<String>,
}

/// The replica that owns an acquisition token (`<replica>:<random>`).
pub fn token_owner(token: &str) -> String {
    token
        .rsplit_once(':')
        .map_or(token, |(owner, _)| owner)
        .to_owned()
}

/// A lock being held.
#[async_trait]
pub trait HeldLock: Send + Sync {
    /// `Ok` while this holder can still trust that it holds the lock.
    async fn ensure_held(&self) -> Result<(), LockError>;

    /// A number that only grows with each acquisition of this lock, for the storage to
    /// reject writes from a holder that has since been overtaken.
    fn fencing_token(&self) -> Option<u64>;

    /// Whether this holder already knows, without asking the service, that the lock is
    /// gone (its watchdog found the lease taken, its session expired). A hold known lost
    /// is never handed to another request (`cohort`). `false` when in doubt: the
    /// holder's check before it writes asks the service anyway.
    fn known_lost(&self) -> bool {
        false
    }

    /// The order found the lock gone or overtaken (a fencing refusal): the hold must
    /// not be handed to another request (`cohort`).
    fn mark_lost(&self) {}

    /// Whether this hold was handed over by another request of the replica rather
    /// than acquired from the lock service (`cohort`; the race timeline marks it).
    fn handed_over(&self) -> bool {
        false
    }

    /// Stops keeping the lock alive while still holding the guard, as a
    /// stop-the-world pause would. Locks whose liveness is not this process's to stop
    /// (a ZooKeeper session is kept by the client library) ignore it.
    fn suspend_renewal(&self) {}

    /// Gives the lock back. Releasing a lock that was lost is not an error for the
    /// caller to act on; it is logged by the primitive and reported as `Lost`.
    async fn release(self) -> Result<(), LockError>
    where
        Self: Sized;
}

/// The lease, in milliseconds, a lease lock accepts (`FLASHSALE_LOCK_LEASE_MS`, for the
/// service and for `lockbench`): at least 30 ms, and at most a day, since a holder that
/// dies blocks its lock for a lease and the deadlines computed from it must not
/// overflow.
pub const LEASE_MS_BOUNDS: std::ops::RangeInclusive<u64> = 30..=86_400_000;

/// The backoff between attempts of a polling lock: doubling from `base` up to `cap`,
/// with full jitter so that waiters released together do not retry in lockstep.
pub fn jittered_backoff(attempt: u32, base: Duration, cap: Duration) -> Duration {
    let ceiling = base.saturating_mul(1u32 << attempt.min(16)).min(cap);
    let millis = ceiling.as_millis().max(1) as u64;
    Duration::from_millis(rand::random_range(millis / 2..=millis))
}

/// A random token identifying one acquisition, so a holder can only ever release or
/// renew its own hold.
pub fn acquisition_token(owner: &str) -> String {
    format!("{owner}:{:032x}", rand::random::<u128>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_the_cap_with_jitter() {
        let base = Duration::from_millis(4);
        let cap = Duration::from_millis(100);
        for attempt in 0..40 {
            let wait = jittered_backoff(attempt, base, cap);
            assert!(wait <= cap, "attempt {attempt}: {wait:?}");
            assert!(
                wait >= Duration::from_millis(2),
                "attempt {attempt}: {wait:?}"
            );
        }
        assert!(jittered_backoff(30, base, cap) >= cap / 2);
    }

    #[test]
    fn tokens_are_unique_and_name_the_owner() {
        let a = acquisition_token("replica-1");
        let b = acquisition_token("replica-1");
        assert_ne!(a, b);
        assert!(a.starts_with("replica-1:"));
    }
}
