//! The crowd, in one of two shapes:
//!
//! - closed loop (`attack`): a Goose attack of shoppers, each sticking to one target
//!   (users are spread evenly over them) and buying one unit at a time, back to back;
//! - open model (`arrive`): orders arrive at a fixed rate whatever the earlier ones
//!   are doing, each timed from the moment it was due, so a slow service cannot slow
//!   the arrivals down and hide its own latency (coordinated omission).
//!
//! Either way the crowd gathers first and nobody buys before the doors open: the
//! figures measure the sale, not the crowd arriving. Orders cycle over the SKUs; every
//! answer is classified (order, sold out, busy, error). Once every SKU has answered
//! "sold out", the crowd keeps buying for the grace period, then stops; `max_seconds`
//! after the doors opened bounds it in any case.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use goose::config::GooseConfiguration;
use goose::goose::{GooseUser, Scenario, Transaction, TransactionResult};
use goose::prelude::{GooseAttack, GooseDefault, GooseDefaultType};
use gumdrop::Options as _;
use serde::Deserialize;
use serde_json::json;
use tokio::time::Instant;

use crate::report::{Times, new_times};

/// What one attack is told.
pub struct CrowdPlan {
    pub targets: Vec<String>,
    pub skus: Vec<String>,
    pub users: u64,
    pub max_seconds: u64,
    pub grace: Duration,
    /// How long the crowd has to gather before the doors open.
    pub gather: Duration,
    /// Goose's own command-line options, passed through (`--goose`).
    pub goose_options: Vec<String>,
    /// Which share of a crowd split over processes this is (`--part`); the whole crowd
    /// otherwise.
    pub share: Share,
}

/// One process's share of the crowd: shoppers `first_user..` of the whole crowd (their
/// names and replicas are the ones they have in a single process), and every
/// `stride`-th arrival of the open model from `phase` on, so the shares together
/// send exactly what one process would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    pub first_user: u64,
    pub stride: u64,
    pub phase: u64,
}

impl Share {
    pub const WHOLE: Share = Share {
        first_user: 0,
        stride: 1,
        phase: 0,
    };
}

/// The answers counted during one attack.
#[derive(Default)]
pub struct Outcomes {
    pub orders: AtomicU64,
    pub sold_out: AtomicU64,
    pub busy: AtomicU64,
    pub errors: AtomicU64,
}

impl Outcomes {
    pub fn requests(&self) -> u64 {
        [&self.orders, &self.sold_out, &self.busy, &self.errors]
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }
}

/// Shared by every user of one attack.
pub struct Sale {
    plan: CrowdPlan,
    pub outcomes: Outcomes,
    /// When the first order may be sent; every time in the figures counts from here.
    doors_open: Instant,
    next_request: AtomicU64,
    /// When each SKU first answered sold out, from the doors opening.
    sold_out_at: Mutex<Vec<Option<Duration>>>,
    /// Response times of the requests sent while stock remained, timed here (Goose
    /// keeps whole milliseconds). Once sold out, answers are cheap refusals that would
    /// only dilute the figures.
    selling_times: Mutex<Times>,
}

#[derive(Deserialize)]
struct ErrorBody {
    error: String,
}

enum Answer {
    Order,
    SoldOut,
    Busy,
    Error,
}

impl Sale {
    pub fn new(plan: CrowdPlan) -> Arc<Sale> {
        let sold_out = plan.skus.iter().map(|_| None).collect();
        let gather = plan.gather;
        Arc::new(Sale {
            plan,
            outcomes: Outcomes::default(),
            doors_open: Instant::now() + gather,
            next_request: AtomicU64::new(0),
            sold_out_at: Mutex::new(sold_out),
            selling_times: Mutex::new(new_times()),
        })
    }

    /// Time since the doors opened (zero before).
    pub fn elapsed(&self) -> Duration {
        Instant::now().saturating_duration_since(self.doors_open)
    }

    /// Sold out everywhere and the grace period over.
    fn finished(&self) -> bool {
        self.sell_out_time()
            .is_some_and(|at| self.elapsed() >= at + self.plan.grace)
    }

