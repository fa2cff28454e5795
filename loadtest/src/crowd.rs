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
//!
//! Each order a shopper means to place (an intent) is sent under its own user name,
//! `shopper-S-N` (`arrival-N` in the open model), and, unless `--no-idempotency-key`,
//! its own `Idempotency-Key`. Some shoppers are impatient (`--retry-share`: they send
//! the same order again, same key, after a 503, a dropped connection or their own
//! timeout) or double-click (`--double-click-share`: the same order twice at once).
//! Since every user means one order, any user with two orders in the records is a
//! duplicate: the report counts them from MySQL, not from the answers.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use goose::config::GooseConfiguration;
use goose::goose::{
    GooseMethod, GooseRequest, GooseUser, Scenario, Transaction, TransactionResult,
};
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
    /// How the shoppers behave around one order.
    pub habits: Habits,
}

/// How the shoppers behave around one order (`docs/loadtest.md`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Habits {
    /// Send an `Idempotency-Key` with each intent (`--no-idempotency-key`: none).
    pub keys: bool,
    /// The share of shoppers who send the same order again when no answer came.
    pub retry_share: f64,
    /// The share of shoppers who send each order twice at once.
    pub double_click_share: f64,
    /// How many times a retrying shopper sends an order again, at most.
    pub retries: u32,
    /// How long a retrying shopper waits for an answer before sending again.
    pub patience: Duration,
}

impl Habits {
    /// Shoppers who send one order once, with a key: the load test's default.
    pub const PLAIN: Habits = Habits {
        keys: true,
        retry_share: 0.0,
        double_click_share: 0.0,
        retries: 3,
        patience: Duration::from_secs(2),
    };

    /// Whether shopper (or arrival) `n` retries, and whether they double-click. Each
    /// trait is drawn from its own hash of `n`, so the two shares are independent
    /// and every process of a split crowd draws the same shoppers.
    pub fn of(&self, n: u64) -> (bool, bool) {
        (
            unit_fraction(n, 0x7265_7472_7921) < self.retry_share,
            unit_fraction(n, 0x636c_6963_6b21) < self.double_click_share,
        )
    }
}

/// A fraction in [0, 1) drawn from `n` and `salt` (splitmix64's finaliser).
fn unit_fraction(n: u64, salt: u64) -> f64 {
    let mut z = n.wrapping_add(salt).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
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
    /// Begins every idempotency key of this crowd: keys are kept by the service for
    /// 24 h across sales, so a counter alone would replay the last run's orders.
    key_prefix: String,
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

/// What one request got back: a status and error code, or nothing (the connection
/// dropped, or the shopper's own timeout fired).
#[derive(Debug, Clone, PartialEq)]
struct Reply {
    status: Option<u16>,
    code: Option<String>,
}

impl Reply {
    async fn of(response: Result<reqwest::Response, reqwest::Error>) -> Reply {
        match response {
            Ok(response) => {
                let status = Some(response.status().as_u16());
                let code = response.json::<ErrorBody>().await.map(|b| b.error).ok();
                Reply { status, code }
            }
            Err(_) => Reply {
                status: None,
                code: None,
            },
        }
    }

    fn answer(&self) -> Answer {
        match self.status {
            Some(status) => classify(status, self.code.as_deref()),
            None => Answer::Error,
        }
    }

    /// No answer to the order yet: a retrying shopper sends it again. A 503 (the
    /// service gave up, or is unavailable), no answer at all, or the first of the
    /// same key's orders still running (409 `in_progress`).
    fn unanswered(&self) -> bool {
        matches!(
            (self.status, self.code.as_deref()),
            (None, _) | (Some(503), _) | (Some(409), Some("in_progress"))
        )
    }
}

/// One order a shopper means to place: its SKU, body and key.
struct Intent {
    sku: usize,
    body: serde_json::Value,
    key: Option<String>,
}

impl Intent {
    /// The order's request, from a builder of `POST /api/orders`.
    fn request(
        &self,
        builder: reqwest::RequestBuilder,
        patience: Option<Duration>,
    ) -> reqwest::RequestBuilder {
        let mut builder = builder.json(&self.body);
        if let Some(key) = &self.key {
            builder = builder.header("Idempotency-Key", key);
        }
        match patience {
            Some(patience) => builder.timeout(patience),
            None => builder,
        }
    }
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
            key_prefix: format!("lt-{:016x}", rand::random::<u64>()),
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

    /// The next intent: its SKU (round robin), its user (`who` and the intent's
    /// number, one user per intent) and its key (the same number after this crowd's
    /// random prefix).
    fn next_intent(&self, who: &str) -> Intent {
        let n = self.next_request.fetch_add(1, Ordering::Relaxed);
        let sku = usize::try_from(n).unwrap_or(0) % self.plan.skus.len();
        let user = format!("{who}-{n}");
        let body = json!({
            "sku": self.plan.skus[sku],
            "user_id": user,
            "quantity": 1,
        });
        let key = self
            .plan
            .habits
            .keys
            .then(|| format!("{}-{user}", self.key_prefix));
        Intent { sku, body, key }
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

    /// One purchase by a Goose `user`: POST an order (twice at once for a
    /// double-clicker, again while unanswered for a retrier), classify the answers.
    async fn buy(&self, user: &mut GooseUser) -> TransactionResult {
        tokio::time::sleep_until(self.doors_open).await;
        let shopper = self.plan.share.first_user + user.weighted_users_index as u64;
        let intent = self.next_intent(&format!("shopper-{shopper}"));
        let (retrier, double_clicker) = self.plan.habits.of(shopper);
        let patience = retrier.then_some(self.plan.habits.patience);
        let selling = self.sell_out_time().is_none();
        let sent = Instant::now();
        let mut attempts = 0;
        loop {
            // The second click goes around Goose (which sends one request of a user at
            // a time), on the same client and connection pool.
            let second = if double_clicker {
                let builder = user.get_request_builder(&GooseMethod::Post, "/api/orders")?;
                Some(intent.request(builder, patience).send())
            } else {
                None
            };
            let builder = user.get_request_builder(&GooseMethod::Post, "/api/orders")?;
            let request = GooseRequest::builder()
                .method(GooseMethod::Post)
                .path("/api/orders")
                .set_request_builder(intent.request(builder, patience))
                .build();
            let (mut goose, second) = match second {
                Some(second) => {
                    let (first, second) = tokio::join!(user.request(request), second);
                    (first?, Some(Reply::of(second).await))
                }
                None => (user.request(request).await?, None),
            };
            let first = Reply::of(goose.response).await;
            if matches!(first.answer(), Answer::SoldOut) {
                // An expected answer in a flash sale, not a failed request.
                user.set_success(&mut goose.request)?;
            }
            let replies: Vec<Reply> = [Some(first), second].into_iter().flatten().collect();
            for reply in &replies {
                self.record(intent.sku, &reply.answer());
            }
            attempts += 1;
            if !retrier
                || attempts > self.plan.habits.retries
                || !replies.iter().all(Reply::unanswered)
                || self.finished()
            {
                break;
            }
            // A short pause, longer each time, before sending the same order again.
            tokio::time::sleep(Duration::from_millis(50 * u64::from(attempts))).await;
        }
        self.record_time(sent, selling);
        if self.finished() {
            goose::trigger_killswitch("every SKU sold out and the grace period is over");
        }
        Ok(())
    }

    /// One order of the open model, due at `due`: timed from then, not from when it
    /// could be sent. Arrival `n` double-clicks or retries as shopper `n` would.
    async fn arrive_once(&self, client: &reqwest::Client, target: &str, due: Instant, n: u64) {
        let intent = self.next_intent(&format!("arrival-{n}"));
        let (retrier, double_clicker) = self.plan.habits.of(n);
        let patience = retrier.then_some(self.plan.habits.patience);
        let selling = self.sell_out_time().is_none();
        let url = format!("{target}/api/orders");
        let mut attempts = 0;
        loop {
            let send = || intent.request(client.post(&url), patience).send();
            let replies = if double_clicker {
                let (a, b) = tokio::join!(send(), send());
                vec![Reply::of(a).await, Reply::of(b).await]
            } else {
                vec![Reply::of(send().await).await]
            };
            for reply in &replies {
                self.record(intent.sku, &reply.answer());
            }
            attempts += 1;
            if !retrier
                || attempts > self.plan.habits.retries
                || !replies.iter().all(Reply::unanswered)
                || self.finished()
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50 * u64::from(attempts))).await;
        }
        self.record_time(due, selling);
    }
}

