//! A ZooKeeper lock: the recipe of Apache Curator's `InterProcessMutex`, written here
//! on the zookeeper-client crate's primitives.
//!
//! 1. Create an ephemeral sequential node `<root>/<name>/_c_<uuid>-lock-<seq>`.
//! 2. List the lock's children: if ours has the lowest sequence, we hold the lock.
//! 3. Otherwise watch only the node just before ours (`exists` with a watch) and go
//!    back to 2 when it is deleted: a release wakes exactly one waiter, no herd.
//! 4. Release: delete our node. A holder whose process dies loses its session after
//!    the session timeout, and ZooKeeper deletes the node for it.
//! 5. Before its write the holder checks that its session is connected and its node
//!    still there; the node's sequence, which only grows under the lock's directory,
//!    is the fencing token.
//!
//! **Connection loss.** A create whose answer was lost may still have made the node;
//! the `_c_<uuid>` prefix (here 128 random bits in hex) lets the recipe find it instead
//! of queueing twice.
//!
//! **Cancellation.** The session is the replica's and lives on, so a node left by a
//! dropped acquisition would block the lock until the replica stops. An acquisition
//! dropped at any point deletes its node from a cleanup task: by its path once the
//! create answered, otherwise by finding the child with its `_c_<uuid>` prefix. The
//! create was sent before the cleanup's listing, and ZooKeeper answers one session in
//! order, so the listing sees the node if it was made. During a partition the client
//! holds the create back and sends it on reconnecting, so the cleanup outwaits the
//! session (three session timeouts). (The crate's own recipe, 0.11.2, deletes the bare
//! child name when cancelled during the create; that fails path validation and the
//! node outlives the request.)
//!
//! **Session.** One per replica, opened in the background at start and again after it
//! expired. Opening is single-flight: contenders that need a session share one attempt,
//! and each waits for it no longer than its own lock wait.

use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use tokio::time::{Instant, timeout, timeout_at};
use zookeeper_client as zk;

use super::task::{AbortOnDrop, Tasks};
use super::{DistributedLock, HeldLock, LockError, LockView};

/// The session timeout, in milliseconds, a replica or `lockbench` may ask for
/// (`FLASHSALE_ZK_SESSION_MS`). ZooKeeper moves the request into its own
/// `minSessionTimeout..=maxSessionTimeout`, but the request travels as a 32-bit count
/// of milliseconds: 2^31 ms or more arrived negative and was quietly cut to the
/// server's minimum. An hour is far above any server's maximum.
pub const SESSION_MS_BOUNDS: std::ops::RangeInclusive<u64> = 1..=3_600_000;

/// The least a background delete is given. A request the client holds back during a
/// partition is sent when it reconnects, so a cleanup must outwait the session
/// (`OwnNode`'s drop); a short session still gets this much.
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(10);
/// Tries of an operation that lost its connection before giving up to the caller.
const CONNECTION_RETRIES: u32 = 5;

/// A session attempt that every contender waiting for it shares; once it ended, its
/// outcome (the session, or why there is none) stays readable with `peek`.
type Opening = Shared<BoxFuture<'static, Result<zk::Client, String>>>;

pub struct ZooKeeperLock {
    servers: String,
    /// Written into each lock node, so anyone can see which replica holds or waits.
    owner: String,
    session_timeout: Duration,
    root: String,
    /// The latest session attempt, and the task driving it in the background (stopped
    /// if the lock service is dropped first).
    session: Mutex<(Opening, AbortOnDrop)>,
    tasks: Tasks,
}

impl ZooKeeperLock {
    /// One session per replica, shared by all its contenders (the Curator prefix keeps
    /// their nodes apart). Starts connecting at once, in the background, so the first
    /// orders do not queue behind other replicas while this one connects; a replica
    /// starts (and its other strategies work) even while ZooKeeper is down. Must be
    /// called within the Tokio runtime.
    pub fn new(
        servers: &str,
        session_timeout: Duration,
        namespace: &str,
        owner: &str,
    ) -> ZooKeeperLock {
        ZooKeeperLock {
            servers: servers.to_owned(),
            owner: owner.to_owned(),
            session_timeout,
            root: format!("/flashsale/{namespace}/locks"),
            session: Mutex::new(open(servers, session_timeout)),
            tasks: Tasks::default(),
        }
    }

