//! Load tests started from the dashboard: the replica runs the built `loadtest` binary
//! against the live replicas and streams its output lines to the page.
//!
//! One load test at a time per replica. The binary is looked up beside this one
//! (`target/release/loadtest` next to `target/release/flashsale`) unless configured;
//! when it is missing the dashboard says how to build it.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::{broadcast, watch};
use utoipa::ToSchema;

use crate::config::AdminToken;

/// Output lines kept for a page that connects mid-run: enough for a run over every
/// strategy, each of which prints its progress and Goose's summary (~45 lines).
const RECENT_LINES: usize = 1000;

pub const BUILD_HINT: &str = "cargo build --release -p loadtest";

/// What the page asks for. Bounds keep a click from becoming an unbounded load.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LoadTestRequest {
    /// Strategy names; empty means all.
    #[serde(default)]
    #[schema(value_type = Vec<crate::model::StrategyName>)]
    pub strategies: Vec<String>,
    #[schema(minimum = 1, maximum = 1000)]
    pub users: u64,
    #[schema(minimum = 1, maximum = 100_000)]
    pub stock: i64,
    #[serde(default = "one")]
    #[schema(minimum = 1, maximum = 64, default = 1)]
    pub skus: u64,
    /// `pause-holder` to inject the paused-holder fault into each run.
    #[serde(default)]
    #[schema(pattern = "^pause-holder$")]
    pub fault: Option<String>,
    /// The share of shoppers who send every order twice at once
    /// (`--double-click-share`).
    #[serde(default)]
    #[schema(minimum = 0, maximum = 1, default = 0)]
    pub double_click_share: f64,
    /// Send no `Idempotency-Key` with the orders (`--no-idempotency-key`): the
    /// lesson's "before", where a double click buys twice.
    #[serde(default)]
    pub no_idempotency_key: bool,
}

fn one() -> u64 {
    1
}

