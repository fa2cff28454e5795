//! The MySQL connections of a replica, which `store` (the records) and `lock` (the
//! lock table) share, and the one rule that sharing them needs.
//!
//! sqlx would ping every connection before handing it out: one round trip per
//! statement or transaction, most of them inside a lock. Like HikariCP's alive-bypass
//! window, only a connection idle for a while is pinged here; one used moments ago is
//! handed out as it is. After a MariaDB restart such a connection is dead, so every
//! caller that may meet one runs its statement through `on_live_connection`, which
//! sends it again on another.

use std::time::Duration;

use sqlx::Connection;
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};

/// A pooled connection used this recently is handed out without a ping.
pub const ALIVE_BYPASS: Duration = Duration::from_millis(500);
/// How long a caller waits for a connection, so an outage answers 503 instead of
/// hanging.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);

/// Connects a pool of `size` connections to `url`.
pub async fn connect(url: &str, size: u32) -> Result<MySqlPool, sqlx::Error> {
    MySqlPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for < ALIVE_BYPASS {
                    return Ok(true);
                }
                Ok(conn.ping().await.is_ok())
            })
        })
        .connect(url)
        .await
}

/// Runs `statement`, a BEGIN, a read or an idempotent write, again when it failed at
/// the connection level: the connection it got may have died with a MariaDB restart
/// (see above). Whatever it sent was not answered; sqlx discards the dead connection,
/// and the next try takes another, at worst a new one, which waits for the database as
/// long as the pool's acquire timeout. So a request sent during a short outage waits
/// instead of failing (`faults::mariadb_blip_mid_sale`).
pub async fn on_live_connection<T, F: Future<Output = Result<T, sqlx::Error>>>(
    pool: &MySqlPool,
    mut statement: impl FnMut() -> F,
) -> Result<T, sqlx::Error> {
    // Each idle connection may be dead, then a new one is opened. No new try starts
    // after one acquire timeout; the last may itself wait that long.
    let tries = pool.options().get_max_connections() + 1;
    let deadline = tokio::time::Instant::now() + pool.options().get_acquire_timeout();
    let mut tried = 1;
    loop {
        match statement().await {
            Err(sqlx::Error::Io(error))
                if tried < tries && tokio::time::Instant::now() < deadline =>
            {
                tracing::debug!(%error, "a dead connection; trying again on another");
                tried += 1;
            }
            result => return result,
        }
    }
}
