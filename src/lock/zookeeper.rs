//! A ZooKeeper lock: the recipe of Apache Curator's `InterProcessMutex`, written here
//! on the zookeeper-client crate's primitives.
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
//!
//! **Cancellation.** The session is the replica's and lives on, so a node left by a
//! dropped acquisition would block the lock until the replica stops. An acquisition
//! dropped at any point deletes its node from a cleanup task: by its path once the
//! create answered, otherwise by finding the child with its `_c_<uuid>` prefix. The
//! create was sent before the cleanup's listing, and ZooKeeper answers one session in
//! order, so the listing sees the node if it was made. During a partition the client
//! holds the create back and sends it on reconnecting, so the cleanup outwaits the
//! session (three session timeouts). (The crate's own recipe,
//! 0.11.2, deletes the bare child name when cancelled during the create; that fails
//! path validation and the node outlives the request.)
//!
//! **Handed over within a replica.** The replica's requests for one lock take turns
//! (`local_queue`), so the replica has one node in the lock's queue at a time. A holder
//! whose replica has more requests waiting gives them its node instead of deleting it,
//! without a call to ZooKeeper: the node, on the replica's session, is the lock, and the
//! request holding the replica's turn is the one using it. A release and the next
//! node's turn cost a delete, a watch event and a listing through ZooKeeper's write
//! pipeline; this costs nothing, and the next holder's last check still asks
//! ZooKeeper that the node and session are there. After `RUN_LIMIT` handovers in a row
//! the node is deleted and the replica's next request queues a new one behind the other
//! replicas', so replicas still take the lock in the order they queued and each waits
//! at most a few holds more; requests of different replicas no longer do (one that came
//! later may go first, by at most a run). Each hold's fencing token is the node's
//! sequence with its place in the run (`local_queue::token_in_run`). A node handed to a
//! request that gave up, with nobody behind it, goes with the queue and is deleted.
//!
//! **Session.** One per replica, opened in the background at start and again after it
//! expired. Opening is single-flight: contenders that need a session share one attempt,
//! and each waits for it no longer than its own lock wait.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use tokio::time::{Instant, timeout, timeout_at};
use zookeeper_client as zk;

use super::local_queue::{LocalQueues, Passed, Turn, token_in_run};
use super::task::{AbortOnDrop, Tasks};
use super::{DistributedLock, HeldLock, LockError, LockView};

/// The session timeout, in milliseconds, a replica or `lockbench` may ask for
/// (`FLASHSALE_ZK_SESSION_MS`). ZooKeeper moves the request into its own
/// `minSessionTimeout..=maxSessionTimeout`, but the request travels as a 32-bit count
/// of milliseconds: 2^31 ms or more arrived negative and was quietly cut to the
/// server's minimum. An hour is far above any server's maximum.
pub const SESSION_MS_BOUNDS: std::ops::RangeInclusive<u64> = 1..=3_600_000;

/// Bound on a background delete (a dropped guard's node). A request the client holds
/// back during a partition is still sent when it reconnects, so a delete cut off here
/// still lands; a dropped acquisition's cleanup must wait longer (`PendingNode`).
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(10);
/// Tries of an operation that lost its connection before giving up to the caller.
const CONNECTION_RETRIES: u32 = 5;

/// A session attempt that every contender waiting for it shares.
type Opening = Shared<BoxFuture<'static, Result<zk::Client, String>>>;

enum Slot {
    Empty,
    Open(zk::Client),
    Opening(Opening),
}

pub struct ZooKeeperLock {
    servers: String,
    /// Written into each lock node, so anyone can see which replica holds or waits.
    owner: String,
    session_timeout: Duration,
    root: String,
    slot: Arc<Mutex<Slot>>,
    /// The latest session attempt, stopped if the lock service is dropped first.
    connecting: Mutex<Option<AbortOnDrop>>,
    local_queues: LocalQueues<HandedNode>,
    tasks: Tasks,
}