impl LoadTestRequest {
    pub fn validate(&self, known: &[&str]) -> Result<(), String> {
        if !(1..=1000).contains(&self.users) {
            return Err("users must be from 1 to 1000".into());
        }
        if !(1..=100_000).contains(&self.stock) {
            return Err("stock must be from 1 to 100000".into());
        }
        if !(1..=64).contains(&self.skus) {
            return Err("skus must be from 1 to 64".into());
        }
        if let Some(unknown) = self
            .strategies
            .iter()
            .find(|s| !known.contains(&s.as_str()))
        {
            return Err(format!("unknown strategy '{unknown}'"));
        }
        if self
            .fault
            .as_deref()
            .is_some_and(|fault| fault != "pause-holder")
        {
            return Err("fault must be \"pause-holder\" or absent".into());
        }
        if !(0.0..=1.0).contains(&self.double_click_share) {
            return Err("double_click_share must be from 0 to 1".into());
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct LoadTestStatus {
    pub available: bool,
    pub binary: String,
    /// How to build the binary when it is missing.
    pub hint: Option<&'static str>,
    pub running: bool,
    pub recent: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("the load-test binary {0} is not built; build it with `{BUILD_HINT}`")]
    NotBuilt(String),
    #[error("a load test is already running on this replica")]
    AlreadyRunning,
    #[error("could not start the load test: {0}")]
    Spawn(#[from] std::io::Error),
}

pub struct LoadTests {
    binary: PathBuf,
    report_dir: PathBuf,
    /// Passed to the load test in its environment (never on its command line, which
    /// any local user can read).
    admin_token: Option<AdminToken>,
    running: Mutex<bool>,
    /// Set when the replica shuts down: a running load test is stopped, since it
    /// targets this replica too and would hold its shutdown up.
    stopping: watch::Sender<bool>,
    recent: Mutex<VecDeque<String>>,
    lines: broadcast::Sender<String>,
}

impl LoadTests {
    pub fn new(
        binary: Option<PathBuf>,
        report_dir: PathBuf,
        admin_token: Option<AdminToken>,
    ) -> LoadTests {
        let binary = binary.unwrap_or_else(|| {
            std::env::current_exe()
                .ok()
                .and_then(|exe| exe.parent().map(|dir| dir.join("loadtest")))
                .unwrap_or_else(|| PathBuf::from("loadtest"))
        });
        LoadTests {
            binary,
            report_dir,
            admin_token,
            running: Mutex::new(false),
            recent: Mutex::new(VecDeque::new()),
            lines: broadcast::channel(1024).0,
            stopping: watch::Sender::new(false),
        }
    }

    /// Output lines as they come, for the live feed.
    pub fn subscribe(&self) -> broadcast::Receiver<String> {
        self.lines.subscribe()
    }

    pub fn status(&self) -> LoadTestStatus {
        let available = self.binary.is_file();
        LoadTestStatus {
            available,
            binary: self.binary.display().to_string(),
            hint: (!available).then_some(BUILD_HINT),
            running: *self.running.lock().unwrap_or_else(|e| e.into_inner()),
            recent: self
                .recent
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .cloned()
                .collect(),
        }
    }

    /// Starts the load test against `targets` and returns at once; the output goes to
    /// subscribers and the recent lines.
    pub fn start(
        self: &std::sync::Arc<Self>,
        targets: &[String],
        request: &LoadTestRequest,
    ) -> Result<(), StartError> {
        if !self.binary.is_file() {
            return Err(StartError::NotBuilt(self.binary.display().to_string()));
        }
        {
            let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
            if *running {
                return Err(StartError::AlreadyRunning);
            }
            *running = true;
        }
        let strategies = if request.strategies.is_empty() {
            "all".to_owned()
        } else {
            request.strategies.join(",")
        };
        let mut command = tokio::process::Command::new(&self.binary);
        // `flashsale cluster` gives this replica its share of the cores; the load
        // generator is a program of its own and sizes its runtime to the machine.
        command.env_remove("TOKIO_WORKER_THREADS");
        command
            .arg("--targets")
            .arg(targets.join(","))
            .args(["--strategies", &strategies])
            .args(["--users", &request.users.to_string()])
            .args(["--stock", &request.stock.to_string()])
            .args(["--skus", &request.skus.to_string()])
            .arg("--out")
            .arg(&self.report_dir);
        if let Some(fault) = &request.fault {
            command.args(["--fault", fault]);
        }
        if request.double_click_share > 0.0 {
            command.args([
                "--double-click-share",
                &request.double_click_share.to_string(),
            ]);
        }
        if request.no_idempotency_key {
            command.arg("--no-idempotency-key");
        }
        if let Some(token) = &self.admin_token {
            command.env("FLASHSALE_ADMIN_TOKEN", token.reveal());
        }
        let spawned = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(error) => {
                *self.running.lock().unwrap_or_else(|e| e.into_inner()) = false;
                return Err(error.into());
            }
        };
        self.recent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.publish(format!(
            "started: {strategies}, {} users, stock {}",
            request.users, request.stock
        ));
        let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
        let this = self.clone();
        tokio::spawn(async move {
            let forward_out = this.forward(stdout);
            let forward_err = this.forward(stderr);
            let mut stopping = this.stopping.subscribe();
            let ended = async {
                tokio::select! {
                    status = child.wait() => Some(status),
                    // The guard `wait_for` returns is not Send; keep only that it fired.
                    _ = async { stopping.wait_for(|stop| *stop).await.is_ok() } => {
                        if let Err(error) = child.kill().await {
                            tracing::warn!(%error, "could not stop the load test");
                        }
                        None
                    }
                }
            };
            let (_, _, status) = tokio::join!(forward_out, forward_err, ended);
            let outcome = match status {
                None => "stopped: this replica is shutting down".to_owned(),
                Some(Ok(status)) if status.success() => "finished".to_owned(),
                // The load test's own verdict (docs/report.md), its report written.
                Some(Ok(status)) if status.code() == Some(1) => {
                    "finished: a lock strategy oversold or ended inconsistent (see the report)"
                        .to_owned()
                }
                Some(Ok(status)) => format!("failed ({status})"),
                Some(Err(error)) => format!("failed ({error})"),
            };
            this.publish(format!("done: load test {outcome}"));
            *this.running.lock().unwrap_or_else(|e| e.into_inner()) = false;
        });
        Ok(())
    }

    /// Stops the running load test, if any (on shutdown).
    pub fn stop(&self) {
        self.stopping.send_replace(true);
    }

    async fn forward(&self, pipe: Option<impl tokio::io::AsyncRead + Unpin>) {
        let Some(pipe) = pipe else { return };
        let mut lines = BufReader::new(pipe).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if !line.trim().is_empty() {
                self.publish(line);
            }
        }
    }

    fn publish(&self, line: String) {
        {
            let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
            if recent.len() == RECENT_LINES {
                recent.pop_front();
            }
            recent.push_back(line.clone());
        }
        // No subscriber is fine: the page may not be open.
        let _ = self.lines.send(line);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(users: u64, stock: i64, strategies: &[&str]) -> LoadTestRequest {
        LoadTestRequest {
            strategies: strategies.iter().map(|s| s.to_string()).collect(),
            users,
            stock,
            skus: 1,
            fault: None,
            double_click_share: 0.0,
            no_idempotency_key: false,
        }
    }

    #[test]
    fn requests_are_bounded() {
        let known = ["none", "redis-lock"];
        assert!(request(60, 200, &[]).validate(&known).is_ok());
        assert!(request(60, 200, &["none"]).validate(&known).is_ok());
        assert!(request(0, 200, &[]).validate(&known).is_err());
        assert!(request(5000, 200, &[]).validate(&known).is_err());
        assert!(request(60, 0, &[]).validate(&known).is_err());
        assert!(request(60, 200, &["magic"]).validate(&known).is_err());
        let mut faulty = request(60, 200, &[]);
        faulty.fault = Some("pause-holder".into());
        assert!(faulty.validate(&known).is_ok());
        faulty.fault = Some("rm -rf".into());
        assert!(faulty.validate(&known).is_err());
        let mut clicking = request(60, 200, &[]);
        clicking.double_click_share = 0.2;
        assert!(clicking.validate(&known).is_ok());
        clicking.double_click_share = 1.5;
        assert!(clicking.validate(&known).is_err());
    }
}