/// Busy is the service refusing as designed: a strategy under contention (a lock not
/// free in time, optimistic retries run out), the same key's first order still
/// running (`in_progress`), or the sale's limit per user reached: the shopper may try
/// again or take it as an answer. Anything else that is not an order or a sold-out is
/// an error.
fn classify(status: u16, code: Option<&str>) -> Answer {
    match (status, code) {
        (201, _) => Answer::Order,
        (409, Some("sold_out")) => Answer::SoldOut,
        (503, Some("lock_timeout" | "too_many_conflicts")) => Answer::Busy,
        (409, Some("in_progress" | "limit_reached")) => Answer::Busy,
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
        assert!(matches!(classify(409, Some("in_progress")), Answer::Busy));
        assert!(matches!(classify(409, Some("limit_reached")), Answer::Busy));
    }

    #[test]
    fn only_a_missing_answer_is_sent_again() {
        let reply = |status: Option<u16>, code: Option<&str>| Reply {
            status,
            code: code.map(str::to_owned),
        };
        assert!(reply(None, None).unanswered());
        assert!(reply(Some(503), Some("timeout")).unanswered());
        assert!(reply(Some(409), Some("in_progress")).unanswered());
        assert!(!reply(Some(201), None).unanswered());
        assert!(!reply(Some(409), Some("sold_out")).unanswered());
        assert!(!reply(Some(422), Some("idempotency_key_reused")).unanswered());
    }

    #[test]
    fn a_share_of_shoppers_has_each_habit_independently() {
        let habits = Habits {
            retry_share: 0.2,
            double_click_share: 0.5,
            ..Habits::PLAIN
        };
        let drawn: Vec<(bool, bool)> = (0..10_000).map(|n| habits.of(n)).collect();
        let retriers = drawn.iter().filter(|d| d.0).count();
        let clickers = drawn.iter().filter(|d| d.1).count();
        let both = drawn.iter().filter(|d| d.0 && d.1).count();
        assert!((1800..2200).contains(&retriers), "{retriers}");
        assert!((4700..5300).contains(&clickers), "{clickers}");
        assert!((800..1200).contains(&both), "independent: {both}");
        assert_eq!(Habits::PLAIN.of(7), (false, false));
    }
}
