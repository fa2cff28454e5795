//! The flashsale load test: for each strategy, switch the cluster, restock, let a
//! Goose crowd buy until sold out (plus a grace period) or a time bound, then read the
//! service's own records and record the run (`docs/report.md`).

pub mod crowd;
pub mod explore;
pub mod merge;
pub mod options;
mod provenance;
pub mod report;
pub mod service;
pub mod slo;
pub mod split;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use chrono::Utc;
use flashsale_wire::report::{LoadConfig, LoadReport, RunResult};

use crate::crowd::{CrowdPlan, Sale, Share};
use crate::options::{Fault, Options, Switch};
use crate::report::ServiceFigures;
use crate::service::Service;

/// How long the closed-loop crowd gathers before the doors open: Goose starts the
/// shoppers over one second.
pub(crate) const GATHER_CROWD: Duration = Duration::from_millis(1500);
pub(crate) const GATHER_OPEN: Duration = Duration::from_millis(300);

/// Checks everything that can be checked before any load is sent: targets answer,
/// strategies exist. Returns the service client and the strategies to run.
pub async fn prepare(options: &Options) -> anyhow::Result<(Service, Vec<String>)> {
    let goose = <goose::config::GooseConfiguration as gumdrop::Options>::parse_args_default(
        &options.goose_options,
    )
    .map_err(|error| anyhow::anyhow!("--goose options: {error}"))?;
    if goose.no_print_metrics {
        // Goose 0.18.1 leaves its HTML report empty when it prints no summary.
        eprintln!(
            "--goose=--no-print-metrics: Goose's HTML reports will be empty; \
             report.json and report.md are not affected"
        );
    }
    split::check(options)?;
    let service = Service::new(&options.targets, options.admin_token.as_deref())?;
    service.check_targets().await?;
    let known = service.strategy_names().await?;
    if let Some((unknown, _)) = options.stock_for.iter().find(|(s, _)| !known.contains(s)) {
        bail!(
            "--stock-for: unknown strategy '{unknown}'; the service knows: {}",
            known.join(", ")
        );
    }
    let strategies = if options.strategies.trim() == "all" {
        known
    } else {
        let chosen: Vec<String> = options
            .strategies
            .split(',')
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .collect();
        if let Some(unknown) = chosen.iter().find(|s| !known.contains(s)) {
            bail!(
                "unknown strategy '{unknown}'; the service knows: {}",
                known.join(", ")
            );
        }
        chosen
    };
    if strategies.is_empty() {
        bail!("no strategies to run");
    }
    Ok((service, strategies))
}

/// Runs every strategy in turn and returns the report (not yet written or saved).
pub async fn run(
    options: &Options,
    service: &Service,
    strategies: &[String],
) -> anyhow::Result<LoadReport> {
    let skus: Vec<String> = (1..=options.skus).map(|i| format!("sale-{i}")).collect();
    if let Some(switch) = options.fencing {
        service.set_fencing(switch == Switch::On).await?;
    }
    if let Some(setting) = options::cohort_setting(options.cohort, options.combine)? {
        service.set_cohort(setting).await?;
    }
    let switches = Switches::of(&service.stats(None).await?);
    let mut runs = Vec::new();
    // Interleaved (every strategy, then every strategy again), so a slow spell of
    // the machine spreads over all of them instead of spoiling one.
    let total = strategies.len() * options.repeat as usize;
    for repeat in 1..=options.repeat {
        for strategy in strategies {
            let n = runs.len() + 1;
            eprintln!("[{n}/{total}] {strategy}: restocking and switching the cluster");
            let run = run_strategy(options, service, strategy, &skus, repeat)
                .await
                .with_context(|| format!("running {strategy}"))?;
            eprintln!(
                "[{n}/{total}] {strategy}: {} orders for {} units, {} oversold, {} duplicate(s), {:.1} s",
                run.orders,
                run.initial_stock,
                run.oversold,
                run.duplicates.repeat_orders,
                run.duration_s
            );
            runs.push(run);
        }
    }
    Ok(LoadReport {
        generated_at: Utc::now(),
        config: load_config(options, strategies, switches),
        runs,
    })
}

/// The cluster's switches as the service reported them, and what produced the run, for
/// the report.
#[derive(Debug, Clone)]
pub(crate) struct Switches {
    pub fencing: bool,
    pub cohort: Option<bool>,
    pub combine: Option<u16>,
    pub provenance: flashsale_wire::report::Provenance,
}

impl Switches {
    pub fn of(stats: &flashsale_wire::stats::Stats) -> Switches {
        Switches {
            fencing: stats.fencing,
            cohort: stats.cohort,
            combine: stats.combine,
            provenance: provenance::of(stats),
        }
    }
}

/// How the run was made, for its report.
pub(crate) fn load_config(
    options: &Options,
    strategies: &[String],
    switches: Switches,
) -> LoadConfig {
    LoadConfig {
        targets: options.targets.clone(),
        users: options.users,
        stock: options.stock,
        skus: options.skus,
        max_seconds: options.max_seconds,
        grace_ms: options.grace_ms,
        strategies: strategies.to_vec(),
        fault: options.fault.map(|fault| {
            match fault {
                Fault::PauseHolder => "pause-holder",
                Fault::Failover => "failover",
            }
            .to_owned()
        }),
        fencing: switches.fencing,
        cohort: switches.cohort,
        combine: switches.combine,
        repeat: options.repeat,
        rate: options.rate,
        parts: options.part.map_or(1, |part| part.of),
        idempotency_keys: !options.no_idempotency_key,
        retry_share: options.retry_share,
        double_click_share: options.double_click_share,
        limit_per_user: options.limit_per_user,
        provenance: Some(switches.provenance),
    }
}

