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

use std::time::Duration;

use deadpool::managed::{self, Metrics, RecycleError, RecycleResult};
use deadpool_redis::redis::aio::{ConnectionLike, MultiplexedConnection};
use deadpool_redis::redis::{self, Client, Cmd, Pipeline, RedisError, RedisFuture, Value};

/// A connection idle for longer is pinged before it is handed out.
const PING_IF_IDLE_FOR: Duration = Duration::from_secs(2);

/// Waiting for a connection, opening one and checking one are each bounded by this, so
/// an outage answers 503 instead of hanging.
const BOUND: Duration = Duration::from_secs(2);

pub type Pool = managed::Pool<Manager, Connection>;
/// The error `Pool::get` returns (the same type as deadpool-redis's).
pub type PoolError = managed::PoolError<RedisError>;

/// A pool of at most `size` connections to the Redis at `url`. Connections are opened
/// on first use, so a replica starts (and answers 503) while Redis is down.
pub fn pool(url: &str, size: usize) -> anyhow::Result<Pool> {
    let client = Client::open(url)?;
    Ok(managed::Pool::builder(Manager { client })
        .max_size(size)
        .wait_timeout(Some(BOUND))
        .create_timeout(Some(BOUND))
        .recycle_timeout(Some(BOUND))
        .runtime(deadpool::Runtime::Tokio1)
        .build()?)
}

pub struct Manager {
    client: Client,
}

impl Manager {
    /// The client the pool's connections come from (for a pub/sub connection of the
    /// same server, which a pool cannot lend).
    pub fn client(&self) -> &Client {
        &self.client
    }
}

/// A pooled connection, whether it failed in use, and whether a command sent on it
/// was dropped before its answer came.
pub struct Tracked {
    connection: MultiplexedConnection,
    broken: bool,
    unanswered: bool,
}

impl Tracked {
    /// Marks the connection broken when `answer` says the connection itself failed
    /// (not a script error or a wrong type, after which it is as good as before).
    fn note<T>(&mut self, answer: &Result<T, RedisError>) {
        if let Err(error) = answer
            && (error.is_io_error()
                || error.is_connection_dropped()
                || error.is_connection_refusal()
                || error.is_timeout())
        {
            self.broken = true;
        }
    }
}

impl managed::Manager for Manager {
    type Type = Tracked;
    type Error = RedisError;

    async fn create(&self) -> Result<Tracked, RedisError> {
        Ok(Tracked {
            connection: self.client.get_multiplexed_async_connection().await?,
            broken: false,
            unanswered: false,
        })
    }

    async fn recycle(&self, tracked: &mut Tracked, metrics: &Metrics) -> RecycleResult<RedisError> {
        if tracked.broken {
            return Err(RecycleError::message("the connection failed in use"));
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