/// A replica's turn on a lock, which can carry a node handed over to the next request.
type ZkTurn = Turn<HandedNode>;

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
        let lock = ZooKeeperLock {
            servers: servers.to_owned(),
            owner: owner.to_owned(),
            session_timeout,
            root: format!("/flashsale/{namespace}/locks"),
            slot: Arc::new(Mutex::new(Slot::Empty)),
            connecting: Mutex::new(None),
            local_queues: LocalQueues::default(),
            tasks: Tasks::default(),
        };
        drop(lock.open(&mut lock.slot()));
        lock
    }

    pub fn lock_dir(&self, name: &str) -> String {
        format!("{}/{name}", self.root)
    }

    /// Background tasks running now: cleanups of dropped acquisitions and guards.
    pub fn background_tasks(&self) -> usize {
        self.tasks.live()
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts a session attempt in the background and puts it in `slot` (held locked
    /// by the caller); the attempt records its outcome there.
    fn open(&self, slot_now: &mut Slot) -> Opening {
        let (servers, session_timeout) = (self.servers.clone(), self.session_timeout);
        let slot = self.slot.clone();
        let (done, outcome) = tokio::sync::oneshot::channel();
        let attempt = AbortOnDrop::spawn(async move {
            let connected = connect(&servers, session_timeout).await;
            let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
            *slot = match &connected {
                Ok(client) => Slot::Open(client.clone()),
                Err(error) => {
                    tracing::warn!(%error, "ZooKeeper not reachable; will retry on use");
                    Slot::Empty
                }
            };
            drop(slot);
            let _ = done.send(connected.map_err(|error| error.to_string()));
        });
        let opening = async move {
            outcome
                .await
                .unwrap_or_else(|_| Err("session attempt stopped".to_owned()))
        }
        .boxed()
        .shared();
        *slot_now = Slot::Opening(opening.clone());
        *self.connecting.lock().unwrap_or_else(|e| e.into_inner()) = Some(attempt);
        opening
    }

    /// The current session, or the one being opened, or a new attempt: waits at most
    /// until `deadline`.
    async fn session(&self, deadline: Instant, wait: Duration) -> Result<zk::Client, LockError> {
        let opening = {
            let mut slot = self.slot();
            match &*slot {
                Slot::Open(client) if !client.state().is_terminated() => {
                    return Ok(client.clone());
                }
                Slot::Opening(opening) => opening.clone(),
                ended => {
                    if let Slot::Open(client) = ended {
                        tracing::warn!(state = ?client.state(), "ZooKeeper session ended; opening a new one");
                    }
                    self.open(&mut slot)
                }
            }
        };
        match timeout_at(deadline, opening).await {
            Err(_) => Err(LockError::Timeout { waited: wait }),
            Ok(Ok(client)) => Ok(client),
            Ok(Err(error)) => Err(LockError::backend("zookeeper", error)),
        }
    }

    /// Forgets `ended` so the next use opens a new session.
    fn discard(&self, ended: &zk::Client) {
        let mut slot = self.slot();
        if matches!(&*slot, Slot::Open(c) if c.session_id() == ended.session_id()) {
            tracing::warn!("ZooKeeper session expired; opening a new one");
            *slot = Slot::Empty;
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

    /// The recipe on one session: create our node, then wait until it is the lowest.
    async fn contend(
        &self,
        client: &zk::Client,
        dir: &str,
        turn: &Arc<ZkTurn>,
    ) -> Result<ZooKeeperGuard, zk::Error> {
        let marker = format!("_c_{}-", uuid());
        let prefix = format!("{dir}/{marker}lock-");
        let mut pending = PendingNode {
            client: client.clone(),
            dir: dir.to_owned(),
            marker: marker.clone(),
            path: None,
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
                    if let Some(child) = find_own(client, dir, &marker).await? {
                        break format!("{dir}/{child}");
                    }
                }
                Err(error) => return Err(error),
            }
        };
        pending.path = Some(path.clone());
        let own = path.rsplit('/').next().unwrap_or_default().to_owned();
        loop {
            let mut children = retrying(|| client.list_children(dir)).await?;
            children.retain(|child| child.contains("-lock-") && sequence_of(child).is_some());
            children.sort_by_key(|child| sequence_of(child));
            let Some(position) = children.iter().position(|child| *child == own) else {
                // Our ephemeral node is gone: the session ended under us.
                return Err(zk::Error::SessionExpired);
            };
            if position == 0 {
                pending.armed = false;
                return Ok(ZooKeeperGuard {
                    client: client.clone(),
                    path,
                    released: false,
                    tasks: self.tasks.clone(),
                    run: 0,
                    turn: turn.clone(),
                });
            }
            let predecessor = format!("{dir}/{}", children[position - 1]);
            let (stat, watcher) = retrying(|| client.check_and_watch_stat(&predecessor)).await?;
            if stat.is_some() {
                watcher.changed().await;
            }
        }
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

/// The child of `dir` this session created with the `marker` prefix, if any.
async fn find_own(
    client: &zk::Client,
    dir: &str,
    marker: &str,
) -> Result<Option<String>, zk::Error> {
    let children = retrying(|| client.list_children(dir)).await?;
    Ok(children.into_iter().find(|child| child.starts_with(marker)))
}

/// A random UUID (version 4 layout) for the Curator prefix.
fn uuid() -> String {
    let bits = rand::random::<u128>() & !(0xf << 76) & !(0x3 << 62) | (0x4 << 76) | (0x2 << 62);
    let hex = format!("{bits:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

/// A node this acquisition created or may have created. Dropped while armed (the
/// acquisition was cut short), it deletes the node in the background.
struct PendingNode {
    client: zk::Client,
    dir: String,
    marker: String,
    /// Known once the create answered.
    path: Option<String>,
    tasks: Tasks,
    armed: bool,
}

impl Drop for PendingNode {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (client, dir, marker, path) = (
            self.client.clone(),
            self.dir.clone(),
            self.marker.clone(),
            self.path.take(),
        );
        // While the connection is down the client holds the create back and sends it
        // on reconnecting, and a create that failed on a stalled connection may still
        // have been applied. So a cleanup must outwait the session: until the client
        // reconnects (the listing, sent after the create, then finds the node) or
        // declares the session expired (after 7/5 of its timeout plus one connection
        // attempt; the node goes with it), trying again after any other failure.
        // Giving up sooner left the node to a session that lived on: the lock blocked
        // until the replica stopped.
        let bound = CLEANUP_TIMEOUT.max(client.session_timeout() * 3);
        self.tasks.spawn_detached(async move {
            let cleanup = async {
                loop {
                    match delete_own(&client, &dir, &marker, path.as_deref()).await {
                        Ok(()) | Err(zk::Error::NoNode | zk::Error::SessionExpired) => return Ok(()),
                        Err(error) if client.state().is_terminated() => return Err(error),
                        Err(error) => {
                            tracing::debug!(%error, %dir, "cleanup of a dropped acquisition failed; trying again");
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                    }
                }
            };
            match timeout(bound, cleanup).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    tracing::warn!(%error, %dir, "could not delete a dropped acquisition's node")
                }
                Err(_) => tracing::warn!(%dir, "deleting a dropped acquisition's node timed out"),
            }
        });
    }
}

/// Deletes the node an acquisition made: at `path` if its create answered, else the
/// child of `dir` with its `marker`, if there is one.
async fn delete_own(
    client: &zk::Client,
    dir: &str,
    marker: &str,
    path: Option<&str>,
) -> Result<(), zk::Error> {
    let path = match path {
        Some(path) => path.to_owned(),
        None => match find_own(client, dir, marker).await? {
            Some(child) => format!("{dir}/{child}"),
            None => return Ok(()),
        },
    };
    delete_node(client, &path).await
}

/// Deletes `path`, retrying over connection losses; an absent node is deleted.
async fn delete_node(client: &zk::Client, path: &str) -> Result<(), zk::Error> {
    match retrying(|| client.delete(path, None)).await {
        Ok(()) | Err(zk::Error::NoNode) => Ok(()),
        Err(error) => Err(error),
    }
}

#[async_trait]
impl DistributedLock for ZooKeeperLock {
    type Guard = ZooKeeperGuard;

    async fn acquire(&self, name: &str, wait: Duration) -> Result<ZooKeeperGuard, LockError> {
        let deadline = Instant::now() + wait;
        let dir = self.lock_dir(name);
        let turn = self
            .local_queues
            .turn(&dir, deadline)
            .await
            .ok_or(LockError::Timeout { waited: wait })?;
        let turn = Arc::new(turn);
        if let Some(node) = turn.take_passed() {
            // On a session still connected; otherwise its drop deletes it if it can,
            // and we queue afresh (on a new session if that one expired).
            if node.client.state() == zk::SessionState::SyncConnected {
                return Ok(node.into_guard(&turn));
            }
        }
        // A session can turn out expired only when used; then one retry on a new one.
        for _ in 0..2 {
            let client = self.session(deadline, wait).await?;
            match timeout_at(deadline, self.contend(&client, &dir, &turn)).await {
                Err(_) => return Err(LockError::Timeout { waited: wait }),
                Ok(Ok(guard)) => return Ok(guard),
                Ok(Err(zk::Error::SessionExpired)) => self.discard(&client),
                Ok(Err(error)) => return Err(zk_error(error)),
            }
        }
        Err(LockError::backend(
            "zookeeper",
            "session expired twice in a row",
        ))
    }

    async fn view(&self, name: &str) -> Result<LockView, LockError> {
        let nodes = self.inspect(name).await?;
        let dir = self.lock_dir(name);
        let mut state = vec![format!(
            "ls {dir} ({} node(s), in sequence order)",
            nodes.len()
        )];
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
    client: zk::Client,
    path: String,
    /// Set once the node's deletion was confirmed, or the node handed over.
    released: bool,
    tasks: Tasks,
    /// How many holds before this one in a row had the node (0: it was created for
    /// this one).
    run: u32,
    /// This replica's turn on the lock, given up when the guard goes.
    turn: Arc<ZkTurn>,
}

/// A node this replica's last holder gave to whoever takes the turn next. Abandoned
/// (the request it was meant for gave up, and nobody else waits), it is deleted under a
/// turn of its own.
struct HandedNode {
    client: zk::Client,
    path: String,
    run: u32,
    tasks: Tasks,
    taken: bool,
    cleanup_turn: Option<ZkTurn>,
}

impl Passed for HandedNode {
    fn abandoned(mut self, turn: Option<ZkTurn>) {
        self.cleanup_turn = turn;
    }
}

impl HandedNode {
    fn into_guard(mut self, turn: &Arc<ZkTurn>) -> ZooKeeperGuard {
        self.taken = true;
        ZooKeeperGuard {
            client: self.client.clone(),
            path: std::mem::take(&mut self.path),
            released: false,
            tasks: self.tasks.clone(),
            run: self.run,
            turn: turn.clone(),
        }
    }
}

impl Drop for HandedNode {
    fn drop(&mut self) {
        if !self.taken {
            let turn = self.cleanup_turn.take();
            delete_in_background(&self.tasks, &self.client, &self.path, turn);
        }
    }
}

impl ZooKeeperGuard {
    pub fn path(&self) -> &str {
        &self.path
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
        let state = self.client.state();
        if state != zk::SessionState::SyncConnected {
            return Err(LockError::Lost(format!("ZooKeeper session is {state:?}")));
        }
        match self.client.check_stat(self.path()).await {
            Ok(Some(stat)) if stat.ephemeral_owner == self.client.session_id().0 => Ok(()),
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

    /// The sequence plus one (the first node under a lock's directory has sequence 0,
    /// and a fence only moves to a strictly greater token, so 0 would be refused), with
    /// the hold's place in its run of handovers.
    fn fencing_token(&self) -> Option<u64> {
        self.sequence()
            .and_then(|sequence| token_in_run(sequence + 1, self.run))
    }

    /// Hands the node to this replica's next request if one waits and the run may go
    /// on; otherwise deletes it, and the successor's watch fires. If the delete fails,
    /// the drop retries it in the background.
    async fn release(mut self) -> Result<(), LockError> {
        if self.turn.hands_over(self.run) && self.client.state() == zk::SessionState::SyncConnected
        {
            self.released = true;
            self.turn.pass_on(HandedNode {
                client: self.client.clone(),
                path: self.path.clone(),
                run: self.run + 1,
                tasks: self.tasks.clone(),
                taken: false,
                cleanup_turn: None,
            });
            return Ok(());
        }
        match delete_node(&self.client, &self.path).await {
            Ok(()) => {
                self.released = true;
                Ok(())
            }
            Err(zk::Error::SessionExpired) => {
                self.released = true;
                Err(LockError::Lost(
                    "ZooKeeper session expired before release".into(),
                ))
            }
            Err(error) => Err(zk_error(error)),
        }
    }
}

impl Drop for ZooKeeperGuard {
    fn drop(&mut self) {
        if !self.released {
            delete_in_background(&self.tasks, &self.client, &self.path, None);
        }
    }
}

/// Deletes a lock node nobody holds any more, from a task of its own, keeping `turn`
/// meanwhile.
fn delete_in_background(tasks: &Tasks, client: &zk::Client, path: &str, turn: Option<ZkTurn>) {
    let (client, path) = (client.clone(), path.to_owned());
    tasks.spawn_detached(async move {
        let _turn = turn;
        match timeout(CLEANUP_TIMEOUT, delete_node(&client, &path)).await {
            Ok(Ok(()) | Err(zk::Error::SessionExpired)) => {}
            Ok(Err(error)) => tracing::warn!(%error, %path, "could not delete a lock node"),
            Err(_) => tracing::warn!(%path, "deleting a lock node timed out"),
        }
    });
}

/// The trailing sequence number of a lock node's name or path.
fn sequence_of(node: &str) -> Option<u64> {
    let digits = node.len() - node.bytes().rev().take_while(u8::is_ascii_digit).count();
    node[digits..].parse().ok()
}

fn zk_error(error: zk::Error) -> LockError {
    LockError::backend("zookeeper", error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn curator_prefixes_are_version_4_uuids() {
        let id = uuid();
        let groups: Vec<usize> = id.split('-').map(str::len).collect();
        assert_eq!(groups, [8, 4, 4, 4, 12]);
        assert_eq!(&id[14..15], "4");
        assert!(matches!(&id[19..20], "8" | "9" | "a" | "b"), "{id}");
        assert_ne!(uuid(), id);
    }

    #[test]
    fn sequences_are_read_from_the_end() {
        assert_eq!(sequence_of("_c_x-lock-0000000042"), Some(42));
        assert_eq!(sequence_of("/a/b/_c_x-lock-0000000000"), Some(0));
        assert_eq!(sequence_of("lock-"), None);
    }
}
