//! The checker: after a round's faults, judge the sale from its records.
//!
//! Once the cluster is quiet (no order in flight any more, as far as the records and
//! the lock waiters show), every strategy but `none` promises:
//! 1. nothing oversold: units ordered ≤ initial stock;
//! 2. MySQL's stock = initial − units ordered (no unit lost or made up);
//! 3. Redis's stock = MySQL's (the cache agrees once quiet; after a fault that may
//!    lose it, an admin reconciles first, as the runbook says; so too after a kill
//!    under redis-atomic, whose taken but uncommitted units stay taken, once Redis is
//!    checked to be below MySQL, not above);
//! 4. patient shoppers, with no fault left, can buy exactly what is left and are then
//!    told `sold_out`: no orphaned lock, lease, znode or row blocks the SKU;
//! 5. a change of another SKU (its reset, its reconcile) refuses no order of this one:
//!    in a round whose faults change no setting of the whole sale, no shopper of the
//!    SKU was told `sale_changed` (`untouched`);
//! 6. at most one order per idempotency key, however often the retrying shoppers sent
//!    it (after hanging up, a killed replica, a 503), under every strategy;
//! 7. no user owns more units than the sale's limit per user, when it has one.
//!
//! Each is read from `/api/stats` (the service's account of Redis and MySQL) and, with
//! `--database-url`, from MySQL directly; both accounts must also agree.

use std::time::Duration;

use flashsale_wire::stats::SkuStats;
use serde::Serialize;
use tokio::time::Instant;

use super::cluster::{Answer, Cluster};
use super::crowd::Tally;
use super::records::{Records, SkuRecord};
use super::schedule::Round;

/// The figures must stay still this long (at least) to call the cluster quiet: longer
/// than a replica's heartbeat, which reports its lock waiters once a second.
const STILL_FOR: Duration = Duration::from_millis(1500);
/// A round that does not go quiet within this is itself a violation.
const QUIET_WITHIN: Duration = Duration::from_secs(60);

pub struct Checker<'a> {
    pub cluster: &'a Cluster,
    pub records: Option<&'a Records>,
    /// How long a patient shopper keeps retrying one unit (503s, lock_lost).
    pub patience: Duration,
}

/// What the round may have done to Redis's copy of the stock, so that an admin
/// reconciles it once quiet, as the runbook says.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Cache {
    /// Nothing: Redis must agree with MySQL by itself.
    Kept,
    /// Redis or MySQL was restarted: the copy may be anything.
    MayBeLost,
    /// A redis-atomic replica was killed between its take in Redis and its COMMIT:
    /// its units stay taken and unsold (Redis below MySQL, never above) until the
    /// reconcile, the undersell its card describes.
    MayUndersell,
}

/// One round's checks: what was found, and what was broken.
#[derive(Debug, Default, Serialize)]
pub struct Verdict {
    /// The service's figures once quiet (after a reconcile, if one was needed).
    pub after_crowd: Option<SkuStats>,
    /// MySQL's, read directly, at the same moment.
    pub after_crowd_mysql: Option<SkuRecord>,
    pub reconciled: bool,
    /// Units the patient shoppers bought, and the retries it took.
    pub patient_bought: i64,
    pub patient_retries: u64,
    /// Targets that stayed down after the round (a replica killed and not restarted).
    pub down: Vec<String>,
    pub quiet_after_ms: u64,
    /// Broken guarantees, each a sentence with the figures.
    pub broken: Vec<String>,
}

