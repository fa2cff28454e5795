//! `flashsale cluster` supervises its replicas: a replica killed with SIGKILL is started
//! again on its port while the others keep serving, and SIGTERM to the supervisor stops
//! every replica. On the landed code the supervisor stopped every replica about 4 s
//! after one of them died.

use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

use crate::support::{base_database_url, free_port, fresh_database, wait_healthy};

/// A base port whose next port is free too.
fn two_free_ports() -> u16 {
    loop {
        let base = free_port();
        if base < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", base + 1)).is_ok() {
            return base;
        }
    }
}

async fn stats(base_url: &str) -> Option<Value> {
    let response = reqwest::get(format!("{base_url}/api/stats")).await.ok()?;
    response.json().await.ok()
}

fn replica<'a>(stats: &'a Value, id: &str) -> Option<&'a Value> {
    stats["replicas"].as_array()?.iter().find(|r| r["id"] == id)
}

fn alive(pid: i32) -> bool {
    // Signal 0 checks existence; a reaped child is gone.
    kill(Pid::from_raw(pid), None).is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_comes_back_while_the_others_serve() {
    let (database_url, namespace) = fresh_database(&base_database_url()).await;
    let base = two_free_ports();
    let mut supervisor = tokio::process::Command::new(env!("CARGO_BIN_EXE_flashsale"))
        .args([
            "cluster",
            "--replicas",
            "2",
            "--base-port",
            &base.to_string(),
        ])
        .env("FLASHSALE_BIND", "127.0.0.1")
        .env("FLASHSALE_DATABASE_URL", &database_url)
        .env("FLASHSALE_NAMESPACE", &namespace)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .expect("start the supervisor");
    let first = format!("http://127.0.0.1:{base}");
    let second = format!("http://127.0.0.1:{}", base + 1);
    assert!(wait_healthy(&first).await && wait_healthy(&second).await);

    // replica-2's pid, as it announces itself.
    let started = Instant::now();
    let doomed = loop {
        let pid = stats(&first)
            .await
            .and_then(|s| replica(&s, "replica-2").and_then(|r| r["pid"].as_i64()));
        if let Some(pid) = pid {
            break i32::try_from(pid).expect("pid");
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "replica-2 never announced itself"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    kill(Pid::from_raw(doomed), Signal::SIGKILL).expect("SIGKILL replica-2");
    let killed = Instant::now();

    // replica-1 answers throughout; replica-2 comes back with a new pid.
    let back = loop {
        let health = reqwest::get(format!("{first}/healthz")).await;
        assert!(
            health.is_ok_and(|r| r.status().is_success()),
            "replica-1 stopped serving {:?} after the kill",
            killed.elapsed()
        );
        let restarted = stats(&second).await.and_then(|s| {
            replica(&s, "replica-2")
                .filter(|r| r["pid"].as_i64() != Some(i64::from(doomed)))
                .cloned()
        });
        if let Some(restarted) = restarted {
            break restarted;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(20),
            "replica-2 did not come back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(back["restarts"], 1, "{back}");
    println!("replica-2 back after {:?}", killed.elapsed());
    assert!(
        supervisor.try_wait().expect("supervisor state").is_none(),
        "the supervisor is still running"
    );

    // SIGTERM to the supervisor stops every replica.
    let pids: Vec<i32> = stats(&first)
        .await
        .and_then(|s| s["replicas"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter_map(|r| r["pid"].as_i64().and_then(|p| i32::try_from(p).ok()))
        .collect();
    assert_eq!(pids.len(), 2, "both replicas announced: {pids:?}");
    let supervisor_pid = i32::try_from(supervisor.id().expect("pid")).expect("pid");
    kill(Pid::from_raw(supervisor_pid), Signal::SIGTERM).expect("SIGTERM");
    let status = tokio::time::timeout(Duration::from_secs(30), supervisor.wait())
        .await
        .expect("the supervisor stopped within 30 s")
        .expect("status");
    assert!(status.success(), "{status}");
    for pid in pids {
        assert!(!alive(pid), "replica {pid} outlived its supervisor");
    }
}
