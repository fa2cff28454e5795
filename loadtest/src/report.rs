//! Turning an attack into a `RunResult`, and the report into a table and files.
//!
//! Counts of answers and latency come from the crowd (Goose); oversold and the stock
//! figures come from the service's own records after the run.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use flashsale_wire::report::{Latency, LoadReport, RunResult};
use flashsale_wire::stats::{Duplicates, SkuStats};
use hdrhistogram::Histogram;

use crate::crowd::Outcomes;

/// Response times in microseconds, 3 significant digits: sub-millisecond resolution
/// for fast strategies, up to a minute without resizing.
pub type Times = Histogram<u64>;

pub fn new_times() -> Times {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("constant, valid bounds")
}

/// Percentiles in milliseconds (fractional) of times recorded in microseconds.
pub fn latency(times: &Times) -> Latency {
    let ms = |us: u64| us as f64 / 1000.0;
    if times.is_empty() {
        return Latency {
            p50: 0.0,
            p90: 0.0,
            p99: 0.0,
            p999: Some(0.0),
            max: 0.0,
        };
    }
    Latency {
        p50: ms(times.value_at_quantile(0.50)),
        p90: ms(times.value_at_quantile(0.90)),
        p99: ms(times.value_at_quantile(0.99)),
        p999: Some(ms(times.value_at_quantile(0.999))),
        max: ms(times.max()),
    }
}

/// The service's figures for the run's SKUs, added up.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ServiceFigures {
    pub orders: u64,
    pub initial_stock: i64,
    pub oversold: i64,
    pub stock_redis: Option<i64>,
    pub stock_mysql: i64,
    pub consistent: bool,
    #[serde(default)]
    pub duplicates: Duplicates,
}

impl ServiceFigures {
    pub fn sum(skus: &[SkuStats]) -> ServiceFigures {
        ServiceFigures {
            orders: skus.iter().map(|s| s.orders.max(0) as u64).sum(),
            initial_stock: skus.iter().map(|s| s.initial_stock).sum(),
            oversold: skus.iter().map(|s| s.oversold).sum(),
            stock_redis: skus.iter().map(|s| s.stock_redis).sum(),
            stock_mysql: skus.iter().map(|s| s.stock_mysql).sum(),
            consistent: skus.iter().all(|s| s.consistent),
            duplicates: Duplicates::sum(skus.iter().map(|s| s.duplicates)),
        }
    }
}

pub fn run_result(
    strategy: &str,
    repeat: u32,
    outcomes: &Outcomes,
    times: &Times,
    duration: Duration,
    sell_out: Option<Duration>,
    service: ServiceFigures,
) -> RunResult {
    let duration_s = duration.as_secs_f64();
    let requests = outcomes.requests();
    let selling_s = sell_out.map_or(duration_s, |d| d.as_secs_f64());
    let per_second = |n: u64, seconds: f64| {
        if seconds > 0.0 {
            n as f64 / seconds
        } else {
            0.0
        }
    };
    RunResult {
        strategy: strategy.to_owned(),
        repeat,
        requests,
        orders: service.orders,
        orders_acknowledged: outcomes.orders.load(Ordering::Relaxed),
        sold_out: outcomes.sold_out.load(Ordering::Relaxed),
        busy: outcomes.busy.load(Ordering::Relaxed),
        errors: outcomes.errors.load(Ordering::Relaxed),
        duration_s,
        sell_out_s: sell_out.map(|d| d.as_secs_f64()),
        rps: per_second(requests, duration_s),
        orders_per_s: per_second(service.orders, selling_s),
        latency_ms: latency(times),
        initial_stock: service.initial_stock,
        oversold: service.oversold,
        stock_redis: service.stock_redis,
        stock_mysql: service.stock_mysql,
        consistent: service.consistent,
        duplicates: service.duplicates,
    }
}

const HEADER: [&str; 14] = [
    "strategy",
    "orders",
    "oversold",
    "duplicates",
    "req/s",
    "orders/s",
    "p50 ms",
    "p90 ms",
    "p99 ms",
    "busy",
    "errors",
    "sell-out s",
    "stock R/M",
    "consistent",
];

