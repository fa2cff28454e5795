//! From the contenders' holds to the report `lockbench` prints (README, "The lock alone").
//!
//! Each contender records, per hold, when its acquire returned and when it began to
//! release, on the machine-wide clock of `board::now_ns`. Merged and sorted by
//! acquisition, consecutive holds by *different* contenders give one handoff each:
//! from the holder starting its release to the next one holding, which is what a
//! waiter sees. A holder that takes the lock again at once is not a handoff (nobody
//! waited less for it), but it shows in the per-contender spread.

use hdrhistogram::Histogram;
use serde::Serialize;

/// One critical section, in `board::now_ns` nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    pub acquired_ns: u64,
    pub released_ns: u64,
}

/// Bytes per hold in a contender's events file: two little-endian u64.
const HOLD_BYTES: usize = 16;

pub fn encode(holds: &[Hold]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(holds.len() * HOLD_BYTES);
    for hold in holds {
        bytes.extend_from_slice(&hold.acquired_ns.to_le_bytes());
        bytes.extend_from_slice(&hold.released_ns.to_le_bytes());
    }
    bytes
}

/// The holds of an events file; a truncated last record (a contender killed while
/// writing) is dropped.
pub fn decode(bytes: &[u8]) -> Vec<Hold> {
    bytes
        .chunks_exact(HOLD_BYTES)
        .map(|record| {
            let (acquired, released) = record.split_at(8);
            Hold {
                acquired_ns: u64::from_le_bytes(acquired.try_into().unwrap_or_default()),
                released_ns: u64::from_le_bytes(released.try_into().unwrap_or_default()),
            }
        })
        .collect()
}

/// The report: the fields README's "The lock alone" lists.
#[derive(Debug, Serialize)]
pub struct Report {
    pub lock: String,
    pub contenders: usize,
    pub seconds: f64,
    pub cycles: u64,
    pub cycles_per_s: f64,
    pub per_contender: Vec<u64>,
    pub handoff_ms: Handoff,
    pub violations: u64,
    /// How many handoffs the percentiles are over.
    pub handoffs: u64,
    /// Acquires and releases that failed for a reason other than the window ending.
    pub errors: u64,
}

/// Handoff percentiles in milliseconds; `null` when there was no handoff (one
/// contender).
#[derive(Debug, Serialize, PartialEq)]
pub struct Handoff {
    pub p50: Option<f64>,
    pub p99: Option<f64>,
}

/// Handoff percentiles and count over every contender's holds (`holds[i]` is
/// contender i's).
pub fn handoffs(holds: &[Vec<Hold>]) -> (Handoff, u64) {
    let mut all: Vec<(u64, u64, usize)> = holds
        .iter()
        .enumerate()
        .flat_map(|(who, own)| {
            own.iter()
                .map(move |hold| (hold.acquired_ns, hold.released_ns, who))
        })
        .collect();
    all.sort_unstable();
    // 1 ns to 10 min, 3 significant digits: sub-microsecond resolution at the low end.
    let mut histogram = match Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3) {
        Ok(histogram) => histogram,
        Err(_) => {
            return (
                Handoff {
                    p50: None,
                    p99: None,
                },
                0,
            );
        }
    };
    for pair in all.windows(2) {
        let ((_, released, before), (acquired, _, after)) = (pair[0], pair[1]);
        // Overlapping holds (a violation) have no handoff.
        if before != after && acquired >= released {
            histogram.saturating_record((acquired - released).max(1));
        }
    }
    let count = histogram.len();
    if count == 0 {
        return (
            Handoff {
                p50: None,
                p99: None,
            },
            0,
        );
    }
    let millis = |quantile| histogram.value_at_quantile(quantile) as f64 / 1e6;
    (
        Handoff {
            p50: Some(millis(0.5)),
            p99: Some(millis(0.99)),
        },
        count,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hold(acquired_ns: u64, released_ns: u64) -> Hold {
        Hold {
            acquired_ns,
            released_ns,
        }
    }

    #[test]
    fn events_round_trip_and_drop_a_torn_record() {
        let holds = vec![hold(1, 2), hold(u64::MAX - 1, u64::MAX)];
        let mut bytes = encode(&holds);
        assert_eq!(decode(&bytes), holds);
        bytes.extend_from_slice(&[7, 7, 7]);
        assert_eq!(decode(&bytes), holds);
    }

    #[test]
    fn handoffs_count_only_changes_of_holder() {
        // A holds twice in a row (not a handoff), then B 1 ms after A began releasing,
        // then A 3 ms after B.
        let a = vec![
            hold(0, 100),
            hold(200, 1_000_000),
            hold(5_000_000, 5_000_100),
        ];
        let b = vec![hold(2_000_000, 2_000_000)];
        let (handoff, count) = handoffs(&[a, b]);
        assert_eq!(count, 2);
        let p50 = handoff.p50.expect("p50");
        let p99 = handoff.p99.expect("p99");
        assert!((p50 - 1.0).abs() < 0.01, "{p50}");
        assert!((p99 - 3.0).abs() < 0.01, "{p99}");
    }

    #[test]
    fn overlaps_and_a_lone_contender_have_no_handoff() {
        let (handoff, count) = handoffs(&[vec![hold(0, 10), hold(20, 30)]]);
        assert_eq!(
            (handoff, count),
            (
                Handoff {
                    p50: None,
                    p99: None
                },
                0
            )
        );
        let (_, count) = handoffs(&[vec![hold(0, 100)], vec![hold(50, 150)]]);
        assert_eq!(count, 0);
    }
}
