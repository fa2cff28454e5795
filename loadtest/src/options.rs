//! The load test's command line: `loadtest [OPTIONS]` runs the load test (as it always
//! has, so scripts and the dashboard need no change; `--part K/N` plays one share of a
//! crowd split over machines), `loadtest merge` adds the shares up, `loadtest explore`
//! runs the fault explorer.

use std::path::PathBuf;

use chrono::{DateTime, Utc};
use clap::{Parser, Subcommand};

use crate::explore::ExploreOptions;
use crate::merge::MergeOptions;
use crate::split::Part;

#[derive(Parser)]
#[command(
    name = "loadtest",
    about = "A crowd of shoppers against every flashsale replica, one strategy after another",
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub load: Options,
}

#[derive(Subcommand)]
pub enum Command {
    /// Seeded fault explorer: short sales under random faults, checked from the records.
    Explore(ExploreOptions),
    /// One report from the partial reports of a crowd split with `--part K/N`.
    Merge(MergeOptions),
}

#[derive(Clone, Parser)]
#[command(
    name = "loadtest",
    about = "A crowd of shoppers against every flashsale replica, one strategy after another"
)]
pub struct Options {
    /// Replicas to spread the crowd over (comma-separated base URLs).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "http://127.0.0.1:8081,http://127.0.0.1:8082,http://127.0.0.1:8083"
    )]
    pub targets: Vec<String>,

    /// `all`, or a comma-separated list of strategy names.
    #[arg(long, default_value = "all")]
    pub strategies: String,

    /// Shoppers buying at once, spread evenly over the targets.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=5000))]
    pub users: u64,

    /// Initial stock of each SKU.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    pub stock: i64,

    /// Initial stock of each SKU for one strategy instead of --stock, repeatable
    /// (`redis-atomic=20000`): a strategy that sells 1000 units in a tenth of a second
    /// needs a larger sale for its rate to be measured rather than its first instants.
    #[arg(long, value_name = "STRATEGY=UNITS", value_parser = parse_stock_for)]
    pub stock_for: Vec<(String, i64)>,

    /// SKUs on sale at once (1 = one hot item; more spreads the lock contention).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub skus: u64,

    /// Upper bound of each strategy's run, in seconds.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub max_seconds: u64,

    /// How long the crowd keeps buying after everything sold out, in milliseconds.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub grace_ms: u64,

    /// Where report.json, report.md and Goose's HTML reports go.
    #[arg(long, default_value = "target/flashsale")]
    pub out: PathBuf,

    /// Token for the service's admin calls (switching, restocking, saving the report).
    #[arg(long, env = "FLASHSALE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,

    /// Do not POST the report to the service's run history.
    #[arg(long)]
    pub no_history: bool,

    /// Exit 1 when a run's p99 latency is above this many ms: `300` for every
    /// strategy, `redis-lock=300,etcd=500` per strategy, or both (`500,etcd=900`).
    #[arg(long, value_parser = crate::slo::parse_objective)]
    pub max_p99_ms: Option<crate::slo::Objective>,

    /// Exit 1 when a run sells fewer orders per second than this (the same forms as
    /// `--max-p99-ms`).
    #[arg(long, value_parser = crate::slo::parse_objective)]
    pub min_orders_per_s: Option<crate::slo::Objective>,

    /// Inject a fault into each run: `pause-holder` makes one lock holder per run stall
    /// past its lease after its last check (Kleppmann's scenario); `failover` (redis-lock
    /// runs only, the service's Redis behind Sentinel) fails the Redis over while a
    /// holder of the first SKU holds a lock the replica never received.
    #[arg(long, value_enum)]
    pub fault: Option<Fault>,

    /// Switch fencing tokens on or off for the runs (default: leave as it is).
    #[arg(long, value_enum)]
    pub fencing: Option<Switch>,

    /// Switch the cohort layer on or off for the runs (default: leave as it is). On, a
    /// replica's requests for a SKU queue locally and the lock is handed on within the
    /// replica; off, every order takes the lock from the lock service.
    #[arg(long, value_enum)]
    pub cohort: Option<Switch>,

    /// Switch the cohort layer on with combining: a lock holder sells up to N orders
    /// queued for its SKU in its replica in one critical section (1: the layer on,
    /// without combining). Cannot go with `--cohort off` above 1.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub combine: Option<u16>,

    /// Run every strategy this many times (interleaved: all strategies, then all
    /// again); the table shows each figure's median and min-max.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub repeat: u32,

    /// Open model: this many orders arrive per second, spread over the targets, each
    /// sent on time whatever the earlier ones are doing, and timed from when it was due
    /// (no coordinated omission). Without it, `--users` shoppers buy back to back.
    #[arg(long, value_parser = parse_rate)]
    pub rate: Option<f64>,

    /// One of Goose's own options for the closed-loop crowd, repeatable, e.g.
    /// `--goose=--request-log=requests.csv` or `--goose=--throttle-requests=200`.
    /// Ours (users, run time, report file...) are defaults Goose's take precedence over.
    #[arg(
        long = "goose",
        value_name = "GOOSE_OPTION",
        allow_hyphen_values = true
    )]
    pub goose_options: Vec<String>,

    /// Play share K of a crowd split over N processes or machines (`2/4`): its shoppers
    /// (or its arrivals with --rate), on the schedule every part derives from
    /// --doors-open. Part 1 also switches and restocks the cluster and reads its
    /// records. Every part writes part-K-of-N.json to --out and prints it on stdout;
    /// `loadtest merge` makes the report. Give every part the same other options.
    #[arg(long, value_name = "K/N")]
    pub part: Option<Part>,

    /// With --part: when the first strategy's doors open, the same for every part
    /// (RFC 3339, e.g. 2030-01-01T12:00:00Z, or Unix time in milliseconds). Strategy i
    /// (from 0) opens at this moment + i × (max-seconds + 6 s). Clocks must agree.
    #[arg(long, env = "FLASHSALE_DOORS_OPEN", value_parser = crate::split::parse_doors_open)]
    pub doors_open: Option<DateTime<Utc>>,

    /// Send no `Idempotency-Key` with the orders: the lesson's "before", where a
    /// double click or a retry buys twice.
    #[arg(long)]
    pub no_idempotency_key: bool,

    /// This share of shoppers (0 to 1), when an order gets no answer (a 503, a dropped
    /// connection, 409 in_progress, or their own --patience-ms), send the same order
    /// again with the same key, up to --retries times.
    #[arg(long, default_value_t = 0.0, value_parser = parse_share)]
    pub retry_share: f64,

    /// This share of shoppers (0 to 1) send every order twice at once, same key.
    #[arg(long, default_value_t = 0.0, value_parser = parse_share)]
    pub double_click_share: f64,

    /// How many times a retrying shopper sends an unanswered order again.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub retries: u32,

    /// How long a retrying shopper waits for an answer before sending again (the other
    /// shoppers wait up to 15 s).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    pub patience_ms: u64,

    /// Each sale's limit per user (`limit_per_user` of the reset); none without it.
    /// Every intent has a user of its own, so with a limit a duplicate is refused
    /// (409 limit_reached) even without keys.
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    pub limit_per_user: Option<i64>,
}

