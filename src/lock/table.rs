//! A lock made of a row in a MySQL table with a unique key on the lock name (the
//! classic "database lock table").
//!
//! - **Acquire**: `INSERT` a row `(lock_name, owner, expires_at)`. A duplicate key
//!   (1062), or the deadlock MariaDB reports for a contended insert (1213), means the
//!   lock is held.
//! - **Expired rows**: a holder that crashed leaves its row behind. A contender that
//!   finds the row past `expires_at` deletes it *by its id* and inserts again. Deleting
//!   by name would be wrong: between our look and our delete another contender may
//!   have taken over and inserted a fresh row, which a delete by name would destroy.
//! - **Renewal**: while working, the holder pushes `expires_at` forward (the shared
//!   lease watchdog), `WHERE id = ? AND owner = ?`.
//! - **Release**: `DELETE ... WHERE lock_name = ? AND owner = ?`.
//! - **Waiting**: nothing wakes a waiter, so it polls with jittered exponential
//!   backoff, bounded by the caller's wait.
//!
//! - **Cancellation**: an INSERT whose caller was dropped may still commit. The attempt
//!   holds the connection it sent the INSERT on and, if dropped, deletes its row (by
//!   its unique owner token) on that same connection, which answers the INSERT first.
//!
//! All times are the database's own, in UTC (`UTC_TIMESTAMP(6)` into `DATETIME(6)`
//! columns), so neither replicas' clocks nor their sessions' time zones matter.

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

/// MySQL error numbers that mean "someone else holds it" for a lock-row INSERT.
const DUPLICATE_KEY: u16 = 1062;
const DEADLOCK: u16 = 1213;
/// How often a release, renewal or takeover is retried after losing a deadlock.
const DEADLOCK_RETRIES: u32 = 20;

const BACKOFF_BASE: Duration = Duration::from_millis(2);
const BACKOFF_CAP: Duration = Duration::from_millis(50);
/// Bound on one undo of a dropped INSERT.
const UNDO_TIMEOUT: Duration = Duration::from_secs(5);

const DELETE_OWN_ROW: &str = "DELETE FROM distributed_locks WHERE lock_name = ? AND owner = ?";

pub struct TableLock {
    pool: MySqlPool,
    owner: String,
    lease: Duration,
    tasks: Tasks,
}

impl TableLock {
    pub fn new(pool: MySqlPool, owner: &str, lease: Duration) -> TableLock {
        TableLock {
            pool,
            owner: owner.to_owned(),
            lease,
            tasks: Tasks::default(),
        }
    }

    /// Background tasks running now: watchdogs of holds and cleanups of dropped
    /// acquisitions and releases.
    pub fn background_tasks(&self) -> usize {
        self.tasks.live()
    }

    /// The row holding `name`, if any: its id, owner and milliseconds to expiry
    /// (negative once expired and not yet taken over).
    pub async fn inspect(&self, name: &str) -> Result<Option<(i64, String, i64)>, LockError> {
        sqlx::query_as(
            "SELECT id, owner, CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) DIV 1000 AS SIGNED)
             FROM distributed_locks WHERE lock_name = ?",
        )
        .bind(name)
        .fetch_optional(&self.pool)
        .await
        .map_err(mysql_error)
    }

    /// One INSERT attempt: the new row's id, or `None` when the name is taken. Until
    /// it returns, a drop deletes whatever row it may have inserted.
    async fn try_insert(&self, name: &str, owner: &str) -> Result<Option<u64>, LockError> {
        let conn = self.pool.acquire().await.map_err(mysql_error)?;
        let mut pending = PendingInsert {
            conn: Some(conn),
            pool: self.pool.clone(),
            name: name.to_owned(),
            owner: owner.to_owned(),
            tasks: self.tasks.clone(),
        };
        let Some(conn) = pending.conn.as_mut() else {
            return Err(LockError::backend("mysql", "attempt already settled"));
        };
        let inserted = sqlx::query(
            "INSERT INTO distributed_locks (lock_name, owner, expires_at)
             VALUES (?, ?, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)",
        )
        .bind(name)
        .bind(owner)
        .bind(micros(self.lease))
        .execute(&mut **conn)
        .await;
        let outcome = match inserted {
            Ok(result) => Ok(Some(result.last_insert_id())),
            Err(sqlx::Error::Database(error))
                if matches!(mysql_number(&*error), Some(DUPLICATE_KEY | DEADLOCK)) =>
            {
                Ok(None)
            }
            // Whether the row went in is unknown: leave the undo armed.
            Err(error) => return Err(mysql_error(error)),
        };
        pending.conn = None;
        outcome
    }

