//! What an etcd acquisition dropped at an await point leaves behind, and how it is
//! undone. The queue put runs in a task of its own, to its answer, so the cleanup
//! knows whether the key was made and deletes it. (Deleted at once instead, a put
//! still in flight could land after the delete, on a lease kept alive for the replica:
//! a key nobody would ever delete.) A key whose fate stays unknown gives the session
//! up: renewals stop and its holders are told, a third of the TTL at least before the
//! lease expires with every key on it.

use std::time::Duration;

use tokio::task::JoinHandle;

use super::EtcdGuard;
use super::calls::{delete_own, etcd_error, refused};
use crate::lock::LockError;

/// Tries of a background cleanup (a key delete, a lease revoke), 300 ms apart.
pub const CLEANUP_TRIES: u32 = 4;
pub const CLEANUP_PAUSE: Duration = Duration::from_millis(300);

/// The queue put's answer: our key's create revision, and the key just before it.
pub type Joined = Result<(i64, Option<etcd_client::KeyValue>), PutFailed>;

/// A queue put that failed, and whether it may have landed all the same (no answer).
pub struct PutFailed {
    pub error: LockError,
    pub may_have_landed: bool,
}

impl PutFailed {
    /// A put with no answer, or an answer that does not say what it did.
    pub fn unknown(why: impl std::fmt::Display) -> PutFailed {
        let error = LockError::backend("etcd", why);
        PutFailed {
            error,
            may_have_landed: true,
        }
    }
}

/// A put etcd refused changed nothing; any other error leaves it unknown.
impl From<etcd_client::Error> for PutFailed {
    fn from(error: etcd_client::Error) -> PutFailed {
        let may_have_landed = !refused(&error);
        PutFailed {
            error: etcd_error(error),
            may_have_landed,
        }
    }
}

/// What an acquisition made in etcd, as far as it knows.
pub enum Made {
    /// The queue put has not answered yet.
    Putting(JoinHandle<Joined>),
    /// The key, at this create revision.
    Key(i64),
    /// A put that failed and may have landed all the same.
    Unknown,
    /// Nothing: the put was refused, or the release deleted the key.
    Nothing,
}

/// Dropped before its release was answered, a guard deletes its key in the background,
/// once its queue put answered; a key whose fate stays unknown gives the session up.
impl Drop for EtcdGuard {
    fn drop(&mut self) {
        let made = std::mem::replace(&mut self.made, Made::Nothing);
        if matches!(made, Made::Nothing) {
            return;
        }
        let (client, key, session) = (self.client.clone(), self.key.clone(), self.session.clone());
        self.tasks.spawn_detached(async move {
            let made = match made {
                Made::Putting(put) => match put.await {
                    Ok(Ok((revision, _))) => Made::Key(revision),
                    Ok(Err(failed)) if !failed.may_have_landed => return,
                    _ => Made::Unknown,
                },
                made => made,
            };
            if let Made::Key(revision) = made {
                for _ in 0..CLEANUP_TRIES {
                    if delete_own(client.clone(), &key, revision).await.is_ok() {
                        return;
                    }
                    tokio::time::sleep(CLEANUP_PAUSE).await;
                }
            }
            tracing::debug!(key, "key left in an unknown state; giving the session up");
            session.give_up();
        });
    }
}
