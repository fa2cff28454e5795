//! Service-level objectives a run must meet, as k6's thresholds do: `--max-p99-ms` and
//! `--min-orders-per-s`, each for every strategy (`300`) or per strategy
//! (`redis-lock=300,etcd=500`; a strategy not named has none unless a bare value is
//! given too). A missed one makes the load test exit 1, naming the strategy. Checked on
//! each run of a strategy, after the report is written.

use flashsale_wire::report::LoadReport;

/// One objective: a bound for every strategy, and bounds for some by name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Objective {
    every: Option<f64>,
    named: Vec<(String, f64)>,
}

impl Objective {
    /// The bound for `strategy`: its own if named, else the one for every strategy.
    fn bound(&self, strategy: &str) -> Option<f64> {
        let named = self.named.iter().find(|(name, _)| name == strategy);
        named.map(|(_, bound)| *bound).or(self.every)
    }
}

/// Parses `300` or `redis-lock=300,etcd=500` (or both: `500,etcd=900`).
pub fn parse_objective(raw: &str) -> Result<Objective, String> {
    let mut objective = Objective::default();
    for part in raw
        .split(',')
        .map(str::trim)
        .filter(|part| !part.is_empty())
    {
        let (name, value) = match part.split_once('=') {
            Some((name, value)) => (Some(name.trim()), value.trim()),
            None => (None, part),
        };
        let bound: f64 = value
            .parse()
            .ok()
            .filter(|bound: &f64| bound.is_finite() && *bound > 0.0)
            .ok_or_else(|| format!("'{value}' is not a positive number"))?;
        match name {
            Some("") => return Err(format!("'{part}' names no strategy")),
            Some(name) => objective.named.push((name.to_owned(), bound)),
            None if objective.every.is_some() => {
                return Err("one bound for every strategy at most".into());
            }
            None => objective.every = Some(bound),
        }
    }
    if objective == Objective::default() {
        return Err("no bound given".into());
    }
    Ok(objective)
}

/// The objectives of one load test.
#[derive(Clone, Debug, Default)]
pub struct Objectives {
    pub max_p99_ms: Option<Objective>,
    pub min_orders_per_s: Option<Objective>,
}

/// Why the load test fails (exit 1), one line each: the records' violations (oversold,
/// inconsistent) and the objectives missed; empty, it passes.
pub fn judge(report: &LoadReport, objectives: &Objectives) -> Vec<String> {
    let mut failures = crate::report::violations(report);
    failures.extend(missed(report, objectives));
    failures
}

/// What the report's runs missed, one line each, naming the strategy.
pub fn missed(report: &LoadReport, objectives: &Objectives) -> Vec<String> {
    let mut found = Vec::new();
    // A bound for a strategy that did not run (a typo: `redis_lock=300`) checks
    // nothing: it fails the run rather than passing it unchecked.
    let ran = |name: &str| report.runs.iter().any(|run| run.strategy == name);
    for (option, objective) in [
        ("--max-p99-ms", &objectives.max_p99_ms),
        ("--min-orders-per-s", &objectives.min_orders_per_s),
    ] {
        let named = objective.iter().flat_map(|o| o.named.iter());
        for (name, _) in named.filter(|(name, _)| !ran(name)) {
            found.push(format!("{option} names {name}, which did not run"));
        }
    }
    for run in &report.runs {
        let which = format!("{} (run {})", run.strategy, run.repeat);
        let max_p99 = objectives.max_p99_ms.as_ref();
        if let Some(bound) = max_p99.and_then(|o| o.bound(&run.strategy))
            && run.latency_ms.p99 > bound
        {
            let p99 = run.latency_ms.p99;
            found.push(format!(
                "{which}: p99 {p99:.1} ms, above --max-p99-ms {bound}"
            ));
        }
        let min_rate = objectives.min_orders_per_s.as_ref();
        if let Some(bound) = min_rate.and_then(|o| o.bound(&run.strategy))
            && run.orders_per_s < bound
        {
            let rate = run.orders_per_s;
            found.push(format!(
                "{which}: {rate:.1} orders/s, below --min-orders-per-s {bound}"
            ));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objectives_parse() {
        let both = parse_objective("500, etcd=900").unwrap();
        assert_eq!(both.bound("etcd"), Some(900.0));
        assert_eq!(both.bound("none"), Some(500.0));
        let named = parse_objective("redis-lock=300").unwrap();
        assert_eq!(named.bound("redis-lock"), Some(300.0));
        assert_eq!(named.bound("etcd"), None);
        for refused in ["", "x", "0", "-5", "NaN", "=3", "1,2", "etcd=inf"] {
            assert!(parse_objective(refused).is_err(), "{refused}");
        }
    }

    fn report(runs: &[(&str, f64, f64)]) -> LoadReport {
        let runs: Vec<serde_json::Value> = runs
            .iter()
            .map(|(strategy, p99, rate)| {
                serde_json::json!({"strategy": strategy, "requests": 1, "orders": 1,
                    "orders_acknowledged": 1, "sold_out": 0, "busy": 0, "errors": 0,
                    "duration_s": 1.0, "sell_out_s": null, "rps": 1.0, "orders_per_s": rate,
                    "latency_ms": {"p50": 1.0, "p90": 1.0, "p99": p99, "max": p99},
                    "initial_stock": 1, "oversold": 0, "stock_redis": 0, "stock_mysql": 0,
                    "consistent": true})
            })
            .collect();
        serde_json::from_value(serde_json::json!({
            "generated_at": "2026-11-28T12:00:00Z",
            "config": {"targets": [], "users": 1, "stock": 1, "skus": 1, "max_seconds": 1,
                       "grace_ms": 0, "strategies": []},
            "runs": runs,
        }))
        .unwrap()
    }

    #[test]
    fn a_missed_objective_names_its_strategy() {
        let report = report(&[("none", 5.0, 900.0), ("etcd", 40.0, 300.0)]);
        let objectives = Objectives {
            max_p99_ms: Some(parse_objective("25").unwrap()),
            min_orders_per_s: Some(parse_objective("none=1000,etcd=100").unwrap()),
        };
        let missed = missed(&report, &objectives);
        assert_eq!(missed.len(), 2, "{missed:?}");
        assert!(
            missed[0].starts_with("none (run 1): 900.0 orders/s"),
            "{missed:?}"
        );
        assert!(
            missed[1].starts_with("etcd (run 1): p99 40.0 ms"),
            "{missed:?}"
        );
        assert!(super::missed(&report, &Objectives::default()).is_empty());
        let typo = Objectives {
            max_p99_ms: Some(parse_objective("redis_lock=300").unwrap()),
            ..Objectives::default()
        };
        let missed = super::missed(&report, &typo);
        assert_eq!(missed, ["--max-p99-ms names redis_lock, which did not run"]);
    }
}