    pub fn lock_dir(&self, name: &str) -> String {
        format!("{}/{name}", self.root)
    }

    /// Background tasks running now: cleanups of dropped acquisitions and guards.
    pub fn background_tasks(&self) -> usize {
        self.tasks.live()
    }

    /// The current session, or the one being opened, or a new attempt if the last one
    /// failed or its session ended: waits at most until `deadline`.
    async fn session(&self, deadline: Instant, wait: Duration) -> Result<zk::Client, LockError> {
        let opening = {
            let mut slot = self.session.lock().unwrap_or_else(|e| e.into_inner());
            match slot.0.peek() {
                Some(Ok(client)) if !client.state().is_terminated() => return Ok(client.clone()),
                Some(Ok(client)) => {
                    tracing::warn!(state = ?client.state(), "ZooKeeper session ended; opening a new one");
                    *slot = open(&self.servers, self.session_timeout);
                }
                Some(Err(_)) => *slot = open(&self.servers, self.session_timeout),
                None => {}
            }
            slot.0.clone()
        };
        match timeout_at(deadline, opening).await {
            Err(_) => Err(LockError::Timeout { waited: wait }),
            Ok(Ok(client)) => Ok(client),
            Ok(Err(error)) => Err(LockError::backend("zookeeper", error)),
        }
    }

    /// The lock's nodes in queue order (the first holds the lock), each with the owner
    /// written in it.
    pub async fn inspect(&self, name: &str) -> Result<Vec<(String, String)>, LockError> {
        let wait = Duration::from_secs(5);
        let client = self.session(Instant::now() + wait, wait).await?;
        let dir = self.lock_dir(name);
        let children = match client.list_children(&dir).await {
            Ok(children) => children,
            Err(zk::Error::NoNode) => return Ok(Vec::new()),
            Err(error) => return Err(zk_error(error)),
        };
        let mut nodes = Vec::new();
        for child in children {
            match client.get_data(&format!("{dir}/{child}")).await {
                Ok((data, _)) => nodes.push((child, String::from_utf8_lossy(&data).into())),
                Err(zk::Error::NoNode) => {}
                Err(error) => return Err(zk_error(error)),
            }
        }
        nodes.sort_by_key(|(node, _)| sequence_of(node));
        Ok(nodes)
    }

    /// The recipe on one session: create our node (step 1), then wait until it is the
    /// lowest (steps 2 and 3).
    async fn contend(&self, client: &zk::Client, dir: &str) -> Result<ZooKeeperGuard, zk::Error> {
        let marker = format!("_c_{:032x}-", rand::random::<u128>());
        let prefix = format!("{dir}/{marker}lock-");
        // From before the create is sent: a drop at any point deletes what it made.
        let mut own = OwnNode {
            node: Node {
                client: client.clone(),
                dir: dir.to_owned(),
                marker,
                path: None,
            },
            tasks: self.tasks.clone(),
            armed: true,
        };
        let ephemeral = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
        let mut losses = 0;
        let path = loop {
            match client
                .create(&prefix, self.owner.as_bytes(), &ephemeral)
                .await
            {
                Ok((_, sequence)) => break format!("{prefix}{sequence}"),
                Err(zk::Error::NoNode) => {
                    let directory = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
                    retrying(|| client.mkdir(dir, &directory)).await?;
                }
                // The node may have been made: look for it before creating another.
                Err(zk::Error::ConnectionLoss) if losses < CONNECTION_RETRIES => {
                    losses += 1;
                    if let Some(path) = own.node.find().await? {
                        break path;
                    }
                }
                Err(error) => return Err(error),
            }
        };
        own.node.path = Some(path.clone());
        let name = path.rsplit('/').next().unwrap_or_default().to_owned();
        loop {
            let mut children = retrying(|| client.list_children(dir)).await?;
            children.retain(|child| child.contains("-lock-") && sequence_of(child).is_some());
            children.sort_by_key(|child| sequence_of(child));
            let Some(position) = children.iter().position(|child| *child == name) else {
                // Our ephemeral node is gone: the session ended under us.
                return Err(zk::Error::SessionExpired);
            };
            if position == 0 {
                return Ok(ZooKeeperGuard { own, path });
            }
            let predecessor = format!("{dir}/{}", children[position - 1]);
            let (stat, watcher) = retrying(|| client.check_and_watch_stat(&predecessor)).await?;
            if stat.is_some() {
                watcher.changed().await;
            }
        }
    }
}

