//! The failover fault: the lock's Redis primary fails over to a replica, through
//! Sentinel, while a holder holds a lock the replica never received.
//!
//! Replication is asynchronous, so the race is real but narrow: a key set on the
//! primary usually reaches the replica within a millisecond. The fault makes it certain
//! rather than likely, with commands a reader can type into `redis-cli`:
//!
//! 1. `ACL SETUSER default -psync -sync` on the primary, then `CLIENT KILL TYPE
//!    master` on the replica to be promoted: its replication link drops and cannot
//!    resume (its `PSYNC` is refused), while Sentinel still sees it healthy. Writes to
//!    the primary from now on do not reach it. (`CLIENT PAUSE WRITE` on the replica
//!    also stops replication, but it holds Sentinel's periodic `PUBLISH` too, and the
//!    promotion queued behind it on the same connection never came under load.)
//! 2. The next lock holder is paused (the paused-holder fault, armed after the cut so
//!    that the promoted replica never learns of it) for less than the lease: whatever
//!    happens next is the failover's doing, not an expired lease.
//! 3. Once the SKU's lock key exists on the primary and the paused holder holds it:
//!    `SENTINEL FAILOVER <master>`. Sentinel sends `REPLICAOF NO ONE` to the replica.
//!    A lock that waits for its replicas (`WAIT`) cannot be held while the replica is
//!    cut: after `within_ms` the ACL is restored, the replica resumes (a partial resync
//!    from the backlog), and the failover comes when a holder holds then; the promoted
//!    replica has that lock.
//! 4. As soon as the replica answers `ROLE` as a primary, the old primary's ACL is
//!    restored. The promoted primary has no lock key: the next order takes the lock.
//! 5. `REPLICAOF <new primary>` and `CLIENT KILL TYPE normal` on the old primary, which
//!    Sentinel would do itself some seconds later: its clients reconnect through
//!    Sentinel, and its copy of the lock is replaced by the new primary's data.
//!
//! With other replicas in the set (Redisson issue 5256: one acknowledges a `WAIT`, the
//! other is elected), they are made unelectable first (`CONFIG SET replica-priority 0`,
//! restored at the end), so Sentinel elects the one that missed the lock.

use std::collections::HashMap;
use std::time::Duration;

use deadpool_redis::redis::{self, Client, aio::MultiplexedConnection};
use serde::Serialize;
use tokio::time::{Instant, sleep, timeout};

use crate::redis_pool::SentinelSource;

/// Each command, and each connection, is bounded by this.
const BOUND: Duration = Duration::from_secs(2);
/// Polling interval of the waits below (each bounded by a deadline).
const POLL: Duration = Duration::from_millis(5);
/// How long Sentinel may take to promote the replica.
const PROMOTION: Duration = Duration::from_secs(15);
/// How long Sentinel may take to see a changed `replica-priority` (it reads the
/// replicas' `INFO` every 10 s).
const PRIORITY_SEEN: Duration = Duration::from_secs(25);

/// The Redis set as Sentinel describes it before the fault.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Plan {
    /// `host:port` of the primary now.
    pub primary: String,
    /// The replica that will miss the lock and be promoted.
    pub promoted: String,
    /// Replicas that stay replicas (and may have acknowledged a `WAIT`).
    pub others: Vec<String>,
}

/// What the fault found once it ended.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    pub plan: Plan,
    /// Whether a holder held the lock when the failover began (otherwise nothing failed
    /// over: replication was restored and the fault withdrawn).
    pub failed_over: bool,
    /// The promoted primary had no lock key at promotion: the lock was lost.
    pub lock_lost: bool,
    /// Unix ms of the `SENTINEL FAILOVER` and of the replica answering as a primary.
    pub failover_at_ms: Option<f64>,
    pub promoted_at_ms: Option<f64>,
}

#[derive(Debug, thiserror::Error)]
pub enum FailoverError {
    #[error("Sentinel: {0}")]
    Sentinel(String),
    #[error("{0}: {1}")]
    Node(String, String),
}

fn node_error(node: &str) -> impl Fn(redis::RedisError) -> FailoverError + '_ {
    move |error| FailoverError::Node(node.to_owned(), error.to_string())
}

