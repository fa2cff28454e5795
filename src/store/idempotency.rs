//! The claim table of idempotency keys (`idempotency_keys`): which key is being
//! answered right now, and the definitive answer of each key, kept 24 hours.
//!
//! The one-order-per-key guarantee is not here: it is the unique key on
//! `orders.idempotency_key`, written in the order's own transaction, which holds
//! whatever happens to a replica. The claim adds what a unique key cannot:
//!
//! - **In progress.** A key is claimed (an `INSERT`) before its order runs; the same
//!   key sent meanwhile to any replica finds the claim and answers 409 `in_progress`
//!   instead of running a second order that MySQL would refuse only at its commit
//!   (after taking a lock, a Redis unit, a place in the queue).
//! - **Replay.** The definitive answer is stored with the claim: the 201's order, or a
//!   refusal that a retry would get again (`sold_out`, `limit_reached`, `not_found`).
//!   Transient answers (timeouts, `lock_timeout`, `sale_changed`, every 503) are not
//!   stored: the claim is given back, so a retry tries again.
//! - **Dead holders.** A claim carries its holder's random token and a deadline in
//!   MySQL's clock (`claimed_until`). A holder that dies (kill -9) leaves its claim;
//!   past the deadline the next request with the key first looks for an order with
//!   the key (the order row is the truth: it may have committed before the crash), and
//!   only if there is none takes the claim over and runs the order. A holder still
//!   alive past its deadline is harmless: its order and the new holder's cannot both
//!   commit (the unique key), and its late answer does not overwrite the new holder's
//!   claim (every write names the token).

use std::time::Duration;

use super::StoreError;
use super::records::{Records, is_duplicate_key};
use crate::model::Idempotency;
use crate::mysql_pool::on_live_connection;
use crate::store::order_commit::{DEADLOCK, mysql_error_number};

/// How long a key's claim and answer are kept.
pub const KEY_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// What a request with an idempotency key may do.
#[derive(Debug)]
pub enum Claim {
    /// This request holds the key: it runs the order, then `answer`s or `release`s.
    Mine(ClaimToken),
    /// The key was answered: the status and JSON body to send again.
    Answered { status: u16, body: String },
    /// Another request holds the key and is still within its deadline.
    InProgress,
    /// The key was sent with another request (another fingerprint).
    OtherRequest,
}

/// The token of a claim held; every later write of the claim names it.
#[derive(Debug, Clone, Copy)]
pub struct ClaimToken(u64);

impl Records {
    /// Claims `key` for `hold` (the deadline past which the claim may be taken over),
    /// or says why not.
    pub async fn claim_key(&self, key: &Idempotency, hold: Duration) -> Result<Claim, StoreError> {
        let micros = u64::try_from(hold.as_micros()).unwrap_or(u64::MAX);
        // An attempt meets a claim inserted, answered or given back by someone else
        // between its statements only a few times in a row; then it answers in_progress.
        for _ in 0..4 {
            let token = ClaimToken(rand::random::<u64>() >> 1);
            let insert = || {
                sqlx::query(
                    "INSERT INTO idempotency_keys (idem_key, fingerprint, claim, claimed_until)
                     VALUES (?, ?, ?, NOW(6) + INTERVAL ? MICROSECOND)",
                )
                .bind(&key.key)
                .bind(&key.fingerprint)
                .bind(token.0)
                .bind(micros)
                .execute(self.pool())
            };
            match on_live_connection(self.pool(), insert).await {
                Ok(_) => return Ok(Claim::Mine(token)),
                Err(error) if is_duplicate_key(&error) => {}
                // Concurrent inserts of one key: InnoDB may pick a victim.
                Err(error) if mysql_error_number(&error) == Some(DEADLOCK) => continue,
                Err(error) => return Err(error.into()),
            }
            if let Some(found) = self.existing_claim(key, token, micros).await? {
                return Ok(found);
            }
        }
        Ok(Claim::InProgress)
    }