impl Options {
    /// How the shoppers behave around one order.
    pub fn habits(&self) -> crate::crowd::Habits {
        crate::crowd::Habits {
            keys: !self.no_idempotency_key,
            retry_share: self.retry_share,
            double_click_share: self.double_click_share,
            retries: self.retries,
            patience: std::time::Duration::from_millis(self.patience_ms),
        }
    }

    /// The initial stock of each SKU in `strategy`'s runs.
    pub fn stock_of(&self, strategy: &str) -> i64 {
        self.stock_for
            .iter()
            .rev()
            .find(|(name, _)| name == strategy)
            .map_or(self.stock, |(_, units)| *units)
    }
}

fn parse_stock_for(raw: &str) -> Result<(String, i64), String> {
    let wrong = || "STRATEGY=UNITS, with UNITS between 1 and 1000000".to_owned();
    let (strategy, units) = raw.split_once('=').ok_or_else(wrong)?;
    match units.trim().parse::<i64>() {
        Ok(units) if (1..=1_000_000).contains(&units) && !strategy.trim().is_empty() => {
            Ok((strategy.trim().to_owned(), units))
        }
        _ => Err(wrong()),
    }
}

fn parse_share(raw: &str) -> Result<f64, String> {
    match raw.parse::<f64>() {
        Ok(share) if (0.0..=1.0).contains(&share) => Ok(share),
        _ => Err("a share between 0 and 1".into()),
    }
}

fn parse_rate(raw: &str) -> Result<f64, String> {
    match raw.parse::<f64>() {
        Ok(rate) if (0.1..=100_000.0).contains(&rate) => Ok(rate),
        _ => Err("a rate between 0.1 and 100000 orders per second".into()),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Fault {
    PauseHolder,
    Failover,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    On,
    Off,
}

/// The cohort switch to set before the runs, from `--cohort` and `--combine`: `None`
/// leaves the cluster as it is.
pub fn cohort_setting(
    cohort: Option<Switch>,
    combine: Option<u16>,
) -> anyhow::Result<Option<(bool, u16)>> {
    Ok(match (cohort, combine) {
        (None, None) => None,
        (Some(switch), None) => Some((switch == Switch::On, 1)),
        (Some(Switch::Off), Some(n)) if n > 1 => {
            anyhow::bail!("--combine {n} needs the cohort layer; it cannot go with --cohort off")
        }
        (Some(Switch::Off), Some(_)) => Some((false, 1)),
        (_, Some(n)) => Some((true, n)),
    })
}
