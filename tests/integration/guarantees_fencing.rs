//! Guarantee 4's last sentence: a lock that yields no fencing token cannot be fenced,
//! so with fencing on its order is refused rather than written unfenced.
//!
//! How a real lock yields no token: the lock services that hand a hold on within a
//! replica (zookeeper, etcd) give each hold of a run of handovers its own token,
//! `token_in_run(id, run)`, the backend's id shifted left by 16 bits plus the run. An
//! id of 2^48 or more has no such token.

use flashsale::lock::local_queue::{RUN_LIMIT, token_in_run};

/// The bounds of `token_in_run`: every id below 2^48 gets a token for every place of
/// its run, tokens grow with the id and then with the run (a new acquisition's first
/// hold is above the last handover of the one before), and from 2^48 on there is none.
/// With the multiplication wrapping instead of checked, id 2^48 gave token 0 (and a
/// fence of 0 let the write through); with the run added past the id's bits, two
/// acquisitions' tokens overlapped.
#[test]
fn token_in_run_is_ordered_and_has_no_token_past_2_pow_48() {
    let last_id = (1u64 << 48) - 1;
    for id in [1, 2, 1000, last_id - 1, last_id] {
        let mut previous = None;
        for run in 0..=RUN_LIMIT {
            let token = token_in_run(id, run).expect("ids below 2^48 have tokens");
            assert!(previous < Some(token), "id {id}, run {run}: {token}");
            previous = Some(token);
        }
        let next_first = token_in_run(id + 1, 0);
        assert!(
            next_first.is_none() || next_first > previous,
            "id {id}: the next acquisition's first hold {next_first:?} is not above \
             this run's last {previous:?}"
        );
    }
    assert_eq!(token_in_run(last_id, u32::from(u16::MAX)), Some(u64::MAX));
    assert_eq!(token_in_run(1 << 48, 0), None);
    assert_eq!(token_in_run(u64::MAX, 0), None);
    assert_eq!(token_in_run(last_id, u32::from(u16::MAX) + 1), None);
}
