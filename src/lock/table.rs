//! A lock made of a row in a MySQL table with a unique key on the lock name (the
//! classic "database lock table", article 002).
//!
//! 1. **Acquire**: `INSERT` a row `(lock_name, owner, expires_at)` under a fresh owner
//!    token. A duplicate key (1062), or the deadlock MariaDB reports for a contended
//!    insert (1213), means the lock is held. The row is the lock.
//! 2. **Expired rows**: a holder that crashed leaves its row behind. A contender that
//!    finds the row past `expires_at` deletes it *by its id*, then inserts again.
//!    Deleting by name would be wrong: between our look and our delete another
//!    contender may have taken over and inserted a fresh row, which a delete by name
//!    would destroy.
//! 3. **Renewal**: while working, the holder pushes `expires_at` forward (the shared
//!    lease watchdog), `WHERE id = ? AND owner = ?`.
//! 4. **Release**: `DELETE ... WHERE lock_name = ? AND owner = ?`.
//! 5. **Waiting**: MySQL cannot tell a waiter that a row was deleted, so waiters poll:
//!    INSERT again after a jittered backoff, from 2 ms doubling up to 250 ms. A waiter
//!    looks at the row's expiry on its first failed INSERT and then only once the row
//!    it saw could have expired (a row can be renewed, or deleted and replaced by a
//!    newer one; a newer one of a shorter lease, from a replica with other settings,
//!    is taken over at most that much later). The row's id is the fencing token: each
//!    new row gets a greater one.
//!
//! Production notes:
//! - **Cancellation**: an INSERT whose caller was dropped may still commit. The attempt
//!   keeps the connection it sent the INSERT on and, if dropped, deletes its row (by
//!   its unique owner token) on that same connection, which answers the INSERT first.
//!   A waiter dropped while backing off holds no connection and has sent nothing.
//! - **A MariaDB restart**: the pool hands out recently used connections unpinged
//!   (`mysql_pool`), so the first statements after a crash meet dead ones. Releases,
//!   renewals, takeovers and reads go again on another connection; an INSERT cut off
//!   there is undone like a dropped one, and the waiter tries again under a new owner
//!   token.
//! - **Bounded waits**: every statement of an acquisition is bounded by the caller's
//!   wait, so one stalled inside MariaDB (behind a row lock) ends with it.
//!
//! All times are the database's own, in UTC (`UTC_TIMESTAMP(6)` into `DATETIME(6)`
//! columns), so neither replicas' clocks nor their sessions' time zones matter.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use sqlx::MySql;
use sqlx::mysql::{MySqlDatabaseError, MySqlPool};
use sqlx::pool::PoolConnection;
use tokio::time::Instant;

use super::lease::{LeaseGuard, LeaseHold};
use super::task::Tasks;
use super::{
    DistributedLock, LockError, LockView, acquisition_token, jittered_backoff, token_owner,
};
use crate::mysql_pool::on_live_connection;

/// MySQL error numbers that mean "someone else holds it" for a lock-row INSERT.
const DUPLICATE_KEY: u16 = 1062;
const DEADLOCK: u16 = 1213;
/// How often a release, renewal or takeover is retried after losing a deadlock.
const DEADLOCK_RETRIES: u32 = 20;

/// The poll's backoff. Every failed INSERT is a statement on the MariaDB the holder
/// needs: with a 50 ms cap, 300 waiters on one SKU (`db_unique_sells_exactly_the_stock`)
/// slowed the holders until orders passed the 30 s request timeout.
const BACKOFF_BASE: Duration = Duration::from_millis(2);
const BACKOFF_CAP: Duration = Duration::from_millis(250);
/// Bound on one undo of a dropped INSERT.
const UNDO_TIMEOUT: Duration = Duration::from_secs(5);

const INSERT_ROW: &str = "INSERT INTO distributed_locks (lock_name, owner, expires_at)
     VALUES (?, ?, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)";
const LOOK_AT_ROW: &str = "SELECT id, owner,
     CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) AS SIGNED)
     FROM distributed_locks WHERE lock_name = ?";
const DELETE_EXPIRED_ROW: &str =
    "DELETE FROM distributed_locks WHERE id = ? AND expires_at < UTC_TIMESTAMP(6)";
const RENEW_ROW: &str =
    "UPDATE distributed_locks SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
     WHERE id = ? AND owner = ? AND expires_at >= UTC_TIMESTAMP(6)";
const LEASE_LEFT: &str =
    "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) AS SIGNED)
     FROM distributed_locks WHERE id = ? AND owner = ?";
const DELETE_OWN_ROW: &str = "DELETE FROM distributed_locks WHERE lock_name = ? AND owner = ?";

