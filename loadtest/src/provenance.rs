//! What produced a report's figures: the service's build and timing settings (from its
//! stats) and the machine the load test runs on (from /proc, where there is one). A
//! figure without them cannot be compared with another.

use flashsale_wire::report::Provenance;
use flashsale_wire::stats::Stats;

pub fn of(stats: &Stats) -> Provenance {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    Provenance {
        commit: stats.commit.clone(),
        lock_lease_ms: stats.lock_lease_ms,
        lock_wait_ms: stats.lock_wait_ms,
        work_ms: stats.work_ms,
        replicas: stats.replicas.len() as u64,
        cores: cores as u64,
        memory_mib: proc_field("/proc/meminfo", "MemTotal")
            .and_then(|kib| kib.trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kib| kib / 1024),
        cpu: proc_field("/proc/cpuinfo", "model name"),
    }
}

/// The value of the first `name: value` line of a /proc file.
fn proc_field(path: &str, name: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|line| line.starts_with(name))?;
    Some(line.split_once(':')?.1.trim().to_owned())
}
