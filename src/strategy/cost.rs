//! What each strategy costs, as last measured: read from the generated sections of
//! BENCHMARKS.md (`scripts/bench.sh` writes each between its markers), built into the
//! binary, so a card never shows a figure somebody typed. "Per order" (`orders`) gives
//! orders/s and the ratio to the base; a strategy it does not list has no cost.
//! "Round trips per order" (`roundtrips`) gives the requests per order sold to each
//! backing service, counted by the servers, with the cohort layer on (the default);
//! "Recovery after `kill -9` of the holder" (`recovery`) the time from the kill to the
//! next order sold. A strategy either section does not list (no run yet; none,
//! optimistic and redis-atomic hold no lock to recover) has none of that figure.

use serde::Serialize;
use utoipa::ToSchema;

const BENCHMARKS: &str = include_str!("../../BENCHMARKS.md");

/// Requests per order sold, to each backing service and in all (median of the runs).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct RoundTrips {
    pub total: f64,
    /// Commands, on every Redis node (Redlock's three included).
    pub redis: f64,
    /// Statements (MariaDB's `Questions`).
    pub mysql: f64,
    /// Packets received.
    pub zookeeper: f64,
    /// gRPC messages received (unary calls and stream messages such as keep-alives).
    pub etcd: f64,
    /// The commit they were measured at (the section's own: it may be another run's
    /// than the orders/s).
    pub commit: String,
}

/// One strategy's measured cost.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Cost {
    /// Orders per second on one hot SKU, three replicas, wrk with 10 connections
    /// each: the median of the repeats.
    pub orders_per_s: f64,
    /// That against the base, `none` on one connection (the bare critical section).
    pub vs_base: f64,
    /// The commit the figures were measured at.
    pub commit: String,
    /// The date of the run.
    pub measured_on: String,
    /// Requests per order to the backing services, with the cohort layer on; null
    /// where not measured.
    pub round_trips: Option<RoundTrips>,
    /// Milliseconds from `kill -9` of the lock's holder to the next order sold by
    /// another replica (median of the runs, with the README demo's 3 s lease); null
    /// where not measured or where no lock is held.
    pub recovery_ms: Option<f64>,
    /// The commit `recovery_ms` was measured at; null with it.
    pub recovery_commit: Option<String>,
}

/// The generated section between `<!-- NAME:begin -->` and `<!-- NAME:end -->`.
fn section<'a>(document: &'a str, name: &str) -> Option<&'a str> {
    let start = document.find(&format!("<!-- {name}:begin -->"))?;
    let end = document[start..].find(&format!("<!-- {name}:end -->"))?;
    Some(&document[start..start + end])
}

/// The cells of `strategy`'s row of a table in `section` with at least `width` cells
/// (counting the empty ones outside the outer bars).
fn row<'a>(section: &'a str, strategy: &str, width: usize) -> Option<Vec<&'a str>> {
    section.lines().find_map(|line| {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        (cells.len() >= width && cells[1] == strategy).then_some(cells)
    })
}

/// The commit a generated section names ("- Commit `abc1234`, ...").
fn commit_of(section: &str) -> Option<String> {
    let line = section
        .lines()
        .find_map(|line| line.strip_prefix("- Commit `"))?;
    Some(line.split('`').next()?.to_owned())
}

/// The "Round trips per order" row: strategy, redis, mysql, zookeeper, etcd, total, ...
fn round_trips_in(document: &str, strategy: &str) -> Option<RoundTrips> {
    let section = section(document, "roundtrips")?;
    let cells = row(section, strategy, 8)?;
    Some(RoundTrips {
        commit: commit_of(section)?,
        redis: median(cells[2])?,
        mysql: median(cells[3])?,
        zookeeper: median(cells[4])?,
        etcd: median(cells[5])?,
        total: median(cells[6])?,
    })
}

/// The "Recovery" row's milliseconds (its cells: strategy, milliseconds, runs, failed
/// runs) and the section's commit.
fn recovery_in(document: &str, strategy: &str) -> Option<(f64, String)> {
    let section = section(document, "recovery")?;
    Some((median(row(section, strategy, 5)?[2])?, commit_of(section)?))
}

/// The first figure of a cell like "1027 (989–1047)".
fn median(cell: &str) -> Option<f64> {
    cell.split_whitespace().next()?.parse().ok()
}

/// `strategy`'s cost in `document`, BENCHMARKS.md's text.
pub fn cost_in(document: &str, strategy: &str) -> Option<Cost> {
    let section = section(document, "orders")?;
    let commit = commit_of(section)?;
    let measured_on = section
        .split("on ")
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .unwrap_or("")
        .to_owned();
    let row = row(section, strategy, 5)?;
    let (recovery_ms, recovery_commit) = recovery_in(document, strategy).unzip();
    Some(Cost {
        orders_per_s: median(row[2])?,
        vs_base: median(row[3])?,
        commit,
        measured_on,
        round_trips: round_trips_in(document, strategy),
        recovery_ms,
        recovery_commit,
    })
}

