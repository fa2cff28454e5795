//! `lockbench`: one lock primitive alone against the running stack (README, "The lock
//! alone").
//!
//!     lockbench --lock redis-lock --contenders 8 --seconds 3
//!
//! The order flow mixes the lock with Redis reads, MySQL commits and HTTP; this
//! measures only the lock. N contenders, each a separate OS process with its own
//! connections (as replicas are), loop acquire, empty critical section, release on
//! one lock name for S seconds. The last line of stdout is one JSON object: cycles,
//! cycles/s, cycles per contender, handoff p50/p99 (from a holder starting its release
//! to the next, different contender holding) and violations (two holders at once,
//! seen on a shared-memory count the lock does not know about; see `bench::board`).
//!
//! The same binary is the contender: the parent starts itself with the hidden
//! `--contender i`. Contenders connect and take a lock of their own once (so sessions
//! and connections are open), say they are ready on the board, and start together at
//! the time the parent writes there. Every wait is bounded: contenders that have not
//! finished S seconds plus a grace after the start are killed, and a contender whose
//! parent vanished exits on its own.

use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use deadpool_redis::redis;
use flashsale::bench::board::{Board, SharedBoard, now_ns};
use flashsale::bench::locks::{self, Backends, LockKind, NoLock, RowLock, RunNames};
use flashsale::bench::summary::{self, Hold, Report};
use flashsale::lock::etcd::EtcdLock;
use flashsale::lock::redis::RedisLock;
use flashsale::lock::redlock::Redlock;
use flashsale::lock::table::TableLock;
use flashsale::lock::zookeeper::ZooKeeperLock;
use flashsale::lock::{DistributedLock, HeldLock, LockError};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;
use tokio::time::{Instant, sleep, timeout, timeout_at};

/// How long contenders may take to connect and warm up before the start.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Between the parent writing the start time and the start: every contender polls
/// the board far more often than this, so all begin at the same moment.
const START_MARGIN: Duration = Duration::from_millis(100);
/// After the window: time for the last release and the contender's report.
const GRACE: Duration = Duration::from_secs(10);
/// Bound on one release.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);
/// Holds a contender records for the handoff figures; it goes on counting cycles
/// beyond (only `none` gets there).
const MAX_HOLDS: usize = 200_000;

#[derive(Debug, Parser)]
#[command(
    name = "lockbench",
    version,
    about = "One lock primitive alone: N contender processes, one lock name, S seconds"
)]
struct Cli {
    /// The lock to measure (`none`: no lock, the control the violation check must
    /// catch).
    #[arg(long, value_enum, required_unless_present = "table")]
    lock: Option<LockKind>,

    /// Measure nothing: print, as a markdown table, the median and min–max per lock
    /// of the reports in FILE (one JSON object per line, from repeated runs; a line
    /// `{"lock": NAME, "failed": true}` counts a failed run).
    #[arg(long, value_name = "FILE", conflicts_with = "contender")]
    table: Option<PathBuf>,

    /// Contender processes.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=64))]
    contenders: u16,

    /// Length of the measured window in seconds.
    #[arg(long, default_value_t = 3.0, value_parser = parse_seconds)]
    seconds: f64,

    #[command(flatten)]
    backends: Backends,

    /// Run as contender number i (started by the parent).
    #[arg(long, hide = true, requires_all = ["run_id", "board"])]
    contender: Option<usize>,

    #[arg(long, hide = true)]
    run_id: Option<String>,

    #[arg(long, hide = true)]
    board: Option<PathBuf>,
}

fn parse_seconds(raw: &str) -> Result<f64, String> {
    match raw.parse::<f64>() {
        Ok(seconds) if seconds.is_finite() && seconds > 0.0 && seconds <= 3600.0 => Ok(seconds),
        _ => Err(format!("'{raw}' is not a number of seconds in (0, 3600]")),
    }
}