pub struct TableLock {
    pool: MySqlPool,
    /// This replica: owner tokens are `<owner>:<random>`.
    owner: String,
    lease: Duration,
    tasks: Tasks,
    /// Acquisitions under way, for tests and the curious.
    waiting: Arc<AtomicUsize>,
}

/// What one INSERT attempt found.
enum Inserted {
    /// The lock is ours: the new row's id.
    Row(u64),
    /// Held by someone else.
    Taken,
    /// The connection died under the INSERT (MariaDB restarted): whether the row went
    /// in is unknown, and the attempt's undo deletes it if it did.
    ConnectionLost,
}

impl TableLock {
    pub fn new(pool: MySqlPool, owner: &str, lease: Duration) -> TableLock {
        TableLock {
            pool,
            owner: owner.to_owned(),
            lease,
            tasks: Tasks::default(),
            waiting: Arc::default(),
        }
    }

    /// Background tasks running now: watchdogs of holds, undos of dropped INSERTs and
    /// background releases.
    pub fn background_tasks(&self) -> usize {
        self.tasks.live()
    }

    /// Acquisitions of this service under way (waiting, or sending their INSERT).
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// The row holding `name`, if any: its id, owner and milliseconds to expiry
    /// (negative once expired and not yet taken over).
    pub async fn inspect(&self, name: &str) -> Result<Option<(i64, String, i64)>, LockError> {
        let row = self.look(name).await?;
        Ok(row.map(|(id, owner, left_us)| (id, owner, left_us / 1000)))
    }

    /// One INSERT under `owner`. Until it returns, a drop deletes whatever row it may
    /// have inserted.
    async fn try_insert(&self, name: &str, owner: &str) -> Result<Inserted, LockError> {
        let conn = self.pool.acquire().await.map_err(mysql_error)?;
        let mut pending = PendingInsert {
            conn: Some(conn),
            pool: self.pool.clone(),
            tasks: self.tasks.clone(),
            name: name.to_owned(),
            owner: owner.to_owned(),
        };
        let conn = pending
            .conn
            .as_mut()
            .ok_or_else(|| mysql_error(sqlx::Error::PoolClosed))?;
        let inserted = sqlx::query(INSERT_ROW)
            .bind(name)
            .bind(owner)
            .bind(micros(self.lease))
            .execute(&mut **conn)
            .await;
        let outcome = match inserted {
            Ok(result) => Inserted::Row(result.last_insert_id()),
            Err(sqlx::Error::Database(error))
                if matches!(mysql_number(&*error), Some(DUPLICATE_KEY | DEADLOCK)) =>
            {
                Inserted::Taken
            }
            // Whether the row went in is unknown: leave the undo armed.
            Err(sqlx::Error::Io(error)) => {
                tracing::debug!(%error, lock = name, "lock-row INSERT on a dead connection");
                return Ok(Inserted::ConnectionLost);
            }
            Err(error) => return Err(mysql_error(error)),
        };
        // The outcome is known: disarm the undo (the row, if any, is the caller's).
        pending.conn = None;
        Ok(outcome)
    }

    /// The row holding `name`: its id, owner, and microseconds to expiry.
    async fn look(&self, name: &str) -> Result<Option<(i64, String, i64)>, LockError> {
        on_live_connection(&self.pool, || {
            sqlx::query_as(LOOK_AT_ROW)
                .bind(name)
                .fetch_optional(&self.pool)
        })
        .await
        .map_err(mysql_error)
    }

    /// `guard`, whose INSERT was sent at `sent`, with its lease ahead of it; `None` if
    /// its row was born expired. The row's lease runs from the INSERT's start
    /// (`UTC_TIMESTAMP` is the statement's time), so one that waited inside MariaDB was
    /// written partly spent, or already expired and open to a takeover. Past a third
    /// of the lease, when the watchdog would first renew, it is renewed to a whole
    /// lease, again if the renewal itself took that long. A drop here releases the row.
    async fn with_lease_ahead(
        &self,
        guard: LeaseGuard<TableHold>,
        sent: Instant,
    ) -> Result<Option<LeaseGuard<TableHold>>, LockError> {
        let mut spent = sent.elapsed();
        while spent >= self.lease / 3 {
            let renewing = Instant::now();
            match guard.renew_now().await {
                Ok(()) => spent = renewing.elapsed(),
                Err(LockError::Lost(_)) => return Ok(None),
                Err(error) => return Err(error),
            }
        }
        Ok(Some(guard))
    }

