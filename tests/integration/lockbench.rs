//! `lockbench` (README, "The lock alone") as a user runs it: the built binary against the stack's
//! services, contenders as separate processes.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Runs `lockbench` with `args`, killed if it outlives `bound`; returns whether it
/// succeeded and the JSON of its last stdout line.
fn lockbench(args: &[&str], bound: Duration) -> (bool, Value) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lockbench"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start lockbench");
    let deadline = Instant::now() + bound;
    while child.try_wait().expect("wait for lockbench").is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("lockbench {args:?} ran longer than {bound:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = child.wait_with_output().expect("lockbench output");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    let report = serde_json::from_str(last)
        .unwrap_or_else(|error| panic!("last line is not JSON ({error}): {stdout}"));
    (output.status.success(), report)
}

fn count(report: &Value, field: &str) -> u64 {
    report[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field} in {report}"))
}

#[test]
fn lockbench_measures_the_redis_lock_without_violations() {
    let args = [
        "--lock",
        "redis-lock",
        "--contenders",
        "3",
        "--seconds",
        "1",
    ];
    let (succeeded, report) = lockbench(&args, Duration::from_secs(90));
    println!("{report}");
    assert!(succeeded, "lockbench failed: {report}");
    assert_eq!(report["lock"], "redis-lock");
    assert_eq!(count(&report, "contenders"), 3);
    assert_eq!(report["seconds"].as_f64(), Some(1.0));
    let cycles = count(&report, "cycles");
    assert!(cycles > 0, "{report}");
    let per_contender: Vec<u64> = report["per_contender"]
        .as_array()
        .expect("per_contender")
        .iter()
        .map(|n| n.as_u64().expect("a count"))
        .collect();
    assert_eq!(per_contender.len(), 3, "{report}");
    assert!(per_contender.iter().all(|&n| n > 0), "{report}");
    assert_eq!(per_contender.iter().sum::<u64>(), cycles);
    assert_eq!(report["cycles_per_s"].as_f64(), Some(cycles as f64));
    assert_eq!(count(&report, "violations"), 0, "{report}");
    // Three contenders for a second hand the lock over many times.
    assert!(count(&report, "handoffs") > 0, "{report}");
    let p50 = report["handoff_ms"]["p50"].as_f64().expect("p50");
    let p99 = report["handoff_ms"]["p99"].as_f64().expect("p99");
    assert!(0.0 < p50 && p50 <= p99, "{report}");
    assert_eq!(count(&report, "errors"), 0, "{report}");
}

/// Without a lock the contenders overlap, and the shared-memory check must say so:
/// otherwise "0 violations" above would prove nothing.
#[test]
fn lockbench_sees_violations_when_there_is_no_lock() {
    let args = ["--lock", "none", "--contenders", "4", "--seconds", "1"];
    let (succeeded, report) = lockbench(&args, Duration::from_secs(60));
    println!("{report}");
    assert!(succeeded, "lockbench failed: {report}");
    assert_eq!(report["lock"], "none");
    assert!(count(&report, "cycles") > 0, "{report}");
    assert!(count(&report, "violations") > 0, "{report}");
}
