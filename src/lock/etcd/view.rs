//! What the dashboard and the tests see of an etcd lock: its keys in queue order and
//! the holder's lease, read from etcd (nothing here takes part in the lock).

use etcd_client::{GetOptions, SortOrder, SortTarget};

use super::EtcdLock;
use super::calls::bounded;
use crate::lock::{LockError, LockView};

impl EtcdLock {
    /// The lock's keys in queue order (create revision), each with its create revision
    /// and lease; the first holds. Also the holder's lease TTL in seconds.
    pub async fn inspect(
        &self,
        name: &str,
    ) -> Result<(Vec<(String, i64, i64)>, Option<i64>), LockError> {
        let mut client = self.client().await?;
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend);
        let response =
            bounded(client.get(format!("{}/", self.lock_name(name)), Some(options))).await?;
        let keys: Vec<(String, i64, i64)> = response
            .kvs()
            .iter()
            .map(|kv| {
                let key = String::from_utf8_lossy(kv.key()).into_owned();
                (key, kv.create_revision(), kv.lease())
            })
            .collect();
        let Some(&(_, _, lease)) = keys.first() else {
            return Ok((keys, None));
        };
        let ttl = bounded(client.lease_time_to_live(lease, None)).await?.ttl();
        Ok((keys, Some(ttl)))
    }

    /// What the dashboard shows of the lock: its keys in queue order.
    pub(super) async fn view_of(&self, name: &str) -> Result<LockView, LockError> {
        let (keys, ttl) = self.inspect(name).await?;
        let mut state = vec![format!(
            "get --prefix {}/ ({} key(s), by create revision)",
            self.lock_name(name),
            keys.len()
        )];
        state.extend(keys.iter().enumerate().map(|(i, (key, revision, lease))| {
            let role = if i == 0 { "holds" } else { "waits" };
            format!("{key}  [create revision {revision}, lease {lease:x}, {role}]")
        }));
        Ok(LockView {
            held: !keys.is_empty(),
            holder: keys.first().map(|(_, _, lease)| format!("lease {lease:x}")),
            lease_left_ms: ttl.map(|seconds| seconds * 1000),
            state,
        })
    }
}
