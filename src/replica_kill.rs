//! `kill -9` of the replica that holds a lock, for the dashboard's one-click fault: the
//! crash a lease or a session exists for. Watch the lock come free when the lease runs
//! out and `flashsale cluster` start the replica again.
//!
//! A replica only knows its siblings from the registry (id, address, pid), and a pid
//! means something only on the machine that issued it. So the kill is refused unless
//! the holder's address is on this machine (loopback) and that pid is a `flashsale`
//! process serving that very port: in containers (compose) or across machines the pid
//! could name another process, and a kill there would hit the wrong one.

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::store::ReplicaInfo;

/// Why the holder cannot be killed from here.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NotKillable {
    #[error("replica {0} is not on this machine (address {1})")]
    Elsewhere(String, String),
    #[error("pid {pid} is not replica {id} (a flashsale serving port {port} on this machine)")]
    NotTheReplica { id: String, pid: u32, port: String },
    #[error("kill -9 of pid {0} failed: {1}")]
    Failed(u32, String),
}

/// Sends SIGKILL to `replica` if it is a flashsale replica on this machine. When it is
/// this very process, the signal is sent a moment later, so the answer still goes out.
pub fn kill_replica(replica: &ReplicaInfo) -> Result<(), NotKillable> {
    let Some((host, port)) = replica.address.rsplit_once(':') else {
        return Err(elsewhere(replica));
    };
    if !is_loopback(host) {
        return Err(elsewhere(replica));
    }
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", replica.pid)).unwrap_or_default();
    let environ = std::fs::read(format!("/proc/{}/environ", replica.pid)).unwrap_or_default();
    if !serves_port(&cmdline, &environ, port) {
        return Err(NotKillable::NotTheReplica {
            id: replica.id.clone(),
            pid: replica.pid,
            port: port.to_owned(),
        });
    }
    let pid =
        i32::try_from(replica.pid).map_err(|e| NotKillable::Failed(replica.pid, e.to_string()))?;
    if replica.pid == std::process::id() {
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        });
        return Ok(());
    }
    kill(Pid::from_raw(pid), Signal::SIGKILL)
        .map_err(|e| NotKillable::Failed(replica.pid, e.to_string()))
}

fn elsewhere(replica: &ReplicaInfo) -> NotKillable {
    NotKillable::Elsewhere(replica.id.clone(), replica.address.clone())
}

fn is_loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback() || ip.is_unspecified())
}

/// Whether a process with this `/proc/<pid>/cmdline` and `environ` (entries separated
/// by NUL) is `flashsale serve` listening on `port`: given as `--port`, or, as `flashsale
/// cluster` starts its replicas, in `FLASHSALE_PORT`.
fn serves_port(cmdline: &[u8], environ: &[u8], port: &str) -> bool {
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    let is_flashsale = args.first().is_some_and(|exe| exe.ends_with(b"flashsale"));
    let serves = args.contains(&b"serve".as_slice());
    let on_port = args
        .windows(2)
        .any(|pair| pair[0] == b"--port" && pair[1] == port.as_bytes())
        || args.contains(&format!("--port={port}").as_bytes())
        || environ
            .split(|b| *b == 0)
            .any(|entry| entry == format!("FLASHSALE_PORT={port}").as_bytes());
    is_flashsale && serves && on_port
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_flashsale_serving_that_port_qualifies() {
        let cmdline = |args: &[&str]| args.join("\0").into_bytes();
        let ours = cmdline(&[
            "/bin/flashsale",
            "serve",
            "--bind",
            "127.0.0.1",
            "--port",
            "8082",
        ]);
        assert!(serves_port(&ours, b"", "8082"));
        assert!(!serves_port(&ours, b"", "8081"), "another port");
        let python = cmdline(&["/usr/bin/python3", "serve", "--port", "8082"]);
        assert!(!serves_port(&python, b"", "8082"));
        let supervisor = cmdline(&["/bin/flashsale", "cluster", "--port", "8082"]);
        assert!(!serves_port(&supervisor, b"", "8082"));
        assert!(!serves_port(b"", b"", "8082"), "no such process");
        // As `flashsale cluster` starts a replica: the port in the environment.
        let supervised = cmdline(&["/bin/flashsale", "serve"]);
        let environ = b"HOME=/root\0FLASHSALE_PORT=8082\0FLASHSALE_REPLICA_ID=replica-2";
        assert!(serves_port(&supervised, environ, "8082"));
        assert!(!serves_port(&supervised, environ, "8083"));
        assert!(!serves_port(&supervised, b"FLASHSALE_PORT=80820", "8082"));
    }

    #[test]
    fn only_loopback_addresses_are_on_this_machine() {
        for here in ["127.0.0.1", "localhost", "[::1]", "0.0.0.0"] {
            assert!(is_loopback(here), "{here}");
        }
        for there in ["replica2", "10.0.0.7", "example.org"] {
            assert!(!is_loopback(there), "{there}");
        }
    }
}
