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
//!   alive past its deadline is harmless: the order's own transaction settles the
//!   claim (stores the 201) with a write that names the holder's token, and rolls back
//!   when that write finds another token (`settle_in_order`). So after a takeover only
//!   the new holder can commit an order, and a key with an order always has that
//!   order as its answer: the two are written together or not at all.

use std::time::Duration;

use sqlx::{MySql, Transaction};

use super::StoreError;
use super::records::{Records, is_duplicate_key};
use crate::model::{Idempotency, Order};
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimToken(u64);

impl ClaimToken {
    /// A fresh token, drawn before the claim is made.
    pub fn draw() -> ClaimToken {
        ClaimToken(rand::random::<u64>() >> 1)
    }

    /// The token as the order carries it (`Idempotency::claim`).
    pub fn value(self) -> u64 {
        self.0
    }

    /// A token chosen by the caller (tests replaying a claim's statements).
    pub fn from_value(value: u64) -> ClaimToken {
        ClaimToken(value & (u64::MAX >> 1))
    }
}

/// Settles the claims of orders just inserted, inside their transaction: each key's
/// answer becomes its order (201), only where the order's request still holds the
/// claim. `false`: at least one claim was taken over meanwhile (its holder was slower
/// than its hold); the caller rolls back, so that order is not recorded and the new
/// holder's answer stands. Orders without a key (or never claimed) need nothing.
/// One statement for any number of orders (a group commit's batch).
pub(crate) async fn settle_in_order(
    tx: &mut Transaction<'_, MySql>,
    orders: &[&Order],
    keys: &[Option<&Idempotency>],
) -> Result<bool, StoreError> {
    let mut claimed = Vec::new();
    for (order, key) in orders.iter().zip(keys) {
        if let Some(Idempotency {
            key,
            claim: Some(token),
            ..
        }) = key
        {
            let body = serde_json::to_string(order).map_err(|e| StoreError::Corrupt {
                what: "orders (as JSON)",
                detail: e.to_string(),
            })?;
            claimed.push((key.as_str(), *token, body));
        }
    }
    if claimed.is_empty() {
        return Ok(true);
    }
    let whens = vec!["WHEN ? THEN ?"; claimed.len()].join(" ");
    // Not `(idem_key, claim) IN ((?, ?), ...)`: MariaDB reads a row constructor's list
    // by scanning the whole table, and under REPEATABLE READ an UPDATE locks every row
    // it scans, so each order locked every claim, waited for every other key's
    // transaction, and held its SKU's row meanwhile. Equalities on the key are a range
    // of the primary key: only these rows. Forced, because on a small table (a new
    // sale's first keys) the optimizer finds the scan cheaper for four keys or more.
    let pairs = vec!["(idem_key = ? AND claim = ?)"; claimed.len()].join(" OR ");
    // Built from constant pieces and the number of orders only; the values are bound.
    let statement = sqlx::AssertSqlSafe(format!(
        "UPDATE idempotency_keys FORCE INDEX (PRIMARY)
         SET claim = NULL, claimed_until = NULL, status = 201,
             answer = CASE idem_key {whens} END
         WHERE {pairs}"
    ));
    let mut update = sqlx::query(statement);
    for (key, _, body) in &claimed {
        update = update.bind(*key).bind(body.as_str());
    }
    for (key, token, _) in &claimed {
        update = update.bind(*key).bind(*token);
    }
    let settled = update.execute(&mut **tx).await?;
    Ok(settled.rows_affected() == claimed.len() as u64)
}

impl Records {
    /// Claims `key` for `hold` (the deadline past which the claim may be taken over)
    /// with `token`, or says why not. The caller holds `token` before the first
    /// statement, so that a claim that landed while its answer was lost (an error
    /// after the INSERT) can still be given back, and every attempt uses it: a later
    /// attempt finds an earlier one's claim its own.
    pub async fn claim_key(
        &self,
        key: &Idempotency,
        token: ClaimToken,
        hold: Duration,
    ) -> Result<Claim, StoreError> {
        // An attempt meets a claim inserted, answered or given back by someone else
        // between its statements only a few times in a row; then it answers in_progress.
        for _ in 0..4 {
            if let Some(claim) = self.try_claim(key, hold, token).await? {
                return Ok(claim);
            }
        }
        Ok(Claim::InProgress)
    }

