//! A short run of the fault explorer against in-process replicas: every round's sale
//! must end with the records in agreement and every unit sellable exactly once.

#[path = "../../tests/integration/support.rs"]
#[allow(dead_code)]
mod support;

use clap::Parser;
use loadtest::explore::{self, ExploreOptions};
use support::TestCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_short_exploration_finds_no_violation() {
    let cluster = TestCluster::start(
        2,
        &[
            "--lock-lease-ms",
            "1000",
            "--work-ms",
            "2",
            "--lock-wait-ms",
            "8000",
        ],
    )
    .await;
    let targets = format!(
        "{},{}",
        cluster.replicas[0].base_url, cluster.replicas[1].base_url
    );
    let seed = std::env::var("EXPLORE_SEED").unwrap_or_else(|_| "20261122".into());
    let rounds = std::env::var("EXPLORE_ROUNDS").unwrap_or_else(|_| "8".into());
    let out = std::env::temp_dir().join(format!("flashsale-explore-{}.json", cluster.namespace));
    let options = ExploreOptions::parse_from([
        "explore",
        "--targets",
        &targets,
        "--seed",
        &seed,
        "--rounds",
        &rounds,
        "--lease-ms",
        "1000",
        "--out",
        &out.to_string_lossy(),
    ]);
    let summary = explore::run(&options).await.expect("the explorer runs");
    assert!(
        summary.violations.is_empty(),
        "{}",
        serde_json::to_string_pretty(&summary.violations).unwrap_or_default()
    );
    assert!(
        summary.faults.values().sum::<u64>() > 0,
        "faults were injected"
    );
}
