//! A Redis lease lock in the manner of Redisson's `RLock`, on a single Redis node.
//!
//! - **Acquire**: `SET <key> <token> NX PX <lease>`; the token is unique per
//!   acquisition, so nobody can release or renew a hold that is not theirs.
//! - **Release**: a Lua compare-and-delete (`GET == token` then `DEL`), which also
//!   leaves one release signal in the lock's signal list.
//! - **Watchdog**: while held, a task renews the lease every `lease / 3` with a Lua
//!   compare-and-`PEXPIRE`; if the key is no longer ours the hold is marked lost. A
//!   holder that dies stops renewing and the lock frees itself after at most `lease`.
//! - **Waiting**: no spinning. The release's signal is taken by one waiting replica
//!   (`BLPOP`, see `signals`), which wakes one local waiter of that lock (FIFO): one
//!   release, one try, as python-redis-lock's waiters do, where Redisson's pub/sub
//!   wakes one waiter in every process. A crashed holder signals nothing, so each
//!   waiter also retries when the lock's remaining TTL runs out.
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
use tokio::time::Instant;

use super::fence_floor::{FenceFloor, bounded_floor};
use super::lease::{LeaseGuard, LeaseHold};
use super::signals::ReleaseSignals;
use super::task::Tasks;
use super::{DistributedLock, LockError, LockView, acquisition_token, token_owner};

/// `SET NX PX`; on success the next fencing token (`INCR`), otherwise the remaining
/// TTL (to know when to retry). With a fence floor to consult (`ARGV[3]` = 1) and no
/// counter, answers 2: the caller seeds the counter while holding the key.
///
/// Handing over: while a release's turn is kept (`KEYS[4]` holds the release's token,
/// set by `RELEASE`), only the try woken by that release's signal (`ARGV[4]`, the
/// token the signal carried) may take the lock; any other is answered like a held
/// lock, with the reservation's TTL. A try that finds the lock held and will wait
/// (for `ARGV[6]` ms more; 0: a try-lock) marks it as waited for (`KEYS[5]`), which is
/// what makes a release keep the turn: until `ARGV[5]` ms after the waiter's next try
/// at the latest (the holder's lease running out or its own wait), since it may sleep
/// until then without trying again. A try refused only by the reservation does not
/// mark, or the mark would keep itself alive and keep refusing an uncontended lock.
/// Taking the lock ends the reservation and deletes a signal still in `KEYS[3]`: it
/// is moot, the next release leaves another.
static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local kept_for = redis.call('GET', KEYS[4])
if kept_for and kept_for ~= ARGV[4] then
  return {0, redis.call('PTTL', KEYS[4])}
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  redis.call('DEL', KEYS[3], KEYS[4])
  if ARGV[3] == '1' and redis.call('EXISTS', KEYS[2]) == 0 then
    return {2, 0}
  end
  return {1, redis.call('INCR', KEYS[2])}
end
local left = redis.call('PTTL', KEYS[1])
local waits = tonumber(ARGV[6])
if waits > 0 then
  redis.call('SET', KEYS[5], '1', 'PX', math.min(math.max(left, 0), waits) + tonumber(ARGV[5]))
end
return {0, left}
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

/// Compare-and-delete, then tell the waiters as `ARGV[2]` says ([`Wake`]): publish on
/// channel `ARGV[3]`; or leave one signal, the token, in list `KEYS[2]` (replacing
/// any) that expires after `ARGV[3]` ms and, if the lock was waited for lately
/// (`KEYS[4]`), keep the turn for the try that signal wakes (`KEYS[3]` = the token,
/// for `ARGV[4]` ms).
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
if ARGV[2] == 'publish' then
  redis.call('PUBLISH', ARGV[3], ARGV[1])
elseif ARGV[2] == 'signal' then
  redis.call('DEL', KEYS[2])
  redis.call('RPUSH', KEYS[2], ARGV[1])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  if redis.call('EXISTS', KEYS[4]) == 1 then
    redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[4])
  end
end
return 1
",
    )
});

/// Whom a release tells that the lock is free.
#[derive(Clone)]
pub(super) enum Wake {
    /// One waiting process, through a signal list (redis-lock), with the turn
    /// reserved for it if the lock was waited for lately.
    Signal(SignalKeys),
}

/// The keys through which a redis-lock release hands the lock over.
#[derive(Clone)]
pub(super) struct SignalKeys {
    /// Where a release leaves its signal (one at most; expires after `ttl_ms`).
    list: String,
    /// Present while a release's turn is kept for the waiter it woke.
    reserved: String,
    /// Present while a try that will wait found the lock held lately (`ACQUIRE`).
    waiting: String,
    ttl_ms: u64,
    /// How long a release keeps the turn (`RESERVED_FOR`).
    reserved_ms: u64,
}

