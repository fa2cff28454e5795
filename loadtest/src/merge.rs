//! `loadtest merge`: one report (`docs/report.md`) from the partial reports of a crowd
//! split with `--part K/N` (split.rs). Counts add up; latency percentiles come from the
//! parts' histograms merged, since a percentile of the whole crowd is not an average
//! of the parts' percentiles; orders, oversold and stock are the service's records as
//! part 1 read them, once per sale, after every part had stopped.

use std::collections::BTreeMap;
use std::io::Read as _;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use anyhow::{Context, bail};
use chrono::Utc;
use flashsale_wire::report::{LoadConfig, LoadReport, RunResult};

use crate::crowd::Outcomes;
use crate::report::{self, new_times};
use crate::split::{MARKER, PartialReport, PartialRun, decode_times};

#[derive(Clone, clap::Args)]
pub struct MergeOptions {
    /// The parts' reports: their part-K-of-N.json files, or text holding them (the
    /// parts' output, e.g. `kubectl logs`: lines without a part's report are skipped);
    /// `-` reads standard input.
    #[arg(required = true, value_name = "FILE")]
    pub inputs: Vec<PathBuf>,

    /// Where report.json and report.md go.
    #[arg(long, default_value = "target/flashsale")]
    pub out: PathBuf,

    /// Also POST the report to this replica's run history (`/api/runs`), e.g.
    /// http://127.0.0.1:8081.
    #[arg(long, value_name = "URL")]
    pub history: Option<String>,

    /// Token for saving to the history.
    #[arg(long, env = "FLASHSALE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
}

/// Every part's report in the inputs.
pub fn read_inputs(inputs: &[PathBuf]) -> anyhow::Result<Vec<PartialReport>> {
    let mut partials = Vec::new();
    for input in inputs {
        let text = if input.as_os_str() == "-" {
            let mut text = String::new();
            std::io::stdin().read_to_string(&mut text)?;
            text
        } else {
            std::fs::read_to_string(input)
                .with_context(|| format!("reading {}", input.display()))?
        };
        let found = parse(&text).with_context(|| format!("in {}", input.display()))?;
        if found.is_empty() {
            bail!("{}: no part's report in it", input.display());
        }
        partials.extend(found);
    }
    Ok(partials)
}

/// The part reports in `text`: a whole file of one, or lines marked with `MARKER`
/// (anywhere in the line, so prefixed logs work too).
pub fn parse(text: &str) -> anyhow::Result<Vec<PartialReport>> {
    if let Ok(whole) = serde_json::from_str::<PartialReport>(text) {
        return Ok(vec![whole]);
    }
    text.lines()
        .filter_map(|line| line.split_once(MARKER).map(|(_, json)| json))
        .map(|json| serde_json::from_str(json).context("a part's report that does not parse"))
        .collect()
}

/// The parts of one run, each once, in order: same doors-open moment, same settings,
/// same sales; part 1 with the records.
fn check(mut partials: Vec<PartialReport>) -> anyhow::Result<Vec<PartialReport>> {
    let Some(first) = partials.first() else {
        bail!("no part's report given");
    };
    let (parts, doors_open) = (first.parts, first.doors_open);
    let mut by_number = BTreeMap::new();
    for partial in partials.drain(..) {
        if (partial.parts, partial.doors_open) != (parts, doors_open) {
            bail!(
                "part {}/{} (doors open {}) is not of the same run as part {}/{parts} (doors open \
                 {doors_open})",
                partial.part,
                partial.parts,
                partial.doors_open,
                first_number(&by_number).unwrap_or(1)
            );
        }
        match by_number.get(&partial.part) {
            // The same report given twice (a file and a log): harmless.
            Some(known) if *known == partial => {}
            Some(_) => bail!("two different reports for part {}/{parts}", partial.part),
            None => {
                by_number.insert(partial.part, partial);
            }
        }
    }
    let missing: Vec<String> = (1..=parts)
        .filter(|k| !by_number.contains_key(k))
        .map(|k| format!("{k}/{parts}"))
        .collect();
    if !missing.is_empty() {
        bail!("missing part(s) {}", missing.join(", "));
    }
    let partials: Vec<PartialReport> = by_number.into_values().collect();
    let reference = &partials[0];
    for partial in &partials[1..] {
        if !same_settings(&partial.config, &reference.config) {
            bail!(
                "part {}/{parts} ran with other settings than part 1: {:?} against {:?}",
                partial.part,
                partial.config,
                reference.config
            );
        }
        let sales = |p: &PartialReport| -> Vec<(String, u32, Vec<String>)> {
            p.runs
                .iter()
                .map(|r| (r.strategy.clone(), r.repeat, r.skus.clone()))
                .collect()
        };
        if sales(partial) != sales(reference) {
            bail!(
                "part {}/{parts} played other sales than part 1 (did it stop early?)",
                partial.part
            );
        }
    }
    if let Some(run) = reference.runs.iter().find(|r| r.service.is_none()) {
        bail!(
            "part 1/{parts} holds no records for {} (repeat {})",
            run.strategy,
            run.repeat
        );
    }
    Ok(partials)
}

