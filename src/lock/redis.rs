//! A Redis lease lock in the manner of Redisson's `RLock`, on a single Redis node.
//!
//! - **Acquire**: `SET <key> <token> NX PX <lease>`; the token is unique per
//!   acquisition, so nobody can release or renew a hold that is not theirs.
//! - **Release**: a Lua compare-and-delete (`GET == token` then `DEL`), which also
//!   `PUBLISH`es on the lock's channel.
//! - **Watchdog**: while held, a task renews the lease every `lease / 3` with a Lua
//!   compare-and-`PEXPIRE`; if the key is no longer ours the hold is marked lost. A
//!   holder that dies stops renewing and the lock frees itself after at most `lease`.
//! - **Waiting**: no spinning. One pub/sub connection per replica listens for release
//!   messages and wakes one local waiter of that lock (FIFO), like Redisson's
//!   semaphore per lock entry. A crashed holder publishes nothing, so each waiter
//!   also retries when the lock's remaining TTL runs out.
//! - **Cancellation**: an acquisition dropped while its `SET` is in flight (a
//!   shopper hung up) may still have taken the key. The attempt holds the connection
//!   it sent the `SET` on and, if dropped, sends the compare-and-delete on that same
//!   connection: Redis answers one connection in order, so the delete runs after the
//!   `SET`, whatever the caller saw.
//! - **Fencing**: `INCR <ns>:fence:<name>` in the acquiring script. A counter that is
//!   missing (Redis lost it) restarts above the floor a [`FenceFloor`] reports (the
//!   fence MySQL checks), not at 1.
//!
//! Watchdog and release-on-drop are the shared `lease::LeaseGuard`; this module
//! provides the Redis commands.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use crate::redis_pool::{Connection, Pool};
use async_trait::async_trait;
use deadpool_redis::redis::{self, Script};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::fence_floor::{FenceFloor, bounded_floor};
use super::lease::{LeaseGuard, LeaseHold};
use super::notices::ReleaseNotices;
use super::task::Tasks;
use super::{DistributedLock, LockError, LockView, acquisition_token, token_owner};

/// `SET NX PX`; on success the next fencing token (`INCR`), otherwise the remaining
/// TTL (to know when to retry). With a fence floor to consult (`ARGV[3]` = 1) and no
/// counter, answers 2: the caller seeds the counter while holding the key.
static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if ARGV[3] == '1' and redis.call('EXISTS', KEYS[2]) == 0 then
    return {2, 0}
  end
  return {1, redis.call('INCR', KEYS[2])}
end
return {0, redis.call('PTTL', KEYS[1])}
",
    )
});

/// While `KEYS[1]` still holds our token: the fencing counter `KEYS[2]` becomes
/// max(counter, floor) + 1 and is returned; -1 if the hold is gone.
pub(super) static SEED_FENCE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return -1
end
local counter = tonumber(redis.call('GET', KEYS[2]) or '0')
local floor = tonumber(ARGV[2])
if floor > counter then
  counter = floor
end
counter = counter + 1
redis.call('SET', KEYS[2], string.format('%d', counter))
return counter
",
    )
});

/// Compare-and-PEXPIRE: extend only our own hold.
static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
",
    )
});

/// Compare-and-delete, then wake the waiters (unless the channel is empty: the undo
/// of a Redlock round that did not reach a majority frees no lock anyone waits for).
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if ARGV[2] ~= '' then redis.call('PUBLISH', ARGV[2], ARGV[1]) end
  return 1
end
return 0
",
    )
});

/// How long a waiter sleeps when the lock exists but has no TTL (set by hand?) or
/// vanished between the SET and the PTTL.
const NO_TTL_RETRY: Duration = Duration::from_millis(50);
/// Bound on one undo of a dropped attempt.
const UNDO_TIMEOUT: Duration = Duration::from_secs(2);

/// Redis lock service of one replica: its pool, its pub/sub listener, its waiters.
pub struct RedisLock {
    pool: Pool,
    namespace: String,
    owner: String,
    lease: Duration,
    notices: ReleaseNotices,
    fence_floor: Option<Arc<dyn FenceFloor>>,
    tasks: Tasks,
}