/// How long a waiter sleeps when the lock exists but has no TTL (set by hand?) or
/// vanished between the SET and the PTTL.
const NO_TTL_RETRY: Duration = Duration::from_millis(50);
/// Bound on one undo of a dropped attempt.
const UNDO_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a release keeps the lock for the waiter its signal wakes. That waiter's
/// try comes within a millisecond or so; the bound is for one that never comes (its
/// process died), after which anyone may take the lock again.
const RESERVED_FOR: Duration = Duration::from_millis(50);
/// A release keeps its turn only if some try that will wait found the lock held this
/// recently (past the lease it found): without waiters, a replica's next order takes
/// the lock at once.
const WAITED_FOR: Duration = Duration::from_secs(1);

/// Redis lock service of one replica: its pool, its signal readers, its waiters.
pub struct RedisLock {
    pool: Pool,
    namespace: String,
    owner: String,
    lease: Duration,
    signals: ReleaseSignals,
    fence_floor: Option<Arc<dyn FenceFloor>>,
    /// How long this service's releases keep the turn for the waiter they wake.
    reserved_for: Duration,
    tasks: Tasks,
}

/// What one `SET NX` attempt found.
enum Attempt {
    Acquired(LeaseGuard<RedisHold>),
    /// Held by someone else for this many more milliseconds.
    Held(i64),
}

impl RedisLock {
    /// Signal readers connect through `client` (a blocked connection serves nothing
    /// else); everything else goes through `pool`.
    pub fn new(
        client: redis::Client,
        pool: Pool,
        namespace: &str,
        owner: &str,
        lease: Duration,
    ) -> RedisLock {
        let tasks = Tasks::default();
        // Every waiter of this replica waits on the signals (no local queue), so its
        // own releases wake them too.
        let signals = ReleaseSignals::new(client, pool.clone(), lease, tasks.clone());
        RedisLock {
            pool,
            namespace: namespace.to_owned(),
            owner: owner.to_owned(),
            lease,
            signals,
            fence_floor: None,
            reserved_for: RESERVED_FOR,
            tasks,
        }
    }

    /// Releases keep the turn for the woken waiter for `kept` instead of `RESERVED_FOR`.
    /// For tests: a try sent right after a release meets the kept turn however late a
    /// loaded machine sends it (50 ms is a short window there).
    pub fn with_kept_turn(mut self, kept: Duration) -> RedisLock {
        self.reserved_for = kept;
        self
    }

    /// Where a lost fencing counter restarts: above `floor`'s answer for the lock name.
    pub fn with_fence_floor(mut self, floor: Arc<dyn FenceFloor>) -> RedisLock {
        self.fence_floor = Some(floor);
        self
    }

    /// Locks this service reads release signals for now (its waiters' and, for a
    /// moment after they left, theirs).
    pub fn signal_readers(&self) -> usize {
        self.signals.readers()
    }

    /// Background tasks running now: watchdogs of holds and cleanups of dropped
    /// acquisitions and releases.
    pub fn background_tasks(&self) -> usize {
        self.tasks.live()
    }

    pub fn key(&self, name: &str) -> String {
        format!("{}:lock:{name}", self.namespace)
    }