    /// The claim someone else inserted: its answer, or in progress, or taken over
    /// with `token` once its holder's deadline has passed. `None`: it was given back
    /// meanwhile (claim again).
    async fn existing_claim(
        &self,
        key: &Idempotency,
        token: ClaimToken,
        micros: u64,
    ) -> Result<Option<Claim>, StoreError> {
        // `claimed_until < NOW(6)`: 1, 0, or NULL once answered.
        type Row = (
            String,
            Option<u64>,
            Option<i64>,
            Option<u16>,
            Option<String>,
        );
        let read = || {
            sqlx::query_as::<_, Row>(
                "SELECT fingerprint, claim, claimed_until < NOW(6), status, answer
                 FROM idempotency_keys WHERE idem_key = ?",
            )
            .bind(&key.key)
            .fetch_optional(self.pool())
        };
        let Some((fingerprint, claim, expired, status, answer)) =
            on_live_connection(self.pool(), read).await?
        else {
            return Ok(None);
        };
        if fingerprint != key.fingerprint {
            return Ok(Some(Claim::OtherRequest));
        }
        if let (Some(status), Some(body)) = (status, answer) {
            return Ok(Some(Claim::Answered { status, body }));
        }
        let Some(held_by) = claim.filter(|_| expired == Some(1)) else {
            return Ok(Some(Claim::InProgress));
        };
        // The holder is presumed dead. Its order may have committed before it died:
        // then that order is the answer, and the claim records it.
        if let Some((order, _)) = self.order_by_key(&key.key).await? {
            let body = serde_json::to_string(&order).map_err(|e| StoreError::Corrupt {
                what: "orders (as JSON)",
                detail: e.to_string(),
            })?;
            self.answer_key(&key.key, ClaimToken(held_by), 201, &body)
                .await?;
            return Ok(Some(Claim::Answered { status: 201, body }));
        }
        let take_over = || {
            sqlx::query(
                "UPDATE idempotency_keys
                 SET claim = ?, claimed_until = NOW(6) + INTERVAL ? MICROSECOND
                 WHERE idem_key = ? AND claim = ? AND claimed_until < NOW(6)",
            )
            .bind(token.0)
            .bind(micros)
            .bind(&key.key)
            .bind(held_by)
            .execute(self.pool())
        };
        let taken = on_live_connection(self.pool(), take_over).await?;
        Ok(Some(if taken.rows_affected() == 1 {
            tracing::warn!(key = %key.key, "an idempotency key's holder passed its deadline; claim taken over");
            Claim::Mine(token)
        } else {
            // Someone else took it over, or the holder answered just now.
            Claim::InProgress
        }))
    }

    /// Stores the key's definitive answer, if `token` still holds its claim.
    pub async fn answer_key(
        &self,
        key: &str,
        token: ClaimToken,
        status: u16,
        body: &str,
    ) -> Result<(), StoreError> {
        let answer = || {
            sqlx::query(
                "UPDATE idempotency_keys SET claim = NULL, claimed_until = NULL,
                     status = ?, answer = ?
                 WHERE idem_key = ? AND claim = ?",
            )
            .bind(status)
            .bind(body)
            .bind(key)
            .bind(token.0)
            .execute(self.pool())
        };
        on_live_connection(self.pool(), answer).await?;
        Ok(())
    }

    /// Gives the claim back (a transient answer): the next request with the key runs
    /// the order again.
    pub async fn release_key(&self, key: &str, token: ClaimToken) -> Result<(), StoreError> {
        let release = || {
            sqlx::query("DELETE FROM idempotency_keys WHERE idem_key = ? AND claim = ?")
                .bind(key)
                .bind(token.0)
                .execute(self.pool())
        };
        on_live_connection(self.pool(), release).await?;
        Ok(())
    }

    /// Deletes the claims and answers older than `KEY_RETENTION`, at most `limit` of
    /// them; how many went. The orders keep their keys: a key sent again after the
    /// purge finds its order through the unique key and is answered with it.
    pub async fn purge_keys(&self, limit: u32) -> Result<u64, StoreError> {
        let seconds = KEY_RETENTION.as_secs();
        let purge = || {
            sqlx::query(
                "DELETE FROM idempotency_keys
                 WHERE created_at < NOW(6) - INTERVAL ? SECOND LIMIT ?",
            )
            .bind(seconds)
            .bind(limit)
            .execute(self.pool())
        };
        Ok(on_live_connection(self.pool(), purge)
            .await?
            .rows_affected())
    }
}
