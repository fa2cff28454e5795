//! `flashsale cluster`: a supervisor of several `serve` processes on consecutive ports.
//! Separate processes (not tasks) so each replica has its own pools and clients, as
//! real replicas would, and can be killed on its own.
//!
//! Each replica has a keeper task. When its process exits or dies (even `kill -9`),
//! the keeper logs it and starts it again on the same port and replica id after a
//! back-off that doubles from 250 ms to 8 s and starts over once a replica has stayed
//! up for 30 s; the other replicas serve on meanwhile. A replica that cannot start at
//! all is retried at the capped back-off, never in a busy loop. The restart count goes
//! to the replica (`FLASHSALE_RESTARTS`), which announces it, so the dashboard shows
//! the restart.
//!
//! On SIGINT/SIGTERM nothing is restarted any more: every replica receives SIGTERM and
//! gets time to finish its in-flight orders, then SIGKILL.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::ClusterConfig;

const STOP_GRACE: Duration = Duration::from_secs(15);
const FIRST_BACKOFF: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(8);
/// A replica up this long is healthy again: its next restart starts from the first
/// back-off.
const STABLE_AFTER: Duration = Duration::from_secs(30);

pub async fn run(config: ClusterConfig) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("locating the flashsale binary")?;
    let stopping = CancellationToken::new();
    let mut keepers = Vec::new();
    for index in 0..config.replicas {
        let port = config
            .base_port
            .checked_add(index)
            .context("replica port beyond 65535")?;
        let replica = Replica {
            exe: exe.clone(),
            serve_args: config.serve_args.clone(),
            port,
            id: format!("replica-{}", index + 1),
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

/// What it takes to start one replica.
struct Replica {
    exe: PathBuf,
    serve_args: Vec<String>,
    port: u16,
    id: String,
}

impl Replica {
    fn start(&self, restarts: u32) -> std::io::Result<Child> {
        Command::new(&self.exe)
            .arg("serve")
            .args(&self.serve_args)
            .env("FLASHSALE_PORT", self.port.to_string())
            .env("FLASHSALE_REPLICA_ID", &self.id)
            .env("FLASHSALE_RESTARTS", restarts.to_string())
            .kill_on_drop(true)
            .spawn()
    }
}

/// Keeps one replica running until `stopping`, then stops it.
async fn keep(replica: Replica, stopping: CancellationToken) {
    let mut restarts = 0u32;
    let mut backoff = FIRST_BACKOFF;
    loop {
        let started = Instant::now();
        match replica.start(restarts) {
            Ok(mut child) => {
                tracing::info!(replica = %replica.id, port = replica.port, pid = child.id(), restarts, "replica started");
                tokio::select! {
                    () = stopping.cancelled() => {
                        stop(&mut child).await;
                        return;
                    }
                    status = child.wait() => {
                        let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
                        tracing::warn!(replica = %replica.id, port = replica.port, %status,
                            restarts, "replica exited; restarting it");
                    }
                }
            }
            Err(error) => {
                tracing::error!(replica = %replica.id, %error, "replica could not start");
            }
        }
        if started.elapsed() >= STABLE_AFTER {
            backoff = FIRST_BACKOFF;
        }
        tracing::info!(replica = %replica.id, backoff_ms = backoff.as_millis() as u64, "restarting after back-off");
        tokio::select! {
            () = stopping.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
        restarts += 1;
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