async fn connect(address: &str) -> Result<MultiplexedConnection, FailoverError> {
    let client = Client::open(format!("redis://{address}")).map_err(node_error(address))?;
    match timeout(BOUND, client.get_multiplexed_async_connection()).await {
        Ok(connection) => connection.map_err(node_error(address)),
        Err(_) => Err(FailoverError::Node(address.to_owned(), "no answer".into())),
    }
}

async fn query<T: redis::FromRedisValue>(
    address: &str,
    connection: &mut MultiplexedConnection,
    command: &redis::Cmd,
) -> Result<T, FailoverError> {
    match timeout(BOUND, command.query_async(connection)).await {
        Ok(answer) => answer.map_err(node_error(address)),
        Err(_) => Err(FailoverError::Node(address.to_owned(), "no answer".into())),
    }
}

/// A connection to the first Sentinel that answers.
async fn sentinel(
    source: &SentinelSource,
) -> Result<(String, MultiplexedConnection), FailoverError> {
    let mut last = String::from("no Sentinel configured");
    for node in &source.nodes {
        match connect(node).await {
            Ok(connection) => return Ok((node.clone(), connection)),
            Err(error) => last = error.to_string(),
        }
    }
    Err(FailoverError::Sentinel(last))
}

/// The replicas Sentinel knows for the master, healthy ones only, as `host:port`, with
/// the priority Sentinel last saw.
async fn replicas(source: &SentinelSource) -> Result<Vec<(String, String)>, FailoverError> {
    let (node, mut connection) = sentinel(source).await?;
    let listed: Vec<HashMap<String, String>> = query(
        &node,
        &mut connection,
        redis::cmd("SENTINEL").arg("REPLICAS").arg(&source.master),
    )
    .await?;
    Ok(listed
        .into_iter()
        .filter(|replica| replica.get("flags").is_some_and(|flags| flags == "slave"))
        .filter_map(|replica| {
            let address = format!("{}:{}", replica.get("ip")?, replica.get("port")?);
            let priority = replica.get("slave-priority").cloned().unwrap_or_default();
            Some((address, priority))
        })
        .collect())
}

/// The primary Sentinel names now.
pub async fn primary(source: &SentinelSource) -> Result<String, FailoverError> {
    let (node, mut connection) = sentinel(source).await?;
    let (host, port): (String, String) = query(
        &node,
        &mut connection,
        redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(&source.master),
    )
    .await?;
    Ok(format!("{host}:{port}"))
}

/// The primary and the replica to promote (the first healthy one Sentinel lists).
pub async fn plan(source: &SentinelSource) -> Result<Plan, FailoverError> {
    let primary = primary(source).await?;
    let mut replicas = replicas(source)
        .await?
        .into_iter()
        .map(|(address, _)| address);
    let promoted = replicas.next().ok_or_else(|| {
        FailoverError::Sentinel(format!(
            "no healthy replica of {} to fail over to",
            source.master
        ))
    })?;
    Ok(Plan {
        primary,
        promoted,
        others: replicas.collect(),
    })
}

fn host_port(address: &str) -> (&str, &str) {
    address.rsplit_once(':').unwrap_or((address, "6379"))
}

/// Unix epoch milliseconds, as the timeline's sections are stamped.
fn now_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |since| since.as_secs_f64() * 1000.0)
}

/// Step 1 (and the preparation for several replicas): the replica to promote stops
/// receiving the primary's writes. Returns once that holds. The cut lasts until
/// `resume` or `restore` (the fault's task always calls one).
pub async fn cut(source: &SentinelSource, plan: &Plan) -> Result<(), FailoverError> {
    let cut = cut_replication(source, plan).await;
    if cut.is_err() {
        // Halfway (other replicas made unelectable, the ACL changed): all undone.
        let _ = restore(plan).await;
    }
    cut
}

async fn cut_replication(source: &SentinelSource, plan: &Plan) -> Result<(), FailoverError> {
    if !plan.others.is_empty() {
        for other in &plan.others {
            let mut connection = connect(other).await?;
            let () = query(
                other,
                &mut connection,
                redis::cmd("CONFIG")
                    .arg("SET")
                    .arg("replica-priority")
                    .arg(0),
            )
            .await?;
        }
        // Sentinel elects by the priority it last read: wait until it has read these.
        let deadline = Instant::now() + PRIORITY_SEEN;
        loop {
            let seen = replicas(source).await?;
            let unelectable = plan.others.iter().all(|other| {
                seen.iter()
                    .any(|(address, priority)| address == other && priority == "0")
            });
            if unelectable {
                break;
            }
            if Instant::now() >= deadline {
                return Err(FailoverError::Sentinel(
                    "Sentinel did not see the other replicas' priority 0 in time".into(),
                ));
            }
            sleep(Duration::from_millis(200)).await;
        }
    }
    retried(
        &plan.primary,
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg("default")
            .arg("-psync")
            .arg("-sync"),
    )
    .await?;
    retried(
        &plan.promoted,
        redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("master"),
    )
    .await
}

