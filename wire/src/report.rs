//! The load-test report (`docs/report.md`): written by the `loadtest` crate, kept by the
//! service under `/api/runs` for the dashboard's history. One definition for both, so
//! they cannot drift apart.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LoadReport {
    pub generated_at: DateTime<Utc>,
    pub config: LoadConfig,
    /// One per strategy run; `POST /api/runs` takes 1 to 64.
    #[schema(min_items = 1, max_items = 64)]
    pub runs: Vec<RunResult>,
}

/// How the load test was run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LoadConfig {
    pub targets: Vec<String>,
    pub users: u64,
    /// Initial stock of each SKU.
    pub stock: i64,
    pub skus: u64,
    /// Upper bound of one strategy's run.
    pub max_seconds: u64,
    /// How long the crowd keeps buying after the last SKU sold out.
    pub grace_ms: u64,
    pub strategies: Vec<String>,
    /// A fault injected during the runs, if any.
    #[serde(default)]
    pub fault: Option<String>,
    /// Whether fencing tokens were checked during the runs.
    #[serde(default)]
    pub fencing: bool,
    /// Whether the lock strategies ran under the cohort layer (a replica's requests
    /// for a SKU queue locally and the lock is handed on within the replica); `None`
    /// in reports of services older than the switch.
    #[serde(default)]
    pub cohort: Option<bool>,
    /// How many queued orders a lock holder sold in one critical section (the cohort
    /// layer's combining, `--combine`; 1: none); `None` in reports older than it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub combine: Option<u16>,
    /// How often each strategy was run (`--repeat`); its runs are interleaved.
    #[serde(default = "one")]
    pub repeat: u32,
    /// Open model: orders arriving per second, whatever the answers (`--rate`); `None`
    /// for the closed loop of `users` shoppers buying back to back.
    #[serde(default)]
    pub rate: Option<f64>,
    /// How many processes shared the crowd (`loadtest --part K/N`, then `loadtest
    /// merge`); 1, and left out, for a single process.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub parts: u32,
    /// Whether the shoppers sent an `Idempotency-Key` with their orders
    /// (`--no-idempotency-key`: not); false in reports older than the keys.
    #[serde(default)]
    pub idempotency_keys: bool,
    /// The share of shoppers who send an unanswered order again (`--retry-share`).
    #[serde(default)]
    pub retry_share: f64,
    /// The share of shoppers who send each order twice at once
    /// (`--double-click-share`).
    #[serde(default)]
    pub double_click_share: f64,
    /// Each sale's limit per user (`--limit-per-user`); `None`: no limit.
    #[serde(default)]
    pub limit_per_user: Option<i64>,
    /// What produced the figures; `None` in reports older than this field.
    #[serde(default)]
    pub provenance: Option<Provenance>,
}

/// What produced a report's figures, so two reports can be told apart: the service's
/// build and timing settings, and the machine the load test ran on (in the lab, the
/// replicas' too).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Provenance {
    /// The commit the answering replica was built from ("unknown" outside git).
    pub commit: Option<String>,
    pub lock_lease_ms: u64,
    pub lock_wait_ms: u64,
    pub work_ms: u64,
    /// Replicas alive when the runs began.
    pub replicas: u64,
    /// Cores the load test's machine offers it (part 1's, for a split crowd).
    pub cores: u64,
    pub memory_mib: Option<u64>,
    pub cpu: Option<String>,
}

fn one() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

/// One strategy's run: client-side counts and latency, then the stock figures from
/// the service's own records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RunResult {
    pub strategy: String,
    /// Which of the strategy's repeated runs this is, from 1.
    #[serde(default = "one")]
    pub repeat: u32,
    pub requests: u64,
    /// Orders recorded in MySQL for the run's SKUs.
    pub orders: u64,
    /// 201 answers the crowd received (equal to `orders` unless answers were lost).
    pub orders_acknowledged: u64,
    pub sold_out: u64,
    /// Refusals under contention: 503 lock_timeout and too_many_conflicts answers.
    pub busy: u64,
    /// Everything that is neither an order, a sold-out nor busy.
    pub errors: u64,
    pub duration_s: f64,
    /// Seconds from the first request until every SKU answered sold out.
    pub sell_out_s: Option<f64>,
    pub rps: f64,
    /// Orders per second while there was stock to sell.
    pub orders_per_s: f64,
    pub latency_ms: Latency,
    pub initial_stock: i64,
    pub oversold: i64,
    /// `None` when Redis held no stock for some SKU.
    pub stock_redis: Option<i64>,
    pub stock_mysql: i64,
    pub consistent: bool,
    /// Orders that repeat an earlier one, from the records (`GET /api/stats`): with
    /// one user per intent, `repeat_orders` are the duplicates a double click or a
    /// retry made; all zero in reports older than the count.
    #[serde(default)]
    pub duplicates: crate::stats::Duplicates,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    /// The 99.9th percentile: at 80 % of capacity the tail that p99 does not yet show
    /// (`scripts/bench.sh latency`); `None` in reports older than the field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p999: Option<f64>,
    pub max: f64,
}
