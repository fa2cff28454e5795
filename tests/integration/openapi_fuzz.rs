//! The API fuzzed from its own OpenAPI document: schemathesis (from PyPI, installed by
//! `scripts/test.sh`) reads `/api/openapi.json` from a replica and sends it requests
//! the document allows and requests it forbids, with the admin token, and runs every
//! check it has: no 5xx, every status and body as documented, forbidden input
//! refused, admin calls refused without the token.
//!
//! Afterwards nothing may be oversold or inconsistent, and a SKU no generated request
//! names must be exactly as it was. The seed is printed; replay with `FUZZ_SEED`, and
//! raise the examples per operation with `FUZZ_EXAMPLES`.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use crate::support::TestCluster;

const TOKEN: &str = "openapi-fuzz-admin-token";
/// The document's example SKU: generated orders buy it.
const ON_SALE: &str = "phone-1";
const GUARDED: &str = "openapi-guard";

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_nothing_wrong_with_the_api() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = root.join("tests/schemathesis");
    let schemathesis = dir.join(".venv/bin/schemathesis");
    assert!(
        schemathesis.is_file(),
        "schemathesis missing: run ./scripts/test.sh, which installs it"
    );
    // `true` stands in for the load-test binary: a started load test ends at once.
    let cluster = TestCluster::start(
        1,
        &[
            "--admin-token",
            TOKEN,
            "--loadtest-bin",
            "/usr/bin/true",
            "--request-timeout-ms",
            "5000",
        ],
    )
    .await;
    cluster.reset(ON_SALE, 1000).await;
    cluster.reset(GUARDED, 7).await;
    assert_eq!(cluster.order(0, GUARDED, "first", 2).await.status(), 201);
    let before = cluster.sku_stats(GUARDED).await;

    let seed = env_number("FUZZ_SEED", 20_261_122);
    let examples = env_number("FUZZ_EXAMPLES", 50);
    println!(
        "schemathesis seed {seed}, {examples} examples per operation (FUZZ_SEED, FUZZ_EXAMPLES)"
    );
    let run = tokio::process::Command::new(&schemathesis)
        .arg("--config-file")
        .arg(dir.join("schemathesis.toml"))
        .arg("run")
        .arg(cluster.url(0, "/api/openapi.json"))
        .args(["--checks", "all"])
        .args(["--header", &format!("Authorization: Bearer {TOKEN}")])
        .args(["--seed", &seed.to_string()])
        .args(["--max-examples", &examples.to_string()])
        .args([
            "--workers",
            "1",
            "--generation-database",
            "none",
            "--no-color",
        ])
        // Its crash cache goes to the build's scratch space, not the work tree.
        .current_dir(env!("CARGO_TARGET_TMPDIR"))
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(600), run)
        .await
        .expect("schemathesis finished within 10 minutes")
        .expect("schemathesis runs");
    let report = String::from_utf8_lossy(&output.stdout);
    println!("{report}");
    eprintln!("{}", String::from_utf8_lossy(&output.stderr));
    assert!(
        output.status.success(),
        "schemathesis found problems (report above)"
    );

    let after = cluster.sku_stats(GUARDED).await;
    for field in ["initial_stock", "stock_redis", "stock_mysql", "orders"] {
        assert_eq!(after[field], before[field], "{GUARDED}.{field} changed");
    }
    let stats = cluster.get_json(0, "/api/stats").await;
    let skus = stats["skus"].as_array().expect("stats list SKUs");
    for sku in skus {
        assert_eq!(sku["oversold"], 0, "oversold after the fuzz: {sku}");
        assert_eq!(
            sku["consistent"], true,
            "inconsistent after the fuzz: {sku}"
        );
    }
    println!("after the fuzz: {} SKUs, all consistent", skus.len());
}

/// The served document is this replica's own: its strategies and its largest quantity.
#[tokio::test]
async fn the_document_states_this_replicas_limits() {
    let cluster = TestCluster::start(1, &["--max-quantity", "3"]).await;
    let document = cluster.get_json(0, "/api/openapi.json").await;
    let schemas = &document["components"]["schemas"];
    assert_eq!(schemas["OrderBody"]["properties"]["quantity"]["maximum"], 3);
    let strategies = cluster.get_json(0, "/api/strategies").await;
    let names: Vec<&Value> = strategies
        .as_array()
        .expect("a list")
        .iter()
        .map(|s| &s["name"])
        .collect();
    let documented: Vec<&Value> = schemas["StrategyName"]["enum"]
        .as_array()
        .expect("an enum")
        .iter()
        .collect();
    assert_eq!(documented, names);
}