/// `strategy`'s cost as last measured.
pub fn cost(strategy: &str) -> Option<Cost> {
    cost_in(BENCHMARKS, strategy)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every strategy the benchmark measures has its figures; reading another row (or
    /// a hand-written table outside the markers) would give other numbers.
    #[test]
    fn costs_come_from_the_generated_section() {
        let document = "| redis-lock | 1 (1–1) | 9.99 | x |\n<!-- orders:begin -->\n\
            _Generated by `scripts/bench.sh` on 2026-11-26; do not edit by hand._\n\
            - Commit `7e0acaf`, release build\n\
            | redis-lock | 1027 (989–1047) | 0.89 (0.82–0.92) | ≥ 0.8 | 0 (0–0) |\n\
            <!-- orders:end -->\n";
        let cost = cost_in(document, "redis-lock").expect("measured");
        assert_eq!(cost.orders_per_s, 1027.0);
        assert_eq!(cost.vs_base, 0.89);
        assert_eq!(cost.commit, "7e0acaf");
        assert_eq!(cost.measured_on, "2026-11-26");
        assert_eq!(cost.round_trips, None, "no round trips section");
        assert_eq!(cost.recovery_ms, None, "no recovery section");
        assert_eq!(cost.recovery_commit, None);
        assert_eq!(cost_in(document, "none"), None);
        for name in ["redis-lock", "db-for-update", "redis-atomic", "redlock"] {
            assert!(
                super::cost(name).is_some(),
                "{name} measured in BENCHMARKS.md"
            );
        }
    }

    /// Round trips and recovery come from their own generated sections, the row of
    /// the strategy itself: the cohort row, not its `classic` row; a figure typed
    /// outside the markers is not read; a strategy with no recovery row has none.
    #[test]
    fn round_trips_and_recovery_come_from_their_sections() {
        let document = "<!-- orders:begin -->\n\
            _Generated by `scripts/bench.sh` on 2026-11-28; do not edit by hand._\n\
            - Commit `abc1234`, binaries from `target/release`\n\
            | redis-lock | 1027 (989–1047) | 0.89 (0.82–0.92) | ≥ 0.8 | 0 (0–0) |\n\
            | none | 2000 (1900–2100) | 1.70 (1.60–1.80) | — | 0 (0–0) |\n\
            <!-- orders:end -->\n\
            | redis-lock | 3000 | 1 | 0 |\n\
            <!-- roundtrips:begin -->\n\
            - Commit `def5678`, binaries from `target/release`\n\
            | strategy | redis | mysql | zookeeper | etcd | total | idle per order | orders sold | other answers |\n\
            |---|---|---|---|---|---|---|---|---|\n\
            | none | 8.9 | 5.2 | 0.0 | 0.0 | 14.1 (14.0–14.3) | 0.1 | 200 | 0 |\n\
            | redis-lock classic | 107.9 (90.1–120.0) | 5.0 | 0.0 | 0.0 | 112.9 (95.1–125.0) | 0.1 | 200 | 0 |\n\
            | redis-lock | 20.5 (20.1–21.0) | 5.0 | 0.0 | 0.0 | 25.5 (25.1–26.0) | 0.1 | 200 | 0 |\n\
            <!-- roundtrips:end -->\n\
            <!-- recovery:begin -->\n\
            - Commit `9abcdef`, binaries from `target/release`\n\
            | strategy | recovery ms | runs | failed runs |\n\
            |---|---|---|---|\n\
            | redis-lock | 3120 (3050–3300) | 3 | 0 |\n\
            | etcd | — | 0 | 3 |\n\
            <!-- recovery:end -->\n";
        let cost = cost_in(document, "redis-lock").expect("measured");
        assert_eq!(
            cost.round_trips,
            Some(RoundTrips {
                total: 25.5,
                redis: 20.5,
                mysql: 5.0,
                zookeeper: 0.0,
                etcd: 0.0,
                commit: "def5678".into(),
            })
        );
        assert_eq!(cost.recovery_ms, Some(3120.0));
        assert_eq!(cost.recovery_commit.as_deref(), Some("9abcdef"));
        assert_eq!(cost.commit, "abc1234", "orders/s keep their own commit");
        let none = cost_in(document, "none").expect("measured");
        assert_eq!(none.round_trips.map(|r| r.total), Some(14.1));
        assert_eq!(none.recovery_ms, None, "none holds no lock: no row");
        assert_eq!(cost_in(document, "etcd"), None, "no orders row");
        assert_eq!(recovery_in(document, "etcd"), None, "every run failed");
    }

    /// The committed BENCHMARKS.md has both sections: every strategy's round trips,
    /// and a recovery time for each lock strategy and none for the three that hold no
    /// lock. Fails when bench.sh stops writing a section or a row.
    #[test]
    fn every_strategy_has_round_trips_and_each_lock_a_recovery() {
        let locks = [
            "redis-lock",
            "db-unique",
            "zookeeper",
            "etcd",
            "redlock",
            "db-for-update",
        ];
        for name in locks.iter().chain(&["none", "optimistic", "redis-atomic"]) {
            let cost = super::cost(name).expect("measured");
            assert!(cost.round_trips.is_some(), "{name}: round trips");
            assert_eq!(
                cost.recovery_ms.is_some(),
                locks.contains(name),
                "{name}: recovery"
            );
        }
    }

    /// README's results table is the last benchmark's: each strategy's orders/s and
    /// ratio there equal the generated section's. Fails when bench.sh rewrites the
    /// section and the README keeps the old figures.
    #[test]
    fn the_readme_shows_the_last_benchmark() {
        let readme = include_str!("../../README.md");
        let mut checked = 0;
        for line in readme.lines() {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            if cells.len() < 5 {
                continue;
            }
            let Some(cost) = super::cost(cells[1]) else {
                continue;
            };
            assert_eq!(
                cells[2].parse::<f64>().ok(),
                Some(cost.orders_per_s),
                "{line}"
            );
            assert_eq!(cells[3].parse::<f64>().ok(), Some(cost.vs_base), "{line}");
            checked += 1;
        }
        assert_eq!(
            checked, 10,
            "the base and every strategy are in README's results table"
        );
    }
}