/// A release notice wakes one waiter of the replica. If that waiter leaves before its
/// try answers (its shopper hung up and the acquisition was dropped, or the try
/// failed), the wake-up passes to the next waiter, who would otherwise sleep until its
/// fallback (the holder's TTL or its own deadline) while the lock is free.
struct Woken<'a> {
    wakeup: &'a Notify,
    /// Woken by a notice that no try has answered yet.
    unused: bool,
}

impl Drop for Woken<'_> {
    fn drop(&mut self) {
        if self.unused {
            self.wakeup.notify_one();
        }
    }
}

/// What one `SET NX` attempt found.
enum Attempt {
    Acquired(LeaseGuard<RedisHold>),
    /// Held by someone else for this many more milliseconds.
    Held(i64),
}

impl RedisLock {
    /// Starts the release listener on its own connection (pub/sub needs one).
    pub fn new(
        client: redis::Client,
        pool: Pool,
        namespace: &str,
        owner: &str,
        lease: Duration,
    ) -> RedisLock {
        let pattern = format!("{namespace}:lock-released:*");
        // Every waiter of this replica waits on the channel (no local queue), so its
        // own releases must wake them too.
        let notices = ReleaseNotices::listen([client], &pattern, None);
        RedisLock {
            pool,
            namespace: namespace.to_owned(),
            owner: owner.to_owned(),
            lease,
            notices,
            fence_floor: None,
            tasks: Tasks::default(),
        }
    }

    /// Where a lost fencing counter restarts: above `floor`'s answer for the lock name.
    pub fn with_fence_floor(mut self, floor: Arc<dyn FenceFloor>) -> RedisLock {
        self.fence_floor = Some(floor);
        self
    }

    /// Whether this service hears release notices now (its subscription is up).
    pub fn hears_releases(&self) -> bool {
        self.notices.listening()
    }

    /// Background tasks running now: watchdogs of holds and cleanups of dropped
    /// acquisitions and releases.
    pub fn background_tasks(&self) -> usize {
        self.tasks.live()
    }

    pub fn key(&self, name: &str) -> String {
        format!("{}:lock:{name}", self.namespace)
    }

    fn channel(&self, name: &str) -> String {
        format!("{}:lock-released:{name}", self.namespace)
    }

    /// The token stored under the lock and its remaining TTL in ms, if it is held.
    pub async fn inspect(&self, name: &str) -> Result<Option<(String, i64)>, LockError> {
        let mut conn = self.pool.get().await.map_err(redis_error)?;
        let (token, ttl): (Option<String>, i64) = redis::pipe()
            .get(self.key(name))
            .pttl(self.key(name))
            .query_async(&mut conn)
            .await
            .map_err(redis_error)?;
        Ok(token.map(|token| (token, ttl)))
    }

    fn fence_key(&self, name: &str) -> String {
        format!("{}:fence:{name}", self.namespace)
    }

    /// One `SET NX PX` attempt; `deadline` bounds its fence floor. Until it returns, a
    /// drop undoes whatever it took.
    async fn try_acquire(
        &self,
        name: &str,
        token: &str,
        deadline: Instant,
    ) -> Result<Attempt, LockError> {
        let conn = self.pool.get().await.map_err(redis_error)?;
        let hold = RedisHold {
            pool: self.pool.clone(),
            key: self.key(name),
            channel: self.channel(name),
            token: token.to_owned(),
            fence: 0,
        };
        let target = Target {
            pool: hold.pool.clone(),
            key: hold.key.clone(),
            channel: hold.channel.clone(),
            token: hold.token.clone(),
        };
        let mut pending = PendingSet::new(conn, target, &self.tasks);
        let (acquired, value): (i64, i64) = ACQUIRE
            .key(&hold.key)
            .key(self.fence_key(name))
            .arg(token)
            .arg(millis(self.lease))
            .arg(if self.fence_floor.is_some() { "1" } else { "0" })
            .invoke_async(pending.conn()?)
            .await
            .map_err(redis_error)?;
        let fence = match acquired {
            0 => {
                pending.disarm();
                return Ok(Attempt::Held(value));
            }
            1 => value,
            _ => {
                // Redis has no counter for this lock (new, or lost in a restart).
                let floor = match &self.fence_floor {
                    Some(source) => bounded_floor(&**source, name, deadline).await?,
                    None => 0,
                };
                let seeded: i64 = SEED_FENCE
                    .key(&hold.key)
                    .key(self.fence_key(name))
                    .arg(token)
                    .arg(floor)
                    .invoke_async(pending.conn()?)
                    .await
                    .map_err(redis_error)?;
                if seeded < 0 {
                    pending.disarm();
                    return Err(LockError::Lost(format!(
                        "{} expired while its fencing counter was seeded",
                        hold.key
                    )));
                }
                seeded
            }
        };
        pending.disarm();
        let hold = RedisHold {
            fence: u64::try_from(fence).unwrap_or(0),
            ..hold
        };
        Ok(Attempt::Acquired(LeaseGuard::start(
            hold,
            self.lease,
            &self.tasks,
        )))
    }
}