    /// Deletes the row holding `name` if it has expired, by its id. Returns whether a
    /// row was taken over.
    async fn take_over_expired(&self, name: &str) -> Result<bool, LockError> {
        let expired: Option<(i64, String)> = sqlx::query_as(
            "SELECT id, owner FROM distributed_locks WHERE lock_name = ? AND expires_at < UTC_TIMESTAMP(6)",
        )
        .bind(name)
        .fetch_optional(&self.pool)
        .await
        .map_err(mysql_error)?;
        let Some((id, previous_owner)) = expired else {
            return Ok(false);
        };
        let deleted = retry_deadlocks(|| {
            sqlx::query(
                "DELETE FROM distributed_locks WHERE id = ? AND expires_at < UTC_TIMESTAMP(6)",
            )
            .bind(id)
            .execute(&self.pool)
        })
        .await?
        .rows_affected();
        if deleted == 1 {
            tracing::warn!(lock = name, id, %previous_owner, "took over an expired lock row");
        }
        Ok(deleted == 1)
    }
}

#[async_trait]
impl DistributedLock for TableLock {
    type Guard = LeaseGuard<TableHold>;

    async fn acquire(&self, name: &str, wait: Duration) -> Result<Self::Guard, LockError> {
        let owner = acquisition_token(&self.owner);
        let deadline = Instant::now() + wait;
        let mut attempt = 0;
        loop {
            if let Some(id) = self.try_insert(name, &owner).await? {
                let hold = TableHold {
                    pool: self.pool.clone(),
                    id,
                    name: name.to_owned(),
                    owner,
                };
                return Ok(LeaseGuard::start(hold, self.lease, &self.tasks));
            }
            if self.take_over_expired(name).await? {
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(LockError::Timeout { waited: wait });
            }
            let pause = jittered_backoff(attempt, BACKOFF_BASE, BACKOFF_CAP);
            tokio::time::sleep_until(deadline.min(now + pause)).await;
            attempt += 1;
        }
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
    async fn renew(&self, lease: Duration) -> Result<bool, LockError> {
        let updated = retry_deadlocks(|| {
            sqlx::query(
                "UPDATE distributed_locks SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
                 WHERE id = ? AND owner = ? AND expires_at >= UTC_TIMESTAMP(6)",
            )
            .bind(micros(lease))
            .bind(self.id)
            .bind(&self.owner)
            .execute(&self.pool)
        })
        .await?;
        // MySQL reports rows *changed*; a renewal within the same microsecond changes
        // nothing but still matched, so count a match via the row's presence.
        if updated.rows_affected() == 1 {
            return Ok(true);
        }
        let still_ours: Option<i64> = sqlx::query_scalar(
            "SELECT id FROM distributed_locks WHERE id = ? AND owner = ? AND expires_at >= UTC_TIMESTAMP(6)",
        )
        .bind(self.id)
        .bind(&self.owner)
        .fetch_optional(&self.pool)
        .await
        .map_err(mysql_error)?;
        Ok(still_ours.is_some())
    }

    async fn delete(&self) -> Result<bool, LockError> {
        let deleted = retry_deadlocks(|| {
            sqlx::query(DELETE_OWN_ROW)
                .bind(&self.name)
                .bind(&self.owner)
                .execute(&self.pool)
        })
        .await?
        .rows_affected();
        Ok(deleted == 1)
    }

    fn describe(&self) -> String {
        format!("lock row {} ({})", self.id, self.name)
    }

    /// The row's auto-increment id: it only grows.
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
    name: String,
    owner: String,
    tasks: Tasks,
}

impl Drop for PendingInsert {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let (pool, name, owner) = (self.pool.clone(), self.name.clone(), self.owner.clone());
        self.tasks.spawn_detached(async move {
            let delete = sqlx::query(DELETE_OWN_ROW).bind(&name).bind(&owner);
            if let Ok(Ok(_)) = tokio::time::timeout(UNDO_TIMEOUT, delete.execute(&mut *conn)).await {
                return;
            }
            // A connection that failed mid-statement is not to be reused.
            conn.close_on_drop();
            drop(conn);
            for _ in 0..3 {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let delete = retry_deadlocks(|| {
                    sqlx::query(DELETE_OWN_ROW)
                        .bind(&name)
                        .bind(&owner)
                        .execute(&pool)
                });
                if let Ok(Ok(_)) = tokio::time::timeout(UNDO_TIMEOUT, delete).await {
                    return;
                }
            }
            tracing::warn!(lock = %name, "could not undo a dropped lock-row INSERT; its lease will expire");
        });
    }
}

/// Runs a lock-table statement again when InnoDB picks it as a deadlock victim. Under
/// contention, the shared locks that failing duplicate-key INSERTs take on the lock
/// row deadlock with the holder's DELETE or UPDATE of that row; the victim's statement
/// was rolled back, so running it again is safe. Without this a release could fail
/// and leave the row blocking everyone until its lease ran out.
async fn retry_deadlocks<T, F, Fut>(mut statement: F) -> Result<T, LockError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, sqlx::Error>>,
{
    let mut attempt = 0;
    loop {
        match statement().await {
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
