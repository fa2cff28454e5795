//! The nemesis: what goes wrong during one round of the explorer, drawn from a seeded
//! random generator so that a round can be replayed exactly from its seed.

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::Serialize;

/// The strategies the explorer checks (`none` oversells by design).
pub const STRATEGIES: [&str; 8] = [
    "redis-lock",
    "db-unique",
    "optimistic",
    "zookeeper",
    "db-for-update",
    "etcd",
    "redlock",
    "redis-atomic",
];

/// Where a paused holder can stall (the service's `at` values).
pub const PAUSE_POINTS: [&str; 4] = ["before_read", "after_read", "before_commit", "after_commit"];

/// One round: the sale, its crowd and its faults.
#[derive(Debug, Clone, Serialize)]
pub struct Round {
    pub seed: u64,
    pub round: u64,
    pub strategy: &'static str,
    pub sku: String,
    pub stock: i64,
    pub fencing: bool,
    pub shoppers: usize,
    /// Share of shoppers who hang up after a few milliseconds.
    pub hang_up_share: f64,
    pub faults: Vec<Fault>,
}

/// A fault, `at_ms` after the round's crowd starts.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fault {
    /// The next holder reaching `point` stalls `pause_ms` (past its lease).
    Pause {
        at_ms: u64,
        point: &'static str,
        pause_ms: u64,
    },
    /// An admin switches the cluster to another strategy.
    Switch { at_ms: u64, to: &'static str },
    /// An admin rewrites the cache from MySQL.
    Reconcile { at_ms: u64 },
    /// `kill -9` of one replica (by the pid it announces); a supervisor restarts it.
    Kill { at_ms: u64, replica: usize },
    /// A command given with `--nemesis` (e.g. restart Redis), by its label.
    Command { at_ms: u64, label: String },
}

/// What the nemesis may do besides pauses, hang-ups, switches and reconciles.
#[derive(Debug, Clone, Default)]
pub struct Powers {
    pub kill: bool,
    /// Labels of `--nemesis label=command` commands.
    pub commands: Vec<String>,
}

/// The round `round` of the run seeded `seed`: each round has its own generator, so
/// `--round R` replays it alone.
pub fn draw(seed: u64, round: u64, lease_ms: u64, powers: &Powers) -> Round {
    let mut rng = StdRng::seed_from_u64(seed ^ round.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let strategy = STRATEGIES[rng.random_range(0..STRATEGIES.len())];
    let stock = rng.random_range(5..=30);
    let faults_wanted = rng.random_range(1..=4);
    let mut faults = Vec::new();
    for _ in 0..faults_wanted {
        let at_ms = rng.random_range(0..1500);
        let fault = match rng.random_range(0..10) {
            0..=4 => Fault::Pause {
                at_ms,
                point: PAUSE_POINTS[rng.random_range(0..PAUSE_POINTS.len())],
                pause_ms: lease_ms + rng.random_range(200..=2 * lease_ms),
            },
            5 | 6 => Fault::Switch {
                at_ms,
                to: STRATEGIES[rng.random_range(0..STRATEGIES.len())],
            },
            7 => Fault::Reconcile { at_ms },
            8 if powers.kill => Fault::Kill {
                at_ms,
                replica: rng.random_range(0..8),
            },
            9 if !powers.commands.is_empty() => Fault::Command {
                at_ms,
                label: powers.commands[rng.random_range(0..powers.commands.len())].clone(),
            },
            _ => Fault::Reconcile { at_ms },
        };
        faults.push(fault);
    }
    faults.sort_by_key(Fault::at_ms);
    Round {
        seed,
        round,
        strategy,
        sku: format!("explore-{seed}-{round}"),
        stock,
        // Fenced rounds are the claim; a few unfenced ones without pauses check that
        // the rest holds without fencing too.
        fencing: faults.iter().any(|f| matches!(f, Fault::Pause { .. })) || rng.random_bool(0.7),
        shoppers: usize::try_from(stock).unwrap_or(10) * 3,
        hang_up_share: rng.random_range(0.0..0.6),
        faults,
    }
}

impl Fault {
    pub fn at_ms(&self) -> u64 {
        match self {
            Fault::Pause { at_ms, .. }
            | Fault::Switch { at_ms, .. }
            | Fault::Reconcile { at_ms }
            | Fault::Kill { at_ms, .. }
            | Fault::Command { at_ms, .. } => *at_ms,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Fault::Pause { .. } => "pause",
            Fault::Switch { .. } => "switch",
            Fault::Reconcile { .. } => "reconcile",
            Fault::Kill { .. } => "kill",
            Fault::Command { .. } => "command",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_is_replayed_from_its_seed() {
        let powers = Powers::default();
        let a = serde_json::to_string(&draw(7, 3, 1000, &powers)).expect("json");
        let b = serde_json::to_string(&draw(7, 3, 1000, &powers)).expect("json");
        assert_eq!(a, b);
        let other = serde_json::to_string(&draw(7, 4, 1000, &powers)).expect("json");
        assert_ne!(a, other);
    }

    #[test]
    fn kills_and_commands_only_when_allowed() {
        for round in 0..200 {
            for fault in draw(1, round, 1000, &Powers::default()).faults {
                assert!(!matches!(fault, Fault::Kill { .. } | Fault::Command { .. }));
            }
        }
    }
}
