//! A small crowd against in-process replicas: the report's orders and oversold must be
//! exactly what MySQL holds, and the report lands in the run history.

use clap::Parser;
use loadtest::options::Options;

use crate::support::TestCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn report_figures_are_the_services_records() {
    let cluster = TestCluster::start(2, &["--work-ms", "20", "--lock-wait-ms", "20000"]).await;
    let targets = format!(
        "{},{}",
        cluster.replicas[0].base_url, cluster.replicas[1].base_url
    );
    let out = std::env::temp_dir().join(format!("flashsale-loadtest-{}", cluster.namespace));
    let mysql = cluster.mysql().await;

    let request_log = format!(
        "--goose=--request-log={}",
        out.join("requests.csv").display()
    );
    for strategy in ["none", "redis-lock"] {
        let options = Options::parse_from([
            "loadtest",
            "--targets",
            &targets,
            "--strategies",
            strategy,
            "--users",
            "20",
            "--stock",
            "15",
            // redis-lock's SKUs get their own stock; none keeps --stock.
            "--stock-for",
            "redis-lock=12",
            "--skus",
            "2",
            "--max-seconds",
            "30",
            "--grace-ms",
            "200",
            // Goose's own options pass through.
            &request_log,
            "--out",
            &out.to_string_lossy(),
        ]);
        let (service, strategies) = loadtest::prepare(&options).await.expect("targets ready");
        let report = loadtest::run(&options, &service, &strategies)
            .await
            .expect("load ran");
        let run = &report.runs[0];

        let orders: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM orders WHERE sku LIKE 'sale-%'")
            .fetch_one(&mysql)
            .await
            .expect("count");
        assert_eq!(run.orders as i64, orders, "{strategy}: orders are MySQL's");
        let units = if strategy == "redis-lock" { 24 } else { 30 };
        assert_eq!(
            run.initial_stock, units,
            "{strategy}: the stock it was given"
        );
        assert_eq!(
            run.oversold,
            (orders - units).max(0),
            "{strategy}: oversold from MySQL"
        );
        // Every 201 the crowd received is a row in MySQL, and nothing else is (no
        // shopper hangs up here, so no answer is lost).
        assert_eq!(
            run.orders_acknowledged as i64, orders,
            "{strategy}: 201s are MySQL's rows"
        );
        let stock: i64 = sqlx::query_scalar(
            "SELECT CAST(SUM(stock) AS SIGNED) FROM products WHERE sku LIKE 'sale-%'",
        )
        .fetch_one(&mysql)
        .await
        .expect("stock");
        assert_eq!(run.stock_mysql, stock, "{strategy}: stock is MySQL's");
        assert!(
            run.latency_ms.p50 <= run.latency_ms.p99 && run.latency_ms.p99 <= run.latency_ms.max
        );
        match strategy {
            "none" => assert!(run.oversold > 0, "none oversells: {run:?}"),
            _ => assert_eq!((run.oversold, run.consistent), (0, true), "{run:?}"),
        }

        loadtest::report::write_files(&report, &out).expect("report files");
        service
            .save_report(&report)
            .await
            .expect("saved to /api/runs");
    }

    let written: flashsale::report::LoadReport = serde_json::from_str(
        &std::fs::read_to_string(out.join("report.json")).expect("report.json"),
    )
    .expect("report.json parses as docs/report.md's report");
    assert_eq!(written.runs[0].strategy, "redis-lock");
    assert!(out.join("report.md").exists());
    // Goose creates the file when the attack starts and fills it only at the end.
    let goose_report = std::fs::read_to_string(out.join("goose-none.html")).expect("goose");
    assert!(
        goose_report.contains("POST buy"),
        "Goose's HTML report has the requests: {} bytes",
        goose_report.len()
    );
    assert!(
        out.join("requests.csv").exists(),
        "Goose's request log, asked for with --goose"
    );
    let history = cluster.get_json(0, "/api/runs").await;
    assert_eq!(
        history.as_array().map(Vec::len),
        Some(2),
        "both reports in the history"
    );
    assert_eq!(
        history[0]["runs"][0]["strategy"], "redis-lock",
        "newest first"
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// The open model and `--repeat`: arrivals at a fixed rate, every strategy run twice
/// (interleaved), each run's figures MySQL's, the table one row per strategy.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_open_model_repeated_run_is_counted_from_the_records() {
    let cluster = TestCluster::start(2, &["--lock-wait-ms", "20000"]).await;
    let targets = format!(
        "{},{}",
        cluster.replicas[0].base_url, cluster.replicas[1].base_url
    );
    let options = Options::parse_from([
        "loadtest",
        "--targets",
        &targets,
        "--strategies",
        "redis-lock,redis-atomic",
        "--rate",
        "100",
        "--repeat",
        "2",
        "--stock",
        "40",
        "--max-seconds",
        "20",
        "--grace-ms",
        "200",
        "--no-history",
    ]);
    let (service, strategies) = loadtest::prepare(&options).await.expect("targets ready");
    let report = loadtest::run(&options, &service, &strategies)
        .await
        .expect("load ran");
    let order: Vec<(&str, u32)> = report
        .runs
        .iter()
        .map(|r| (r.strategy.as_str(), r.repeat))
        .collect();
    assert_eq!(
        order,
        [
            ("redis-lock", 1),
            ("redis-atomic", 1),
            ("redis-lock", 2),
            ("redis-atomic", 2)
        ]
    );
    for run in &report.runs {
        assert_eq!(
            (run.orders, run.oversold, run.consistent),
            (40, 0, true),
            "{run:?}"
        );
        assert_eq!(run.orders_acknowledged, 40, "{run:?}");
        assert!(run.sell_out_s.is_some(), "sold out: {run:?}");
    }
    assert!(loadtest::report::violations(&report).is_empty());
    let table = loadtest::report::text_table(&report);
    assert_eq!(
        table.lines().count(),
        3,
        "a header and one row per strategy:\n{table}"
    );
    assert!(
        table.contains("redis-atomic") && table.contains('–'),
        "{table}"
    );
}

#[tokio::test]
async fn bad_arguments_stop_before_any_load() {
    assert!(
        Options::try_parse_from(["loadtest", "--users", "0"]).is_err(),
        "zero users"
    );
    assert!(
        Options::try_parse_from(["loadtest", "--stock", "-3"]).is_err(),
        "negative stock"
    );
    for bad in ["redis-atomic", "redis-atomic=0", "=10", "redis-atomic=lots"] {
        assert!(
            Options::try_parse_from(["loadtest", "--stock-for", bad]).is_err(),
            "--stock-for {bad}"
        );
    }
    let options = Options::parse_from([
        "loadtest",
        "--stock",
        "30",
        "--stock-for",
        "redis-atomic=500",
    ]);
    assert_eq!(
        (options.stock_of("redis-atomic"), options.stock_of("etcd")),
        (500, 30)
    );

    let options = Options::parse_from(["loadtest", "--goose=--no-such-goose-option"]);
    let error = loadtest::prepare(&options)
        .await
        .err()
        .expect("bad Goose option");
    assert!(error.to_string().contains("--goose options"), "{error}");

    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("port");
    let unreachable = format!("http://{}", closed.local_addr().expect("address"));
    drop(closed);
    let options = Options::parse_from(["loadtest", "--targets", &unreachable]);
    let error = loadtest::prepare(&options)
        .await
        .err()
        .expect("unreachable target");
    assert!(error.to_string().contains("unreachable"), "{error}");

    let cluster = TestCluster::start(1, &[]).await;
    let options = Options::parse_from([
        "loadtest",
        "--targets",
        &cluster.replicas[0].base_url,
        "--strategies",
        "none,magic",
    ]);
    let error = loadtest::prepare(&options)
        .await
        .err()
        .expect("unknown strategy");
    assert!(
        error.to_string().contains("unknown strategy 'magic'"),
        "{error}"
    );
    let options = Options::parse_from([
        "loadtest",
        "--targets",
        &cluster.replicas[0].base_url,
        "--stock-for",
        "magic=10",
    ]);
    let error = loadtest::prepare(&options)
        .await
        .err()
        .expect("unknown strategy given a stock");
    assert!(error.to_string().contains("--stock-for"), "{error}");
}

/// `--cohort off|on` switches the cluster's cohort layer before the runs, as
/// `--fencing` switches fencing, and the report's `config` records the mode the runs
/// had (from the service's stats, not from the option); without the option the
/// cluster is left as it is. Markdown says it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cohort_option_switches_the_cluster_and_is_recorded() {
    let cluster = TestCluster::start(1, &["--lock-wait-ms", "20000"]).await;
    let out = std::env::temp_dir().join(format!("flashsale-cohort-{}", cluster.namespace));
    let run = |cohort: Option<&'static str>| {
        let mut args = vec![
            "loadtest".to_owned(),
            "--targets".to_owned(),
            cluster.replicas[0].base_url.clone(),
            "--strategies".to_owned(),
            "redis-lock".to_owned(),
            "--users".to_owned(),
            "4".to_owned(),
            "--stock".to_owned(),
            "5".to_owned(),
            "--max-seconds".to_owned(),
            "20".to_owned(),
            "--grace-ms".to_owned(),
            "0".to_owned(),
            "--out".to_owned(),
            out.to_string_lossy().into_owned(),
        ];
        if let Some(cohort) = cohort {
            args.extend(["--cohort".to_owned(), cohort.to_owned()]);
        }
        async move {
            let options = Options::parse_from(args);
            let (service, strategies) = loadtest::prepare(&options).await.expect("ready");
            loadtest::run(&options, &service, &strategies)
                .await
                .expect("load ran")
        }
    };
    let cohort_now = || async { cluster.get_json(0, "/api/admin/cohort").await["enabled"].clone() };

    let report = run(Some("off")).await;
    assert_eq!(report.config.cohort, Some(false));
    assert_eq!(cohort_now().await, false, "the cluster was switched off");
    assert_eq!(
        (report.runs[0].oversold, report.runs[0].consistent),
        (0, true)
    );
    assert!(
        loadtest::report::markdown(&report).contains("Cohort layer: off"),
        "the markdown says the mode"
    );
    let report = run(None).await;
    assert_eq!(report.config.cohort, Some(false), "left as it was");
    let report = run(Some("on")).await;
    assert_eq!(report.config.cohort, Some(true));
    assert_eq!(cohort_now().await, true);
    let _ = std::fs::remove_dir_all(&out);
}

