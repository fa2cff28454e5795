//! `flashsale cluster`: a supervisor of several `serve` processes on consecutive ports.
//! Separate processes (not tasks) so each replica has its own pools and clients, as
//! real replicas would, and can be killed on its own.
//!
//! Each replica has a keeper task. When its process exits or dies (even `kill -9`),
//! the keeper logs it (replica, pid, exit status, restart count, back-off) and starts
//! it again on the same port and replica id after a back-off that doubles from 250 ms
//! to 8 s and starts over once the replica has stayed up for 30 s; the other replicas
//! serve on meanwhile. A replica that cannot start at all is retried at the capped
//! back-off, never in a busy loop. The restart count goes to the replica
//! (`FLASHSALE_RESTARTS`), which announces it, so the dashboard shows the restart.
//!
//! Replicas on one machine share its cores, so each replica's Tokio runtime gets its
//! share of them (`TOKIO_WORKER_THREADS`, at least one) rather than a worker per
//! core: three replicas of two workers each on two cores spent the contended orders'
//! time waking and stealing between threads (BENCHMARKS, "Round trips per order",
//! item 8). A `TOKIO_WORKER_THREADS` set for the supervisor is passed on as it is.
//!
//! On SIGINT/SIGTERM nothing is restarted any more: every replica receives SIGTERM and
//! gets time to finish its in-flight orders, then SIGKILL. No replica outlives the
//! supervisor: a dropped child is killed (`kill_on_drop`), and a replica whose
//! supervisor died by `kill -9` notices and stops itself (`supervisor_gone`).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::ValueEnum;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::ClusterConfig;
use crate::logging::LogFormat;

const STOP_GRACE: Duration = Duration::from_secs(15);
const FIRST_BACKOFF: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(8);
/// A replica up this long is healthy again: its next restart starts from the first
/// back-off.
const STABLE_AFTER: Duration = Duration::from_secs(30);
/// How often a replica checks that its supervisor is still there.
const ORPHAN_CHECK: Duration = Duration::from_secs(1);

/// Runs the replicas until SIGINT/SIGTERM; they log in `log_format`, as the supervisor.
pub async fn run(config: ClusterConfig, log_format: LogFormat) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("locating the flashsale binary")?;
    let stopping = CancellationToken::new();
    let worker_threads = match std::env::var(WORKER_THREADS) {
        Ok(chosen) => chosen,
        Err(_) => {
            let cores = std::thread::available_parallelism().map_or(1, usize::from);
            workers_per_replica(cores, config.replicas).to_string()
        }
    };
    tracing::info!(replicas = config.replicas, worker_threads = %worker_threads, "starting replicas");
    let mut keepers = Vec::new();
    for index in 0..config.replicas {
        let port = config
            .base_port
            .checked_add(index)
            .context("replica port beyond 65535")?;
        let replica = Replica {
            exe: exe.clone(),
            serve_args: config.serve_args.clone(),
            log_format,
            port,
            id: format!("replica-{}", index + 1),
            worker_threads: worker_threads.clone(),
        };
        keepers.push(tokio::spawn(keep(replica, stopping.clone())));
    }
    crate::app::shutdown_signal().await;
    stopping.cancel();
    for keeper in keepers {
        if let Err(error) = keeper.await {
            tracing::error!(%error, "a replica keeper failed");
        }
    }
    Ok(())
}

/// Tokio's own setting of a runtime's worker threads.
const WORKER_THREADS: &str = "TOKIO_WORKER_THREADS";

/// Each replica's share of the machine's `cores`, at least one worker.
fn workers_per_replica(cores: usize, replicas: u16) -> usize {
    (cores / usize::from(replicas.max(1))).max(1)
}

/// What it takes to start one replica.
struct Replica {
    exe: PathBuf,
    serve_args: Vec<String>,
    log_format: LogFormat,
    port: u16,
    id: String,
    /// Its runtime's worker threads (`TOKIO_WORKER_THREADS`).
    worker_threads: String,
}

impl Replica {
    fn start(&self, restarts: u32) -> std::io::Result<Child> {
        Command::new(&self.exe)
            .arg("serve")
            .args(&self.serve_args)
            .env(
                "FLASHSALE_LOG_FORMAT",
                self.log_format
                    .to_possible_value()
                    .map_or("text".into(), |v| v.get_name().to_owned()),
            )
            .env("FLASHSALE_PORT", self.port.to_string())
            .env("FLASHSALE_REPLICA_ID", &self.id)
            .env("FLASHSALE_RESTARTS", restarts.to_string())
            .env("FLASHSALE_SUPERVISOR_PID", std::process::id().to_string())
            .env(WORKER_THREADS, &self.worker_threads)
            .kill_on_drop(true)
            .spawn()
    }
}

