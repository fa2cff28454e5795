//! A ZooKeeper lock: the recipe of Apache Curator's `InterProcessMutex`, through the
//! zookeeper-client crate's Curator-compatible implementation.
//!
//! - Each contender creates an ephemeral sequential node
//!   `<root>/<name>/_c_<uuid>-lock-<seq>`; the lowest sequence holds the lock.
//! - Every other contender watches only its predecessor, so a release wakes exactly
//!   one waiter (no herd).
//! - The node is ephemeral: a holder whose process dies loses its session after the
//!   session timeout and ZooKeeper deletes the node. The `_c_<uuid>` prefix lets the
//!   recipe find its own node again after a connection loss during creation.
//! - A holder checks, before committing, that its session is connected and its node
//!   still exists; after a session expiry it must not commit. An expired session is
//!   terminal, so the next acquisition opens a new one.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::RwLock;
use zookeeper_client as zk;

use super::{DistributedLock, HeldLock, LockError};

pub struct ZooKeeperLock {
    servers: String,
    /// Written into each lock node, so anyone can see which replica holds or waits.
    owner: String,
    session_timeout: Duration,
    root: String,
    /// Opened in the background at start, and again on use after an expiry or a
    /// failed start: a replica starts (and its other strategies work) even while
    /// ZooKeeper is down.
    client: Arc<RwLock<Option<zk::Client>>>,
}

impl ZooKeeperLock {
    /// One session per replica, shared by all its contenders (the Curator prefix keeps
    /// their nodes apart). Starts connecting at once, in the background, so the first
    /// orders do not queue behind other replicas while this one connects. Must be
    /// called within the Tokio runtime.
    pub fn new(
        servers: &str,
        session_timeout: Duration,
        namespace: &str,
        owner: &str,
    ) -> ZooKeeperLock {
        let client: Arc<RwLock<Option<zk::Client>>> = Arc::default();
        let (slot, address) = (client.clone(), servers.to_owned());
        tokio::spawn(async move {
            let mut slot = slot.write().await;
            match connect(&address, session_timeout).await {
                Ok(session) => *slot = Some(session),
                Err(error) => {
                    tracing::warn!(%error, "ZooKeeper not reachable at start; will retry on use")
                }
            }
        });
        ZooKeeperLock {
            servers: servers.to_owned(),
            owner: owner.to_owned(),
            session_timeout,
            root: format!("/flashsale/{namespace}/locks"),
            client,
        }
    }

    pub fn lock_dir(&self, name: &str) -> String {
        format!("{}/{name}", self.root)
    }

    /// The current session, or a new one if there is none yet or it ended.
    async fn session(&self) -> Result<zk::Client, LockError> {
        let usable = |client: &Option<zk::Client>| {
            client
                .as_ref()
                .filter(|c| !c.state().is_terminated())
                .cloned()
        };
        if let Some(client) = usable(&*self.client.read().await) {
            return Ok(client);
        }
        let mut slot = self.client.write().await;
        if let Some(client) = usable(&slot) {
            return Ok(client);
        }
        if let Some(ended) = slot.as_ref() {
            tracing::warn!(state = ?ended.state(), "ZooKeeper session ended; opening a new one");
        }
        let client = connect(&self.servers, self.session_timeout).await?;
        *slot = Some(client.clone());
        Ok(client)
    }
}

async fn connect(servers: &str, session_timeout: Duration) -> Result<zk::Client, LockError> {
    zk::Client::connector()
        .with_session_timeout(session_timeout)
        .with_connection_timeout(Duration::from_secs(3))
        .connect(servers)
        .await
        .map_err(zk_error)
}

#[async_trait]
impl DistributedLock for ZooKeeperLock {
    type Guard = ZooKeeperGuard;