fn row(run: &RunResult) -> [String; 14] {
    let redis = run.stock_redis.map_or("-".to_owned(), |s| s.to_string());
    [
        run.strategy.clone(),
        run.orders.to_string(),
        if run.oversold > 0 {
            format!("{} OVERSOLD", run.oversold)
        } else {
            "0".into()
        },
        duplicates_said(&run.duplicates),
        format!("{:.0}", run.rps),
        format!("{:.0}", run.orders_per_s),
        format!("{:.2}", run.latency_ms.p50),
        format!("{:.2}", run.latency_ms.p90),
        format!("{:.2}", run.latency_ms.p99),
        run.busy.to_string(),
        run.errors.to_string(),
        run.sell_out_s.map_or("-".into(), |s| format!("{s:.2}")),
        format!("{redis}/{}", run.stock_mysql),
        if run.consistent {
            "yes".into()
        } else {
            "NO".into()
        },
    ]
}

/// The table's header and rows: one row per run, or with `--repeat` one per strategy
/// with the median and the min-max of its runs.
fn table(report: &LoadReport) -> (Vec<String>, Vec<Vec<String>>) {
    if report.config.repeat <= 1 {
        let header = HEADER.iter().map(|h| (*h).to_owned()).collect();
        return (
            header,
            report.runs.iter().map(|r| row(r).to_vec()).collect(),
        );
    }
    let header = [
        "strategy",
        "runs",
        "orders/s",
        "p50 ms",
        "p99 ms",
        "oversold (worst)",
        "duplicates (worst)",
        "busy",
        "errors",
        "consistent",
    ]
    .map(str::to_owned)
    .to_vec();
    let mut strategies: Vec<&str> = Vec::new();
    for run in &report.runs {
        if !strategies.contains(&run.strategy.as_str()) {
            strategies.push(&run.strategy);
        }
    }
    let rows = strategies
        .into_iter()
        .map(|name| {
            let runs: Vec<&RunResult> = report.runs.iter().filter(|r| r.strategy == name).collect();
            let worst = runs.iter().map(|r| r.oversold).max().unwrap_or(0);
            vec![
                name.to_owned(),
                runs.len().to_string(),
                spread(runs.iter().map(|r| r.orders_per_s), 0),
                spread(runs.iter().map(|r| r.latency_ms.p50), 2),
                spread(runs.iter().map(|r| r.latency_ms.p99), 2),
                if worst > 0 {
                    format!("{worst} OVERSOLD")
                } else {
                    "0".into()
                },
                duplicates_said(&worst_duplicates(&runs)),
                runs.iter().map(|r| r.busy).sum::<u64>().to_string(),
                runs.iter().map(|r| r.errors).sum::<u64>().to_string(),
                if runs.iter().all(|r| r.consistent) {
                    "yes".into()
                } else {
                    "NO".into()
                },
            ]
        })
        .collect();
    (header, rows)
}

/// The duplicates of a run as a cell: the repeat orders (one user per intent, so
/// each is a duplicate), then any order sharing a key or unit over the limit, which
/// the records' own guarantees should make impossible.
fn duplicates_said(d: &Duplicates) -> String {
    let mut said = if d.repeat_orders > 0 {
        format!("{} DUPLICATE", d.repeat_orders)
    } else {
        "0".into()
    };
    if d.orders_sharing_key > 0 {
        let _ = write!(said, ", {} SHARING A KEY", d.orders_sharing_key);
    }
    if d.units_over_limit > 0 {
        let _ = write!(said, ", {} OVER THE LIMIT", d.units_over_limit);
    }
    said
}

/// Each count's worst over a strategy's repeated runs.
fn worst_duplicates(runs: &[&RunResult]) -> Duplicates {
    runs.iter().fold(Duplicates::default(), |a, r| Duplicates {
        orders_sharing_key: a.orders_sharing_key.max(r.duplicates.orders_sharing_key),
        repeat_orders: a.repeat_orders.max(r.duplicates.repeat_orders),
        units_over_limit: a.units_over_limit.max(r.duplicates.units_over_limit),
    })
}