    /// Response times of the requests sent before the sale sold out.
    pub fn selling_times(&self) -> Times {
        self.selling_times
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// When every SKU had answered sold out (the last of them to), from the doors
    /// opening.
    pub fn sell_out_time(&self) -> Option<Duration> {
        let sold_out = self.sold_out_at.lock().unwrap_or_else(|e| e.into_inner());
        sold_out
            .iter()
            .copied()
            .collect::<Option<Vec<Duration>>>()?
            .into_iter()
            .max()
    }

    fn record(&self, sku: usize, answer: &Answer) {
        let counter = match answer {
            Answer::Order => &self.outcomes.orders,
            Answer::SoldOut => &self.outcomes.sold_out,
            Answer::Busy => &self.outcomes.busy,
            Answer::Error => &self.outcomes.errors,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if !matches!(answer, Answer::SoldOut) {
            return;
        }
        let now = self.elapsed();
        self.sold_out_at.lock().unwrap_or_else(|e| e.into_inner())[sku].get_or_insert(now);
    }

    /// When each SKU first answered sold out, from the doors opening (`None`: never).
    pub fn sold_out_times(&self) -> Vec<Option<Duration>> {
        self.sold_out_at
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The next order's SKU (round robin) and body.
    fn next_order(&self, shopper: &str) -> (usize, serde_json::Value) {
        let n = self.next_request.fetch_add(1, Ordering::Relaxed);
        let sku = usize::try_from(n).unwrap_or(0) % self.plan.skus.len();
        let body = json!({
            "sku": self.plan.skus[sku],
            "user_id": shopper,
            "quantity": 1,
        });
        (sku, body)
    }

    /// Times the requests sent while stock remained. Once sold out, answers are cheap
    /// refusals that would only dilute the figures.
    fn record_time(&self, since: Instant, selling: bool) {
        if selling {
            let us = u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX);
            self.selling_times
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .saturating_record(us);
        }
    }

    /// One purchase by a Goose `user`: POST an order, classify the answer.
    async fn buy(&self, user: &mut GooseUser) -> TransactionResult {
        tokio::time::sleep_until(self.doors_open).await;
        let shopper = self.plan.share.first_user + user.weighted_users_index as u64;
        let (sku, body) = self.next_order(&format!("shopper-{shopper}"));
        let selling = self.sell_out_time().is_none();
        let sent = Instant::now();
        let mut goose = user.post_json("/api/orders", &body).await?;
        self.record_time(sent, selling);
        let answer = match goose.response {
            Ok(response) => {
                let status = response.status().as_u16();
                let code = response.json::<ErrorBody>().await.map(|b| b.error).ok();
                classify(status, code.as_deref())
            }
            Err(_) => Answer::Error,
        };
        if matches!(answer, Answer::SoldOut) {
            // An expected answer in a flash sale, not a failed request.
            user.set_success(&mut goose.request)?;
        }
        self.record(sku, &answer);
        if self.finished() {
            goose::trigger_killswitch("every SKU sold out and the grace period is over");
        }
        Ok(())
    }

    /// One order of the open model, due at `due`: timed from then, not from when it
    /// could be sent.
    async fn arrive_once(&self, client: &reqwest::Client, target: &str, due: Instant, n: u64) {
        let (sku, body) = self.next_order(&format!("arrival-{n}"));
        let selling = self.sell_out_time().is_none();
        let sent = client
            .post(format!("{target}/api/orders"))
            .json(&body)
            .send()
            .await;
        let answer = match sent {
            Ok(response) => {
                let status = response.status().as_u16();
                let code = response.json::<ErrorBody>().await.map(|b| b.error).ok();
                classify(status, code.as_deref())
            }
            Err(_) => Answer::Error,
        };
        self.record_time(due, selling);
        self.record(sku, &answer);
    }
}

/// Busy is the strategy refusing under contention, as designed (a lock not free in
/// time, optimistic retries run out): the shopper may try again. Anything else that is
/// not an order or a sold-out is an error.
fn classify(status: u16, code: Option<&str>) -> Answer {
    match (status, code) {
        (201, _) => Answer::Order,
        (409, Some("sold_out")) => Answer::SoldOut,
        (503, Some("lock_timeout" | "too_many_conflicts")) => Answer::Busy,
        _ => Answer::Error,
    }
}

/// Orders in flight at once in the open model; an arrival beyond is counted as an
/// error (the service is that far behind) rather than queued, which would delay the
/// arrivals after it.
const MAX_ARRIVALS_IN_FLIGHT: usize = 4096;

/// The open model: `rate` orders per second from the doors opening, round robin over
/// the targets, until sold out plus grace or `max_seconds`. A share sends only its
/// arrivals (every `stride`-th from `phase`), at the times they have in the whole.
pub async fn arrive(sale: Arc<Sale>, rate: f64) -> anyhow::Result<()> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(15))
        .build()?;
    let interval = Duration::from_secs_f64(1.0 / rate);
    let closing = sale.doors_open + Duration::from_secs(sale.plan.max_seconds);
    let in_flight = Arc::new(tokio::sync::Semaphore::new(MAX_ARRIVALS_IN_FLIGHT));
    let mut orders = tokio::task::JoinSet::new();
    let Share { stride, phase, .. } = sale.plan.share;
    for n in (phase..).step_by(usize::try_from(stride)?) {
        let due = sale.doors_open + interval.mul_f64(n as f64);
        if due >= closing || sale.finished() {
            break;
        }
        tokio::time::sleep_until(due).await;
        let Ok(place) = in_flight.clone().try_acquire_owned() else {
            sale.outcomes.errors.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let targets = &sale.plan.targets;
        let target = targets[usize::try_from(n).unwrap_or(0) % targets.len()].clone();
        let (sale, client) = (sale.clone(), client.clone());
        orders.spawn(async move {
            let _place = place;
            sale.arrive_once(&client, &target, due, n).await;
        });
        // Reap finished orders as we go, so the set stays small.
        while orders.try_join_next().is_some() {}
    }
    while orders.join_next().await.is_some() {}
    Ok(())
}

/// Runs one Goose attack; the figures accumulate in `sale`.
pub async fn attack(sale: Arc<Sale>, html_report: &Path) -> anyhow::Result<()> {
    let targets = sale.plan.targets.clone();
    let first_user = sale.plan.share.first_user;
    let pick_target: Transaction = Transaction::new(Arc::new(move |user: &mut GooseUser| {
        let shopper = usize::try_from(first_user).unwrap_or(0) + user.weighted_users_index;
        let target = targets[shopper % targets.len()].clone();
        Box::pin(async move {
            user.set_base_url(&target)?;
            Ok(())
        })
    }))
    .set_name("pick a replica")
    .set_on_start();
    let buyer = sale.clone();
    let buy: Transaction = Transaction::new(Arc::new(move |user: &mut GooseUser| {
        let sale = buyer.clone();
        Box::pin(async move { sale.buy(user).await })
    }))
    .set_name("buy");

    let plan = &sale.plan;
    let users = usize::try_from(plan.users)?;
    let configuration = GooseConfiguration::parse_args_default(&plan.goose_options)
        .map_err(|error| anyhow::anyhow!("--goose options: {error}"))?;
    GooseAttack::initialize_with_config(configuration)?
        .register_scenario(
            Scenario::new("shoppers")
                .register_transaction(pick_target)
                .register_transaction(buy),
        )
        .set_default(GooseDefault::Host, plan.targets[0].as_str())?
        .set_default(GooseDefault::Users, users)?
        // Every shopper arrives within the first second, then waits for the doors.
        .set_default(GooseDefault::HatchRate, users.to_string().as_str())?
        .set_default(
            GooseDefault::RunTime,
            usize::try_from(plan.max_seconds + plan.gather.as_secs().saturating_add(1))?,
        )?
        .set_default(GooseDefault::NoResetMetrics, true)?
        // Goose writes its HTML report only when it also prints its summary (0.18.1
        // skips both under NoPrintMetrics), so the summary is printed, trimmed to the
        // one request's table: the scenario and its transactions repeat it.
        .set_default(GooseDefault::NoScenarioMetrics, true)?
        .set_default(GooseDefault::NoTransactionMetrics, true)?
        .set_default(GooseDefault::NoErrorSummary, true)?
        .set_default(GooseDefault::NoTelnet, true)?
        .set_default(GooseDefault::NoWebSocket, true)?
        .set_default(GooseDefault::Quiet, 1)?
        .set_default(GooseDefault::Timeout, "15")?
        .set_default(
            GooseDefault::ReportFile,
            html_report.to_string_lossy().as_ref(),
        )?
        .execute()
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contention_refusals_are_busy_and_the_rest_errors() {
        assert!(matches!(classify(201, None), Answer::Order));
        assert!(matches!(classify(409, Some("sold_out")), Answer::SoldOut));
        assert!(matches!(classify(503, Some("lock_timeout")), Answer::Busy));
        assert!(matches!(
            classify(503, Some("too_many_conflicts")),
            Answer::Busy
        ));
        assert!(matches!(
            classify(503, Some("backend_unavailable")),
            Answer::Error
        ));
        assert!(matches!(classify(409, Some("lock_lost")), Answer::Error));
        assert!(matches!(classify(500, None), Answer::Error));
    }
}
