//! The crowd: one Goose attack of shoppers buying against every target.
//!
//! Each Goose user sticks to one target (users are spread evenly over them) and buys
//! one unit at a time, back to back, cycling over the SKUs. Every answer is classified
//! (order, sold out, busy, error). Once every SKU has answered "sold out", the crowd
//! keeps buying for the grace period, then Goose's killswitch ends the attack; the
//! `max_seconds` run time bounds it in any case.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use goose::config::GooseConfiguration;
use goose::goose::{GooseUser, Scenario, Transaction, TransactionResult};
use goose::prelude::{GooseAttack, GooseDefault, GooseDefaultType};
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
    started: Instant,
    next_request: AtomicU64,
    sold_out: Vec<AtomicBool>,
    all_sold_out_at: Mutex<Option<Duration>>,
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
        let sold_out = plan.skus.iter().map(|_| AtomicBool::new(false)).collect();
        Arc::new(Sale {
            plan,
            outcomes: Outcomes::default(),
            started: Instant::now(),
            next_request: AtomicU64::new(0),
            sold_out,
            all_sold_out_at: Mutex::new(None),
            selling_times: Mutex::new(new_times()),
        })
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Response times of the requests sent before the sale sold out.
    pub fn selling_times(&self) -> Times {
        self.selling_times
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// When every SKU had answered sold out, measured from the attack's start.
    pub fn sell_out_time(&self) -> Option<Duration> {
        *self
            .all_sold_out_at
            .lock()
            .unwrap_or_else(|e| e.into_inner())
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
        self.sold_out[sku].store(true, Ordering::Relaxed);
        if !self.sold_out.iter().all(|s| s.load(Ordering::Relaxed)) {
            return;
        }
        let sold_out_at = *self
            .all_sold_out_at
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(|| self.started.elapsed());
        if self.started.elapsed() >= sold_out_at + self.plan.grace {
            goose::trigger_killswitch("every SKU sold out and the grace period is over");
        }
    }

    /// One purchase by `user`: POST an order, classify the answer.
    async fn buy(&self, user: &mut GooseUser) -> TransactionResult {
        let n = self.next_request.fetch_add(1, Ordering::Relaxed);
        let sku = usize::try_from(n).unwrap_or(0) % self.plan.skus.len();
        let body = json!({
            "sku": self.plan.skus[sku],
            "user_id": format!("shopper-{}", user.weighted_users_index),
            "quantity": 1,
        });
        let selling = self.sell_out_time().is_none();
        let sent = Instant::now();
        let mut goose = user.post_json("/api/orders", &body).await?;
        if selling {
            let us = u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX);
            self.selling_times
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .saturating_record(us);
        }
        let answer = match goose.response {
            Ok(response) => {
                let status = response.status().as_u16();
                let code = response.json::<ErrorBody>().await.map(|b| b.error).ok();
                match (status, code.as_deref()) {
                    (201, _) => Answer::Order,
                    (409, Some("sold_out")) => Answer::SoldOut,
                    (503, Some("lock_timeout")) => Answer::Busy,
                    _ => Answer::Error,
                }
            }
            Err(_) => Answer::Error,
        };
        if matches!(answer, Answer::SoldOut) {
            // An expected answer in a flash sale, not a failed request.
            user.set_success(&mut goose.request)?;
        }
        self.record(sku, &answer);
        Ok(())
    }
}

/// Runs one Goose attack; the figures accumulate in `sale`.
pub async fn attack(sale: Arc<Sale>, html_report: &Path) -> anyhow::Result<()> {
    let targets = sale.plan.targets.clone();
    let pick_target: Transaction = Transaction::new(Arc::new(move |user: &mut GooseUser| {
        let target = targets[user.weighted_users_index % targets.len()].clone();
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
    let configuration = GooseConfiguration::default();
    GooseAttack::initialize_with_config(configuration)?
        .register_scenario(
            Scenario::new("shoppers")
                .register_transaction(pick_target)
                .register_transaction(buy),
        )
        .set_default(GooseDefault::Host, plan.targets[0].as_str())?
        .set_default(GooseDefault::Users, users)?
        // Every shopper arrives within the first second: a flash sale opens at once.
        .set_default(GooseDefault::HatchRate, users.to_string().as_str())?
        .set_default(GooseDefault::RunTime, usize::try_from(plan.max_seconds)?)?
        .set_default(GooseDefault::NoResetMetrics, true)?
        .set_default(GooseDefault::NoPrintMetrics, true)?
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