/// Starts a session attempt, driven in the background until it ends.
fn open(servers: &str, session_timeout: Duration) -> (Opening, AbortOnDrop) {
    let servers = servers.to_owned();
    let opening = async move {
        let connecting = zk::Client::connector()
            .with_session_timeout(session_timeout)
            .with_connection_timeout(Duration::from_secs(3))
            .connect(&servers)
            .await;
        connecting.map_err(|error| {
            tracing::warn!(%error, "ZooKeeper not reachable; will retry on use");
            error.to_string()
        })
    }
    .boxed()
    .shared();
    let driver = AbortOnDrop::spawn(opening.clone().map(drop));
    (opening, driver)
}

/// Runs `operation` again after a connection loss, a few times.
async fn retrying<T, F, Fut>(operation: F) -> Result<T, zk::Error>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<T, zk::Error>>,
{
    let mut losses = 0;
    loop {
        match operation().await {
            Err(zk::Error::ConnectionLoss) if losses < CONNECTION_RETRIES => {
                losses += 1;
                tokio::time::sleep(Duration::from_millis(50) * losses).await;
            }
            outcome => return outcome,
        }
    }
}

/// Our node in a lock's queue, or the one a create may have made.
#[derive(Clone)]
struct Node {
    client: zk::Client,
    dir: String,
    /// The Curator prefix `_c_<random>-` that finds the node when its path is unknown.
    marker: String,
    /// Known once the create answered.
    path: Option<String>,
}

impl Node {
    /// The path of the child of the lock that this session created with our marker.
    async fn find(&self) -> Result<Option<String>, zk::Error> {
        let children = retrying(|| self.client.list_children(&self.dir)).await?;
        let own = children.into_iter().find(|c| c.starts_with(&self.marker));
        Ok(own.map(|child| format!("{}/{child}", self.dir)))
    }

    /// Deletes the node, found by its marker if its path is not known; a node already
    /// gone counts as deleted.
    async fn delete(&self) -> Result<(), zk::Error> {
        let path = match &self.path {
            Some(path) => path.clone(),
            None => match self.find().await? {
                Some(path) => path,
                None => return Ok(()),
            },
        };
        match retrying(|| self.client.delete(&path, None)).await {
            Ok(()) | Err(zk::Error::NoNode) => Ok(()),
            Err(error) => Err(error),
        }
    }
}

/// A node nobody will delete otherwise: dropped while armed (an acquisition cut short,
/// a guard not released), it deletes the node in the background.
struct OwnNode {
    node: Node,
    tasks: Tasks,
    /// Cleared once the node's deletion was confirmed.
    armed: bool,
}

impl Drop for OwnNode {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let node = self.node.clone();
        // While the connection is down the client holds the create back and sends it
        // on reconnecting, and a create that failed on a stalled connection may still
        // have been applied. So a cleanup must outwait the session: until the client
        // reconnects (the listing, sent after the create, then finds the node) or
        // declares the session expired (after 7/5 of its timeout plus one connection
        // attempt; the node goes with it), trying again after any other failure.
        // Giving up sooner left the node to a session that lived on: the lock blocked
        // until the replica stopped.
        let bound = CLEANUP_TIMEOUT.max(node.client.session_timeout() * 3);
        self.tasks.spawn_detached(async move {
            let dir = &node.dir;
            let cleanup = async {
                loop {
                    match node.delete().await {
                        Ok(()) | Err(zk::Error::SessionExpired) => return Ok(()),
                        Err(error) if node.client.state().is_terminated() => return Err(error),
                        Err(error) => {
                            tracing::debug!(%error, %dir, "deleting a lock node failed; trying again");
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                    }
                }
            };
            match timeout(bound, cleanup).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::warn!(%error, %dir, "could not delete a lock node"),
                Err(_) => tracing::warn!(%dir, "deleting a lock node timed out"),
            }
        });
    }
}

#[async_trait]
impl DistributedLock for ZooKeeperLock {
    type Guard = ZooKeeperGuard;

    /// Waiters queue in the lock itself, each behind its predecessor's key or node.
    fn queues_waiters(&self) -> bool {
        true
    }

