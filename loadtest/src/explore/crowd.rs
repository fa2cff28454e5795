//! The crowd of one round: a bounded number of shoppers, a bounded number at once,
//! spread over the live targets, some of them hanging up a few milliseconds into their
//! order. Impatience is a fault of its own: a client that leaves must not cut the
//! order's critical section short (a COMMIT without its cache write, a lock
//! acquisition half made).
//!
//! Every shopper sends an `Idempotency-Key` of their own, and some retry: while their
//! order is unanswered (they hung up, their replica was killed, a 503, the key still
//! in progress) they send it again with the same key, as an impatient client would.
//! With a limit per user in the round, three shoppers share each user. The checker
//! then finds at most one order per key and no user over the limit in the records.
//!
//! What the shoppers were told is tallied for the summary only; the checker never
//! trusts it.

use std::sync::Mutex;
use std::time::Duration;

use futures::StreamExt;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::Serialize;
use tokio::time::Instant;

use super::cluster::{Answer, Cluster};
use super::schedule::Round;

/// A shopper who does not hang up still gives up this long after the crowd's window,
/// which bounds the round.
const LAST_WAIT: Duration = Duration::from_secs(3);
/// How many times a retrying shopper sends an unanswered order again.
const RETRIES: u32 = 3;
/// Shoppers per user when the round has a limit per user.
const SHOPPERS_PER_USER: usize = 3;

/// The answers the crowd got.
#[derive(Debug, Default, Serialize)]
pub struct Tally {
    pub sent: u64,
    /// Shoppers sent with a 1-50 ms timeout of their own (the hang-up fault).
    pub impatient: u64,
    pub created: u64,
    pub sold_out: u64,
    /// 503s: lock_timeout, sale_changed, backend_unavailable, ...
    pub busy: u64,
    /// Of those, `sale_changed`: the SKU changed while the order was under way.
    pub sale_changed: u64,
    pub lock_lost: u64,
    /// Shoppers who hung up (on purpose, or at the round's bound).
    pub hung_up: u64,
    /// Refused connections and connections broken mid-request (killed replicas).
    pub unreachable: u64,
    /// Anything else (4xx/5xx other than the above): the round still passes if the
    /// records agree, but the count is in the summary.
    pub other: u64,
    /// Orders sent again with the same key by retrying shoppers.
    pub retries: u64,
    /// Of the last answers, `limit_reached` (the round's limit per user).
    pub limit_reached: u64,
}

/// One shopper of the plan.
struct Shopper {
    index: usize,
    /// After the sale opens.
    arrives: Duration,
    quantity: i64,
    hang_up: Option<Duration>,
    /// Sends the order again, same key, while unanswered.
    retries: bool,
}

/// The plan's shoppers, derived from its crowd seed alone.
fn shoppers(round: &Round) -> Vec<Shopper> {
    let plan = &round.crowd;
    let mut rng = StdRng::seed_from_u64(plan.seed);
    // A generator of its own, so that the other traits are drawn as before retries.
    let mut retry_rng = StdRng::seed_from_u64(plan.seed ^ 0x7265_7472_7921);
    (0..plan.shoppers)
        .map(|index| Shopper {
            retries: retry_rng.random_bool(plan.retry_share.clamp(0.0, 1.0)),
            index,
            arrives: Duration::from_millis(rng.random_range(0..=plan.arrival_ms)),
            quantity: if rng.random_bool(plan.two_units_share) {
                2
            } else {
                1
            },
            hang_up: rng
                .random_bool(plan.hang_up_share)
                .then(|| Duration::from_millis(rng.random_range(1..=50))),
        })
        .collect()
}

/// Sends the round's crowd and waits until every shopper has an answer or gave up.
pub async fn buy(cluster: &Cluster, round: &Round, sku: &str) -> Tally {
    let started = Instant::now();
    let window = Duration::from_millis(round.crowd.window_ms);
    let tally = Mutex::new(Tally::default());
    // In order of arrival: at most `concurrency` shoppers are in the shop at once, the
    // others queue at the door.
    let mut queue = shoppers(round);
    queue.sort_by_key(|s| s.arrives);
    futures::stream::iter(queue)
        .map(|shopper| {
            let tally = &tally;
            async move {
                tokio::time::sleep_until(started + shopper.arrives).await;
                if started.elapsed() >= window {
                    return; // the round's bound: this shopper never came
                }
                let deadline = started + window + LAST_WAIT;
                let patience = deadline.saturating_duration_since(Instant::now());
                let give_up = shopper.hang_up.map_or(patience, |h| h.min(patience));
                let user = match round.crowd.limit_per_user {
                    Some(_) => format!("shopper-{}", shopper.index / SHOPPERS_PER_USER),
                    None => format!("shopper-{}", shopper.index),
                };
                // Unique to the SKU (and so to the run and round): keys are global.
                let key = format!("{sku}-s{}", shopper.index);
                let mut target = shopper.index;
                let order = |target: usize, give_up: Duration| {
                    cluster.order(target, sku, &user, shopper.quantity, Some(&key), give_up)
                };
                let mut answer = order(target, give_up).await;
                if answer == Answer::Unreachable {
                    // As a load balancer would: the next replica.
                    target += 1;
                    answer = order(target, give_up).await;
                }
                let mut retries = if shopper.retries { RETRIES } else { 0 };
                while retries > 0 && answer.unanswered() && Instant::now() < deadline {
                    retries -= 1;
                    tally
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .retried(&answer);
                    if matches!(answer, Answer::Unreachable | Answer::Broken(_)) {
                        target += 1;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    // Patient this time: the retry waits for its answer.
                    let patience = deadline.saturating_duration_since(Instant::now());
                    answer = order(target, patience).await;
                }
                tally
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .add(&answer, shopper.hang_up.is_some());
            }
        })
        .buffer_unordered(round.crowd.concurrency.max(1))
        .collect::<()>()
        .await;
    tally.into_inner().unwrap_or_else(|e| e.into_inner())
}

impl Tally {
    /// An answer a retrying shopper did not take: counted for guarantee 5 (a
    /// `sale_changed` to a shopper of this SKU) before the order is sent again.
    fn retried(&mut self, answer: &Answer) {
        self.retries += 1;
        if matches!(answer, Answer::Busy(code) if code == "sale_changed") {
            self.sale_changed += 1;
        }
    }

    fn add(&mut self, answer: &Answer, impatient: bool) {
        self.sent += 1;
        self.impatient += u64::from(impatient);
        if matches!(answer, Answer::Busy(code) if code == "sale_changed") {
            self.sale_changed += 1;
        }
        if matches!(answer, Answer::Refused(409, code) if code == "limit_reached") {
            self.limit_reached += 1;
        }
        let count = match answer {
            Answer::Created => &mut self.created,
            Answer::SoldOut => &mut self.sold_out,
            Answer::Busy(_) => &mut self.busy,
            Answer::LockLost => &mut self.lock_lost,
            Answer::HungUp => &mut self.hung_up,
            Answer::Unreachable | Answer::Broken(_) => &mut self.unreachable,
            Answer::Refused(..) => &mut self.other,
        };
        *count += 1;
    }
}
