//! `loadtest explore`: a seeded fault explorer, in the manner of Jepsen's nemesis and
//! checker. The load test shows what each strategy costs on a good day; this tries to
//! break what each one promises. Many short sales run on the live cluster, each of a
//! fresh SKU under a random schedule of faults (holders paused past their lease at any
//! point of the critical section, shoppers hanging up, strategy switches, reconciles,
//! resets and reconciles of another SKU on sale at the same time, `kill -9` of a
//! replica, and with `--disruptive` backend restarts and session losses), then the
//! records are checked.
//!
//! - `schedule`: the plan of a round, drawn from the seed (replayable);
//! - `nemesis`: carries out the faults while the crowd buys;
//! - `crowd`: the impatient shoppers;
//! - `checker` and `records`: the judgement, from the system of record;
//! - `cluster`: the HTTP calls all of them make.
//!
//! A failure prints the seed, the round and the schedule as JSON, and
//! `loadtest explore --seed S --round R` replays that round alone.

pub mod checker;
pub mod cluster;
pub mod crowd;
pub mod nemesis;
pub mod records;
pub mod schedule;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use chrono::{DateTime, Utc};
use serde::Serialize;

use self::checker::{Cache, Checker, Verdict};
use self::cluster::Cluster;
use self::crowd::Tally;
use self::nemesis::FaultLog;
use self::records::Records;
use self::schedule::{Disruption, Powers, Round};

#[derive(Debug, Clone, clap::Args)]
pub struct ExploreOptions {
    /// Replicas (comma-separated base URLs); shoppers are spread over them.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "http://127.0.0.1:8081,http://127.0.0.1:8082,http://127.0.0.1:8083"
    )]
    pub targets: Vec<String>,

    /// Seed of the run [default: from the clock, printed].
    #[arg(long)]
    pub seed: Option<u64>,

    /// Rounds to run, each a sale of its own.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub rounds: u64,

    /// Run only this round of the seed: replays a failure.
    #[arg(long)]
    pub round: Option<u64>,

    /// The replicas' lock lease (FLASHSALE_LOCK_LEASE_MS): pauses outlast it.
    #[arg(long, default_value_t = 3000, value_parser = clap::value_parser!(u64).range(100..=60_000))]
    pub lease_ms: u64,

    /// Strategies to explore (comma-separated) [default: every one but `none`].
    #[arg(long, value_delimiter = ',')]
    pub strategies: Vec<String>,

    /// Never `kill -9` a replica (by default the nemesis kills replicas on this
    /// machine that `flashsale cluster` restarts; one left down is skipped).
    #[arg(long)]
    pub no_kill: bool,

    /// Switch the cohort layer on or off once before the first round (default: leave
    /// it as it is), so each mode can be explored on its own.
    #[arg(long, value_enum)]
    pub cohort: Option<crate::options::Switch>,

    /// Switch the cohort layer on with combining (a holder sells up to N queued orders
    /// in one critical section) once before the first round.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub combine: Option<u16>,

    /// Also take backends away mid-sale, with the commands below. For a private stack
    /// only: every other user of those services sees the outage too.
    #[arg(long)]
    pub disruptive: bool,

    /// Command that restarts Redis (it comes back empty), e.g.
    /// `scripts/stack.sh restart redis`. These commands need --disruptive.
    #[arg(long, requires = "disruptive")]
    pub restart_redis_cmd: Option<String>,

    /// Command that restarts MariaDB, e.g. `scripts/stack.sh restart mariadb`.
    #[arg(long, requires = "disruptive")]
    pub restart_mysql_cmd: Option<String>,

    /// Command that makes the replicas lose their ZooKeeper sessions.
    #[arg(long, requires = "disruptive")]
    pub zookeeper_session_loss_cmd: Option<String>,

    /// Command that makes the replicas lose their etcd leases.
    #[arg(long, requires = "disruptive")]
    pub etcd_session_loss_cmd: Option<String>,

    /// Command that fails the replicas' Redis over to its replica through Sentinel,
    /// e.g. `scripts/stack.sh failover` (the replicas must find Redis through
    /// Sentinel, as `stack.sh env` sets).
    #[arg(long, requires = "disruptive")]
    pub failover_redis_cmd: Option<String>,

    /// Also read the figures from this MySQL database with plain SQL (the replicas'
    /// FLASHSALE_DATABASE_URL), not only from the service's /api/stats.
    #[arg(long)]
    pub database_url: Option<String>,

    /// Token for the admin calls (strategy, fencing, reset, faults, reconcile).
    #[arg(long, env = "FLASHSALE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,

    /// Where the summary goes (JSON).
    #[arg(long, default_value = "target/flashsale/explore.json")]
    pub out: PathBuf,
}

