//! `lockbench`: one lock primitive alone, measured with contenders that are separate
//! OS processes (as replicas are), so that what is timed is the lock and its backend,
//! not our order flow. The binary (`src/bin/lockbench.rs`) runs the processes; this
//! module holds what they share:
//!
//! - `board`: a memory-mapped file every contender maps. Its holder count is how
//!   violations are seen without trusting the lock under test; its start and end
//!   times make every contender measure the same window.
//! - `locks`: the backends' settings (the same flags and environment as `flashsale
//!   serve`) and each lock built from them, plus the two that `crate::lock` does not
//!   have: the row lock of `db-for-update` and `none`, the control with no lock at all.
//! - `summary`: the contenders' holds turned into the report (cycles, handoff
//!   percentiles).
//! - `table`: repeated reports as the markdown table `scripts/bench.sh` writes into
//!   BENCHMARKS.md.

pub mod board;
pub mod locks;
pub mod summary;
pub mod table;
