//! The Redis connections of a replica: a deadpool pool of multiplexed connections, as
//! deadpool-redis builds it, with one difference. deadpool-redis sends `UNWATCH` and
//! `PING` and waits for the answer before it hands out a connection, and every Redis
//! call here takes one from the pool: each command cost two round trips, most of them
//! while a lock is held (docs/benchmarks-notes.md, "Round trips per order").
//!
//! Here a connection used in the last two seconds is handed out as it is; only an idle
//! one is pinged first. What the ping was for, not handing out a dead connection, is
//! kept another way: a connection whose command failed at the connection level (Redis
//! restarted, the socket dropped) is marked and replaced instead of handed out again,
//! and one whose caller gave up waiting for an answer (Redlock's 50 ms per node) is
//! pinged before its next use: a node that went silent never answers with an error.
//! Nothing in this code uses `WATCH`, so there is nothing to `UNWATCH`.
//!
//! The Redis is either one server at a URL or the primary that Redis Sentinel names
//! ([`Source`]). Behind Sentinel, each new connection asks Sentinel for the primary,
//! and a connection to any node but the primary Sentinel names now is not handed out
//! (the pool learns the primary from Sentinel's `+switch-master` announcements, as
//! Redisson and Lettuce do, and from asking it once a second). Waiting for the old
//! primary to say so is not enough: Sentinel turns a primary that is still up into a
//! replica only at its next look, up to 10 s later, and until then it takes writes
//! that the new primary never sees (two replicas would sell one SKU's stock from two
//! copies). A moment remains, from the promotion until the pool hears of it (up to
//! about a second), in which writes still reach the old primary and are lost: the
//! window fencing covers (docs/failover.md). A demoted primary's `READONLY` answer
//! marks a connection broken too.

use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use futures::StreamExt;

use deadpool::managed::{self, Metrics, RecycleError, RecycleResult};
use deadpool_redis::redis::aio::{ConnectionLike, MultiplexedConnection};
use deadpool_redis::redis::sentinel::{SentinelClient, SentinelServerType};
use deadpool_redis::redis::{
    self, Client, Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, ServerErrorKind, Value,
};

/// A connection idle for longer is pinged before it is handed out.
const PING_IF_IDLE_FOR: Duration = Duration::from_secs(2);

/// Waiting for a connection, opening one and checking one are each bounded by this, so
/// an outage answers 503 instead of hanging.
const BOUND: Duration = Duration::from_secs(2);

pub type Pool = managed::Pool<Manager, Connection>;
/// The error `Pool::get` returns (the same type as deadpool-redis's).
pub type PoolError = managed::PoolError<RedisError>;

/// Where a replica's Redis is: one server, or whichever primary Sentinel names now.
#[derive(Clone)]
pub enum Source {
    Direct(Client),
    Sentinel(Arc<SentinelSource>),
}

/// The Sentinels watching a primary, and the name they know it by.
pub struct SentinelSource {
    /// `host:port` of each Sentinel.
    pub nodes: Vec<String>,
    /// The name under which the Sentinels monitor the primary (`sentinel monitor NAME`).
    pub master: String,
    /// Asks the Sentinels in turn; `&mut` for its connection cache, hence the lock.
    client: tokio::sync::Mutex<SentinelClient>,
}

impl From<Client> for Source {
    fn from(client: Client) -> Source {
        Source::Direct(client)
    }
}

impl Source {
    /// One Redis server at `url`.
    pub fn direct(url: &str) -> anyhow::Result<Source> {
        Ok(Source::Direct(Client::open(url)?))
    }

    /// The primary that the Sentinels at `nodes` (`host:port`) monitor as `master`.
    pub fn sentinel(nodes: &[String], master: &str) -> anyhow::Result<Source> {
        let urls: Vec<String> = nodes.iter().map(|node| format!("redis://{node}")).collect();
        let client =
            SentinelClient::build(urls, master.to_owned(), None, SentinelServerType::Master)?;
        Ok(Source::Sentinel(Arc::new(SentinelSource {
            nodes: nodes.to_vec(),
            master: master.to_owned(),
            client: tokio::sync::Mutex::new(client),
        })))
    }

    /// `--redis-sentinel` when given, otherwise the URL.
    pub fn from_config(url: &str, sentinels: &[String], master: &str) -> anyhow::Result<Source> {
        // `--redis-sentinel=` (empty) asks for the URL even where the environment
        // names Sentinels.
        let sentinels: Vec<String> = sentinels
            .iter()
            .filter(|node| !node.trim().is_empty())
            .cloned()
            .collect();
        if sentinels.is_empty() {
            Source::direct(url)
        } else {
            Source::sentinel(&sentinels, master)
        }
    }