/// "median (min–max)" of the values, with `digits` decimals.
pub fn spread(values: impl Iterator<Item = f64>, digits: usize) -> String {
    let mut values: Vec<f64> = values.collect();
    if values.is_empty() {
        return "-".into();
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    let median = if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    };
    format!(
        "{median:.digits$} ({:.digits$}–{:.digits$})",
        values[0],
        values[n - 1]
    )
}

/// The results as an aligned text table for the terminal.
pub fn text_table(report: &LoadReport) -> String {
    let (header, rows) = table(report);
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            rows.iter()
                .map(|r| r[i].chars().count())
                .chain([header[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: &[String]| {
        cells
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:>width$}"))
            .collect::<Vec<_>>()
            .join("  ")
    };
    let mut out = line(&header);
    out.push('\n');
    for r in &rows {
        out.push_str(&line(r));
        out.push('\n');
    }
    out
}

/// The report as Markdown: readable offline, in a terminal or on a forge.
pub fn markdown(report: &LoadReport) -> String {
    let c = &report.config;
    let mut md = String::new();
    let _ = writeln!(md, "# flashsale load test\n");
    let _ = writeln!(md, "Generated {}.\n", report.generated_at.to_rfc3339());
    let _ = writeln!(
        md,
        "{} shoppers over {} replica(s) ({}), {} SKU(s) with {}; each run ends {} ms \
         after everything sold out, or after {} s.{}\n",
        c.users,
        c.targets.len(),
        c.targets.join(", "),
        c.skus,
        stock_said(report),
        c.grace_ms,
        c.max_seconds,
        c.fault
            .as_ref()
            .map_or(String::new(), |f| format!(" Fault injected: {f}."))
    );
    let fencing = if c.fencing {
        "on (stale lock holders' writes are refused by MySQL)"
    } else {
        "off"
    };
    let _ = writeln!(md, "Fencing tokens: {fencing}.\n");
    let _ = writeln!(
        md,
        "Shoppers: {}; {:.0} % send an unanswered order again, {:.0} % double-click{}.\n",
        if c.idempotency_keys {
            "one Idempotency-Key per order they mean to place"
        } else {
            "no Idempotency-Key (the \"before\")"
        },
        c.retry_share * 100.0,
        c.double_click_share * 100.0,
        c.limit_per_user.map_or(String::new(), |l| format!(
            "; each sale allows {l} unit(s) per user"
        )),
    );
    if let Some(cohort) = c.cohort {
        let cohort = match (cohort, c.combine.unwrap_or(1)) {
            (false, _) => "off (every order takes the lock from the lock service)".to_owned(),
            (true, 1) => "on (a replica's requests for a SKU queue locally and the holder \
                          hands the lock to the next one, up to 8 in a row)"
                .to_owned(),
            (true, n) => format!(
                "on, combining (a lock holder sells up to {n} orders queued for its SKU in \
                 its replica in one critical section)"
            ),
        };
        let _ = writeln!(md, "Cohort layer: {cohort}.\n");
    }
    if c.parts > 1 {
        let _ = writeln!(
            md,
            "The crowd was split over {} processes (`loadtest --part K/N`), their figures \
             merged (`loadtest merge`): counts added up, latency from their histograms \
             merged, the records read once.\n",
            c.parts
        );
    }
    let (header, rows) = table(report);
    if c.repeat > 1 {
        let _ = writeln!(
            md,
            "Each strategy run {} times, interleaved; each cell: median (min–max).\n",
            c.repeat
        );
    }
    if let Some(rate) = c.rate {
        let _ = writeln!(
            md,
            "Open model: {rate} orders arriving per second, each timed from when it was due.\n"
        );
    }
    let _ = writeln!(md, "| {} |", header.join(" | "));
    let _ = writeln!(md, "|{}", "---|".repeat(header.len()));
    for row in &rows {
        let _ = writeln!(md, "| {} |", row.join(" | "));
    }
    let _ = writeln!(
        md,
        "\nOrders, oversold and stock come from the service's records (MySQL orders, Redis and \
         MySQL stock) after each run; requests, latency and busy/errors from the crowd. \
         Oversold = orders − initial stock. Duplicates = orders of a user beyond their first \
         (every order the crowd means to place has a user of its own, so a second order is a \
         double click or a retry that bought again), from MySQL's orders; orders sharing a \
         key and units over the limit would be broken guarantees. Consistent = Redis stock, MySQL stock and \
         initial − ordered all agree. orders/s counts the time until sold out; latency \
         percentiles (measured by the crowd, microsecond resolution) cover the requests sent before sold out. Goose's own \
         HTML report per strategy is beside this file (its charts load from a CDN)."
    );
    md
}

/// The units per SKU the runs sold, from their records rather than the config, since
/// `--stock-for` gives some strategies another stock: "1000 units each (redis-atomic:
/// 20000)", the stock most strategies sold first.
fn stock_said(report: &LoadReport) -> String {
    let skus = i64::try_from(report.config.skus.max(1)).unwrap_or(1);
    let mut stocks: Vec<(String, i64)> = Vec::new();
    for run in &report.runs {
        if !stocks.iter().any(|(strategy, _)| *strategy == run.strategy) {
            stocks.push((run.strategy.clone(), run.initial_stock / skus));
        }
    }
    // On a tie, the stock of the strategy run first (max_by_key keeps the last).
    let Some(base) = stocks
        .iter()
        .rev()
        .map(|(_, each)| *each)
        .max_by_key(|each| stocks.iter().filter(|(_, e)| e == each).count())
    else {
        return format!("{} units each", report.config.stock);
    };
    let others: Vec<String> = stocks
        .iter()
        .filter(|(_, each)| *each != base)
        .map(|(strategy, each)| format!("{strategy}: {each}"))
        .collect();
    if others.is_empty() {
        format!("{base} units each")
    } else {
        format!("{base} units each ({})", others.join(", "))
    }
}

/// What makes a run fail (its exit status): a lock strategy that oversold or left the
/// stock inconsistent. `none` overselling is the lesson, not a failure. Under every
/// strategy, `none` too: a duplicate order while the shoppers sent keys, two orders
/// under one key, or a user over the limit (MySQL's guarantees, whatever the lock).
pub fn violations(report: &LoadReport) -> Vec<String> {
    let mut found = Vec::new();
    for run in &report.runs {
        let d = &run.duplicates;
        if report.config.idempotency_keys && d.repeat_orders > 0 {
            found.push(format!(
                "{} made {} duplicate order(s) with idempotency keys",
                run.strategy, d.repeat_orders
            ));
        }
        if d.orders_sharing_key > 0 {
            found.push(format!(
                "{} recorded {} order(s) sharing a key",
                run.strategy, d.orders_sharing_key
            ));
        }
        if d.units_over_limit > 0 {
            found.push(format!(
                "{} sold {} unit(s) over the limit per user",
                run.strategy, d.units_over_limit
            ));
        }
    }
    for run in report.runs.iter().filter(|r| r.strategy != "none") {
        if run.oversold > 0 {
            found.push(format!(
                "{} oversold {} unit(s)",
                run.strategy, run.oversold
            ));
        }
        if !run.consistent {
            found.push(format!(
                "{} ended inconsistent (Redis {}, MySQL {})",
                run.strategy,
                run.stock_redis.map_or("missing".into(), |s| s.to_string()),
                run.stock_mysql
            ));
        }
    }
    found
}

pub fn write_files(report: &LoadReport, out: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(out)?;
    std::fs::write(
        out.join("report.json"),
        serde_json::to_string_pretty(report)? + "\n",
    )?;
    std::fs::write(out.join("report.md"), markdown(report))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Times in milliseconds (fractional allowed) → count.
    fn times(pairs: &[(f64, u64)]) -> Times {
        let mut times = new_times();
        for &(ms, count) in pairs {
            times.record_n((ms * 1000.0) as u64, count).unwrap();
        }
        times
    }

    #[test]
    fn a_spread_is_the_median_and_the_range() {
        assert_eq!(spread([3.0, 1.0, 2.0].into_iter(), 1), "2.0 (1.0–3.0)");
        assert_eq!(spread([4.0, 1.0].into_iter(), 0), "2 (1–4)");
        assert_eq!(spread(std::iter::empty(), 0), "-");
    }

    #[test]
    fn percentiles_keep_sub_millisecond_resolution() {
        // 100 requests: 50 at 0.4 ms, 40 at 5 ms, 9 at 20 ms, 1 at 300 ms.
        let l = latency(&times(&[(0.4, 50), (5.0, 40), (20.0, 9), (300.0, 1)]));
        let close = |a: f64, b: f64| (a - b).abs() <= b * 0.001;
        assert!(close(l.p50, 0.4), "{l:?}");
        assert!(
            close(l.p90, 5.0) && close(l.p99, 20.0) && close(l.max, 300.0),
            "{l:?}"
        );
        assert_eq!(latency(&new_times()).p99, 0.0);
    }

    /// The tail beyond p99: of 10,000 orders, 150 at 20 ms hold p99 and 49 at 80 ms
    /// hold p99.9, below the one slowest (300 ms). Computed as p99 or as the maximum,
    /// the p99.9 would read 20 or 300.
    #[test]
    fn p99_9_is_the_tail_between_p99_and_the_maximum() {
        let l = latency(&times(&[(1.0, 9800), (20.0, 150), (80.0, 49), (300.0, 1)]));
        let close = |a: f64, b: f64| (a - b).abs() <= b * 0.001;
        assert!(close(l.p99, 20.0) && close(l.max, 300.0), "{l:?}");
        assert!(l.p999.is_some_and(|p| close(p, 80.0)), "{l:?}");
        let json = serde_json::to_value(l).unwrap();
        assert!(
            (json["p999"].as_f64().unwrap() - 80.0).abs() < 0.1,
            "{json}"
        );
    }

    /// A report saved before p99.9 existed still reads, and is written back as it was.
    #[test]
    fn latency_without_p99_9_reads_as_none() {
        let old = serde_json::json!({"p50": 1.0, "p90": 2.0, "p99": 3.0, "max": 4.0});
        let read: Latency = serde_json::from_value(old.clone()).unwrap();
        assert_eq!(read.p999, None);
        assert_eq!(serde_json::to_value(read).unwrap(), old);
    }

    /// A run of `strategy` with its record's figures, the rest empty.
    fn run(strategy: &str, oversold: i64, consistent: bool, initial_stock: i64) -> RunResult {
        RunResult {
            strategy: strategy.into(),
            oversold,
            consistent,
            initial_stock,
            ..run_result(
                strategy,
                1,
                &Outcomes::default(),
                &new_times(),
                Duration::from_secs(1),
                None,
                ServiceFigures::default(),
            )
        }
    }

    /// A report of `runs` over `skus` SKUs of `stock` units.
    fn report(runs: Vec<RunResult>, stock: i64, skus: u64) -> LoadReport {
        LoadReport {
            generated_at: chrono::Utc::now(),
            config: flashsale_wire::report::LoadConfig {
                targets: vec![],
                users: 1,
                stock,
                skus,
                max_seconds: 1,
                grace_ms: 0,
                strategies: vec![],
                fault: None,
                fencing: false,
                cohort: None,
                combine: None,
                repeat: 1,
                rate: None,
                parts: 1,
                idempotency_keys: true,
                retry_share: 0.0,
                double_click_share: 0.0,
                limit_per_user: None,
                provenance: None,
            },
            runs,
        }
    }

    #[test]
    fn the_stock_said_is_the_runs_not_the_configs() {
        let runs = |stocks: &[(&str, i64)]| {
            stocks
                .iter()
                .map(|(strategy, units)| run(strategy, 0, true, *units))
                .collect()
        };
        let said = |stocks: &[(&str, i64)]| stock_said(&report(runs(stocks), 1000, 2));
        assert_eq!(said(&[]), "1000 units each");
        assert_eq!(
            said(&[("none", 2000), ("etcd", 2000), ("redis-atomic", 40000)]),
            "1000 units each (redis-atomic: 20000)"
        );
        // Every run sold with --stock-for: the config's stock was sold by none.
        assert_eq!(said(&[("redis-atomic", 40000)]), "20000 units each");
        assert_eq!(
            said(&[("etcd", 20), ("redlock", 40)]),
            "10 units each (redlock: 20)"
        );
    }

    #[test]
    fn a_lock_strategy_that_oversold_or_diverged_fails_the_run_and_none_does_not() {
        let report = |runs| report(runs, 1, 1);
        let run = |strategy: &str, oversold: i64, consistent: bool| {
            run(strategy, oversold, consistent, 1)
        };
        assert!(
            violations(&report(vec![
                run("none", 5, false),
                run("redis-lock", 0, true)
            ]))
            .is_empty()
        );
        assert_eq!(
            violations(&report(vec![
                run("redis-lock", 2, true),
                run("etcd", 0, false)
            ])),
            vec![
                "redis-lock oversold 2 unit(s)".to_owned(),
                "etcd ended inconsistent (Redis missing, MySQL 0)".to_owned()
            ]
        );
    }

    /// A duplicate made while the shoppers sent keys fails the run, under `none` too;
    /// without keys it is the lesson. Orders sharing a key or units over the limit
    /// always fail it.
    #[test]
    fn duplicates_fail_the_run_only_where_a_guarantee_promised_none() {
        let with = |duplicates: Duplicates, keys: bool| {
            let mut report = report(
                vec![RunResult {
                    duplicates,
                    ..run("none", 0, true, 1)
                }],
                1,
                1,
            );
            report.config.idempotency_keys = keys;
            violations(&report)
        };
        let repeats = Duplicates {
            repeat_orders: 3,
            ..Duplicates::default()
        };
        assert_eq!(
            with(repeats, true),
            vec!["none made 3 duplicate order(s) with idempotency keys".to_owned()]
        );
        assert!(with(repeats, false).is_empty());
        let broken = Duplicates {
            orders_sharing_key: 1,
            units_over_limit: 2,
            ..Duplicates::default()
        };
        assert_eq!(with(broken, false).len(), 2);
        let table = text_table(&report(
            vec![RunResult {
                duplicates: repeats,
                ..run("none", 0, true, 1)
            }],
            1,
            1,
        ));
        assert!(table.contains("3 DUPLICATE"), "{table}");
    }

    fn sku(
        orders: i64,
        initial: i64,
        redis: Option<i64>,
        mysql: i64,
        consistent: bool,
    ) -> SkuStats {
        SkuStats {
            sku: flashsale_wire::Sku::parse("s").expect("valid"),
            initial_stock: initial,
            stock_redis: redis,
            stock_mysql: mysql,
            orders,
            ordered_quantity: orders,
            oversold: (orders - initial).max(0),
            consistent,
            updated_at: chrono::Utc::now(),
            limit_per_user: None,
            duplicates: Duplicates {
                repeat_orders: orders / 10,
                ..Duplicates::default()
            },
        }
    }

    #[test]
    fn service_figures_add_up_over_skus() {
        let figures = ServiceFigures::sum(&[
            sku(10, 10, Some(0), 0, true),
            sku(14, 10, Some(3), 3, false),
        ]);
        assert_eq!(
            figures,
            ServiceFigures {
                orders: 24,
                initial_stock: 20,
                oversold: 4,
                stock_redis: Some(3),
                stock_mysql: 3,
                consistent: false,
                duplicates: Duplicates {
                    repeat_orders: 2,
                    ..Duplicates::default()
                },
            }
        );
        assert_eq!(
            ServiceFigures::sum(&[sku(1, 1, None, 0, false)]).stock_redis,
            None
        );
    }

    #[test]
    fn rates_count_selling_time() {
        let outcomes = Outcomes::default();
        outcomes.orders.store(100, Ordering::Relaxed);
        outcomes.sold_out.store(300, Ordering::Relaxed);
        let service = ServiceFigures {
            orders: 100,
            initial_stock: 100,
            consistent: true,
            ..Default::default()
        };
        let run = run_result(
            "x",
            1,
            &outcomes,
            &times(&[(2.0, 400)]),
            Duration::from_secs(4),
            Some(Duration::from_secs(2)),
            service,
        );
        assert_eq!(
            (run.requests, run.rps, run.orders_per_s),
            (400, 100.0, 50.0)
        );
        assert_eq!(run.sell_out_s, Some(2.0));
    }
}
