//! The nemesis: carries out a round's faults at their times while the crowd buys, and
//! keeps a log of what it actually did. A fault the cluster could not take (no holder
//! claimed a pause, the replica to kill was already down) is logged as missed rather
//! than failing the round: the checker judges the records, not the nemesis.
//!
//! `kill -9` is aimed only at a `flashsale` process on this machine whose pid a
//! replica announced in `/api/stats` for one of the targets; backend restarts and
//! session losses run only the commands the operator gave with `--disruptive`.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::Serialize;
use tokio::time::Instant;

use super::cluster::Cluster;
use super::schedule::{Disruption, Fault, Round};

/// A command the operator gave for a disruptive fault may take this long.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(120);

/// What the nemesis did in one round.
#[derive(Debug, Default, Serialize)]
pub struct FaultLog {
    /// Faults carried out, by kind (a pause counts when armed).
    pub injected: BTreeMap<&'static str, u64>,
    /// Pauses no longer waiting when the next one was armed or the crowd left: taken
    /// by a lock holder (or lost with Redis, in a round that restarted it).
    pub pauses_claimed: u64,
    /// Pauses still waiting then: replaced, or withdrawn after the crowd.
    pub pauses_unclaimed: u64,
    /// Faults not carried out, and why.
    pub missed: Vec<String>,
}

/// Runs every fault of `round` at its time, measured from `started`; `other` is the
/// round's other SKU, which resets and reconciles of one SKU aim at.
pub async fn strike(
    cluster: &Cluster,
    round: &Round,
    commands: &BTreeMap<Disruption, String>,
    started: Instant,
    other: &str,
) -> FaultLog {
    let mut log = FaultLog::default();
    for timed in &round.faults {
        tokio::time::sleep_until(started + Duration::from_millis(timed.at_ms)).await;
        let kind = timed.fault.kind();
        let done = match &timed.fault {
            Fault::Pause { at, pause_ms } => arm_pause(cluster, &mut log, *pause_ms, at).await,
            Fault::Switch { to } => cluster.switch(to).await,
            Fault::Reconcile => cluster.reconcile().await,
            Fault::ReconcileOther => cluster.reconcile_sku(other).await,
            Fault::ResetOther { stock } => cluster.reset(other, *stock, None).await,
            Fault::Kill { target } => kill_replica(cluster, *target).await,
            Fault::Disrupt { what } => match commands.get(what) {
                Some(command) => run_command(command).await,
                None => Err(anyhow::anyhow!("no command given for {}", what.kind())),
            },
        };
        match done {
            Ok(()) => *log.injected.entry(kind).or_insert(0) += 1,
            Err(error) => log
                .missed
                .push(format!("{kind} at {} ms: {error:#}", timed.at_ms)),
        }
    }
    log
}

/// Withdraws a pause nobody claimed, so it cannot stall the patient shoppers, and
/// counts the claimed ones.
pub async fn withdraw_pause(cluster: &Cluster, log: &mut FaultLog) -> anyhow::Result<()> {
    let armed = log.injected.get("pause").copied().unwrap_or(0);
    if armed == 0 {
        return Ok(());
    }
    if cluster.stats().await?.pause_armed_ms.is_some() {
        log.pauses_unclaimed += 1;
        log.missed.push("pause: no lock holder claimed it".into());
    }
    cluster.disarm_pause().await?;
    log.pauses_claimed = armed.saturating_sub(log.pauses_unclaimed);
    Ok(())
}

/// Arms a pause; one armed earlier and still unclaimed is replaced (and logged).
async fn arm_pause(
    cluster: &Cluster,
    log: &mut FaultLog,
    pause_ms: u64,
    at: &str,
) -> anyhow::Result<()> {
    if cluster.stats().await?.pause_armed_ms.is_some() {
        log.pauses_unclaimed += 1;
        log.missed
            .push("pause: replaced before a lock holder claimed it".into());
    }
    cluster.arm_pause(pause_ms, at).await
}

/// `kill -9` of the replica behind `target` (or the next live one), by the pid it
/// announced, if it is a `flashsale` process on this machine. Never the last live one.
async fn kill_replica(cluster: &Cluster, target: usize) -> anyhow::Result<()> {
    let live: Vec<usize> = (0..cluster.target_count())
        .map(|step| (target + step) % cluster.target_count())
        .filter(|&t| cluster.is_up(t))
        .collect();
    if live.len() < 2 {
        bail!("only {} replica(s) up: the last one stays", live.len());
    }
    let target = live[0];
    let address = loopback_address(cluster.url(target))
        .with_context(|| format!("{} is not on this machine", cluster.url(target)))?;
    let stats = cluster.stats().await?;
    let replica = stats
        .replicas
        .iter()
        .find(|r| loopback_address(&r.address).as_deref() == Some(address.as_str()))
        .with_context(|| format!("no replica announces {address}"))?;
    let pid = i32::try_from(replica.pid).context("pid out of range")?;
    let command_line = std::fs::read(format!("/proc/{pid}/cmdline"))
        .with_context(|| format!("pid {pid} ({}) is not running here", replica.id))?;
    if !String::from_utf8_lossy(&command_line).contains("flashsale") {
        bail!("pid {pid} is not a flashsale process");
    }
    kill(Pid::from_raw(pid), Signal::SIGKILL).with_context(|| format!("kill -9 {pid}"))?;
    cluster.mark_down(target);
    Ok(())
}

/// `host:port` of a URL or address on loopback (`localhost` spelled as 127.0.0.1).
fn loopback_address(url_or_address: &str) -> Option<String> {
    let rest = url_or_address
        .split_once("://")
        .map_or(url_or_address, |(_, rest)| rest);
    let host_port = rest.split('/').next()?;
    let (host, port) = host_port.rsplit_once(':')?;
    let host = match host {
        "localhost" => "127.0.0.1",
        host if host.starts_with("127.") => host,
        _ => return None,
    };
    Some(format!("{host}:{port}"))
}

async fn run_command(command: &str) -> anyhow::Result<()> {
    let run = tokio::process::Command::new("sh")
        .args(["-c", command])
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(COMMAND_TIMEOUT, run)
        .await
        .with_context(|| format!("'{command}' took over {COMMAND_TIMEOUT:?}"))??;
    if !output.status.success() {
        bail!(
            "'{command}' failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::loopback_address;

    #[test]
    fn only_loopback_targets_are_killable() {
        assert_eq!(
            loopback_address("http://127.0.0.1:8081/").as_deref(),
            Some("127.0.0.1:8081")
        );
        assert_eq!(
            loopback_address("http://localhost:8082").as_deref(),
            Some("127.0.0.1:8082")
        );
        assert_eq!(
            loopback_address("127.0.0.1:8083").as_deref(),
            Some("127.0.0.1:8083")
        );
        assert_eq!(loopback_address("http://app1:8080"), None);
        assert_eq!(loopback_address("0.0.0.0:8080"), None);
    }
}
