//! The undo of a `SET` whose answer its caller may never see (redis-lock's
//! acquisitions). An acquisition dropped while its `SET` is in flight (a
//! shopper hung up) may still have taken the key. Redis answers one connection in
//! order, so a compare-and-delete sent on the connection that carried the `SET` runs
//! after it, whatever the caller saw.

use std::time::Duration;

use super::{delete_on, release_with};
use crate::lock::LockError;
use crate::lock::task::Tasks;
use crate::redis_pool::{Connection, Pool};

/// Bound on one undo of a dropped attempt.
const UNDO_TIMEOUT: Duration = Duration::from_secs(2);

/// A `SET NX` sent on `conn` whose outcome its caller may never see. Unless disarmed,
/// dropping it sends the compare-and-delete of its token on the same connection, so
/// that Redis runs the delete after the `SET`; if that connection fails, on fresh ones
/// (by then the `SET` has either run or never will).
pub(in crate::lock) struct PendingSet {
    conn: Option<Connection>,
    target: Target,
    tasks: Tasks,
}

/// The key a `SET` went to, the channel its release tells, and its token.
#[derive(Clone)]
pub(in crate::lock) struct Target {
    pub pool: Pool,
    pub key: String,
    pub channel: String,
    pub token: String,
}

impl PendingSet {
    pub(in crate::lock) fn new(conn: Connection, target: Target, tasks: &Tasks) -> PendingSet {
        PendingSet {
            conn: Some(conn),
            target,
            tasks: tasks.clone(),
        }
    }

    pub(in crate::lock) fn conn(&mut self) -> Result<&mut Connection, LockError> {
        self.conn
            .as_mut()
            .ok_or_else(|| LockError::backend("redis", "attempt already settled"))
    }

    /// The attempt's outcome is known to the caller: nothing to undo.
    pub(in crate::lock) fn disarm(&mut self) {
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