    /// A client of the primary now. Behind Sentinel, this asks a Sentinel (which
    /// checks that the node it names answers `ROLE` as a primary), bounded by `BOUND`.
    pub async fn client(&self) -> Result<Client, RedisError> {
        match self {
            Source::Direct(client) => Ok(client.clone()),
            Source::Sentinel(sentinel) => {
                // Boxed: the Sentinel client's future is deep enough to overflow the
                // compiler's layout queries of every future that awaits a connection.
                let ask: std::pin::Pin<Box<dyn Future<Output = _> + Send + '_>> =
                    Box::pin(async { sentinel.client.lock().await.async_get_client().await });
                match tokio::time::timeout(BOUND, ask).await {
                    Ok(answer) => answer,
                    Err(_) => Err(RedisError::from((
                        ErrorKind::Io,
                        "no answer from Sentinel",
                        format!("within {BOUND:?}"),
                    ))),
                }
            }
        }
    }

    /// The Sentinels, when the Redis is found through them.
    pub fn sentinel_source(&self) -> Option<&SentinelSource> {
        match self {
            Source::Direct(_) => None,
            Source::Sentinel(sentinel) => Some(sentinel),
        }
    }
}

/// A pool of at most `size` connections to the Redis at `url`. Connections are opened
/// on first use, so a replica starts (and answers 503) while Redis is down.
pub fn pool(url: &str, size: usize) -> anyhow::Result<Pool> {
    pool_of(Source::direct(url)?, size)
}

/// The same for any [`Source`].
pub fn pool_of(source: Source, size: usize) -> anyhow::Result<Pool> {
    let manager = Manager {
        source,
        primary: Arc::default(),
        watching: OnceLock::new(),
    };
    Ok(managed::Pool::builder(manager)
        .max_size(size)
        .wait_timeout(Some(BOUND))
        .create_timeout(Some(BOUND))
        .recycle_timeout(Some(BOUND))
        .runtime(deadpool::Runtime::Tokio1)
        .build()?)
}

pub struct Manager {
    source: Source,
    /// Behind Sentinel, the primary's `host:port` as the watch last learnt it (`None`
    /// until it has): a connection to any other node is not handed out.
    primary: Arc<RwLock<Option<String>>>,
    /// The task that keeps it, started with the first connection.
    watching: OnceLock<Watching>,
}

/// Stops the failover watch with its pool.
struct Watching(tokio::task::AbortHandle);

impl Drop for Watching {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Manager {
    /// Where the pool's connections come from (for a pub/sub connection of the same
    /// server, which a pool cannot lend).
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// Whether `address` may be used: the primary the watch knows, or any node while
    /// it knows none (a URL, or a watch that has not heard from Sentinel yet).
    fn is_primary(&self, address: &str) -> bool {
        match self.primary.read() {
            Ok(primary) => primary.as_deref().is_none_or(|primary| primary == address),
            Err(_) => true,
        }
    }
}

/// A pooled connection, whether it failed in use, and whether a command sent on it
/// was dropped before its answer came.
pub struct Tracked {
    connection: MultiplexedConnection,
    broken: bool,
    unanswered: bool,
    /// The `host:port` it was opened to.
    address: String,
}

impl Tracked {
    /// Marks the connection broken when `answer` says the connection itself failed
    /// (not a script error or a wrong type, after which it is as good as before).
    fn note<T>(&mut self, answer: &Result<T, RedisError>) {
        if let Err(error) = answer
            && (error.is_io_error()
                || error.is_connection_dropped()
                || error.is_connection_refusal()
                || error.is_timeout()
                || demoted(error))
        {
            self.broken = true;
        }
    }
}

/// The answer of a primary that a failover turned into a replica: the connection
/// points at the wrong node now. Inside a script the error comes wrapped, hence the text.
fn demoted(error: &RedisError) -> bool {
    error.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly)
        || error.to_string().contains("READONLY")
}

impl managed::Manager for Manager {
    type Type = Tracked;
    type Error = RedisError;

