//! `flashsale cluster`: several `serve` processes on consecutive ports, started and
//! stopped together. Separate processes (not tasks) so each replica has its own pools
//! and clients, as real replicas would, and can be killed on its own.
//!
//! Each child gets its port and replica id through the environment and inherits the
//! rest of the `FLASHSALE_*` configuration. On SIGINT/SIGTERM every child receives
//! SIGTERM and gets time to finish its in-flight orders; if one child exits by itself
//! the cluster stops the others and exits with an error, rather than limp along.

use std::time::Duration;

use anyhow::Context;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

use crate::config::ClusterConfig;

const STOP_GRACE: Duration = Duration::from_secs(15);

pub async fn run(config: ClusterConfig) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("locating the flashsale binary")?;
    let mut children = Vec::new();
    for index in 0..config.replicas {
        let port = config
            .base_port
            .checked_add(index)
            .context("replica port beyond 65535")?;
        let child = Command::new(&exe)
            .arg("serve")
            .args(&config.serve_args)
            .env("FLASHSALE_PORT", port.to_string())
            .env("FLASHSALE_REPLICA_ID", format!("replica-{}", index + 1))
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting replica {} on port {port}", index + 1))?;
        tracing::info!(
            replica = index + 1,
            port,
            pid = child.id(),
            "replica started"
        );
        children.push(child);
    }

    let outcome = tokio::select! {
        () = crate::app::shutdown_signal() => Ok(()),
        (index, status) = first_exit(&mut children) => {
            Err(anyhow::anyhow!("replica {} exited on its own ({status})", index + 1))
        }
    };
    for child in &mut children {
        stop(child).await;
    }
    outcome
}

/// Waits until any child exits, returning its index and status.
async fn first_exit(children: &mut [Child]) -> (usize, String) {
    let waits = children.iter_mut().enumerate().map(|(index, child)| {
        Box::pin(async move {
            let status = match child.wait().await {
                Ok(status) => status.to_string(),
                Err(error) => error.to_string(),
            };
            (index, status)
        })
    });
    futures::future::select_all(waits).await.0
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
