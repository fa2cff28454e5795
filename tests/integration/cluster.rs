//! `flashsale cluster` is a supervisor (README, "When things break"), tried on the real binary: a replica
//! killed with SIGKILL comes back on its port while the others keep selling; a replica
//! that cannot start is retried with a doubling back-off, not in a busy loop; SIGTERM
//! stops every replica and nothing is restarted meanwhile; and no replica outlives a
//! supervisor killed with SIGKILL. The landed code stopped every replica about 4 s
//! after one of them died.

use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt;
use tokio::process::Child;

use crate::support::{base_database_url, free_port, fresh_database, wait_healthy};

/// A base port whose next `count - 1` ports are free too.
fn consecutive_free_ports(count: u16) -> u16 {
    loop {
        let base = free_port();
        let rest_free = (1..count).all(|offset| {
            base.checked_add(offset)
                .is_some_and(|port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
        });
        if rest_free {
            return base;
        }
    }
}

/// `flashsale cluster` on the test's own database and namespace, in a process group of
/// its own: dropping it (a failed assertion included) kills the supervisor and every
/// replica, where killing the supervisor alone could leave replicas behind.
struct Supervisor {
    child: Child,
    pid: i32,
    base: u16,
}

impl Supervisor {
    /// Starts `replicas` replicas on consecutive free ports (or from `base`); `log` takes
    /// the supervisor's log (tracing writes to stdout).
    async fn start(replicas: u16, base: Option<u16>, log: Stdio) -> Supervisor {
        let (database_url, namespace) = fresh_database(&base_database_url()).await;
        let base = base.unwrap_or_else(|| consecutive_free_ports(replicas));
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_flashsale"))
            .args(["cluster", "--replicas", &replicas.to_string()])
            .args(["--base-port", &base.to_string()])
            .env("FLASHSALE_BIND", "127.0.0.1")
            .env("FLASHSALE_DATABASE_URL", &database_url)
            .env("FLASHSALE_NAMESPACE", &namespace)
            .env("FLASHSALE_DB_POOL", "4")
            .env("FLASHSALE_REDIS_POOL", "8")
            .env("RUST_LOG", "warn")
            .env("NO_COLOR", "1")
            .stdout(log)
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .expect("start the supervisor");
        let pid = i32::try_from(child.id().expect("running")).expect("pid");
        Supervisor { child, pid, base }
    }

    fn url(&self, replica: u16) -> String {
        format!("http://127.0.0.1:{}", self.base + replica - 1)
    }

    fn running(&mut self) -> bool {
        self.child.try_wait().expect("supervisor state").is_none()
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        let _ = killpg(Pid::from_raw(self.pid), Signal::SIGKILL);
    }
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .connect_timeout(crate::support::CONNECT_TIMEOUT)
        .build()
        .expect("HTTP client")
}

async fn stats(base_url: &str) -> Option<Value> {
    let response = http()
        .get(format!("{base_url}/api/stats"))
        .send()
        .await
        .ok()?;
    response.json().await.ok()
}

/// `replica`'s entry in `base_url`'s /api/stats, once it has announced itself.
async fn announced(base_url: &str, replica: &str) -> Value {
    let started = Instant::now();
    loop {
        let entry = stats(base_url).await.and_then(|s| {
            s["replicas"]
                .as_array()
                .and_then(|all| all.iter().find(|r| r["id"] == replica).cloned())
        });
        if let Some(entry) = entry {
            return entry;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{replica} never announced itself"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn pid_of(entry: &Value) -> i32 {
    i32::try_from(entry["pid"].as_i64().expect("pid")).expect("pid")
}

/// No such process any more. A zombie counts as gone: it runs nothing and holds no
/// port, and on this machine killed children linger as zombies for a while.
fn gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

async fn wait_gone(pids: &[i32], within: Duration) -> Vec<i32> {
    let started = Instant::now();
    loop {
        let alive: Vec<i32> = pids.iter().copied().filter(|&pid| !gone(pid)).collect();
        if alive.is_empty() || started.elapsed() > within {
            return alive;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn order(base_url: &str, sku: &str, user: &str) -> Result<StatusCode, reqwest::Error> {
    http()
        .post(format!("{base_url}/api/orders"))
        .json(&json!({ "sku": sku, "user_id": user, "quantity": 1 }))
        .send()
        .await
        .map(|response| response.status())
}

async fn health(base_url: &str) -> Result<StatusCode, reqwest::Error> {
    http()
        .get(format!("{base_url}/healthz"))
        .send()
        .await
        .map(|response| response.status())
}

/// SIGTERM to the supervisor: it exits cleanly, every pid in `replicas` is gone, and
/// nothing else it started is left.
async fn terminate(mut supervisor: Supervisor, replicas: &[i32]) {
    kill(Pid::from_raw(supervisor.pid), Signal::SIGTERM).expect("SIGTERM");
    let status = tokio::time::timeout(Duration::from_secs(30), supervisor.child.wait())
        .await
        .expect("the supervisor stopped within 30 s")
        .expect("status");
    assert!(status.success(), "the supervisor exited with {status}");
    let left = wait_gone(replicas, Duration::ZERO).await;
    assert!(
        left.is_empty(),
        "replicas {left:?} outlived their supervisor"
    );
    // Nor any process the test never saw announced (one restarted during the
    // shutdown, say): the supervisor's process group is empty.
    assert_eq!(
        killpg(Pid::from_raw(supervisor.pid), None),
        Err(nix::errno::Errno::ESRCH),
        "processes left in the supervisor's group"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_comes_back_while_the_others_serve() {
    let mut supervisor = Supervisor::start(3, None, Stdio::inherit()).await;
    let urls: Vec<String> = (1..=3).map(|replica| supervisor.url(replica)).collect();
    for url in &urls {
        assert!(wait_healthy(url).await, "{url} did not become healthy");
    }
    let reset = http()
        .post(format!("{}/api/admin/reset", urls[0]))
        .json(&json!({ "sku": "supervised", "stock": 100_000 }))
        .send()
        .await
        .expect("reset");
    assert_eq!(reset.status(), StatusCode::OK);
    let mut pids = Vec::new();
    for replica in ["replica-1", "replica-2", "replica-3"] {
        pids.push(pid_of(&announced(&urls[0], replica).await));
    }
    let doomed = pids[1];

    kill(Pid::from_raw(doomed), Signal::SIGKILL).expect("SIGKILL replica-2");
    let killed = Instant::now();
    // Until replica-2 answers again from its own port with a new pid, the two others
    // take orders and report healthy on every round.
    let mut rounds = 0;
    let back = loop {
        for (name, url) in [("replica-1", &urls[0]), ("replica-3", &urls[2])] {
            let user = format!("{name}-{rounds}");
            let ordered = order(url, "supervised", &user).await;
            assert!(
                matches!(ordered, Ok(StatusCode::CREATED)),
                "{name} did not sell {:?} after the kill: {ordered:?}",
                killed.elapsed()
            );
            let healthy = health(url).await;
            assert!(
                matches!(healthy, Ok(StatusCode::OK)),
                "{name} unhealthy {:?} after the kill: {healthy:?}",
                killed.elapsed()
            );
        }
        rounds += 1;
        let restarted = stats(&urls[1]).await.and_then(|s| {
            s["replicas"].as_array().and_then(|all| {
                all.iter()
                    .find(|r| r["id"] == "replica-2" && r["pid"] != json!(doomed))
                    .cloned()
            })
        });
        if let Some(restarted) = restarted {
            break restarted;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "replica-2 did not come back within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let back_after = killed.elapsed();
    assert!(gone(doomed), "the killed replica was reaped");
    assert_eq!(back["restarts"], 1, "{back}");
    assert_eq!(
        back["address"],
        format!("127.0.0.1:{}", supervisor.base + 1)
    );
    assert_eq!(health(&urls[1]).await.ok(), Some(StatusCode::OK));
    let ordered = order(&urls[1], "supervised", "after-the-restart").await;
    assert_eq!(
        ordered.ok(),
        Some(StatusCode::CREATED),
        "replica-2 sells again"
    );
    assert!(supervisor.running(), "the supervisor is still running");
    println!(
        "replica-2 back after {back_after:?}; the others sold {} units meanwhile",
        rounds * 2
    );

    pids[1] = pid_of(&back);
    pids.push(doomed);
    terminate(supervisor, &pids).await;
}

/// A replica whose port is taken exits at once, again and again: the supervisor waits
/// 250 ms, 500 ms, 1 s, 2 s between the attempts (each logged), and once the port is
/// free the replica serves, reporting how often it was restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_cannot_start_is_retried_with_a_growing_back_off() {
    let blocker = std::net::TcpListener::bind("127.0.0.1:0").expect("a port to hold");
    let port = blocker.local_addr().expect("address").port();
    let mut supervisor = Supervisor::start(1, Some(port), Stdio::piped()).await;
    let log = supervisor.child.stdout.take().expect("piped log");
    let (exits, mut exits_rx) = tokio::sync::mpsc::unbounded_channel();
    // The supervisor's log, read as it comes: the restart events with their arrival.
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(log).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            println!("{line}");
            if line.contains("replica exited") {
                let _ = exits.send((Instant::now(), line));
            }
        }
    });

    let mut seen = Vec::new();
    while seen.len() < 4 {
        let exit = tokio::time::timeout(Duration::from_secs(20), exits_rx.recv())
            .await
            .expect("the supervisor keeps retrying")
            .expect("the supervisor's log is open");
        seen.push(exit);
    }
    drop(blocker);
    let field = |line: &str, name: &str| -> String {
        let start = line.find(&format!(" {name}=")).expect(name) + name.len() + 2;
        line[start..]
            .split_whitespace()
            .next()
            .expect(name)
            .to_owned()
    };
    let backoffs: Vec<String> = seen.iter().map(|(_, l)| field(l, "backoff_ms")).collect();
    assert_eq!(backoffs, ["250", "500", "1000", "2000"]);
    for (number, (_, line)) in seen.iter().enumerate() {
        assert!(line.contains("replica=replica-1"), "{line}");
        assert_eq!(field(line, "restart"), (number + 1).to_string(), "{line}");
        assert!(line.contains("status=exit status: 1"), "{line}");
        assert!(line.contains(" pid="), "{line}");
    }
    for (pair, wait) in seen.windows(2).zip([250, 500, 1000]) {
        let gap = pair[1].0 - pair[0].0;
        assert!(
            gap >= Duration::from_millis(wait * 9 / 10),
            "attempts {gap:?} apart after a back-off of {wait} ms"
        );
    }

    let url = supervisor.url(1);
    assert!(
        wait_healthy(&url).await,
        "the replica serves once its port is free"
    );
    let entry = announced(&url, "replica-1").await;
    assert_eq!(entry["restarts"], 4, "{entry}");
    assert!(supervisor.running());
    terminate(supervisor, &[pid_of(&entry)]).await;
}

/// A supervisor killed with SIGKILL cannot stop its replicas; they notice their parent
/// is gone and stop by themselves instead of holding their ports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_stop_when_their_supervisor_is_killed() {
    let mut supervisor = Supervisor::start(1, None, Stdio::inherit()).await;
    let url = supervisor.url(1);
    assert!(wait_healthy(&url).await);
    let replica = pid_of(&announced(&url, "replica-1").await);

    supervisor
        .child
        .start_kill()
        .expect("SIGKILL the supervisor");
    supervisor.child.wait().await.expect("reaped");
    let left = wait_gone(&[replica], Duration::from_secs(20)).await;
    assert!(
        left.is_empty(),
        "replica {replica} outlived a killed supervisor"
    );
    assert!(health(&url).await.is_err(), "nothing answers on its port");
}

/// Replicas on one machine split its cores: each runtime is started with its share
/// (`TOKIO_WORKER_THREADS`, at least one), or with the number the supervisor was given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_get_their_share_of_the_cores() {
    let replicas = 2;
    let supervisor = Supervisor::start(replicas, None, Stdio::inherit()).await;
    let url = supervisor.url(1);
    assert!(wait_healthy(&url).await);
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let expected = std::env::var("TOKIO_WORKER_THREADS")
        .unwrap_or_else(|_| (cores / usize::from(replicas)).max(1).to_string());
    let mut pids = Vec::new();
    for replica in ["replica-1", "replica-2"] {
        let pid = pid_of(&announced(&url, replica).await);
        let environ = std::fs::read(format!("/proc/{pid}/environ")).expect("environ");
        let workers = environ
            .split(|byte| *byte == 0)
            .find_map(|entry| entry.strip_prefix(b"TOKIO_WORKER_THREADS="))
            .map(|value| String::from_utf8_lossy(value).into_owned());
        assert_eq!(workers.as_deref(), Some(expected.as_str()), "{replica}");
        pids.push(pid);
    }
    terminate(supervisor, &pids).await;
}
