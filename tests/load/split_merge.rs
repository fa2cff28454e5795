//! A crowd split in two, as over two machines: `loadtest --part 1/2` and `--part 2/2`,
//! each its own process (Goose keeps process-wide state, so two crowds cannot share
//! one), against in-process replicas; then `loadtest merge`. The merged report's
//! orders and oversold must be what MySQL holds, its counts the parts' sums, its
//! latency the parts' raw histograms merged.

use std::path::Path;
use std::time::Duration;

use clap::Parser;
use flashsale::report::LoadReport;
use loadtest::options::Options;
use loadtest::split::{PartialReport, decode_times};

use crate::support::TestCluster;

/// The loadtest arguments (JSON) of a part's process.
const PART_ARGS: &str = "FLASHSALE_TEST_PART_ARGS";
const PART_TEST: &str = "split_merge::part_process";

/// Not a test of its own: what a part's process runs (what `loadtest --part K/N`
/// runs). The test below starts this test binary again, with this function alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a part's process, started by a_crowd_split_in_two_merges_into_the_records"]
async fn part_process() {
    let Ok(args) = std::env::var(PART_ARGS) else {
        return;
    };
    let args: Vec<String> = serde_json::from_str(&args).expect("arguments");
    let options = Options::parse_from(args);
    let (service, strategies) = loadtest::prepare(&options).await.expect("targets ready");
    let (part, doors_open) = (
        options.part.expect("--part"),
        options.doors_open.expect("--doors-open"),
    );
    let partial = loadtest::split::run_part(&options, &service, &strategies, part, doors_open)
        .await
        .expect("the part played");
    loadtest::split::publish(&partial, &options.out).expect("report written");
}

/// Starts part `k` of 2 as a process; returns its standard output.
async fn part(k: u32, args: &[String]) -> String {
    let mut args = args.to_vec();
    args.extend(["--part".to_owned(), format!("{k}/2")]);
    let output = tokio::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([PART_TEST, "--exact", "--ignored", "--nocapture"])
        .env(PART_ARGS, serde_json::to_string(&args).expect("json"))
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(60), output)
        .await
        .expect("the part ends within a minute")
        .expect("the part runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "part {k}/2 failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

fn read_part(out: &Path, k: u32) -> PartialReport {
    let path = out.join(format!("part-{k}-of-2.json"));
    serde_json::from_str(&std::fs::read_to_string(&path).expect("part report")).expect("parses")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crowd_split_in_two_merges_into_the_records() {
    let cluster = TestCluster::start(2, &["--work-ms", "20", "--lock-wait-ms", "20000"]).await;
    let targets = format!(
        "{},{}",
        cluster.replicas[0].base_url, cluster.replicas[1].base_url
    );
    let out = std::env::temp_dir().join(format!("flashsale-split-{}", cluster.namespace));
    // The moment both parts agree on, in time for two processes to start.
    let doors_open = chrono::Utc::now() + chrono::TimeDelta::seconds(3);
    let args: Vec<String> = [
        "loadtest",
        "--targets",
        &targets,
        "--strategies",
        "none,redis-lock",
        "--users",
        "20",
        "--stock",
        "15",
        "--skus",
        "2",
        "--max-seconds",
        "3",
        "--grace-ms",
        "200",
        "--doors-open",
        &doors_open.timestamp_millis().to_string(),
        "--out",
        &out.to_string_lossy(),
    ]
    .map(str::to_owned)
    .to_vec();
    let (stdout_1, stdout_2) = tokio::join!(part(1, &args), part(2, &args));
    let parts = [read_part(&out, 1), read_part(&out, 2)];
    // Each part printed the report it wrote: `kubectl logs` is enough to merge.
    let printed: Vec<PartialReport> = [&stdout_1, &stdout_2]
        .iter()
        .flat_map(|stdout| loadtest::merge::parse(stdout).expect("printed report parses"))
        .collect();
    assert_eq!(printed, parts, "printed and written reports are the same");

    let report = loadtest::merge::merge(parts.to_vec()).expect("the parts merge");
    assert_eq!((report.config.parts, report.config.users), (2, 20));
    let mysql = cluster.mysql().await;
    for (i, run) in report.runs.iter().enumerate() {
        let strategy = &run.strategy;
        let shares = [&parts[0].runs[i], &parts[1].runs[i]];
        assert_eq!(shares[0].skus, shares[1].skus);
        assert!(
            shares.iter().all(|s| s.requests > 0),
            "{strategy}: both parts bought: {shares:?}"
        );
        assert_eq!(
            (shares[0].users, shares[1].users),
            (10, 10),
            "the crowd split evenly"
        );
        let orders: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM orders WHERE sku IN (?, ?)")
            .bind(&shares[0].skus[0])
            .bind(&shares[0].skus[1])
            .fetch_one(&mysql)
            .await
            .expect("count");
        assert_eq!(run.orders as i64, orders, "{strategy}: orders are MySQL's");
        assert_eq!(
            run.orders_acknowledged as i64, orders,
            "{strategy}: every 201 either part received is a row, and nothing else is"
        );
        assert_eq!(run.initial_stock, 30);
        assert_eq!(run.oversold, (orders - 30).max(0), "{strategy}: oversold");
        assert_eq!(run.requests, shares.iter().map(|s| s.requests).sum::<u64>());
        assert!(run.sell_out_s.is_some(), "{strategy} sold out: {run:?}");

        // Latency from the raw histograms: the whole crowd's count and maximum, and
        // percentiles among the parts', not their average.
        let times = shares.map(|s| decode_times(&s.latency_us).expect("histogram"));
        let ms = |us: u64| us as f64 / 1000.0;
        assert_eq!(
            run.latency_ms.max,
            ms(times.iter().map(|t| t.max()).max().unwrap_or(0))
        );
        for t in &times {
            assert!(
                run.latency_ms.p99 >= ms(t.value_at_quantile(0.5)),
                "{run:?}"
            );
        }
        let medians = times.each_ref().map(|t| ms(t.value_at_quantile(0.5)));
        assert!(
            medians[0].min(medians[1]) <= run.latency_ms.p50
                && run.latency_ms.p50 <= medians[0].max(medians[1]),
            "{strategy}: p50 {} between the parts' {medians:?}",
            run.latency_ms.p50
        );
        match strategy.as_str() {
            "none" => assert!(run.oversold > 0, "none oversells: {run:?}"),
            _ => assert_eq!((run.oversold, run.consistent), (0, true), "{run:?}"),
        }
    }

    loadtest::report::write_files(&report, &out).expect("report files");
    let written: LoadReport = serde_json::from_str(
        &std::fs::read_to_string(out.join("report.json")).expect("report.json"),
    )
    .expect("report.json parses as docs/report.md's report");
    assert_eq!(written.config.parts, 2);
    assert!(loadtest::report::markdown(&written).contains("redis-lock"));
    let _ = std::fs::remove_dir_all(&out);
}