    async fn acquire(&self, name: &str, wait: Duration) -> Result<ZooKeeperGuard, LockError> {
        let deadline = Instant::now() + wait;
        let dir = self.lock_dir(name);
        // A session can turn out expired only when used; then one retry, on a new one
        // (`session` opens one in place of an ended session).
        for _ in 0..2 {
            let client = self.session(deadline, wait).await?;
            match timeout_at(deadline, self.contend(&client, &dir)).await {
                Err(_) => return Err(LockError::Timeout { waited: wait }),
                Ok(Ok(guard)) => return Ok(guard),
                Ok(Err(zk::Error::SessionExpired)) => {}
                Ok(Err(error)) => return Err(zk_error(error)),
            }
        }
        Err(zk_error("session expired twice in a row"))
    }

    async fn view(&self, name: &str) -> Result<LockView, LockError> {
        let nodes = self.inspect(name).await?;
        let dir = self.lock_dir(name);
        let count = nodes.len();
        let mut state = vec![format!("ls {dir} ({count} node(s), in sequence order)")];
        state.extend(nodes.iter().enumerate().map(|(i, (node, owner))| {
            let role = if i == 0 { "holds" } else { "waits" };
            format!("{node}  [{owner}, {role}]")
        }));
        Ok(LockView {
            held: !nodes.is_empty(),
            holder: nodes.first().map(|(_, owner)| owner.clone()),
            lease_left_ms: None,
            state,
        })
    }
}

/// A held ZooKeeper lock: our ephemeral node. Dropping it deletes the node.
pub struct ZooKeeperGuard {
    own: OwnNode,
    path: String,
}

impl ZooKeeperGuard {
    pub fn path(&self) -> &str {
        &self.path
    }
}

#[async_trait]
impl HeldLock for ZooKeeperGuard {
    /// Step 5: the session connected, and our node there, created by this session.
    async fn ensure_held(&self) -> Result<(), LockError> {
        let client = &self.own.node.client;
        let state = client.state();
        if state != zk::SessionState::SyncConnected {
            return Err(LockError::Lost(format!("ZooKeeper session is {state:?}")));
        }
        match client.check_stat(self.path()).await {
            Ok(Some(stat)) if stat.ephemeral_owner == client.session_id().0 => Ok(()),
            Ok(_) => Err(LockError::Lost(format!("lock node {} is gone", self.path))),
            Err(zk::Error::SessionExpired) => {
                Err(LockError::Lost("ZooKeeper session expired".into()))
            }
            Err(error) => Err(zk_error(error)),
        }
    }

    /// Without asking ZooKeeper: a session that is not connected (the connection was
    /// lost, or the session expired or closed) may already have lost the node, and a
    /// hold that cannot be checked is not one to pass on.
    fn known_lost(&self) -> bool {
        self.own.node.client.state() != zk::SessionState::SyncConnected
    }

    /// The bare sequence, plus one: the first node under a lock's directory has
    /// sequence 0, and a fence only moves to a strictly greater token.
    fn fencing_token(&self) -> Option<u64> {
        sequence_of(&self.path).map(|sequence| sequence + 1)
    }

    /// Step 4: deletes the node, and the successor's watch fires. If the delete fails,
    /// the drop retries it in the background.
    async fn release(mut self) -> Result<(), LockError> {
        let deleted = self.own.node.delete().await;
        // An expired session took the node with it.
        self.own.armed = !matches!(deleted, Ok(()) | Err(zk::Error::SessionExpired));
        match deleted {
            Ok(()) => Ok(()),
            Err(zk::Error::SessionExpired) => Err(LockError::Lost(
                "ZooKeeper session expired before release".into(),
            )),
            Err(error) => Err(zk_error(error)),
        }
    }
}

/// The trailing sequence number of a lock node's name or path.
fn sequence_of(node: &str) -> Option<u64> {
    let digits = node.len() - node.bytes().rev().take_while(u8::is_ascii_digit).count();
    node[digits..].parse().ok()
}

fn zk_error(error: impl std::fmt::Display) -> LockError {
    LockError::backend("zookeeper", error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_are_read_from_the_end() {
        assert_eq!(sequence_of("_c_x-lock-0000000042"), Some(42));
        assert_eq!(sequence_of("/a/b/_c_x-lock-0000000000"), Some(0));
        assert_eq!(sequence_of("lock-"), None);
    }
}