/// What a run found: written to `--out`.
#[derive(Debug, Serialize)]
pub struct Summary {
    pub generated_at: DateTime<Utc>,
    pub seed: u64,
    pub rounds: u64,
    /// Faults carried out, by kind (`hang_up`: shoppers who left after 1-50 ms).
    pub faults: BTreeMap<String, u64>,
    /// Faults drawn but not carried out, by kind.
    pub faults_missed: u64,
    /// Strategies the rounds started under.
    pub strategies: BTreeMap<String, u64>,
    pub fenced_rounds: u64,
    /// The cohort layer as `--cohort` set it; `None`: left as the cluster had it.
    pub cohort: Option<bool>,
    /// Its combining as `--combine` set it; `None`: left as the cluster had it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub combine: Option<u16>,
    /// Rounds whose faults changed only the other SKU among the sale's settings, so
    /// that a `sale_changed` on the SKU under test broke guarantee 5 (`checker`).
    pub sku_scoped_rounds: u64,
    pub violations: Vec<Violation>,
    /// Why the run stopped early (a round could not be set up), if it did.
    pub aborted: Option<String>,
    pub details: Vec<RoundReport>,
}

/// A round whose records broke a guarantee, with what replays it.
#[derive(Debug, Serialize)]
pub struct Violation {
    pub seed: u64,
    pub round: u64,
    pub replay: String,
    pub broken: Vec<String>,
    pub schedule: Round,
}

/// Everything about one round.
#[derive(Debug, Serialize)]
pub struct RoundReport {
    pub round: u64,
    pub sku: String,
    pub strategy: String,
    pub stock: i64,
    pub fencing: bool,
    pub seconds: f64,
    pub crowd: Tally,
    pub nemesis: FaultLog,
    pub verdict: Verdict,
}

/// Runs the rounds and returns the summary (not yet written).
pub async fn run(options: &ExploreOptions) -> anyhow::Result<Summary> {
    let seed = options.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_secs())
    });
    let commands = disruptive_commands(options);
    let strategies = chosen_strategies(options)?;
    let powers = Powers {
        lease_ms: options.lease_ms,
        strategies,
        kill: !options.no_kill,
        disruptive: commands.keys().copied().collect(),
    };
    let cluster = Cluster::new(&options.targets, options.admin_token.as_deref())?;
    let down = cluster.refresh(Duration::ZERO).await;
    if down.len() == options.targets.len() {
        bail!("no target answers its health check: {}", down.join(", "));
    }
    let records = match &options.database_url {
        Some(url) => Some(Records::connect(url).await?),
        None => None,
    };
    let cohort = crate::options::cohort_setting(options.cohort, options.combine)?;
    if let Some(setting) = cohort {
        cluster
            .set_cohort(setting)
            .await
            .context("switching the cohort layer")?;
    }
    let checker = Checker {
        cluster: &cluster,
        records: records.as_ref(),
        patience: Duration::from_millis(options.lease_ms * 4).max(Duration::from_secs(20)),
    };
    // A label that makes each run's SKUs fresh, so leftovers of an earlier run of the
    // same seed cannot leak in.
    let run_label = format!("{:x}", Utc::now().timestamp_millis() % 0xFF_FFFF);
    let rounds: Vec<u64> = match options.round {
        Some(round) => vec![round],
        None => (0..options.rounds).collect(),
    };
    eprintln!(
        "explore: seed {seed}, {} round(s), lease {} ms, kill {}, disruptive {:?}, MySQL read {}",
        rounds.len(),
        options.lease_ms,
        powers.kill,
        powers.disruptive,
        if records.is_some() {
            "directly"
        } else {
            "via /api/stats only"
        }
    );

    let mut summary = Summary::new(seed);
    summary.cohort = cohort.map(|(enabled, _)| enabled);
    summary.combine = cohort.map(|(_, combine)| combine);
    for round in rounds {
        let plan = schedule::draw(seed, round, &powers, cluster.target_count());
        let sku = format!("x{seed}-{run_label}-r{round}");
        let report = match play(&cluster, &checker, &commands, &plan, &sku).await {
            Ok(report) => report,
            Err(error) => {
                eprintln!("round {round}: could not be set up, stopping: {error:#}");
                summary.aborted = Some(format!("round {round}: {error:#}"));
                break;
            }
        };
        print_round(&plan, &report);
        if !report.verdict.broken.is_empty() {
            let violation = Violation {
                seed,
                round,
                replay: replay_command(options, seed, round),
                broken: report.verdict.broken.clone(),
                schedule: plan.clone(),
            };
            eprintln!("  VIOLATION in round {round} of seed {seed}:");
            for what in &violation.broken {
                eprintln!("    - {what}");
            }
            eprintln!("    replay: {}", violation.replay);
            eprintln!(
                "    schedule: {}",
                serde_json::to_string(&plan).unwrap_or_default()
            );
            summary.violations.push(violation);
        }
        summary.add(&plan, report);
    }
    Ok(summary)
}

