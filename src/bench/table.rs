//! Many `lockbench` reports (one JSON object per line, as `scripts/bench.sh` collects
//! them from repeated runs) as one markdown table: per lock, the median and the
//! min–max of each figure, so a reader sees the spread beside the value.

use std::fmt::Write;

use serde::Deserialize;

/// One line: a report, or `{"lock": ..., "failed": true}` for a run that failed.
#[derive(Debug, Deserialize)]
struct Line {
    lock: String,
    #[serde(default)]
    failed: bool,
    #[serde(default)]
    cycles_per_s: f64,
    #[serde(default)]
    per_contender: Vec<u64>,
    #[serde(default)]
    handoff_ms: Handoff,
    #[serde(default)]
    violations: u64,
    #[serde(default)]
    errors: u64,
}

#[derive(Debug, Default, Deserialize)]
struct Handoff {
    p50: Option<f64>,
    p99: Option<f64>,
}

/// The runs of one lock, in the order first seen.
#[derive(Default)]
struct Runs {
    attempted: usize,
    cycles_per_s: Vec<f64>,
    p50: Vec<f64>,
    p99: Vec<f64>,
    /// Most cycles of a contender over fewest, per run (infinite if one had none).
    spread: Vec<f64>,
    violations: u64,
    errors: u64,
}

pub fn markdown(lines: &str) -> anyhow::Result<String> {
    let mut locks: Vec<(String, Runs)> = Vec::new();
    for (number, text) in lines.lines().enumerate() {
        if text.trim().is_empty() {
            continue;
        }
        let line: Line = serde_json::from_str(text)
            .map_err(|error| anyhow::anyhow!("line {}: {error}", number + 1))?;
        let at = match locks.iter().position(|(lock, _)| *lock == line.lock) {
            Some(at) => at,
            None => {
                locks.push((line.lock.clone(), Runs::default()));
                locks.len() - 1
            }
        };
        let runs = &mut locks[at].1;
        runs.attempted += 1;
        if line.failed {
            continue;
        }
        runs.cycles_per_s.push(line.cycles_per_s);
        runs.p50.extend(line.handoff_ms.p50);
        runs.p99.extend(line.handoff_ms.p99);
        let most = line.per_contender.iter().max().copied().unwrap_or(0);
        let fewest = line.per_contender.iter().min().copied().unwrap_or(0);
        runs.spread.push(if fewest == 0 {
            f64::INFINITY
        } else {
            most as f64 / fewest as f64
        });
        runs.violations += line.violations;
        runs.errors += line.errors;
    }

    let mut table = String::from(
        "| lock | runs ok | cycles/s | handoff p50 ms | handoff p99 ms | \
         contender max/min | violations | errors |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for (lock, runs) in &locks {
        writeln!(
            table,
            "| {lock} | {}/{} | {} | {} | {} | {} | {} | {} |",
            runs.cycles_per_s.len(),
            runs.attempted,
            spread_of(&runs.cycles_per_s, |v| format!("{v:.0}")),
            spread_of(&runs.p50, millis),
            spread_of(&runs.p99, millis),
            spread_of(&runs.spread, ratio),
            runs.violations,
            runs.errors,
        )?;
    }
    Ok(table)
}

/// `median (min–max)`, or the value alone for one run, or `–` for none.
fn spread_of(values: &[f64], show: impl Fn(f64) -> String) -> String {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.as_slice() {
        [] => "–".to_owned(),
        [only] => show(*only),
        [first, .., last] => format!(
            "{} ({}–{})",
            show(median(&sorted)),
            show(*first),
            show(*last)
        ),
    }
}

fn median(sorted: &[f64]) -> f64 {
    let middle = sorted.len() / 2;
    if sorted.len() % 2 == 1 {
        sorted[middle]
    } else {
        (sorted[middle - 1] + sorted[middle]) / 2.0
    }
}

/// Milliseconds: three decimals below 10 ms (handoffs are sub-millisecond), one above.
fn millis(value: f64) -> String {
    if value < 10.0 {
        format!("{value:.3}")
    } else {
        format!("{value:.1}")
    }
}

fn ratio(value: f64) -> String {
    if value.is_finite() {
        format!("{value:.2}")
    } else {
        "∞".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_ranges_per_lock() {
        let lines = r#"
{"lock":"redis-lock","cycles_per_s":3000.0,"per_contender":[10,20],"handoff_ms":{"p50":0.2,"p99":2.0},"violations":0,"errors":0}
{"lock":"redis-lock","cycles_per_s":1000.0,"per_contender":[10,10],"handoff_ms":{"p50":0.4,"p99":30.0},"violations":0,"errors":1}
{"lock":"etcd","failed":true}
{"lock":"redis-lock","cycles_per_s":2000.0,"per_contender":[0,10],"handoff_ms":{"p50":0.3,"p99":4.0},"violations":0,"errors":0}
{"lock":"none","cycles_per_s":5.0,"per_contender":[5],"handoff_ms":{"p50":null,"p99":null},"violations":7,"errors":0}
"#;
        let table = markdown(lines).expect("table");
        let rows: Vec<&str> = table.lines().collect();
        assert_eq!(rows.len(), 5, "{table}");
        assert_eq!(
            rows[2],
            "| redis-lock | 3/3 | 2000 (1000–3000) | 0.300 (0.200–0.400) | 4.000 (2.000–30.0) | 2.00 (1.00–∞) | 0 | 1 |"
        );
        assert_eq!(rows[3], "| etcd | 0/1 | – | – | – | – | 0 | 0 |");
        assert_eq!(rows[4], "| none | 1/1 | 5 | – | – | 1.00 | 7 | 0 |");
    }

    #[test]
    fn even_counts_take_the_mean_of_the_middle_two() {
        assert_eq!(median(&[1.0, 2.0, 4.0, 10.0]), 3.0);
    }

    #[test]
    fn bad_lines_are_reported_with_their_number() {
        let error = markdown("{\"lock\":\"x\"}\nnot json").expect_err("bad line");
        assert!(error.to_string().starts_with("line 2:"), "{error}");
    }
}