    /// Tries until it holds the lock: an INSERT, and after a failed one a look at the
    /// row if it may have expired, then a pause. Unbounded: `acquire` bounds it.
    async fn poll(&self, name: &str) -> Result<LeaseGuard<TableHold>, LockError> {
        // Until then the row that blocks us has not expired: no need to look.
        let mut live_until: Option<Instant> = None;
        let mut attempt = 0;
        loop {
            // A fresh token each try: an undone attempt cannot be confused with it.
            let owner = acquisition_token(&self.owner);
            let sent = Instant::now();
            match self.try_insert(name, &owner).await? {
                Inserted::Row(id) => {
                    let (pool, lock) = (self.pool.clone(), name.to_owned());
                    let hold = TableHold {
                        pool,
                        id,
                        name: lock,
                        owner,
                    };
                    let guard = LeaseGuard::start(hold, self.lease, &self.tasks);
                    if let Some(guard) = self.with_lease_ahead(guard, sent).await? {
                        return Ok(guard);
                    }
                    // Born expired: the guard's drop deleted the row if it was still
                    // ours; the next try looks at whatever row is there.
                    tracing::warn!(lock = name, waited = ?sent.elapsed(),
                        "a lock row's INSERT outlasted its lease; trying again");
                    live_until = None;
                    continue;
                }
                // The undo deletes the row if it went in; the next try goes on another
                // connection.
                Inserted::ConnectionLost => continue,
                Inserted::Taken => {}
            }
            if live_until.is_none_or(|until| Instant::now() >= until) {
                let asked = Instant::now();
                match self.look(name).await? {
                    // Released since our INSERT failed: go again at once.
                    None => continue,
                    Some((id, previous_owner, left_us)) if left_us < 0 => {
                        let deleted = run_retried(&self.pool, || {
                            sqlx::query(DELETE_EXPIRED_ROW).bind(id).execute(&self.pool)
                        })
                        .await?;
                        if deleted.rows_affected() == 1 {
                            tracing::warn!(lock = name, id, %previous_owner, "took over an expired lock row");
                            continue;
                        }
                    }
                    // Counted from before the question: the row lives at least that long.
                    Some((_, _, left_us)) => {
                        live_until = Some(asked + Duration::from_micros(left_us.unsigned_abs()));
                    }
                }
            }
            tokio::time::sleep(jittered_backoff(attempt, BACKOFF_BASE, BACKOFF_CAP)).await;
            attempt += 1;
        }
    }
}

/// Counts an acquisition under way for as long as it lives.
struct Waiting(Arc<AtomicUsize>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[async_trait]
impl DistributedLock for TableLock {
    type Guard = LeaseGuard<TableHold>;

    /// Every step is bounded by the caller's wait, statements too: one stalled inside
    /// MariaDB (behind a row lock, a slow commit) is dropped with the rest, and a
    /// dropped step leaves nothing behind (`PendingInsert`, the guard's release).
    async fn acquire(&self, name: &str, wait: Duration) -> Result<Self::Guard, LockError> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let _waiting = Waiting(self.waiting.clone());
        tokio::time::timeout(wait, self.poll(name))
            .await
            .map_err(|_| LockError::Timeout { waited: wait })?
    }

    async fn view(&self, name: &str) -> Result<LockView, LockError> {
        Ok(match self.inspect(name).await? {
            Some((id, owner, left_ms)) => LockView {
                held: left_ms > 0,
                holder: Some(token_owner(&owner)),
                lease_left_ms: Some(left_ms),
                state: vec![format!(
                    "distributed_locks row id={id} lock_name='{name}' owner='{owner}' expires in {left_ms} ms"
                )],
            },
            None => LockView {
                state: vec![format!("no row for lock_name='{name}': free")],
                ..LockView::default()
            },
        })
    }
}

/// One acquisition: the row's id and the owner token written in it.
#[derive(Clone)]
pub struct TableHold {
    pool: MySqlPool,
    id: u64,
    name: String,
    owner: String,
}

#[async_trait]
impl LeaseHold for TableHold {
    /// The driver reports rows matched, not changed (`FOUND_ROWS`), so a renewal
    /// within the same microsecond still counts.
    async fn renew(&self, lease: Duration) -> Result<bool, LockError> {
        let updated = run_retried(&self.pool, || {
            sqlx::query(RENEW_ROW)
                .bind(micros(lease))
                .bind(self.id)
                .bind(&self.owner)
                .execute(&self.pool)
        })
        .await?;
        Ok(updated.rows_affected() == 1)
    }