impl Summary {
    fn new(seed: u64) -> Summary {
        Summary {
            generated_at: Utc::now(),
            seed,
            rounds: 0,
            faults: BTreeMap::new(),
            faults_missed: 0,
            strategies: BTreeMap::new(),
            fenced_rounds: 0,
            cohort: None,
            combine: None,
            sku_scoped_rounds: 0,
            violations: Vec::new(),
            aborted: None,
            details: Vec::new(),
        }
    }

    fn add(&mut self, plan: &Round, report: RoundReport) {
        self.rounds += 1;
        *self.strategies.entry(plan.strategy.clone()).or_insert(0) += 1;
        self.fenced_rounds += u64::from(plan.fencing);
        self.sku_scoped_rounds +=
            u64::from(!plan.changes_every_sku() && plan.disruptions().next().is_none());
        let mut count = |kind: &str, n: u64| *self.faults.entry(kind.to_owned()).or_insert(0) += n;
        for (kind, n) in &report.nemesis.injected {
            count(kind, *n);
        }
        count("hang_up", report.crowd.impatient);
        // Not faults of the nemesis but of the shoppers: orders sent again with the
        // same key, and rounds sold with a limit per user.
        count("retry", report.crowd.retries);
        count(
            "limit_per_user",
            u64::from(plan.crowd.limit_per_user.is_some()),
        );
        count("pause_claimed", report.nemesis.pauses_claimed);
        self.faults_missed += report.nemesis.missed.len() as u64;
        self.details.push(report);
    }
}

/// One line per round on stderr, as it ends.
fn print_round(plan: &Round, report: &RoundReport) {
    let verdict = match report.verdict.broken.len() {
        0 => "ok".to_owned(),
        n => format!("{n} VIOLATION(S)"),
    };
    let faults: Vec<String> = plan
        .faults
        .iter()
        .map(|t| format!("{}@{}", t.fault.kind(), t.at_ms))
        .collect();
    eprintln!(
        "round {:>3}: {:<13} {:>2} units, fencing {:<3}, faults [{}], {} hang-ups, {} retries{}; crowd bought {} ({} sale_changed), patient shoppers {}; {:.1} s: {verdict}",
        plan.round,
        plan.strategy,
        plan.stock,
        if plan.fencing { "on" } else { "off" },
        faults.join(" "),
        report.crowd.impatient,
        report.crowd.retries,
        plan.crowd
            .limit_per_user
            .map_or(String::new(), |l| format!(", limit {l}/user")),
        report.crowd.created,
        report.crowd.sale_changed,
        report.verdict.patient_bought,
        report.seconds,
    );
}

/// One round: prepare the sale, let the crowd and the nemesis loose at once, withdraw
/// what is left of the faults, then check.
async fn play(
    cluster: &Cluster,
    checker: &Checker<'_>,
    commands: &BTreeMap<Disruption, String>,
    plan: &Round,
    sku: &str,
) -> anyhow::Result<RoundReport> {
    let started = tokio::time::Instant::now();
    // A setup that fails is the environment, not a finding: stop the run.
    cluster.refresh(Duration::from_secs(10)).await;
    cluster
        .disarm_pause()
        .await
        .context("withdrawing an old pause")?;
    cluster.switch(&plan.strategy).await.context("switching")?;
    cluster
        .set_fencing(plan.fencing)
        .await
        .context("switching fencing")?;
    cluster
        .reset(sku, plan.stock, plan.crowd.limit_per_user)
        .await
        .context("restocking")?;
    // A second SKU on sale at the same time, with a crowd of its own: the target of
    // the resets and reconciles of one SKU, which the SKU under test must not notice.
    let other = format!("{sku}-other");
    cluster
        .reset(&other, plan.stock, plan.crowd.limit_per_user)
        .await
        .context("restocking the other SKU")?;
    let mut other_plan = plan.clone();
    other_plan.crowd.shoppers = plan.crowd.shoppers.div_ceil(2);
    other_plan.crowd.seed = plan.crowd.seed.wrapping_add(1);

    let sale_opens = tokio::time::Instant::now();
    let ((crowd, _), mut log) = tokio::join!(
        async {
            tokio::join!(
                crowd::buy(cluster, plan, sku),
                crowd::buy(cluster, &other_plan, &other)
            )
        },
        nemesis::strike(cluster, plan, commands, sale_opens, &other)
    );
    if let Err(error) = nemesis::withdraw_pause(cluster, &mut log).await {
        log.missed.push(format!("withdrawing the pause: {error:#}"));
    }
    let cache = if plan.disruptions().any(Disruption::loses_cache) {
        Cache::MayBeLost
    } else if plan.may_undersell() {
        Cache::MayUndersell
    } else {
        Cache::Kept
    };
    // A claimed pause may still be running: the figures must stay still past it.
    let still_for = Duration::from_millis(if log.pauses_claimed > 0 {
        plan.longest_pause_ms() + 1000
    } else {
        0
    });
    let mut verdict = checker.check(sku, plan.stock, cache, still_for).await;
    verdict.broken.extend(checker::untouched(plan, &crowd));
    Ok(RoundReport {
        round: plan.round,
        sku: sku.to_owned(),
        strategy: plan.strategy.clone(),
        stock: plan.stock,
        fencing: plan.fencing,
        seconds: started.elapsed().as_secs_f64(),
        crowd,
        nemesis: log,
        verdict,
    })
}