    async fn acquire(&self, name: &str, wait: Duration) -> Result<ZooKeeperGuard, LockError> {
        let deadline = tokio::time::Instant::now() + wait;
        let dir = self.lock_dir(name);
        // A session can turn out expired only when used; then one retry on a new one.
        for _ in 0..2 {
            let client = self.session().await?;
            let prefix = zk::LockPrefix::new_curator(&dir, "lock-").map_err(zk_error)?;
            let options = zk::LockOptions::new(zk::Acls::anyone_all())
                .with_ancestor_options(zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all()))
                .map_err(zk_error)?;
            // The recipe is cancellation safe: on timeout it deletes the node it created.
            let contended = tokio::time::timeout_at(
                deadline,
                client.lock(prefix, self.owner.as_bytes(), options),
            )
            .await;
            match contended {
                Err(_) => return Err(LockError::Timeout { waited: wait }),
                Ok(Ok(lock)) => {
                    return Ok(ZooKeeperGuard {
                        lock: lock.into_owned(),
                    });
                }
                Ok(Err(zk::Error::SessionExpired)) => self.discard(&client).await,
                Ok(Err(error)) => return Err(zk_error(error)),
            }
        }
        Err(LockError::backend(
            "zookeeper",
            "session expired twice in a row",
        ))
    }
}

impl ZooKeeperLock {
    /// The lock's nodes in queue order (the first holds the lock), each with the owner
    /// written in it.
    pub async fn inspect(&self, name: &str) -> Result<Vec<(String, String)>, LockError> {
        let client = self.session().await?;
        let dir = self.lock_dir(name);
        let children = match client.list_children(&dir).await {
            Ok(children) => children,
            Err(zk::Error::NoNode) => return Ok(Vec::new()),
            Err(error) => return Err(zk_error(error)),
        };
        let mut nodes = Vec::new();
        for child in children {
            let owner = match client.get_data(&format!("{dir}/{child}")).await {
                Ok((data, _)) => String::from_utf8_lossy(&data).into_owned(),
                Err(zk::Error::NoNode) => continue,
                Err(error) => return Err(zk_error(error)),
            };
            nodes.push((child, owner));
        }
        nodes.sort_by_key(|(node, _)| sequence_of(node));
        Ok(nodes)
    }

    /// Forgets `ended` so the next use opens a new session.
    async fn discard(&self, ended: &zk::Client) {
        let mut slot = self.client.write().await;
        if slot
            .as_ref()
            .is_some_and(|c| c.session_id() == ended.session_id())
        {
            tracing::warn!("ZooKeeper session expired; opening a new one");
            *slot = None;
        }
    }
}

/// A held ZooKeeper lock: our ephemeral node. Dropping it deletes the node.
pub struct ZooKeeperGuard {
    lock: zk::OwnedLockClient,
}

impl ZooKeeperGuard {
    pub fn path(&self) -> &str {
        self.lock.lock_path()
    }

    /// The node's sequence number: it only grows under the lock's directory, so it
    /// can serve as a fencing token.
    pub fn sequence(&self) -> Option<u64> {
        sequence_of(self.path())
    }
}

#[async_trait]
impl HeldLock for ZooKeeperGuard {
    async fn ensure_held(&self) -> Result<(), LockError> {
        let client = self.lock.client();
        let state = client.state();
        if state != zk::SessionState::SyncConnected {
            return Err(LockError::Lost(format!("ZooKeeper session is {state:?}")));
        }
        match client.check_stat(self.path()).await {
            Ok(Some(stat)) if stat.ephemeral_owner == client.session_id().0 => Ok(()),
            Ok(_) => Err(LockError::Lost(format!(
                "lock node {} is gone",
                self.path()
            ))),
            Err(zk::Error::SessionExpired) => {
                Err(LockError::Lost("ZooKeeper session expired".into()))
            }
            Err(error) => Err(zk_error(error)),
        }
    }

    /// The sequence plus one: the first node under a lock's directory has sequence 0,
    /// and a fence only moves to a strictly greater token, so 0 would be refused.
    fn fencing_token(&self) -> Option<u64> {
        self.sequence().map(|sequence| sequence + 1)
    }

    /// Dropping the owned lock deletes the node (retrying over connection loss); the
    /// successor's watch fires and it takes over.
    async fn release(self) -> Result<(), LockError> {
        drop(self.lock);
        Ok(())
    }
}

/// The trailing sequence number of a lock node's name or path.
fn sequence_of(node: &str) -> Option<u64> {
    let digits = node.len() - node.bytes().rev().take_while(u8::is_ascii_digit).count();
    node[digits..].parse().ok()
}

fn zk_error(error: zk::Error) -> LockError {
    LockError::backend("zookeeper", error)
}