/// Steps 3 to 5, once `held` said a holder holds the lock key `lock_key`.
pub async fn fail_over(
    source: &SentinelSource,
    plan: Plan,
    lock_key: &str,
) -> Result<Outcome, FailoverError> {
    let (node, mut sentinel_connection) = sentinel(source).await?;
    let failover_at_ms = now_ms();
    let asked: Result<(), _> = query(
        &node,
        &mut sentinel_connection,
        redis::cmd("SENTINEL").arg("FAILOVER").arg(&source.master),
    )
    .await;
    if let Err(error) = asked {
        let _ = restore(&plan).await;
        return Err(error);
    }
    // Sentinel closes the replica's clients as it promotes it: a fresh connection for
    // each look.
    let deadline = Instant::now() + PROMOTION;
    loop {
        if let Ok(role) = once::<Vec<redis::Value>>(&plan.promoted, &redis::cmd("ROLE")).await
            && matches!(role.first(), Some(redis::Value::BulkString(role)) if role == b"master")
        {
            break;
        }
        if Instant::now() >= deadline {
            let _ = restore(&plan).await;
            return Err(FailoverError::Sentinel(format!(
                "{} was not promoted within {PROMOTION:?}",
                plan.promoted
            )));
        }
        sleep(POLL).await;
    }
    let promoted_at_ms = now_ms();
    // Looked at at once, before Sentinel names the new primary to anyone.
    let lock_kept = once::<bool>(&plan.promoted, redis::cmd("EXISTS").arg(lock_key)).await;
    let lock_kept = match lock_kept {
        Ok(kept) => kept,
        Err(error) => {
            let _ = restore(&plan).await;
            return Err(error);
        }
    };
    restore(&plan).await?;
    // What Sentinel does to a demoted primary once it sees it again (some seconds
    // later): follow the new primary and drop its clients, who reconnect through
    // Sentinel. Done now, so that orders flow again at once.
    let (host, port) = host_port(&plan.promoted);
    retried(&plan.primary, redis::cmd("REPLICAOF").arg(host).arg(port)).await?;
    retried(
        &plan.primary,
        redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("normal")
            .arg("SKIPME")
            .arg("yes"),
    )
    .await?;
    Ok(Outcome {
        plan,
        failed_over: true,
        lock_lost: !lock_kept,
        failover_at_ms: Some(failover_at_ms),
        promoted_at_ms: Some(promoted_at_ms),
    })
}

/// The primary accepts its replicas' resync again: the cut replica reconnects within
/// a second and catches up from the backlog. The others stay unelectable.
pub async fn resume(plan: &Plan) -> Result<(), FailoverError> {
    retried(
        &plan.primary,
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg("default")
            .arg("+psync")
            .arg("+sync"),
    )
    .await
}

/// Undoes the cut: the old primary's ACL as it was, the others electable. Each step is
/// tried a few times on fresh connections (a reconfigured node closes its clients),
/// and all are tried even when one fails.
pub async fn restore(plan: &Plan) -> Result<(), FailoverError> {
    let mut result = resume(plan).await;
    for other in &plan.others {
        let priority = redis::cmd("CONFIG")
            .arg("SET")
            .arg("replica-priority")
            .arg(100)
            .clone();
        result = result.and(retried(other, &priority).await);
    }
    result
}

/// One command on a connection of its own.
async fn once<T: redis::FromRedisValue>(
    address: &str,
    command: &redis::Cmd,
) -> Result<T, FailoverError> {
    let mut connection = connect(address).await?;
    query(address, &mut connection, command).await
}

/// The same, tried up to five times.
async fn retried(address: &str, command: &redis::Cmd) -> Result<(), FailoverError> {
    let mut last = Ok(());
    for _ in 0..5 {
        last = once::<redis::Value>(address, command).await.map(|_| ());
        if last.is_ok() {
            break;
        }
        sleep(Duration::from_millis(20)).await;
    }
    last
}