impl Checker<'_> {
    /// Runs every check of a round on `sku` of `initial` units, after what the round
    /// may have done to the `cache`.
    pub async fn check(
        &self,
        sku: &str,
        initial: i64,
        cache: Cache,
        still_for: Duration,
    ) -> Verdict {
        let mut verdict = Verdict {
            down: self.cluster.refresh(Duration::from_secs(10)).await,
            ..Verdict::default()
        };
        let started = Instant::now();
        let quiet = self.quiet(sku, still_for.max(STILL_FOR)).await;
        verdict.quiet_after_ms = started.elapsed().as_millis() as u64;
        let mut figures = match quiet {
            Ok(figures) => figures,
            Err(error) => {
                verdict.broken.push(error);
                return verdict;
            }
        };
        if cache == Cache::MayUndersell
            && figures
                .stock_redis
                .is_some_and(|redis| redis > figures.stock_mysql)
        {
            verdict.broken.push(format!(
                "Redis shows more than MySQL after a killed taker: {}",
                show(&figures)
            ));
        }
        if figures.stock_redis.is_none() || cache != Cache::Kept {
            if cache == Cache::Kept {
                verdict.broken.push(format!(
                    "Redis lost the stock without a Redis or MySQL fault: {}",
                    show(&figures)
                ));
            }
            verdict.reconciled = true;
            if let Err(error) = self.cluster.reconcile().await {
                verdict.broken.push(format!("reconcile failed: {error:#}"));
                return verdict;
            }
            match self.cluster.sku_stats(sku).await {
                Ok((after, _)) => figures = after,
                Err(error) => {
                    verdict
                        .broken
                        .push(format!("stats after reconcile: {error:#}"));
                    return verdict;
                }
            }
        }
        let mysql = self
            .agree(sku, initial, &figures, "once quiet", &mut verdict.broken)
            .await;
        let left = mysql.as_ref().map_or(figures.stock_mysql, |m| m.stock);
        verdict.after_crowd = Some(figures);
        verdict.after_crowd_mysql = mysql;

        let last = self.sell_what_is_left(sku, left, &mut verdict).await;
        match self.cluster.sku_stats(sku).await {
            // What was broken once quiet stays broken: report the end only if it
            // breaks something new.
            Ok((end, _)) if verdict.broken.is_empty() => {
                self.agree(
                    sku,
                    initial,
                    &end,
                    "after the patient shoppers",
                    &mut verdict.broken,
                )
                .await;
                if end.ordered_quantity < initial {
                    verdict.broken.push(format!(
                        "{} unit(s) never sold: the patient shoppers bought {} of the {left} left (last answer {last:?}): {}",
                        initial - end.ordered_quantity,
                        verdict.patient_bought,
                        show(&end)
                    ));
                }
            }
            Ok(_) => {}
            Err(error) => verdict.broken.push(format!("final stats: {error:#}")),
        }
        if last != Some(Answer::SoldOut) && verdict.broken.is_empty() {
            verdict.broken.push(format!(
                "after buying what was left, an order got {last:?}, not sold_out"
            ));
        }
        verdict
    }

    /// Waits until the SKU's figures (and MySQL's, if read) have not moved for
    /// `still_for` while no replica reports a lock waiter.
    async fn quiet(&self, sku: &str, still_for: Duration) -> Result<SkuStats, String> {
        let started = Instant::now();
        let mut last_seen = String::new();
        let mut still_since = Instant::now();
        let mut last_error = String::from("no answer");
        while started.elapsed() < QUIET_WITHIN {
            match self.cluster.sku_stats(sku).await {
                Ok((figures, stats)) => {
                    let waiters: u64 = stats.replicas.iter().map(|r| r.lock_waiters).sum();
                    let direct = match self.records {
                        Some(records) => format!("{:?}", records.sku(sku).await.ok()),
                        None => String::new(),
                    };
                    let seen = format!("{} {direct}", show(&figures));
                    if seen != last_seen || waiters > 0 {
                        (last_seen, still_since) = (seen, Instant::now());
                    } else if still_since.elapsed() >= still_for {
                        return Ok(figures);
                    }
                }
                // A backend restarting: keep asking.
                Err(error) => last_error = format!("{error:#}"),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if self.cluster.live_targets() == 0 {
            return Err(format!(
                "every replica is down and none came back within {QUIET_WITHIN:?} (last error: {last_error})"
            ));
        }
        Err(format!(
            "the cluster did not go quiet within {QUIET_WITHIN:?} (last figures: {last_seen}; last error: {last_error})"
        ))
    }

    /// Checks guarantees 1-3 on the service's figures and, with `--database-url`, that
    /// MySQL holds the same (or checks MySQL's own figures too where it does not);
    /// returns MySQL's.
    async fn agree(
        &self,
        sku: &str,
        initial: i64,
        figures: &SkuStats,
        when: &str,
        broken: &mut Vec<String>,
    ) -> Option<SkuRecord> {
        let service = SkuRecord {
            initial_stock: figures.initial_stock,
            stock: figures.stock_mysql,
            orders: figures.orders,
            ordered_quantity: figures.ordered_quantity,
            sharing_key: figures.duplicates.orders_sharing_key,
            over_limit: figures.duplicates.units_over_limit,
        };
        let mysql = match self.records {
            Some(records) => match records.sku(sku).await {
                Ok(mysql) => Some(mysql),
                Err(error) => {
                    broken.push(format!("{when}: reading MySQL: {error:#}"));
                    None
                }
            },
            None => None,
        };
        let source = match &mysql {
            Some(mysql) if *mysql == service => "/api/stats and MySQL",
            Some(mysql) => {
                broken.push(format!(
                    "{when}: /api/stats says {service:?} but MySQL holds {mysql:?}"
                ));
                for problem in invariants(mysql, initial) {
                    broken.push(format!("{when}, MySQL: {problem}: {mysql:?}"));
                }
                "/api/stats"
            }
            None => "/api/stats",
        };
        for problem in invariants(&service, initial) {
            broken.push(format!("{when}, {source}: {problem}: {}", show(figures)));
        }
        if figures.stock_redis != Some(figures.stock_mysql) {
            broken.push(format!(
                "{when}: Redis stock {:?} ≠ MySQL stock {}: {}",
                figures.stock_redis,
                figures.stock_mysql,
                show(figures)
            ));
        }
        mysql
    }

    /// Patient shoppers buy one unit at a time until told `sold_out` (at most `left`
    /// and a few more, in case an order answered late had sold one); returns the last
    /// answer. Whether they bought exactly what was left is judged from the records.
    async fn sell_what_is_left(
        &self,
        sku: &str,
        left: i64,
        verdict: &mut Verdict,
    ) -> Option<Answer> {
        let mut last = None;
        for unit in 0..left.max(0) + 3 {
            let answer = self
                .buy_patiently(
                    sku,
                    &format!("patient-{unit}"),
                    unit,
                    &mut verdict.patient_retries,
                )
                .await;
            match answer {
                Answer::Created => verdict.patient_bought += 1,
                Answer::SoldOut => return Some(answer),
                _ => {
                    verdict.broken.push(format!(
                        "the SKU is blocked: after {} of the {left} unit(s) left were bought, an order got neither a sale nor sold_out within {:?} (last answer {answer:?}; an orphaned lock?)",
                        verdict.patient_bought, self.patience
                    ));
                    return Some(answer);
                }
            }
            last = Some(answer);
        }
        last
    }

    /// One unit, retried on every answer that means "not now" until bought, sold out,
    /// refused, or out of patience.
    async fn buy_patiently(&self, sku: &str, user: &str, target: i64, retries: &mut u64) -> Answer {
        let started = Instant::now();
        let mut target = usize::try_from(target).unwrap_or(0);
        loop {
            let answer = self
                .cluster
                .order(target, sku, user, 1, None, self.patience)
                .await;
            let again = matches!(
                answer,
                Answer::Busy(_) | Answer::LockLost | Answer::Unreachable | Answer::Broken(_)
            );
            if !again || started.elapsed() >= self.patience {
                return answer;
            }
            *retries += 1;
            target += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Guarantee 5: `sale_changed` answers to the shoppers of the SKU under test, in a
/// round where only the other SKU was reset or reconciled, break it. A round that
/// switched the strategy, reconciled every SKU or restarted a backend (the settings
/// may be lost and republished) may refuse them legitimately.
pub fn untouched(round: &Round, crowd: &Tally) -> Option<String> {
    if round.changes_every_sku() || round.disruptions().next().is_some() {
        return None;
    }
    (crowd.sale_changed > 0).then(|| {
        format!(
            "{} order(s) of the SKU answered sale_changed, though only the other SKU was \
             reset or reconciled",
            crowd.sale_changed
        )
    })
}

/// Guarantees 1, 2, 6 and 7 on one account of the records.
fn invariants(record: &SkuRecord, initial: i64) -> Vec<String> {
    let mut problems = Vec::new();
    if record.sharing_key > 0 {
        problems.push(format!(
            "{} order(s) sharing an idempotency key with an earlier one",
            record.sharing_key
        ));
    }
    if record.over_limit > 0 {
        problems.push(format!(
            "{} unit(s) sold beyond the limit per user",
            record.over_limit
        ));
    }
    if record.initial_stock != initial {
        problems.push(format!(
            "initial stock {} instead of {initial}",
            record.initial_stock
        ));
    }
    if record.ordered_quantity > initial {
        problems.push(format!("OVERSOLD by {}", record.ordered_quantity - initial));
    }
    if record.stock != initial - record.ordered_quantity {
        problems.push(format!(
            "MySQL stock {} ≠ initial {initial} − ordered {}",
            record.stock, record.ordered_quantity
        ));
    }
    problems
}

fn show(figures: &SkuStats) -> String {
    format!(
        "initial {} ordered {} ({} orders) MySQL {} Redis {:?}",
        figures.initial_stock,
        figures.ordered_quantity,
        figures.orders,
        figures.stock_mysql,
        figures.stock_redis
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(stock: i64, ordered: i64) -> SkuRecord {
        SkuRecord {
            initial_stock: 10,
            stock,
            orders: ordered,
            ordered_quantity: ordered,
            sharing_key: 0,
            over_limit: 0,
        }
    }

    /// Records with two orders under one key, or a user beyond the limit, break the
    /// round: without guarantees 6 and 7 in `invariants` these pass.
    #[test]
    fn invariants_catch_a_key_ordered_twice_and_a_user_over_the_limit() {
        let twice = SkuRecord {
            sharing_key: 1,
            ..record(4, 6)
        };
        let found = invariants(&twice, 10);
        assert!(
            found
                .iter()
                .any(|p| p.contains("1 order(s) sharing an idempotency key")),
            "{found:?}"
        );
        let greedy = SkuRecord {
            over_limit: 2,
            ..record(4, 6)
        };
        let found = invariants(&greedy, 10);
        assert!(
            found
                .iter()
                .any(|p| p.contains("2 unit(s) sold beyond the limit")),
            "{found:?}"
        );
    }

    #[test]
    fn invariants_catch_oversell_and_lost_units() {
        assert!(invariants(&record(4, 6), 10).is_empty());
        let oversold = invariants(&record(0, 11), 10);
        assert!(
            oversold.iter().any(|p| p.contains("OVERSOLD by 1")),
            "{oversold:?}"
        );
        assert!(
            oversold.iter().any(|p| p.contains("MySQL stock 0")),
            "stock 0 ≠ 10 − 11: {oversold:?}"
        );
        let lost = invariants(&record(3, 6), 10);
        assert_eq!(lost.len(), 1, "{lost:?}");
        assert_eq!(
            invariants(&record(4, 6), 12).len(),
            2,
            "another initial stock"
        );
    }
}
