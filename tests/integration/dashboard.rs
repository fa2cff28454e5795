//! The dashboard in a real browser: Debian's chromium, driven by playwright-core
//! (`tests/browser/*.mjs`), against replicas started here. `scripts/test.sh` installs
//! chromium and playwright-core. Screenshots land in `target/`: dashboard.png,
//! race-locked.png, race-none.png, comparison.png and phone.png from the first test,
//! kill-and-return.png from the second.

use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::process::Child;

use crate::support::{TestCluster, free_port, wait_healthy};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Runs `tests/browser/<script>` with `args` under node, for at most `limit`, and
/// fails the test with its output if it fails.
async fn run_browser_script(script: &str, args: &[&str], limit: Duration) {
    assert!(
        root()
            .join("tests/browser/node_modules/playwright-core")
            .is_dir()
            && Path::new("/usr/bin/chromium").exists(),
        "chromium or playwright-core missing: run ./scripts/test.sh, which installs them"
    );
    let run = tokio::process::Command::new("node")
        .arg(root().join("tests/browser").join(script))
        .args(args)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(limit, run)
        .await
        .unwrap_or_else(|_| panic!("{script} finished within {limit:?}"))
        .expect("node runs");
    println!("{}", String::from_utf8_lossy(&output.stdout));
    eprintln!("{}", String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{script} failed (see above)");
}

fn screenshot(name: &str) -> PathBuf {
    root().join("target").join(name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_follows_the_sale_in_a_browser() {
    // 50 ms of work per order makes `none` oversell for certain when 20 buy at once.
    // The replica says it was restarted twice, as `flashsale cluster` would tell it,
    // so the page must show the restart. The lease and lock wait are the service's
    // defaults (10 s, 5 s): the page must time its paused-holder walkthrough for them.
    let cluster = TestCluster::start(1, &["--work-ms", "50", "--restarts", "2"]).await;
    let shot = screenshot("dashboard.png");
    run_browser_script(
        "dashboard.mjs",
        &[&cluster.replicas[0].base_url, &shot.to_string_lossy()],
        Duration::from_secs(180),
    )
    .await;
}

/// The settings of both replicas of the kill test: the page times its pause from the
/// lease of the replica serving it, so the holder must have the same.
const KILL_TEST_TIMING: [&str; 4] = ["--work-ms", "50", "--lock-lease-ms", "4000"];

/// `flashsale cluster` supervising one replica, `replica-2`, on the test's database and
/// namespace, in a process group of its own: dropping it (a failed assertion included)
/// kills the supervisor and its replica together.
struct Supervised {
    _child: Child,
    pid: i32,
    base_url: String,
}

impl Supervised {
    async fn start(cluster: &TestCluster) -> Supervised {
        let port = free_port().to_string();
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_flashsale"))
            .args(["cluster", "--replicas", "1", "--base-port", &port, "--"])
            // The supervisor names its replicas replica-1, replica-2...: this one joins
            // the test's in-process replica-1 under another name.
            .args(["--replica-id", "replica-2"])
            .args(["--database-url", &cluster.database_url])
            .args(["--namespace", &cluster.namespace])
            .args(["--db-pool", "4", "--redis-pool", "8"])
            .args(KILL_TEST_TIMING)
            .env("RUST_LOG", "warn")
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .expect("start flashsale cluster");
        let pid = i32::try_from(child.id().expect("running")).expect("pid");
        let base_url = format!("http://127.0.0.1:{port}");
        Supervised {
            _child: child,
            pid,
            base_url,
        }
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        let _ = killpg(Pid::from_raw(self.pid), Signal::SIGKILL);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kill_button_kills_a_supervised_holder_and_the_page_sees_it_return() {
    let cluster = TestCluster::start(1, &KILL_TEST_TIMING).await;
    let supervised = Supervised::start(&cluster).await;
    assert!(
        wait_healthy(&supervised.base_url).await,
        "the supervised replica did not become healthy"
    );
    let shot = screenshot("kill-and-return.png");
    run_browser_script(
        "kill.mjs",
        &[
            &cluster.replicas[0].base_url,
            &supervised.base_url,
            &shot.to_string_lossy(),
        ],
        Duration::from_secs(120),
    )
    .await;
}