    /// One attempt of `claim_key` with `token`; `None`: try again (with a new token).
    /// Public for the tests that send an attempt twice, as `on_live_connection` does
    /// after an IO error that hid the first one's success.
    pub async fn try_claim(
        &self,
        key: &Idempotency,
        hold: Duration,
        token: ClaimToken,
    ) -> Result<Option<Claim>, StoreError> {
        let micros = u64::try_from(hold.as_micros()).unwrap_or(u64::MAX);
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
            Ok(_) => return Ok(Some(Claim::Mine(token))),
            Err(error) if is_duplicate_key(&error) => {}
            // Concurrent inserts of one key: InnoDB may pick a victim.
            Err(error) if mysql_error_number(&error) == Some(DEADLOCK) => return Ok(None),
            Err(error) => return Err(error.into()),
        }
        self.existing_claim(key, token, micros).await
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
        // Another body's claim, unless its holder is dead: then the key's order, if
        // any, decides (its own request must not be refused by a dead stranger's claim).
        let dead_holder = claim.is_some() && expired == Some(1);
        if fingerprint != key.fingerprint && !dead_holder {
            return Ok(Some(Claim::OtherRequest));
        }
        if let (Some(status), Some(body)) = (status, answer) {
            return Ok(Some(Claim::Answered { status, body }));
        }
        // Our own INSERT, resent by `on_live_connection` after an IO error that hid
        // its success: the claim is ours.
        if claim == Some(token.0) {
            return Ok(Some(Claim::Mine(token)));
        }
        let Some(held_by) = claim.filter(|_| expired == Some(1)) else {
            return Ok(Some(Claim::InProgress));
        };
        // The holder is presumed dead. Its order may have committed before it died:
        // then that order is the answer, and the claim records it.
        // The claim then takes the order's fingerprint: a claim made after the purge
        // by another request with the key must not answer that request with this
        // order (422), nor refuse the order's own request.
        if let Some((order, fingerprint)) = self.order_by_key(&key.key).await? {
            let body = serde_json::to_string(&order).map_err(|e| StoreError::Corrupt {
                what: "orders (as JSON)",
                detail: e.to_string(),
            })?;
            let record = || {
                sqlx::query(
                    "UPDATE idempotency_keys SET claim = NULL, claimed_until = NULL,
                         status = 201, answer = ?, fingerprint = ?
                     WHERE idem_key = ? AND claim = ?",
                )
                .bind(&body)
                .bind(&fingerprint)
                .bind(&key.key)
                .bind(held_by)
                .execute(self.pool())
            };
            on_live_connection(self.pool(), record).await?;
            if fingerprint != key.fingerprint {
                return Ok(Some(Claim::OtherRequest));
            }
            return Ok(Some(Claim::Answered { status: 201, body }));
        }
        if fingerprint != key.fingerprint {
            return Ok(Some(Claim::OtherRequest));
        }
        let take_over = || {
            sqlx::query(
                "UPDATE idempotency_keys
                 SET claim = ?, claimed_until = NOW(6) + INTERVAL ? MICROSECOND
                 WHERE idem_key = ?
                   AND (claim = ? AND claimed_until < NOW(6) OR claim = ?)",
            )
            .bind(token.0)
            .bind(micros)
            .bind(&key.key)
            .bind(held_by)
            // Resent after an IO error that hid its success: the claim is ours already.
            .bind(token.0)
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

    /// Stores the key's definitive answer, if `token` still holds its claim; whether
    /// it did.
    pub async fn answer_key(
        &self,
        key: &str,
        token: ClaimToken,
        status: u16,
        body: &str,
    ) -> Result<bool, StoreError> {
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
        // Resent after an IO error that hid its success, it finds nothing: the
        // answer is then read back by the caller (`key_now`), which finds it stored.
        Ok(on_live_connection(self.pool(), answer)
            .await?
            .rows_affected()
            == 1)
    }

    /// What a key has now, for a request that held it and lost it (taken over, or
    /// answered by another): its stored answer, or in progress.
    pub async fn key_now(&self, key: &Idempotency) -> Result<Claim, StoreError> {
        let read = || {
            sqlx::query_as::<_, (String, Option<u16>, Option<String>)>(
                "SELECT fingerprint, status, answer FROM idempotency_keys WHERE idem_key = ?",
            )
            .bind(&key.key)
            .fetch_optional(self.pool())
        };
        Ok(match on_live_connection(self.pool(), read).await? {
            Some((fingerprint, _, _)) if fingerprint != key.fingerprint => Claim::OtherRequest,
            Some((_, Some(status), Some(body))) => Claim::Answered { status, body },
            _ => Claim::InProgress,
        })
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
    /// them, except claims whose holder is still within its hold (its order's
    /// transaction settles the claim, and would roll back finding it gone); how many
    /// went. The orders keep their keys: a key sent again after the
    /// purge finds its order through the unique key and is answered with it.
    pub async fn purge_keys(&self, limit: u32) -> Result<u64, StoreError> {
        let seconds = KEY_RETENTION.as_secs();
        let purge = || {
            sqlx::query(
                "DELETE FROM idempotency_keys
                 WHERE created_at < NOW(6) - INTERVAL ? SECOND
                   AND (claim IS NULL OR claimed_until < NOW(6))
                 LIMIT ?",
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
