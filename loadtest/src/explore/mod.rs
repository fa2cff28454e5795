//! A seeded fault explorer, in the manner of Jepsen's nemesis and checker: many short
//! sales on the running cluster, each under a random schedule of faults (holders paused
//! at random points past their lease, shoppers hanging up, strategy switches, cache
//! rewrites, replicas killed, commands such as a backend restart), then a check of the
//! system of record. A failure names the seed, the round and its schedule, and
//! `explore --seed S --round R` replays that round alone.

pub mod checker;
pub mod schedule;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::Serialize;
use serde_json::json;

use self::checker::{Checker, Violation};
use self::schedule::{Fault, Powers, Round};

#[derive(Clone, Parser)]
#[command(
    name = "explore",
    about = "Seeded fault explorer: short sales under random faults, checked from the records"
)]
pub struct ExploreOptions {
    /// Replicas (comma-separated base URLs); orders are spread over them.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "http://127.0.0.1:8081,http://127.0.0.1:8082,http://127.0.0.1:8083"
    )]
    pub targets: Vec<String>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Rounds to run (each its own sale).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub rounds: u64,
    /// Run only this round of the seed (to replay a failure).
    #[arg(long)]
    pub round: Option<u64>,
    /// The replicas' lock lease (FLASHSALE_LOCK_LEASE_MS): pauses outlast it.
    #[arg(long, default_value_t = 3000)]
    pub lease_ms: u64,
    /// Let the nemesis `kill -9` replicas (they must run on this machine under
    /// `flashsale cluster`, which restarts them).
    #[arg(long)]
    pub kill: bool,
    /// `label=shell command` the nemesis may run mid-sale, e.g.
    /// `redis-restart=...`; repeatable. Never run by default.
    #[arg(long = "nemesis")]
    pub nemesis: Vec<String>,
    #[arg(long, env = "FLASHSALE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Where the summary goes.
    #[arg(long, default_value = "target/flashsale/explore.json")]
    pub out: PathBuf,
}

/// What a run found.
#[derive(Debug, Default, Serialize)]
pub struct Summary {
    pub seed: u64,
    pub rounds: u64,
    pub faults: BTreeMap<&'static str, u64>,
    pub orders: i64,
    pub violations: Vec<Violation>,
}

pub async fn run(options: &ExploreOptions) -> anyhow::Result<Summary> {
    let commands: BTreeMap<String, String> = options
        .nemesis
        .iter()
        .map(|raw| {
            raw.split_once('=')
                .map(|(l, c)| (l.to_owned(), c.to_owned()))
                .with_context(|| format!("--nemesis '{raw}' is not label=command"))
        })
        .collect::<anyhow::Result<_>>()?;
    let powers = Powers {
        kill: options.kill,
        commands: commands.keys().cloned().collect(),
    };
    let checker = Checker::new(options).await?;
    let rounds: Vec<u64> = match options.round {
        Some(round) => vec![round],
        None => (0..options.rounds).collect(),
    };
    let mut summary = Summary {
        seed: options.seed,
        ..Summary::default()
    };
    for round in rounds {
        let plan = schedule::draw(options.seed, round, options.lease_ms, &powers);
        for fault in &plan.faults {
            *summary.faults.entry(fault.kind()).or_insert(0) += 1;
        }
        let outcome = play(&checker, &plan, &commands).await;
        summary.rounds += 1;
        match outcome {
            Ok(sold) => {
                summary.orders += sold;
                eprintln!(
                    "round {round}: {} {} units, {} fault(s): ok",
                    plan.strategy,
                    plan.stock,
                    plan.faults.len()
                );
            }
            Err(violation) => {
                eprintln!(
                    "round {round}: VIOLATION {}\n  replay: explore --seed {} --round {round}\n  schedule: {}",
                    violation.what,
                    options.seed,
                    serde_json::to_string(&plan).unwrap_or_default()
                );
                summary.violations.push(violation);
            }
        }
    }
    Ok(summary)
}

/// One round: sale, crowd and faults at once, then quiet, then the checks.
async fn play(
    checker: &Checker,
    plan: &Round,
    commands: &BTreeMap<String, String>,
) -> Result<i64, Violation> {
    let fail = |what: String| Violation::new(plan, what);
    checker
        .prepare(plan)
        .await
        .map_err(|e| fail(format!("could not prepare the round: {e:#}")))?;
    let crowd = crowd(checker, plan);
    let nemesis = async {
        let started = tokio::time::Instant::now();
        for fault in &plan.faults {
            tokio::time::sleep_until(started + Duration::from_millis(fault.at_ms())).await;
            if let Err(error) = inject(checker, fault, commands).await {
                eprintln!("  fault {fault:?} not injected: {error:#}");
            }
        }
    };
    tokio::join!(crowd, nemesis);
    checker.check(plan).await
}

/// Shoppers buying one unit each, starting over 1.5 s; some hang up after 1-50 ms.
async fn crowd(checker: &Checker, plan: &Round) {
    let mut rng = StdRng::seed_from_u64(plan.seed ^ plan.round ^ 0xC0FFEE);
    let shoppers: Vec<(u64, Option<u64>)> = (0..plan.shoppers)
        .map(|_| {
            let start = rng.random_range(0..1500);
            let hang_up = rng
                .random_bool(plan.hang_up_share)
                .then(|| rng.random_range(1..=50));
            (start, hang_up)
        })
        .collect();
    let orders = shoppers
        .into_iter()
        .enumerate()
        .map(|(i, (start, hang_up))| async move {
            tokio::time::sleep(Duration::from_millis(start)).await;
            let body = json!({ "sku": plan.sku, "user_id": format!("shopper-{i}"), "quantity": 1 });
            let _ = checker
                .order(i, &body, hang_up.map(Duration::from_millis))
                .await;
        });
    futures::future::join_all(orders).await;
}

async fn inject(
    checker: &Checker,
    fault: &Fault,
    commands: &BTreeMap<String, String>,
) -> anyhow::Result<()> {
    match fault {
        Fault::Pause {
            point, pause_ms, ..
        } => checker.arm_pause(*pause_ms, point).await,
        Fault::Switch { to, .. } => checker.switch(to).await,
        Fault::Reconcile { .. } => checker.reconcile().await,
        Fault::Kill { replica, .. } => checker.kill(*replica).await,
        Fault::Command { label, .. } => {
            let command = commands.get(label).context("unknown nemesis label")?;
            let status = tokio::process::Command::new("sh")
                .args(["-c", command])
                .status()
                .await?;
            anyhow::ensure!(status.success(), "'{command}' failed: {status}");
            Ok(())
        }
    }
}