fn disruptive_commands(options: &ExploreOptions) -> BTreeMap<Disruption, String> {
    if !options.disruptive {
        return BTreeMap::new();
    }
    [
        (Disruption::RestartRedis, &options.restart_redis_cmd),
        (Disruption::RestartMysql, &options.restart_mysql_cmd),
        (
            Disruption::ZookeeperSessionLoss,
            &options.zookeeper_session_loss_cmd,
        ),
        (Disruption::EtcdSessionLoss, &options.etcd_session_loss_cmd),
        (Disruption::FailoverRedis, &options.failover_redis_cmd),
    ]
    .into_iter()
    .filter_map(|(what, command)| command.clone().map(|c| (what, c)))
    .collect()
}

fn chosen_strategies(options: &ExploreOptions) -> anyhow::Result<Vec<String>> {
    let chosen: Vec<String> = options
        .strategies
        .iter()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect();
    if let Some(bad) = chosen
        .iter()
        .find(|s| !schedule::STRATEGIES.contains(&s.as_str()))
    {
        bail!(
            "'{bad}' cannot be explored: choose among {} (`none` oversells by design)",
            schedule::STRATEGIES.join(", ")
        );
    }
    Ok(chosen)
}

/// The command line that draws the same round again (targets and token aside).
fn replay_command(options: &ExploreOptions, seed: u64, round: u64) -> String {
    let mut command = format!(
        "loadtest explore --seed {seed} --round {round} --lease-ms {}",
        options.lease_ms
    );
    if !options.strategies.is_empty() {
        command += &format!(" --strategies {}", options.strategies.join(","));
    }
    if options.no_kill {
        command += " --no-kill";
    }
    if let Some(switch) = options.cohort {
        let on = switch == crate::options::Switch::On;
        command += if on { " --cohort on" } else { " --cohort off" };
    }
    if let Some(combine) = options.combine {
        command += &format!(" --combine {combine}");
    }
    if options.disruptive {
        command += " --disruptive";
        for (flag, value) in [
            ("--restart-redis-cmd", &options.restart_redis_cmd),
            ("--restart-mysql-cmd", &options.restart_mysql_cmd),
            (
                "--zookeeper-session-loss-cmd",
                &options.zookeeper_session_loss_cmd,
            ),
            ("--etcd-session-loss-cmd", &options.etcd_session_loss_cmd),
            ("--failover-redis-cmd", &options.failover_redis_cmd),
        ] {
            if let Some(value) = value {
                command += &format!(" {flag} '{value}'");
            }
        }
    }
    command
}

/// Prints the summary's last lines and writes it to `out`.
pub fn finish(summary: &Summary, out: &std::path::Path) -> anyhow::Result<()> {
    let faults: Vec<String> = summary
        .faults
        .iter()
        .map(|(kind, n)| format!("{n} {kind}"))
        .collect();
    println!(
        "explore: seed {}, {} round(s) ({} fenced), faults: {} ({} missed); {} round(s) with violations",
        summary.seed,
        summary.rounds,
        summary.fenced_rounds,
        faults.join(", "),
        summary.faults_missed,
        summary.violations.len()
    );
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(out, serde_json::to_string_pretty(summary)? + "\n")
        .with_context(|| format!("writing {}", out.display()))?;
    println!("explore: summary in {}", out.display());
    Ok(())
}