#[async_trait]
impl DistributedLock for RedisLock {
    type Guard = LeaseGuard<RedisHold>;

    async fn acquire(&self, name: &str, wait: Duration) -> Result<Self::Guard, LockError> {
        let channel = self.channel(name);
        let token = acquisition_token(&self.owner);
        let deadline = Instant::now() + wait;
        let wakeup = self.notices.register(&channel);
        let mut woken = Woken {
            wakeup: &wakeup,
            unused: false,
        };
        loop {
            // Listen before trying, so a release between the try and the wait is seen.
            let released = wakeup.notified();
            tokio::pin!(released);
            if released.as_mut().enable() {
                // A wake-up stored while nobody listened, taken here: the try answers
                // it, and a try that never answers passes it on.
                woken.unused = true;
            }

            let attempt = self.try_acquire(name, &token, deadline).await?;
            // The try answered: a wake-up it followed is used either way (a lock taken
            // by someone else will be released, and that release notified).
            woken.unused = false;
            let ttl = match attempt {
                Attempt::Acquired(guard) => return Ok(guard),
                Attempt::Held(ttl) => ttl,
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(LockError::Timeout { waited: wait });
            }
            let fallback = match u64::try_from(ttl) {
                Ok(ttl) if ttl > 0 => Duration::from_millis(ttl),
                _ => NO_TTL_RETRY,
            };
            let retry_at = deadline.min(now + fallback);
            tokio::select! {
                () = &mut released => woken.unused = true,
                () = tokio::time::sleep_until(retry_at) => {
                    if Instant::now() >= deadline {
                        // A notice that reached `released` meanwhile is passed on by
                        // tokio when it is dropped; nothing else was consumed.
                        return Err(LockError::Timeout { waited: wait });
                    }
                }
            }
        }
    }

    async fn view(&self, name: &str) -> Result<LockView, LockError> {
        let key = self.key(name);
        Ok(match self.inspect(name).await? {
            Some((token, ttl)) => LockView {
                held: true,
                holder: Some(token_owner(&token)),
                lease_left_ms: Some(ttl),
                state: vec![
                    format!("GET {key} → \"{token}\""),
                    format!("PTTL {key} → {ttl}"),
                ],
            },
            None => LockView {
                state: vec![format!("GET {key} → (nil): free")],
                ..LockView::default()
            },
        })
    }
}

/// A `SET NX` sent on `conn` whose outcome its caller may never see. Unless disarmed,
/// dropping it sends the compare-and-delete of its token on the same connection, so
/// that Redis runs the delete after the `SET`; if that connection fails, on fresh ones
/// (by then the `SET` has either run or never will).
pub(super) struct PendingSet {
    conn: Option<Connection>,
    target: Target,
    tasks: Tasks,
}

/// The key a `SET` went to, the channel its release publishes on, and its token.
#[derive(Clone)]
pub(super) struct Target {
    pub pool: Pool,
    pub key: String,
    pub channel: String,
    pub token: String,
}