    async fn create(&self) -> Result<Tracked, RedisError> {
        if let Source::Sentinel(sentinel) = &self.source {
            self.watching.get_or_init(|| {
                let task = tokio::spawn(watch_failovers(sentinel.clone(), self.primary.clone()));
                Watching(task.abort_handle())
            });
        }
        let client = self.source.client().await?;
        let address = client.get_connection_info().addr().to_string();
        // Sentinel's lookup (`SENTINEL MASTERS`) can name the old primary for a moment
        // after its `GET-MASTER-ADDR-BY-NAME`, which the watch asks, names the new one.
        if !self.is_primary(&address) {
            return Err(RedisError::from((
                ErrorKind::Io,
                "Sentinel is failing the Redis over",
                format!("{address} is no longer the primary"),
            )));
        }
        Ok(Tracked {
            connection: client.get_multiplexed_async_connection().await?,
            broken: false,
            unanswered: false,
            address,
        })
    }

    async fn recycle(&self, tracked: &mut Tracked, metrics: &Metrics) -> RecycleResult<RedisError> {
        if tracked.broken {
            return Err(RecycleError::message("the connection failed in use"));
        }
        if !self.is_primary(&tracked.address) {
            return Err(RecycleError::message(
                "opened to a primary since failed over",
            ));
        }
        if !tracked.unanswered && metrics.last_used() < PING_IF_IDLE_FOR {
            return Ok(());
        }
        let answer: String = redis::cmd("PING")
            .query_async(&mut tracked.connection)
            .await?;
        if answer == "PONG" {
            tracked.unanswered = false;
            Ok(())
        } else {
            Err(RecycleError::message("unexpected answer to PING"))
        }
    }
}

/// Keeps `primary`, the `host:port` of `sentinel.master`'s primary: announced by a
/// Sentinel on its `+switch-master` channel (`<master> <old ip> <old port> <new ip>
/// <new port>`, about a second after the promotion), and asked of it once a second
/// besides (a subscription that went quiet, a failover while nobody listened). A
/// Sentinel that stops answering is left for the next one.
async fn watch_failovers(sentinel: Arc<SentinelSource>, primary: Arc<RwLock<Option<String>>>) {
    let moved_to = |now: String| {
        if let Ok(mut known) = primary.write()
            && known.as_ref() != Some(&now)
        {
            tracing::warn!(primary = %now, "the Redis primary is now here: connections elsewhere are dropped");
            *known = Some(now);
        }
    };
    loop {
        for node in &sentinel.nodes {
            let listen = async {
                let client = Client::open(format!("redis://{node}"))?;
                let asking = client.get_multiplexed_async_connection().await?;
                let mut pubsub = client.get_async_pubsub().await?;
                pubsub.subscribe("+switch-master").await?;
                Ok::<_, RedisError>((asking, pubsub))
            };
            let (mut asking, pubsub) = match tokio::time::timeout(BOUND, listen).await {
                Ok(Ok(listening)) => listening,
                Ok(Err(error)) => {
                    tracing::warn!(%error, node, "cannot listen to Sentinel");
                    continue;
                }
                Err(_) => {
                    tracing::warn!(node, "no answer from Sentinel");
                    continue;
                }
            };
            let mut announcements = pubsub.into_on_message();
            let mut ask = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    announced = announcements.next() => {
                        let Some(announced) = announced else { break };
                        let announced: String = announced.get_payload().unwrap_or_default();
                        let mut fields = announced.split(' ');
                        if fields.next() == Some(sentinel.master.as_str()) {
                            let new: Vec<&str> = fields.skip(2).collect();
                            moved_to(new.join(":"));
                        }
                    }
                    _ = ask.tick() => {
                        let mut question = redis::cmd("SENTINEL");
                        question.arg("GET-MASTER-ADDR-BY-NAME").arg(&sentinel.master);
                        let asked = question.query_async::<(String, String)>(&mut asking);
                        match tokio::time::timeout(BOUND, asked).await {
                            Ok(Ok((host, port))) => moved_to(format!("{host}:{port}")),
                            _ => break,
                        }
                    }
                }
            }
            tracing::warn!(node, "lost Sentinel; listening to the next one");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A connection taken from the pool; back in the pool when dropped.
pub struct Connection {
    object: managed::Object<Manager>,
}

impl From<managed::Object<Manager>> for Connection {
    fn from(object: managed::Object<Manager>) -> Self {
        Connection { object }
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            // Stays set if this future is dropped before the answer.
            self.object.unanswered = true;
            let answer = self.object.connection.req_packed_command(cmd).await;
            self.object.unanswered = false;
            self.object.note(&answer);
            answer
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            self.object.unanswered = true;
            let answer = self
                .object
                .connection
                .req_packed_commands(pipeline, offset, count)
                .await;
            self.object.unanswered = false;
            self.object.note(&answer);
            answer
        })
    }

    fn get_db(&self) -> i64 {
        self.object.connection.get_db()
    }
}