    fn signal_keys(&self, name: &str) -> SignalKeys {
        let ns = &self.namespace;
        SignalKeys {
            list: format!("{ns}:lock-signal:{name}"),
            reserved: format!("{ns}:lock-reserved:{name}"),
            waiting: format!("{ns}:lock-waiting:{name}"),
            ttl_ms: millis(self.lease),
            reserved_ms: millis(self.reserved_for),
        }
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

    /// One `SET NX PX` attempt; `deadline` bounds its fence floor (and says whether a
    /// refused try will wait). `signals`: the lock's `signal_keys`. `woken_by`: the
    /// token of the release whose signal woke this try, which may take the turn that
    /// release kept. Until it returns, a drop undoes whatever it took.
    async fn try_acquire(
        &self,
        name: &str,
        token: &str,
        deadline: Instant,
        signals: &SignalKeys,
        woken_by: Option<&str>,
    ) -> Result<Attempt, LockError> {
        let waits = deadline.saturating_duration_since(Instant::now());
        let conn = self.pool.get().await.map_err(redis_error)?;
        let hold = RedisHold {
            pool: self.pool.clone(),
            key: self.key(name),
            wake: Wake::Signal(signals.clone()),
            token: token.to_owned(),
            fence: 0,
        };
        let target = Target {
            pool: hold.pool.clone(),
            key: hold.key.clone(),
            wake: hold.wake.clone(),
            token: hold.token.clone(),
        };
        let mut pending = PendingSet::new(conn, target, &self.tasks);
        let (acquired, value): (i64, i64) = ACQUIRE
            .key(&hold.key)
            .key(self.fence_key(name))
            .key(&signals.list)
            .key(&signals.reserved)
            .key(&signals.waiting)
            .arg(token)
            .arg(millis(self.lease))
            .arg(if self.fence_floor.is_some() { "1" } else { "0" })
            .arg(woken_by.unwrap_or(""))
            .arg(millis(WAITED_FOR))
            .arg(millis(waits))
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
        let token = acquisition_token(&self.owner);
        let deadline = Instant::now() + wait;
        let keys = self.signal_keys(name);
        // Most acquisitions find the lock free and need no signal reader.
        let mut ttl = match self
            .try_acquire(name, &token, deadline, &keys, None)
            .await?
        {
            Attempt::Acquired(guard) => return Ok(guard),
            Attempt::Held(ttl) => ttl,
        };
        if Instant::now() >= deadline {
            return Err(LockError::Timeout { waited: wait });
        }
        // A release since that try left its signal in Redis: the reader finds it.
        // Dropped with a signal it took and never tried, `waiting` passes it on.
        let mut waiting = self
            .signals
            .wait_on(&self.key(name), &keys.list, &keys.reserved);
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(LockError::Timeout { waited: wait });
            }
            let fallback = match u64::try_from(ttl) {
                Ok(ttl) if ttl > 0 => Duration::from_millis(ttl),
                _ => NO_TTL_RETRY,
            };
            let woken_by = waiting.signal_until(deadline.min(now + fallback)).await;
            if woken_by.is_none() && Instant::now() >= deadline {
                return Err(LockError::Timeout { waited: wait });
            }
            let attempt = self
                .try_acquire(name, &token, deadline, &keys, woken_by.as_deref())
                .await?;
            waiting.tried();
            ttl = match attempt {
                Attempt::Acquired(guard) => return Ok(guard),
                Attempt::Held(ttl) => ttl,
            };
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

/// The key a `SET` went to, whom its release tells, and its token.
#[derive(Clone)]
pub(super) struct Target {
    pub pool: Pool,
    pub key: String,
    pub wake: Wake,
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
}

impl Drop for PendingSet {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let Target {
            pool,
            key,
            wake,
            token,
        } = self.target.clone();
        self.tasks.spawn_detached(async move {
            let same_connection = release_with(&mut conn, &key, &wake, &token);
            match tokio::time::timeout(UNDO_TIMEOUT, same_connection).await {
                Ok(Ok(_)) => return,
                // Sent behind the SET on a live but slow connection: it runs after it.
                Err(_) => return,
                Ok(Err(_)) => {}
            }
            drop(conn);
            for _ in 0..3 {
                let fresh = delete_on(&pool, &key, &wake, &token);
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
    wake: Wake,
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

/// Compare-and-delete on one node, telling the waiters as `wake` says: `true` if it
/// was ours.
pub(super) async fn delete_on(
    pool: &Pool,
    key: &str,
    wake: &Wake,
    token: &str,
) -> Result<bool, LockError> {
    let mut conn = pool.get().await.map_err(redis_error)?;
    release_with(&mut conn, key, wake, token).await
}

/// The same on a given connection.
pub(super) async fn release_with(
    conn: &mut Connection,
    key: &str,
    wake: &Wake,
    token: &str,
) -> Result<bool, LockError> {
    let mut release = RELEASE.key(key);
    release.arg(token);
    match wake {
        Wake::Signal(keys) => release
            .key(&keys.list)
            .key(&keys.reserved)
            .key(&keys.waiting)
            .arg("signal")
            .arg(keys.ttl_ms)
            .arg(keys.reserved_ms),
    };
    let deleted: i64 = release.invoke_async(conn).await.map_err(redis_error)?;
    Ok(deleted == 1)
}

#[async_trait]
impl LeaseHold for RedisHold {
    async fn renew(&self, lease: Duration) -> Result<bool, LockError> {
        renew_on(&self.pool, &self.key, &self.token, lease).await
    }

    async fn delete(&self) -> Result<bool, LockError> {
        delete_on(&self.pool, &self.key, &self.wake, &self.token).await
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