/// What a contender prints on its stdout for the parent.
#[derive(Debug, Serialize, Deserialize)]
struct ContenderReport {
    contender: usize,
    cycles: u64,
    errors: u64,
    first_error: Option<String>,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,sqlx=error")),
        )
        .init();
    let cli = Cli::parse();
    // One thread per process: a contender is one client, like one replica's task.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("lockbench: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = match (&cli.table, cli.lock, cli.contender) {
        (Some(file), _, _) => print_table(file),
        (None, Some(lock), Some(who)) => runtime.block_on(contender_main(&cli, lock, who)),
        (None, Some(lock), None) => runtime.block_on(lead(&cli, lock)),
        (None, None, _) => Err(anyhow::anyhow!("--lock is required")),
    };
    match outcome {
        Ok(code) => code,
        Err(error) => {
            eprintln!("lockbench: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn print_table(file: &Path) -> anyhow::Result<ExitCode> {
    let lines =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    print!("{}", flashsale::bench::table::markdown(&lines)?);
    Ok(ExitCode::SUCCESS)
}

// ---------------------------------------------------------------------------------
// The parent

async fn lead(cli: &Cli, lock: LockKind) -> anyhow::Result<ExitCode> {
    let run_id = new_run_id();
    let names = RunNames::new(&cli.backends, &run_id);
    let dir = RunDir::create(&run_id)?;
    let shared = SharedBoard::create(&dir.board())?;
    // Cleared whatever happened, even after a preparation that failed halfway.
    let finished = match locks::prepare(lock, &cli.backends, &names, usize::from(cli.contenders))
        .await
    {
        Ok(backends) => run_contenders(cli, lock, &backends, &run_id, &dir, shared.board()).await,
        Err(error) => Err(error),
    };
    locks::clear(lock, &cli.backends, &names).await;
    let finished = finished?;

    let contenders = finished.len();
    let mut per_contender = Vec::with_capacity(contenders);
    let mut holds = Vec::with_capacity(contenders);
    let mut errors = 0;
    let mut failed = false;
    for (who, outcome) in finished.into_iter().enumerate() {
        match outcome {
            Ok(report) => {
                if let Some(error) = &report.first_error {
                    eprintln!(
                        "lockbench: contender {who}: {} errors, the first: {error}",
                        report.errors
                    );
                }
                per_contender.push(report.cycles);
                errors += report.errors;
            }
            Err(problem) => {
                eprintln!("lockbench: contender {who} {problem}");
                per_contender.push(0);
                failed = true;
            }
        }
        let recorded = std::fs::read(dir.events(who)).unwrap_or_default();
        holds.push(summary::decode(&recorded));
    }
    let (handoff_ms, handoffs) = summary::handoffs(&holds);
    let cycles: u64 = per_contender.iter().sum();
    let report = Report {
        lock: lock.name().to_owned(),
        contenders,
        seconds: cli.seconds,
        cycles,
        cycles_per_s: cycles as f64 / cli.seconds,
        per_contender,
        handoff_ms,
        violations: shared.board().violations.load(Ordering::SeqCst),
        handoffs,
        errors,
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// Starts the contenders, starts the clock once all are ready, waits for them (killing
/// those that overrun) and returns each one's report or what went wrong with it.
async fn run_contenders(
    cli: &Cli,
    lock: LockKind,
    backends: &Backends,
    run_id: &str,
    dir: &RunDir,
    board: &Board,
) -> anyhow::Result<Vec<Result<ContenderReport, String>>> {
    let program = std::env::current_exe().context("finding this binary")?;
    let mut children = Vec::new();
    for who in 0..usize::from(cli.contenders) {
        let mut command = tokio::process::Command::new(&program);
        command
            .arg("--lock")
            .arg(lock.name())
            .arg("--seconds")
            .arg(cli.seconds.to_string())
            .arg("--contender")
            .arg(who.to_string())
            .arg("--run-id")
            .arg(run_id)
            .arg("--board")
            .arg(dir.board())
            .envs(backends.to_env())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            // Whatever way this function ends, no contender outlives it.
            .kill_on_drop(true);
        let mut child = command.spawn().context("starting a contender")?;
        let stdout = child.stdout.take();
        let output = tokio::spawn(async move {
            let mut text = String::new();
            if let Some(mut stdout) = stdout {
                let _ = stdout.read_to_string(&mut text).await;
            }
            text
        });
        children.push((child, output));
    }

    let ready_by = Instant::now() + READY_TIMEOUT;
    loop {
        let ready = board.ready.load(Ordering::SeqCst);
        if ready as usize == children.len() {
            break;
        }
        for (who, (child, _)) in children.iter_mut().enumerate() {
            if let Some(status) = child.try_wait()? {
                bail!("contender {who} stopped before the start ({status})");
            }
        }
        if Instant::now() >= ready_by {
            bail!(
                "only {ready} of {} contenders were ready within {READY_TIMEOUT:?}",
                children.len()
            );
        }
        sleep(Duration::from_millis(5)).await;
    }
    let start = now_ns() + nanos(START_MARGIN);
    board.end_ns.store(
        start + nanos(Duration::from_secs_f64(cli.seconds)),
        Ordering::SeqCst,
    );
    board.start_ns.store(start, Ordering::SeqCst);

    let finish_by = Instant::now() + START_MARGIN + Duration::from_secs_f64(cli.seconds) + GRACE;
    let mut finished = Vec::with_capacity(children.len());
    for (who, (mut child, output)) in children.into_iter().enumerate() {
        let status = match timeout_at(finish_by, child.wait()).await {
            Ok(status) => status.map_err(|error| format!("could not be waited for: {error}")),
            Err(_) => {
                let _ = child.kill().await;
                Err(format!(
                    "overran the window by more than {GRACE:?} and was killed"
                ))
            }
        };
        let text = output.await.unwrap_or_default();
        finished.push(status.and_then(|status| {
            let last = text.lines().last().unwrap_or_default();
            match serde_json::from_str::<ContenderReport>(last) {
                Ok(report) if status.success() && report.contender == who => Ok(report),
                _ => Err(format!("failed ({status})")),
            }
        }));
    }
    Ok(finished)
}

/// Lowercase letters and digits only: it names a database.
fn new_run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() % (1 << 40))
        .unwrap_or(0);
    format!("{:x}{nanos:x}", std::process::id())
}

fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// The run's files (the board, each contender's holds), in memory when /dev/shm
/// exists; removed when the run ends, however it ends.
struct RunDir {
    path: PathBuf,
}

impl RunDir {
    fn create(run_id: &str) -> anyhow::Result<RunDir> {
        let shm = Path::new("/dev/shm");
        let base = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        let path = base.join(format!("lockbench-{run_id}"));
        std::fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(RunDir { path })
    }

    fn board(&self) -> PathBuf {
        self.path.join("board")
    }

    fn events(&self, who: usize) -> PathBuf {
        events_file(&self.board(), who)
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Where contender `who` writes its holds: beside the board.
fn events_file(board: &Path, who: usize) -> PathBuf {
    board.with_file_name(format!("events-{who}"))
}

// ---------------------------------------------------------------------------------
// A contender

async fn contender_main(cli: &Cli, lock: LockKind, who: usize) -> anyhow::Result<ExitCode> {
    let (Some(run_id), Some(board_path)) = (&cli.run_id, &cli.board) else {
        bail!("--contender needs --run-id and --board");
    };
    // Bounded even if the parent is gone and nobody would kill this process.
    let hard_limit =
        READY_TIMEOUT + START_MARGIN + Duration::from_secs_f64(cli.seconds) + GRACE * 2;
    std::thread::spawn(move || {
        std::thread::sleep(hard_limit);
        eprintln!("lockbench: contender {who} still running after {hard_limit:?}; exiting");
        std::process::exit(3);
    });

    let shared = SharedBoard::open(board_path)
        .with_context(|| format!("opening the board {}", board_path.display()))?;
    let names = RunNames::new(&cli.backends, run_id);
    let run = Contender {
        who,
        board: shared.board(),
        names: &names,
        events: events_file(board_path, who),
    };
    let backends = &cli.backends;
    let owner = format!("lockbench-{who}");
    let lease = backends.lease();
    let report = match lock {
        LockKind::RedisLock => {
            let client = redis::Client::open(backends.redis_url.as_str())?;
            let pool = redis_pool(&backends.redis_url)?;
            let wait = Duration::from_millis(backends.redis_lock_wait_timeout_ms);
            let lock = RedisLock::new(client, pool, &names.namespace, &owner, lease)
                .with_wait_replicas(backends.redis_lock_wait_replicas, wait);
            run.contend(&lock).await?
        }
        LockKind::DbUnique => {
            let pool = sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(2)
                .acquire_timeout(Duration::from_secs(5))
                .connect(&backends.database_url)
                .await
                .context("connecting to the run's database")?;
            let lock = TableLock::new(pool, &owner, lease);
            run.contend(&lock).await?
        }
        LockKind::Zookeeper => {
            let lock = ZooKeeperLock::new(
                &backends.zookeeper,
                backends.zk_session_timeout(),
                &names.namespace,
                &owner,
            );
            run.contend(&lock).await?
        }
        LockKind::DbForUpdate => {
            let longest = Duration::from_secs_f64(cli.seconds) + GRACE;
            let lock = RowLock::connect(&backends.database_url, longest).await?;
            run.contend(&lock).await?
        }
        LockKind::Etcd => {
            run.contend(&EtcdLock::new(&backends.etcd, &names.namespace, lease))
                .await?
        }
        LockKind::Redlock => {
            let nodes = backends
                .redlock_urls
                .iter()
                .map(|url| redis_pool(url))
                .collect::<anyhow::Result<_>>()?;
            run.contend(&Redlock::new(nodes, &names.namespace, &owner, lease))
                .await?
        }
        LockKind::None => run.contend(&NoLock).await?,
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(ExitCode::SUCCESS)
}

/// A Redis pool of this contender's own, built as the service builds its pools.
fn redis_pool(url: &str) -> anyhow::Result<flashsale::redis_pool::Pool> {
    flashsale::redis_pool::pool(url, 4).context("creating a Redis pool")
}

struct Contender<'a> {
    who: usize,
    board: &'a Board,
    names: &'a RunNames,
    events: PathBuf,
}

impl Contender<'_> {
    /// Warms up, waits for the start, loops until the end, writes its holds.
    async fn contend<L: DistributedLock>(&self, lock: &L) -> anyhow::Result<ContenderReport> {
        let warm_up = async {
            let guard = lock
                .acquire(&self.names.warm_up_lock(self.who), READY_TIMEOUT)
                .await?;
            guard.release().await
        };
        timeout(READY_TIMEOUT, warm_up)
            .await
            .context("warming up took too long")?
            .context("warming up (connecting, taking a lock of its own)")?;
        self.board.ready.fetch_add(1, Ordering::SeqCst);

        let (start, end) = self.wait_for_start().await?;
        sleep(Duration::from_nanos(start.saturating_sub(now_ns()))).await;

        let mut holds: Vec<Hold> = Vec::with_capacity(4096);
        let (mut cycles, mut errors, mut first_error) = (0u64, 0u64, None);
        let mut note = |error: LockError| {
            errors += 1;
            if first_error.is_none() {
                first_error = Some(error.to_string());
            }
        };
        loop {
            let now = now_ns();
            if now >= end {
                break;
            }
            let wait = Duration::from_nanos(end - now);
            let guard = match lock.acquire(&self.names.lock, wait).await {
                Ok(guard) => guard,
                Err(LockError::Timeout { .. }) => continue,
                Err(error) => {
                    note(error);
                    // A failing backend must not turn this loop into a spin.
                    sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let inside = self.board.holders.fetch_add(1, Ordering::SeqCst) + 1;
            let acquired_ns = now_ns();
            if inside > 1 {
                self.board.violations.fetch_add(1, Ordering::SeqCst);
            }
            self.board.most_holders.fetch_max(inside, Ordering::SeqCst);
            // The critical section is empty: what is measured is the lock.
            let released_ns = now_ns();
            self.board.holders.fetch_sub(1, Ordering::SeqCst);
            match timeout(RELEASE_TIMEOUT, guard.release()).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => note(error),
                Err(_) => note(LockError::backend("lockbench", "release timed out")),
            }
            if acquired_ns < end {
                cycles += 1;
                if holds.len() < MAX_HOLDS {
                    holds.push(Hold {
                        acquired_ns,
                        released_ns,
                    });
                }
            }
        }
        std::fs::write(&self.events, summary::encode(&holds))
            .with_context(|| format!("writing {}", self.events.display()))?;
        Ok(ContenderReport {
            contender: self.who,
            cycles,
            errors,
            first_error,
        })
    }

    /// The window the parent writes once everyone is ready.
    async fn wait_for_start(&self) -> anyhow::Result<(u64, u64)> {
        let give_up = Instant::now() + READY_TIMEOUT + START_MARGIN;
        loop {
            let start = self.board.start_ns.load(Ordering::SeqCst);
            if start != 0 {
                return Ok((start, self.board.end_ns.load(Ordering::SeqCst)));
            }
            if Instant::now() >= give_up {
                bail!("no start within {READY_TIMEOUT:?}");
            }
            sleep(Duration::from_millis(1)).await;
        }
    }
}