impl PendingSet {
    pub(super) fn new(conn: Connection, target: Target, tasks: &Tasks) -> PendingSet {
        PendingSet {
            conn: Some(conn),
            target,
            tasks: tasks.clone(),
        }
    }

    pub(super) fn conn(&mut self) -> Result<&mut Connection, LockError> {
        self.conn
            .as_mut()
            .ok_or_else(|| LockError::backend("redis", "attempt already settled"))
    }

    /// The attempt's outcome is known to the caller: nothing to undo.
    pub(super) fn disarm(&mut self) {
        self.conn = None;
    }

    /// Undoes the attempt now, on its connection, waiting at most `bound`. A delete
    /// still unanswered then is queued behind the `SET` and will run after it; one
    /// that failed leaves the attempt armed, for the drop to retry on fresh
    /// connections.
    pub(super) async fn undo(&mut self, bound: Duration) {
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        let Target {
            key,
            channel,
            token,
            ..
        } = &self.target;
        let undone = tokio::time::timeout(bound, release_with(conn, key, channel, token)).await;
        if !matches!(undone, Ok(Err(_))) {
            self.conn = None;
        }
    }
}

impl Drop for PendingSet {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let Target {
            pool,
            key,
            channel,
            token,
        } = self.target.clone();
        self.tasks.spawn_detached(async move {
            let same_connection = release_with(&mut conn, &key, &channel, &token);
            match tokio::time::timeout(UNDO_TIMEOUT, same_connection).await {
                Ok(Ok(_)) => return,
                // Sent behind the SET on a live but slow connection: it runs after it.
                Err(_) => return,
                Ok(Err(_)) => {}
            }
            drop(conn);
            for _ in 0..3 {
                let fresh = delete_on(&pool, &key, &channel, &token);
                if let Ok(Ok(_)) = tokio::time::timeout(UNDO_TIMEOUT, fresh).await {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            tracing::warn!(lock = %key, "could not undo a dropped acquisition; its lease will expire");
        });
    }
}

/// One acquisition: the key and the token stored under it.
#[derive(Clone)]
pub struct RedisHold {
    pool: Pool,
    key: String,
    channel: String,
    token: String,
    fence: u64,
}

/// Compare-and-PEXPIRE on one node: `true` if `key` still held `token`.
pub(super) async fn renew_on(
    pool: &Pool,
    key: &str,
    token: &str,
    lease: Duration,
) -> Result<bool, LockError> {
    let mut conn = pool.get().await.map_err(redis_error)?;
    let renewed: i64 = RENEW
        .key(key)
        .arg(token)
        .arg(millis(lease))
        .invoke_async(&mut conn)
        .await
        .map_err(redis_error)?;
    Ok(renewed == 1)
}

/// Compare-and-delete on one node, publishing on `channel`: `true` if it was ours.
pub(super) async fn delete_on(
    pool: &Pool,
    key: &str,
    channel: &str,
    token: &str,
) -> Result<bool, LockError> {
    let mut conn = pool.get().await.map_err(redis_error)?;
    release_with(&mut conn, key, channel, token).await
}

/// The same on a given connection.
pub(super) async fn release_with(
    conn: &mut Connection,
    key: &str,
    channel: &str,
    token: &str,
) -> Result<bool, LockError> {
    let deleted: i64 = RELEASE
        .key(key)
        .arg(token)
        .arg(channel)
        .invoke_async(conn)
        .await
        .map_err(redis_error)?;
    Ok(deleted == 1)
}

#[async_trait]
impl LeaseHold for RedisHold {
    async fn renew(&self, lease: Duration) -> Result<bool, LockError> {
        renew_on(&self.pool, &self.key, &self.token, lease).await
    }

    async fn delete(&self) -> Result<bool, LockError> {
        delete_on(&self.pool, &self.key, &self.channel, &self.token).await
    }

    fn describe(&self) -> String {
        format!("redis lock {}", self.key)
    }

    /// From `INCR <ns>:fence:<name>` at acquisition.
    fn fencing_token(&self) -> Option<u64> {
        Some(self.fence)
    }
}

pub(super) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

pub(super) fn redis_error(error: impl std::fmt::Display) -> LockError {
    LockError::backend("redis", error)
}