    /// A read, where the default renews: the renewal's UPDATE is an InnoDB commit, with
    /// its fsync, on the critical path of every order. With at least a third of the
    /// lease left (the watchdog renews every third) the write that follows has that
    /// long; with less, this renews. A write slower than that is still stopped by the
    /// row id's fencing token, which MySQL checks in the order's own transaction.
    async fn confirm(&self, lease: Duration) -> Result<bool, LockError> {
        let left_us: Option<i64> = on_live_connection(&self.pool, || {
            sqlx::query_scalar(LEASE_LEFT)
                .bind(self.id)
                .bind(&self.owner)
                .fetch_optional(&self.pool)
        })
        .await
        .map_err(mysql_error)?;
        match left_us {
            None => Ok(false),
            Some(left_us) if left_us >= micros(lease / 3) => Ok(true),
            // Expired (the renewal refuses it too) or running low: the renewal decides.
            Some(_) => self.renew(lease).await,
        }
    }

    async fn delete(&self) -> Result<bool, LockError> {
        let deleted = run_retried(&self.pool, || {
            sqlx::query(DELETE_OWN_ROW)
                .bind(&self.name)
                .bind(&self.owner)
                .execute(&self.pool)
        })
        .await?;
        Ok(deleted.rows_affected() == 1)
    }

    fn describe(&self) -> String {
        format!("lock row {} ({})", self.id, self.name)
    }

    /// The row's auto-increment id: a new row has a greater id than any before it.
    fn fencing_token(&self) -> Option<u64> {
        Some(self.id)
    }
}

/// An INSERT sent on `conn` whose outcome its caller may never see. Dropped while
/// armed, it deletes its row on the same connection: that connection first drains the
/// INSERT's answer (sqlx waits for an abandoned statement before the next), so the
/// delete runs after the INSERT. If the connection is broken, the delete is retried on
/// fresh ones (the server may still be finishing the INSERT), then left to the lease.
struct PendingInsert {
    conn: Option<PoolConnection<MySql>>,
    pool: MySqlPool,
    tasks: Tasks,
    name: String,
    owner: String,
}

impl Drop for PendingInsert {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let (pool, name, owner) = (self.pool.clone(), self.name.clone(), self.owner.clone());
        self.tasks.spawn_detached(async move {
            let delete = || sqlx::query(DELETE_OWN_ROW).bind(&name).bind(&owner);
            // A database error is an answer: the connection is still in step. sqlx hands
            // an abandoned statement's error to the next statement, which is then never
            // sent, so the first error is usually the INSERT's own (1062 or 1213: it
            // inserted nothing): send the DELETE again, a moment later.
            for tries in 0..DEADLOCK_RETRIES {
                let deleted = tokio::time::timeout(UNDO_TIMEOUT, delete().execute(&mut *conn));
                match deleted.await {
                    Ok(Ok(_)) => return,
                    Ok(Err(sqlx::Error::Database(_))) => {
                        let pause = jittered_backoff(tries, BACKOFF_BASE, BACKOFF_CAP);
                        tokio::time::sleep(pause).await;
                    }
                    _ => break,
                }
            }
            // A connection that failed mid-statement is not to be reused: the server may
            // still be finishing the INSERT, so fresh connections try a while later.
            conn.close_on_drop();
            drop(conn);
            for _ in 0..3 {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let fresh = run_retried(&pool, || delete().execute(&pool));
                if let Ok(Ok(_)) = tokio::time::timeout(UNDO_TIMEOUT, fresh).await {
                    return;
                }
            }
            tracing::warn!(lock = %name, "could not undo a dropped lock-row INSERT; its lease will expire");
        });
    }
}

/// Runs an idempotent lock-table statement (a DELETE or UPDATE of our own or an
/// expired row) again when InnoDB picks it as a deadlock victim, or on another
/// connection when its own was dead (`on_live_connection`). The shared locks that
/// failing duplicate-key INSERTs take on the lock row deadlock with the holder's
/// DELETE or UPDATE of that row; the victim's statement was rolled back, so running it
/// again is safe. Without this a release could fail and leave the row blocking
/// everyone until its lease ran out.
async fn run_retried<T, F, Fut>(pool: &MySqlPool, mut statement: F) -> Result<T, LockError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, sqlx::Error>>,
{
    let mut attempt = 0;
    loop {
        match on_live_connection(pool, &mut statement).await {
            Err(sqlx::Error::Database(error))
                if attempt < DEADLOCK_RETRIES && mysql_number(&*error) == Some(DEADLOCK) =>
            {
                attempt += 1;
                tokio::time::sleep(jittered_backoff(attempt, BACKOFF_BASE, BACKOFF_CAP)).await;
            }
            result => return result.map_err(mysql_error),
        }
    }
}

fn mysql_number(error: &dyn sqlx::error::DatabaseError) -> Option<u16> {
    error
        .try_downcast_ref::<MySqlDatabaseError>()
        .map(MySqlDatabaseError::number)
}

fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

fn mysql_error(error: sqlx::Error) -> LockError {
    LockError::backend("mysql", error)
}
