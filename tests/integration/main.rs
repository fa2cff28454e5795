//! Integration tests against the real Redis and MariaDB of `scripts/stack.sh`.
//! Run them with `./scripts/test.sh`.

mod admin;
mod admin_auth;
mod bad_input;
mod cluster;
mod dashboard;
mod faults;
mod fenced_reads;
mod fencing;
mod fuzz;
mod group_commit;
mod guarantees_cache;
mod guarantees_fencing;
mod guarantees_hangups;
mod guarantees_optimistic;
mod guarantees_sale_changes;
mod guarantees_support;
mod hangups;
mod killed_after_commit;
mod limits;
mod lock_cancellation;
mod lock_handover;
mod lock_primitives;
mod lock_stalls;
mod lock_strategies;
mod lockbench;
mod none_strategy;
mod openapi_fuzz;
mod operations;
mod row_lock_queue;
mod sale_changes;
mod sku_epoch_edges;
mod sku_scoped_changes;
mod support;
mod timeline;
mod unknown_commit;