/// Objectives, as k6's thresholds, and the run's provenance: a run that misses `--max-p99-ms` (here an
/// unreachable 1 µs) fails the load test, naming the strategy, though nothing was
/// oversold; a reachable objective passes. Without `slo::judge` in the verdict the
/// run would pass on its records alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_missed_objective_fails_the_run_and_names_the_strategy() {
    let cluster = TestCluster::start(1, &["--lock-wait-ms", "20000"]).await;
    let out = std::env::temp_dir().join(format!("flashsale-slo-{}", cluster.namespace));
    let options = Options::parse_from([
        "loadtest",
        "--targets",
        &cluster.replicas[0].base_url,
        "--strategies",
        "redis-lock",
        "--users",
        "4",
        "--stock",
        "8",
        "--max-seconds",
        "20",
        "--max-p99-ms",
        "redis-lock=0.001",
        "--min-orders-per-s",
        "0.5",
        "--no-history",
        "--out",
        &out.to_string_lossy(),
    ]);
    let (service, strategies) = loadtest::prepare(&options).await.expect("targets ready");
    let report = loadtest::run(&options, &service, &strategies)
        .await
        .expect("load ran");
    assert_eq!(report.runs[0].oversold, 0, "{:?}", report.runs[0]);
    // The report says what produced it: the replica's commit and settings, the machine.
    let made_by = report.config.provenance.clone().expect("provenance");
    let head = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .expect("git");
    let head = String::from_utf8_lossy(&head.stdout).trim().to_owned();
    assert_eq!(made_by.commit.as_deref(), Some(head.as_str()));
    assert_eq!(
        (made_by.replicas, made_by.lock_wait_ms),
        (1, 20000),
        "{made_by:?}"
    );
    assert!(
        made_by.cores >= 1 && made_by.memory_mib.is_some_and(|m| m > 0),
        "{made_by:?}"
    );
    let objectives = loadtest::slo::Objectives {
        max_p99_ms: options.max_p99_ms.clone(),
        min_orders_per_s: options.min_orders_per_s.clone(),
    };
    let failures = loadtest::slo::judge(&report, &objectives);
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert!(
        failures[0].starts_with("redis-lock (run 1): p99 ") && failures[0].contains("--max-p99-ms"),
        "{failures:?}"
    );
    let reachable = loadtest::slo::Objectives {
        max_p99_ms: Some(loadtest::slo::parse_objective("60000").expect("parses")),
        ..objectives
    };
    assert!(loadtest::slo::judge(&report, &reachable).is_empty());
    let _ = std::fs::remove_dir_all(&out);
}