/// Keeps one replica running until `stopping`, then stops it.
async fn keep(replica: Replica, stopping: CancellationToken) {
    let mut restarts = 0u32;
    let mut backoff = Backoff::new();
    loop {
        let started = Instant::now();
        let (pid, status) = match replica.start(restarts) {
            Ok(mut child) => {
                let pid = child.id();
                tracing::info!(replica = %replica.id, port = replica.port, pid, restarts, "replica started");
                // Biased: a replica that exits during the shutdown (a terminal's Ctrl-C
                // reaches the children too) is stopped, not restarted.
                tokio::select! {
                    biased;
                    () = stopping.cancelled() => {
                        stop(&mut child).await;
                        return;
                    }
                    status = child.wait() => {
                        (pid, status.map_or_else(|e| format!("unknown ({e})"), |s| s.to_string()))
                    }
                }
            }
            Err(error) => (None, format!("could not start: {error}")),
        };
        if stopping.is_cancelled() {
            return;
        }
        let wait = backoff.after(started.elapsed());
        restarts = restarts.saturating_add(1);
        tracing::warn!(
            replica = %replica.id,
            port = replica.port,
            pid,
            %status,
            up_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            restart = restarts,
            backoff_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            "replica exited; restarting it after the back-off"
        );
        tokio::select! {
            biased;
            () = stopping.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// The wait before each restart: doubling from `FIRST_BACKOFF` up to `MAX_BACKOFF`
/// while a replica keeps dying young, back to the first once it stayed up
/// `STABLE_AFTER`.
struct Backoff {
    next: Duration,
}

impl Backoff {
    fn new() -> Self {
        Backoff {
            next: FIRST_BACKOFF,
        }
    }

    /// The wait after a run that lasted `uptime`.
    fn after(&mut self, uptime: Duration) -> Duration {
        if uptime >= STABLE_AFTER {
            self.next = FIRST_BACKOFF;
        }
        let wait = self.next;
        self.next = (wait * 2).min(MAX_BACKOFF);
        wait
    }
}

/// Completes once this replica's supervisor is gone; never for a replica without one.
/// `flashsale cluster` starts its replicas as its own children, so another parent means
/// the supervisor died without stopping them (`kill -9` leaves it no time) and the
/// replica was handed to init: it should stop rather than hold its port with nobody
/// left to restart or stop it.
pub async fn supervisor_gone(supervisor: Option<u32>) {
    let Some(supervisor) = supervisor else {
        return std::future::pending().await;
    };
    loop {
        let parent = std::os::unix::process::parent_id();
        if parent != supervisor {
            tracing::warn!(
                supervisor,
                parent,
                "the supervisor is gone; stopping this replica"
            );
            return;
        }
        tokio::time::sleep(ORPHAN_CHECK).await;
    }
}

/// SIGTERM, then SIGKILL if the child has not finished within the grace period.
async fn stop(child: &mut Child) {
    let Some(pid) = child.id() else { return };
    let Ok(pid) = i32::try_from(pid) else { return };
    if let Err(error) = kill(Pid::from_raw(pid), Signal::SIGTERM) {
        tracing::warn!(pid, %error, "could not signal replica");
    }
    if tokio::time::timeout(STOP_GRACE, child.wait())
        .await
        .is_err()
    {
        tracing::warn!(pid, "replica did not stop in time; killing it");
        let _ = child.kill().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_cap_and_starts_over_after_a_stable_run() {
        let mut backoff = Backoff::new();
        let young = Duration::from_millis(100);
        let waits: Vec<u128> = (0..7).map(|_| backoff.after(young).as_millis()).collect();
        assert_eq!(waits, [250, 500, 1000, 2000, 4000, 8000, 8000]);
        assert_eq!(backoff.after(STABLE_AFTER), FIRST_BACKOFF);
        assert_eq!(backoff.after(young), FIRST_BACKOFF * 2);
    }

    #[test]
    fn replicas_split_the_cores_and_each_keeps_one_worker() {
        assert_eq!(workers_per_replica(2, 3), 1);
        assert_eq!(workers_per_replica(8, 3), 2);
        assert_eq!(workers_per_replica(16, 1), 16);
        assert_eq!(workers_per_replica(1, 0), 1);
    }
}
