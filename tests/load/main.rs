//! The load test and the fault explorer against real replicas. The `loadtest` crate
//! does not depend on the service (it shares only the wire types), so the tests that
//! start replicas for it live here, beside the service's own, with `loadtest` as a
//! dev-dependency. Run them with `./scripts/test.sh`.

#[path = "../integration/support.rs"]
#[allow(dead_code)]
mod support;

mod duplicates;
mod explore;
mod report_matches_mysql;
mod split_merge;