fn first_number(parts: &BTreeMap<u32, PartialReport>) -> Option<u32> {
    parts.keys().next().copied()
}

/// Every setting but the switches (fencing, cohort, combining), which part 1 sets and the others
/// only observe.
fn same_settings(a: &LoadConfig, b: &LoadConfig) -> bool {
    LoadConfig {
        fencing: b.fencing,
        cohort: b.cohort,
        combine: b.combine,
        // Each part ran on its own machine.
        provenance: b.provenance.clone(),
        ..a.clone()
    } == *b
}

/// The report of the whole crowd.
pub fn merge(partials: Vec<PartialReport>) -> anyhow::Result<LoadReport> {
    let partials = check(partials)?;
    let reference = &partials[0];
    let mut runs = Vec::new();
    for (i, run) in reference.runs.iter().enumerate() {
        let shares: Vec<&PartialRun> = partials.iter().map(|p| &p.runs[i]).collect();
        runs.push(
            merge_run(&shares)
                .with_context(|| format!("merging {} (repeat {})", run.strategy, run.repeat))?,
        );
    }
    Ok(LoadReport {
        generated_at: Utc::now(),
        config: reference.config.clone(),
        runs,
    })
}

/// One sale's figures from every part's share of it (part 1's first).
fn merge_run(shares: &[&PartialRun]) -> anyhow::Result<RunResult> {
    let first = shares[0];
    let sum = |field: fn(&PartialRun) -> u64| shares.iter().map(|s| field(s)).sum::<u64>();
    let outcomes = Outcomes {
        orders: AtomicU64::new(sum(|s| s.orders_acknowledged)),
        sold_out: AtomicU64::new(sum(|s| s.sold_out)),
        busy: AtomicU64::new(sum(|s| s.busy)),
        errors: AtomicU64::new(sum(|s| s.errors)),
    };
    let mut times = new_times();
    for share in shares {
        times
            .add(decode_times(&share.latency_us)?)
            .map_err(|e| anyhow::anyhow!("adding up the latency histograms: {e:?}"))?;
    }
    let duration = shares.iter().map(|s| s.duration_s).fold(0.0, f64::max);
    let records = first
        .service
        .clone()
        .context("part 1 holds no records of the sale")?;
    Ok(report::run_result(
        &first.strategy,
        first.repeat,
        &outcomes,
        &times,
        seconds(duration),
        sell_out(shares).map(seconds),
        records,
    ))
}

fn seconds(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or_default()
}