async fn run_strategy(
    options: &Options,
    service: &Service,
    strategy: &str,
    skus: &[String],
    repeat: u32,
) -> anyhow::Result<RunResult> {
    service.switch_strategy(strategy).await?;
    for sku in skus {
        service
            .reset(sku, options.stock_of(strategy), options.limit_per_user)
            .await?;
    }
    let pause = match options.fault {
        Some(Fault::PauseHolder) => Some(service.arm_pause().await?),
        // The failover loses a redis-lock; the other strategies run without a fault.
        Some(Fault::Failover) if strategy == "redis-lock" => {
            Some(service.arm_failover(&skus[0]).await?)
        }
        Some(Fault::Failover) | None => None,
    };
    let sale = Sale::new(CrowdPlan {
        targets: options.targets.clone(),
        skus: skus.to_vec(),
        users: options.users,
        max_seconds: options.max_seconds,
        grace: Duration::from_millis(options.grace_ms),
        // Goose starts every shopper within the first second; the open model only
        // needs its client ready.
        gather: if options.rate.is_some() {
            GATHER_OPEN
        } else {
            GATHER_CROWD
        },
        goose_options: options.goose_options.clone(),
        share: Share::WHOLE,
        habits: options.habits(),
    });
    std::fs::create_dir_all(&options.out)?;
    let html = options.out.join(format!("goose-{strategy}.html"));
    play(
        &sale,
        strategy.to_owned(),
        options.stock_of(strategy) * skus.len() as i64,
        options.rate,
        &html,
    )
    .await?;
    let duration = sale.elapsed();
    if let Some(pause_ms) = pause {
        await_paused_holder(service, strategy, pause_ms).await?;
    }
    let figures = ServiceFigures::sum(&settled_stats(service, skus).await?);
    Ok(report::run_result(
        strategy,
        repeat,
        &sale.outcomes,
        &sale.selling_times(),
        duration,
        sale.sell_out_time(),
        figures,
    ))
}

/// With the paused-holder fault: if no holder claimed the pause (the strategy holds no
/// lease to suspend), withdraw it; otherwise wait until the paused holder has woken
/// and written, so its late order is in the figures.
async fn await_paused_holder(
    service: &Service,
    strategy: &str,
    pause_ms: u64,
) -> anyhow::Result<()> {
    let counter = format!("{strategy}.paused_holders");
    let deadline =
        tokio::time::Instant::now() + Duration::from_millis(pause_ms) + Duration::from_secs(15);
    loop {
        let stats = service.stats(None).await?;
        if stats.pause_armed_ms.is_some() {
            eprintln!("      {strategy}: no lock holder claimed the pause (nothing to pause)");
            return service.disarm_pause().await;
        }
        if stats.counters.get(&counter).copied().unwrap_or(0) > 0 {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("the paused holder did not wake within {pause_ms} ms + 15 s");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The service's figures once no more orders land (requests cut off by the end of the
/// attack may still be committing).
pub(crate) async fn settled_stats(
    service: &Service,
    skus: &[String],
) -> anyhow::Result<Vec<flashsale_wire::stats::SkuStats>> {
    let mut previous: Option<Vec<i64>> = None;
    for _ in 0..50 {
        let mut stats = Vec::new();
        for sku in skus {
            stats.push(service.sku_stats(sku).await?);
        }
        let orders: Vec<i64> = stats.iter().map(|s| s.orders).collect();
        if previous.as_ref() == Some(&orders) {
            return Ok(stats);
        }
        previous = Some(orders);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("orders kept changing for 10 s after the crowd stopped")
}

/// Plays one crowd, the closed loop or the open model at `rate`, with a progress line
/// every second.
pub(crate) async fn play(
    sale: &Arc<Sale>,
    label: String,
    units: i64,
    rate: Option<f64>,
    html: &std::path::Path,
) -> anyhow::Result<()> {
    let progress = tokio::spawn(show_progress(sale.clone(), label, units));
    let attack = match rate {
        Some(rate) => crowd::arrive(sale.clone(), rate).await,
        None => crowd::attack(sale.clone(), html).await,
    };
    progress.abort();
    attack
}

async fn show_progress(sale: Arc<Sale>, strategy: String, units: i64) {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let o = &sale.outcomes;
        eprintln!(
            "      {strategy}: {:>5.1} s  {:>6} requests  {:>5}/{units} sold  {} busy  {} errors{}",
            sale.elapsed().as_secs_f64(),
            o.requests(),
            o.orders.load(std::sync::atomic::Ordering::Relaxed),
            o.busy.load(std::sync::atomic::Ordering::Relaxed),
            o.errors.load(std::sync::atomic::Ordering::Relaxed),
            if sale.sell_out_time().is_some() {
                "  (sold out)"
            } else {
                ""
            },
        );
    }
}
