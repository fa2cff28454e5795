//! Integration tests against the real Redis and MariaDB of `scripts/stack.sh`.
//! Run them with `./scripts/test.sh`.

mod admin;
mod admin_auth;
mod bad_input;
mod dashboard;
mod faults;
mod fencing;
mod fuzz;
mod limits;
mod lock_cancellation;
mod lock_primitives;
mod lock_strategies;
mod none_strategy;
mod openapi_fuzz;
mod support;
