//! The dashboard in a real browser: Debian's chromium, driven by playwright-core
//! (`tests/browser/dashboard.mjs`), against a replica started here. `scripts/test.sh`
//! installs chromium and playwright-core.

use std::path::Path;
use std::time::Duration;

use crate::support::TestCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_follows_the_sale_in_a_browser() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let script = root.join("tests/browser/dashboard.mjs");
    assert!(
        root.join("tests/browser/node_modules/playwright-core")
            .is_dir()
            && Path::new("/usr/bin/chromium").exists(),
        "chromium or playwright-core missing: run ./scripts/test.sh, which installs them"
    );
    // 50 ms of work per order makes `none` oversell for certain when 20 buy at once.
    // The replica says it was restarted twice, as `flashsale cluster` would tell it,
    // so the page must show the restart.
    let cluster = TestCluster::start(1, &["--work-ms", "50", "--restarts", "2"]).await;
    let screenshot = root.join("target/dashboard.png");

    let run = tokio::process::Command::new("node")
        .arg(&script)
        .arg(&cluster.replicas[0].base_url)
        .arg(&screenshot)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the browser test finished within 2 minutes")
        .expect("node runs");
    println!("{}", String::from_utf8_lossy(&output.stdout));
    eprintln!("{}", String::from_utf8_lossy(&output.stderr));
    assert!(
        output.status.success(),
        "the browser test failed (see above)"
    );
}
