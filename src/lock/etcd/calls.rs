//! The plumbing every step of the etcd lock shares: a bound on each call, its errors,
//! and reading a transaction's answer. Nothing here decides who holds the lock.

use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, KeyValue, Txn, TxnOp, TxnOpResponse, TxnResponse};
use tokio::time::timeout;

use crate::lock::LockError;

/// Bound on every call but the wait for a deletion.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Bounds a short etcd call by `CALL_TIMEOUT`.
pub async fn bounded<T>(
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, LockError> {
    timeout(CALL_TIMEOUT, call)
        .await
        .map_err(|_| LockError::backend("etcd", format!("no answer within {CALL_TIMEOUT:?}")))?
        .map_err(etcd_error)
}

pub fn etcd_error(error: etcd_client::Error) -> LockError {
    LockError::backend("etcd", error)
}

/// Whether etcd refused a call outright, which then changed nothing (any other error
/// leaves its outcome unknown).
pub fn refused(error: &etcd_client::Error) -> bool {
    use tonic::Code;
    matches!(error, etcd_client::Error::GRpcStatus(status) if matches!(status.code(),
        Code::InvalidArgument | Code::NotFound | Code::ResourceExhausted
            | Code::FailedPrecondition | Code::OutOfRange))
}

/// The store's revision an answer was read at (0: no header).
pub fn revision_of(header: Option<&etcd_client::ResponseHeader>) -> i64 {
    header.map_or(0, |header| header.revision())
}

/// The keys read by the `index`th operation of a transaction (none if it was no read).
pub fn read_of(response: &TxnResponse, index: usize) -> Vec<KeyValue> {
    match response.op_responses().into_iter().nth(index) {
        Some(TxnOpResponse::Get(mut get)) => get.take_kvs(),
        _ => Vec::new(),
    }
}

/// Deletes `key` if it still has create revision `revision`; whether it had.
pub async fn delete_own(mut client: Client, key: &str, revision: i64) -> Result<bool, LockError> {
    let txn = Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, revision)])
        .and_then([TxnOp::delete(key, None)]);
    Ok(bounded(client.txn(txn)).await?.succeeded())
}