/// When every SKU had answered the crowd sold out: each SKU's earliest answer over
/// the parts, the latest over the SKUs; `None` if some SKU never did.
fn sell_out(shares: &[&PartialRun]) -> Option<f64> {
    let skus = shares[0].sold_out_s.len();
    (0..skus)
        .map(|sku| {
            shares
                .iter()
                .filter_map(|s| s.sold_out_s.get(sku).copied().flatten())
                .reduce(f64::min)
        })
        .try_fold(0.0, |latest: f64, first| first.map(|t| latest.max(t)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::ServiceFigures;
    use crate::split::encode_times;

    fn config() -> LoadConfig {
        LoadConfig {
            targets: vec!["http://a".into()],
            users: 4,
            stock: 10,
            skus: 2,
            max_seconds: 5,
            grace_ms: 100,
            strategies: vec!["redis-lock".into()],
            fault: None,
            fencing: false,
            cohort: Some(true),
            combine: None,
            repeat: 1,
            rate: None,
            parts: 2,
            idempotency_keys: true,
            retry_share: 0.0,
            double_click_share: 0.0,
            limit_per_user: None,
            provenance: None,
        }
    }

    /// Part `part` of 2, its requests answered in `ms` (each once).
    fn partial(part: u32, ms: &[u64], sold_out_s: Vec<Option<f64>>) -> PartialReport {
        let mut times = new_times();
        for &ms in ms {
            times.record(ms * 1000).expect("in range");
        }
        let doors_open = crate::split::parse_doors_open("2030-01-01T12:00:00Z").expect("time");
        PartialReport {
            part,
            parts: 2,
            doors_open,
            generated_at: doors_open,
            config: config(),
            runs: vec![PartialRun {
                strategy: "redis-lock".into(),
                repeat: 1,
                doors_open,
                skus: vec!["s-1".into(), "s-2".into()],
                users: 2,
                late_s: 0.0,
                requests: ms.len() as u64,
                orders_acknowledged: ms.len() as u64 - 1,
                sold_out: 1,
                busy: 0,
                errors: 0,
                duration_s: 2.0 + f64::from(part),
                sold_out_s,
                latency_us: encode_times(&times).expect("encodes"),
                service: (part == 1).then_some(ServiceFigures {
                    orders: 20,
                    initial_stock: 20,
                    oversold: 0,
                    stock_redis: Some(0),
                    stock_mysql: 0,
                    consistent: true,
                    duplicates: Default::default(),
                }),
            }],
        }
    }

    #[test]
    fn counts_add_up_and_percentiles_come_from_the_whole_histogram() {
        // Part 1 fast (1-10 ms), part 2 slow (100-109 ms), ten requests each: the
        // whole crowd's median is a fast request's time, its p90 a slow one's. An
        // average of the parts' medians (55 ms) would be no request's time at all.
        let fast: Vec<u64> = (1..=10).collect();
        let slow: Vec<u64> = (100..110).collect();
        let report = merge(vec![
            partial(2, &slow, vec![Some(1.5), Some(0.9)]),
            partial(1, &fast, vec![Some(1.2), None]),
        ])
        .expect("merges");
        assert_eq!(report.config.parts, 2);
        let run = &report.runs[0];
        assert_eq!(
            (run.requests, run.orders_acknowledged, run.sold_out),
            (20, 18, 2)
        );
        assert_eq!((run.orders, run.oversold, run.consistent), (20, 0, true));
        assert!(
            (run.latency_ms.p50 - 10.0).abs() < 0.01,
            "{:?}",
            run.latency_ms
        );
        assert!(
            (run.latency_ms.p99 - 109.0).abs() < 0.1,
            "{:?}",
            run.latency_ms
        );
        assert_eq!(run.duration_s, 4.0, "the last part's end");
        // SKU 1 first sold out at 1.2 s (part 1), SKU 2 at 0.9 s (part 2).
        assert_eq!(run.sell_out_s, Some(1.2));
        assert!((run.orders_per_s - 20.0 / 1.2).abs() < 1e-6, "{run:?}");
    }

    #[test]
    fn a_run_is_sold_out_only_once_every_sku_was() {
        let one = partial(1, &[1], vec![Some(1.0), None]);
        let two = partial(2, &[1], vec![Some(2.0), None]);
        assert_eq!(sell_out(&[&one.runs[0], &two.runs[0]]), None);
    }

    #[test]
    fn parts_missing_twice_or_of_another_run_are_refused() {
        let error = |partials| merge(partials).expect_err("refused").to_string();
        let one = || partial(1, &[1], vec![None, None]);
        let two = || partial(2, &[2], vec![None, None]);
        assert!(error(vec![one()]).contains("missing part(s) 2/2"));
        let mut other = two();
        other.runs[0].requests += 1;
        assert!(error(vec![one(), two(), other]).contains("two different reports"));
        let mut later = two();
        later.doors_open += chrono::TimeDelta::seconds(60);
        assert!(error(vec![one(), later]).contains("not of the same run"));
        let mut bigger = two();
        bigger.config.users = 8;
        assert!(error(vec![one(), bigger]).contains("other settings"));
        let mut no_records = one();
        no_records.runs[0].service = None;
        assert!(error(vec![no_records, two()]).contains("holds no records"));
        // The same report twice (a file and a log) counts once.
        assert!(merge(vec![one(), two(), two()]).is_ok());
    }

    #[test]
    fn reports_are_found_in_files_and_in_logs() {
        let one = partial(1, &[1], vec![None, None]);
        let two = partial(2, &[2], vec![None, None]);
        let file = serde_json::to_string_pretty(&one).expect("json");
        assert_eq!(parse(&file).expect("a file"), vec![one.clone()]);
        let log = format!(
            "[pod/a] part 1/2: doors open in 3.0 s\n[pod/a] {MARKER}{}\n[pod/b] progress\n{MARKER}{}\n",
            serde_json::to_string(&one).expect("json"),
            serde_json::to_string(&two).expect("json"),
        );
        assert_eq!(parse(&log).expect("a log"), vec![one, two]);
        assert!(parse("nothing here").expect("no error").is_empty());
    }
}
