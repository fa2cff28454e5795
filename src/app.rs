//! One replica put together: connect the stores, build the router, announce the
//! replica, serve until told to stop, then deregister.
//!
//! This is the composition root: it builds the layers (stores, strategies, HTTP) and
//! wires them; it holds no logic of its own.
//!
//! Tests use `Server::bind` + `Server::run` directly to start real replicas on random
//! ports, exactly as `flashsale serve` does.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio_util::task::TaskTracker;

use crate::config::ServeConfig;
use crate::http::{AppState, Snapshots};
use crate::loadtests::LoadTests;
use crate::redis_pool;
use crate::replica::Heartbeat;
use crate::store::{ClusterState, Records, StockCache, Store, Timeline};
use crate::strategy::{self, Backends, SaleFlow};

/// A replica bound to its port, ready to serve.
pub struct Server {
    listener: TcpListener,
    router: axum::Router,
    heartbeat: Heartbeat,
    live_feed: tokio::task::JoinHandle<()>,
    loadtests: Arc<LoadTests>,
    orders_in_flight: TaskTracker,
}

impl Server {
    /// Connects the stores, builds the strategies and the router: composition only.
    pub async fn bind(config: ServeConfig) -> anyhow::Result<Server> {
        config.check()?;
        let listener = TcpListener::bind((config.bind, config.port))
            .await
            .with_context(|| format!("binding {}:{}", config.bind, config.port))?;
        let address = listener.local_addr()?;
        let replica_id = config
            .replica_id
            .clone()
            .unwrap_or_else(|| format!("replica-{}", address.port()));

        let redis_source = redis_pool::Source::from_config(
            &config.redis_url,
            &config.redis_sentinel,
            &config.redis_sentinel_master,
        )
        .context("parsing the Redis URL or the Sentinels' addresses")?;
        let redis = redis_pool::pool_of(redis_source, config.redis_pool)
            .context("creating the Redis pool")?;
        let records = Records::connect(
            &config.database_url,
            config.db_pool,
            config.connect_timeout(),
        )
        .await
        .context("connecting to MySQL and applying migrations")?;
        let backends = backends(&config, &replica_id, &redis, &records)?;
        let store = Store {
            cache: StockCache::new(redis.clone(), config.namespace.clone()),
            records,
            cluster: ClusterState::new(redis.clone(), config.namespace.clone()),
            timeline: Timeline::start(redis, config.namespace.clone()),
        };
        let flow = Arc::new(SaleFlow {
            store: store.clone(),
            work: config.work(),
            replica_id,
            lock_wait: config.lock_wait(),
            lock_lease: config.lock_lease(),
            lock_waiters: AtomicU64::new(0),
            combining: Default::default(),
        });
        let state = AppState {
            flow: flow.clone(),
            store: store.clone(),
            strategies: strategy::registry(&backends),
            max_quantity: config.max_quantity,
            idempotency_hold: std::time::Duration::from_millis(config.idempotency_hold_ms),
            requests: Arc::new(AtomicU64::new(0)),
            snapshots: Arc::new(Snapshots::new(None)),
            loadtests: Arc::new(LoadTests::new(
                config.loadtest_bin.clone(),
                config.report_dir.clone(),
                config.admin_token.clone(),
            )),
            admin_token: config.admin_token.clone(),
            metrics: crate::telemetry::prometheus(),
            orders_in_flight: TaskTracker::new(),
            stock_audit: Default::default(),
        };
        crate::telemetry::register_events(&state.strategies.names());
        let advertised = config
            .advertise
            .clone()
            .unwrap_or_else(|| address.to_string());
        let heartbeat = Heartbeat::new(
            store.cluster,
            advertised,
            config.restarts,
            state.requests.clone(),
            flow,
        );
        let limits = crate::http::limits::Limits::new(
            std::time::Duration::from_millis(config.request_timeout_ms),
            usize::try_from(config.max_in_flight).unwrap_or(usize::MAX),
        );
        Ok(Server {
            listener,
            heartbeat,
            live_feed: crate::http::spawn_snapshots(state.clone()),
            loadtests: state.loadtests.clone(),
            orders_in_flight: state.orders_in_flight.clone(),
            router: crate::http::router(
                state,
                config.static_dir.as_deref(),
                limits,
                &config.cors_origins,
            ),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        // The listener was bound successfully, so it has an address.
        self.listener
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// Serves until `shutdown` completes, lets in-flight requests finish, then
    /// deregisters the replica.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        tracing::info!(address = %self.local_addr(), "serving");
        let heartbeat = self.heartbeat.start().await;
        let loadtests = self.loadtests;
        let served = axum::serve(self.listener, self.router)
            .with_graceful_shutdown(async move {
                shutdown.await;
                // A load test started here also targets this replica and would keep
                // connections open until it ends.
                loadtests.stop();
            })
            .await;
        // Orders whose clients hung up are still running: let them finish (their
        // waits and work are bounded) rather than cut them at the process exit.
        self.orders_in_flight.close();
        if tokio::time::timeout(ORDER_DRAIN, self.orders_in_flight.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                left = self.orders_in_flight.len(),
                "orders still running at shutdown"
            );
        }
        self.live_feed.abort();
        heartbeat.stop().await;
        served.context("serving HTTP")
    }
}

/// What the strategies are built from: this replica's own clients and pools.
fn backends(
    config: &ServeConfig,
    replica_id: &str,
    redis: &redis_pool::Pool,
    records: &Records,
) -> anyhow::Result<Backends> {
    Ok(Backends {
        redis_client: redis.manager().source().clone(),
        redis_pool: redis.clone(),
        mysql: records.pool().clone(),
        namespace: config.namespace.clone(),
        replica_id: replica_id.to_owned(),
        lease: config.lock_lease(),
        zookeeper: config.zookeeper.clone(),
        zookeeper_session_timeout: config.zk_session_timeout(),
        redlock_nodes: config
            .redlock_urls
            .iter()
            .map(|url| redis_pool::pool(url, config.redis_pool))
            .collect::<anyhow::Result<_>>()?,
        etcd: config.etcd.clone(),
        optimistic_attempts: config.optimistic_attempts,
        redis_lock_wait: (
            config.redis_lock_wait_replicas,
            std::time::Duration::from_millis(config.redis_lock_wait_timeout_ms),
        ),
    })
}

/// How long shutdown waits for orders still running after their requests ended.
const ORDER_DRAIN: std::time::Duration = std::time::Duration::from_secs(30);

/// Completes on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::error!(%error, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::error!(%error, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
    tracing::info!("shutting down");
}
