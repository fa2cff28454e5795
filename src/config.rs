//! Command-line and environment configuration.
//!
//! Every option has a `FLASHSALE_*` environment fallback so that `scripts/stack.sh env`,
//! docker-compose and the tests can point replicas at their services without flags.
//! The defaults match the ports `scripts/stack.sh` uses.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use subtle::ConstantTimeEq;

use crate::logging::LogFormat;

#[derive(Debug, Parser)]
#[command(
    name = "flashsale",
    version,
    about = "Flash-sale oversell lab: order service replicas"
)]
pub struct Cli {
    /// `text` to read, `json` (one object per line) for a log pipeline.
    #[arg(
        long,
        global = true,
        env = "FLASHSALE_LOG_FORMAT",
        value_enum,
        default_value_t
    )]
    pub log_format: LogFormat,

    #[command(subcommand)]
    pub command: Command,
}

// Parsed once per process: the size of the larger variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run one replica of the order service.
    Serve(ServeConfig),
    /// Run several `serve` replicas on consecutive ports and stop them together.
    Cluster(ClusterConfig),
    /// Ask a replica whether it is ready: exit 0 when `--url` answers 2xx within 2 s,
    /// 1 otherwise. The container image's health check, so it needs no curl.
    Healthcheck(HealthcheckConfig),
}

#[derive(Debug, Clone, Args)]
pub struct HealthcheckConfig {
    #[arg(
        long,
        env = "FLASHSALE_HEALTHCHECK_URL",
        default_value = "http://127.0.0.1:8080/readyz"
    )]
    pub url: String,
}

#[derive(Debug, Clone, Args)]
pub struct ServeConfig {
    /// Address to listen on.
    #[arg(long, env = "FLASHSALE_BIND", default_value = "127.0.0.1")]
    pub bind: IpAddr,

    /// Port to listen on (0 picks a free one).
    #[arg(long, env = "FLASHSALE_PORT", default_value_t = 8081)]
    pub port: u16,

    /// This replica's name in /api/stats and in the orders it records
    /// [default: replica-<port>].
    #[arg(long, env = "FLASHSALE_REPLICA_ID")]
    pub replica_id: Option<String>,

    /// `host:port` at which the other replicas' dashboards and the load tests they
    /// start reach this replica [default: the address it listens on]. Set it when
    /// listening on 0.0.0.0, e.g. `app1:8080` in docker-compose.
    #[arg(long, env = "FLASHSALE_ADVERTISE", value_parser = parse_host_port)]
    pub advertise: Option<String>,

    /// How often `flashsale cluster` has restarted this replica (it sets this), shown
    /// in /api/stats and on the dashboard.
    #[arg(long, env = "FLASHSALE_RESTARTS", default_value_t = 0, hide = true)]
    pub restarts: u32,

    /// The pid of the `flashsale cluster` supervising this replica (it sets this). A
    /// replica whose supervisor is gone, even by `kill -9`, shuts down gracefully
    /// rather than hold its port with nobody to stop it.
    #[arg(long, env = "FLASHSALE_SUPERVISOR_PID", hide = true)]
    pub supervisor_pid: Option<u32>,

    /// Redis holding the stock cache, the active strategy and the replica registry.
    #[arg(
        long,
        env = "FLASHSALE_REDIS_URL",
        default_value = "redis://127.0.0.1:6390"
    )]
    pub redis_url: String,

    /// Find the Redis through Redis Sentinel instead of `--redis-url`: the Sentinels'
    /// `host:port` (comma-separated). Connections go to the primary they name, and to
    /// the new one after a failover. Empty (the default): the one Redis at the URL.
    #[arg(long, env = "FLASHSALE_REDIS_SENTINEL", value_delimiter = ',')]
    pub redis_sentinel: Vec<String>,

    /// The name the Sentinels monitor the primary under (`sentinel monitor NAME ...`).
    #[arg(
        long,
        env = "FLASHSALE_REDIS_SENTINEL_MASTER",
        default_value = "flashsale"
    )]
    pub redis_sentinel_master: String,

    /// MySQL/MariaDB, the system of record.
    #[arg(
        long,
        env = "FLASHSALE_DATABASE_URL",
        default_value = "mysql://flashsale:flashsale@127.0.0.1:3390/flashsale",
        hide_env_values = true
    )]
    pub database_url: String,

    /// Prefix of every Redis key, so several deployments (or tests) share one Redis.
    #[arg(long, env = "FLASHSALE_NAMESPACE", default_value = "flashsale")]
    pub namespace: String,

    /// ZooKeeper servers (host:port, comma-separated) for the zookeeper strategy.
    #[arg(long, env = "FLASHSALE_ZOOKEEPER", default_value = "127.0.0.1:2190")]
    pub zookeeper: String,

    /// The independent Redis nodes of the redlock strategy (comma-separated URLs).
    #[arg(
        long,
        env = "FLASHSALE_REDLOCK_URLS",
        value_delimiter = ',',
        default_value = "redis://127.0.0.1:6390,redis://127.0.0.1:6391,redis://127.0.0.1:6392"
    )]
    pub redlock_urls: Vec<String>,

    /// etcd endpoints (comma-separated) for the etcd strategy.
    #[arg(long, env = "FLASHSALE_ETCD", default_value = "http://127.0.0.1:2390")]
    pub etcd: String,

    /// ZooKeeper session timeout in milliseconds: how long after a replica dies its
    /// lock nodes disappear.
    #[arg(long, env = "FLASHSALE_ZK_SESSION_MS", default_value_t = 4000,
          value_parser = clap::value_parser!(u64).range(crate::lock::zookeeper::SESSION_MS_BOUNDS))]
    pub zk_session_ms: u64,

    /// How long an order waits for its lock before answering 503 lock_timeout. At
    /// most an hour: deadlines are computed from it, and an absurd one would overflow.
    #[arg(long, env = "FLASHSALE_LOCK_WAIT_MS", default_value_t = 5000,
          value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    pub lock_wait_ms: u64,

    /// Lease of the Redis and lock-table locks; the watchdog renews it every third.
    /// A replica that dies holding a lock blocks the SKU for at most this long, so at
    /// most a day.
    #[arg(long, env = "FLASHSALE_LOCK_LEASE_MS", default_value_t = 10000,
          value_parser = clap::value_parser!(u64).range(crate::lock::LEASE_MS_BOUNDS))]
    pub lock_lease_ms: u64,

    /// redis-lock: replicas that must acknowledge the lock's `SET` (`WAIT N timeout`)
    /// before it counts as held; fewer, and the lock is released and tried again. 0
    /// (the default): no `WAIT`, and a failover can lose a lock the replica never got.
    #[arg(long, env = "FLASHSALE_REDIS_LOCK_WAIT_REPLICAS", default_value_t = 0,
          value_parser = clap::value_parser!(u32).range(0..=16))]
    pub redis_lock_wait_replicas: u32,

    /// How long redis-lock's `WAIT` waits for the acknowledgements, in milliseconds:
    /// at most 400, under the Redis client's 500 ms bound on an answer (a longer
    /// `WAIT` would end as a connection error, not as "too few acknowledgements").
    #[arg(long, env = "FLASHSALE_REDIS_LOCK_WAIT_TIMEOUT_MS", default_value_t = 100,
          value_parser = clap::value_parser!(u64).range(1..=400))]
    pub redis_lock_wait_timeout_ms: u64,

    /// Attempts of the optimistic strategy before it answers 503. With the backoff
    /// capped at 100 ms, 50 retry for about as long as a lock strategy waits (5 s): on
    /// one hot SKU with 30 buyers, 10 left some losing every round until they gave up.
    #[arg(long, env = "FLASHSALE_OPTIMISTIC_ATTEMPTS", default_value_t = 50,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub optimistic_attempts: u32,

    /// Simulated work inside the critical section, in milliseconds (widens the race).
    #[arg(long, env = "FLASHSALE_WORK_MS", default_value_t = 0)]
    pub work_ms: u64,

    /// Longest a request may take before it is abandoned with 503.
    #[arg(long, env = "FLASHSALE_REQUEST_TIMEOUT_MS", default_value_t = 30_000,
          value_parser = clap::value_parser!(u64).range(100..))]
    pub request_timeout_ms: u64,

    /// How long a request holds its Idempotency-Key's claim before another request
    /// with the key may presume it dead and take it over (after checking that no
    /// order has the key). Longer than an order normally runs; an order that outlives
    /// it still cannot be recorded twice (the key is unique in MySQL).
    #[arg(long, env = "FLASHSALE_IDEMPOTENCY_HOLD_MS", default_value_t = 60_000,
          value_parser = clap::value_parser!(u64).range(100..))]
    pub idempotency_hold_ms: u64,

    /// Requests one replica runs at once, admin calls apart (they have 16 places of
    /// their own); more are refused with 503 at once.
    #[arg(long, env = "FLASHSALE_MAX_IN_FLIGHT", default_value_t = 1024,
          value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub max_in_flight: u64,

    /// Largest quantity one order may ask for.
    #[arg(long, env = "FLASHSALE_MAX_QUANTITY", default_value_t = 10,
          value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    pub max_quantity: i64,

    /// MySQL connections per replica.
    #[arg(long, env = "FLASHSALE_DB_POOL", default_value_t = 16)]
    pub db_pool: u32,

    /// Redis connections per replica.
    #[arg(long, env = "FLASHSALE_REDIS_POOL", default_value_t = 32)]
    pub redis_pool: usize,

    /// How long to keep retrying the first database connection at start.
    #[arg(long, env = "FLASHSALE_CONNECT_TIMEOUT_S", default_value_t = 60)]
    pub connect_timeout_s: u64,

    /// The load-test binary the dashboard starts [default: `loadtest` beside this
    /// binary].
    #[arg(long, env = "FLASHSALE_LOADTEST_BIN")]
    pub loadtest_bin: Option<PathBuf>,

    /// Where load tests started from the dashboard write their reports.
    #[arg(long, env = "FLASHSALE_REPORT_DIR", default_value = "target/flashsale")]
    pub report_dir: PathBuf,

    /// Token admin calls must present as `Authorization: Bearer <token>`. Without one,
    /// admin calls are open, and the service refuses to listen beyond loopback.
    #[arg(long, env = "FLASHSALE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<AdminToken>,

    /// Web origins whose pages may call the API from a browser, such as
    /// `https://shop.example` (comma-separated in the environment), or `*` for any.
    /// None by default: no CORS headers are sent.
    #[arg(long = "cors-origin", env = "FLASHSALE_CORS_ORIGINS", value_delimiter = ',',
          value_parser = parse_origin)]
    pub cors_origins: Vec<String>,

    /// Serve the dashboard from this folder instead of the copy compiled into the
    /// binary: for editing the page without rebuilding.
    #[arg(long, env = "FLASHSALE_STATIC_DIR")]
    pub static_dir: Option<PathBuf>,
}

impl ServeConfig {
    /// Refuses a configuration that would expose open admin calls beyond loopback.
    pub fn check(&self) -> anyhow::Result<()> {
        if self.admin_token.is_none() && !self.bind.is_loopback() {
            anyhow::bail!(
                "listening on {} without FLASHSALE_ADMIN_TOKEN would leave the admin calls open \
                 to the network; set a token or bind to loopback",
                self.bind
            );
        }
        Ok(())
    }

    pub fn work(&self) -> Duration {
        Duration::from_millis(self.work_ms)
    }

    pub fn lock_wait(&self) -> Duration {
        Duration::from_millis(self.lock_wait_ms)
    }

    pub fn lock_lease(&self) -> Duration {
        Duration::from_millis(self.lock_lease_ms)
    }

    pub fn zk_session_timeout(&self) -> Duration {
        Duration::from_millis(self.zk_session_ms)
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_secs(self.connect_timeout_s)
    }
}

/// `host:port`, as an HTTP client needs it: a host name or address and a port number.
fn parse_host_port(raw: &str) -> Result<String, String> {
    let valid = raw.rsplit_once(':').is_some_and(|(host, port)| {
        !host.is_empty()
            && !host.chars().any(|c| c.is_whitespace() || c == '/')
            && port.parse::<u16>().is_ok_and(|port| port > 0)
    });
    if valid {
        Ok(raw.to_owned())
    } else {
        Err(format!("'{raw}' is not host:port, such as app1:8080"))
    }
}

/// `*`, or an origin as browsers send it: `http` or `https`, a host, an optional port,
/// and nothing after.
fn parse_origin(raw: &str) -> Result<String, String> {
    let origin = raw.trim();
    let rest = origin
        .strip_prefix("https://")
        .or_else(|| origin.strip_prefix("http://"));
    let valid = origin == "*"
        || rest.is_some_and(|host| {
            !host.is_empty()
                && host
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '[' | ']'))
        });
    if valid {
        Ok(origin.to_owned())
    } else {
        Err(format!(
            "'{raw}' is not an origin such as https://shop.example or http://127.0.0.1:3000 \
             (no path, no trailing slash), nor *"
        ))
    }
}

#[derive(Debug, Clone, Args)]
pub struct ClusterConfig {
    /// How many replicas to start.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=32))]
    pub replicas: u16,

    /// Port of the first replica; the others take the next ones.
    #[arg(long, default_value_t = 8081)]
    pub base_port: u16,

    /// Extra arguments passed to every `serve` (after `--`).
    #[arg(last = true)]
    pub serve_args: Vec<String>,
}

/// The admin token: compared in constant time, never printed.
#[derive(Clone)]
pub struct AdminToken(String);

impl AdminToken {
    /// Constant-time comparison (`subtle`), so response timing does not reveal how
    /// much of the token a guess got right.
    pub fn matches(&self, presented: &str) -> bool {
        self.0.as_bytes().ct_eq(presented.as_bytes()).into()
    }

    pub fn reveal(&self) -> &str {
        &self.0
    }
}

impl std::str::FromStr for AdminToken {
    type Err = String;
    fn from_str(raw: &str) -> Result<Self, String> {
        if raw.len() < 16 {
            return Err("the admin token must be at least 16 characters".into());
        }
        Ok(AdminToken(raw.to_owned()))
    }
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(***)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_token_rules() {
        let token: AdminToken = "0123456789abcdef".parse().expect("long enough");
        assert!(token.matches("0123456789abcdef"));
        assert!(!token.matches("0123456789abcdeF"));
        assert!(!token.matches("0123456789abcde"));
        assert!("short".parse::<AdminToken>().is_err());
        assert_eq!(format!("{token:?}"), "AdminToken(***)");
    }

    #[test]
    fn advertised_addresses_are_host_and_port() {
        for good in ["app1:8080", "127.0.0.1:8081", "[::1]:80"] {
            assert_eq!(parse_host_port(good).as_deref(), Ok(good));
        }
        for bad in [
            "app1",
            "app1:",
            ":8080",
            "app1:0",
            "app1:99999",
            "http://app1:8080",
        ] {
            assert!(parse_host_port(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn cors_origins_are_origins() {
        for good in [
            "*",
            "https://shop.example",
            "http://127.0.0.1:3000",
            "http://[::1]:80",
        ] {
            assert_eq!(parse_origin(good).as_deref(), Ok(good));
        }
        for bad in [
            "",
            "shop.example",
            "https://",
            "https://shop.example/",
            "ftp://x",
            "http://a b",
        ] {
            assert!(parse_origin(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn lock_times_are_bounded() {
        let parses = |args: &[&str]| Cli::try_parse_from(args).is_ok();
        assert!(parses(&["flashsale", "serve", "--lock-wait-ms", "3600000"]));
        assert!(!parses(&[
            "flashsale",
            "serve",
            "--lock-wait-ms",
            "3600001"
        ]));
        assert!(!parses(&[
            "flashsale",
            "serve",
            "--lock-wait-ms",
            "18446744073709551615"
        ]));
        assert!(parses(&[
            "flashsale",
            "serve",
            "--lock-lease-ms",
            "86400000"
        ]));
        assert!(!parses(&[
            "flashsale",
            "serve",
            "--lock-lease-ms",
            "86400001"
        ]));
        assert!(parses(&[
            "flashsale",
            "serve",
            "--zk-session-ms",
            "3600000"
        ]));
        for refused in ["0", "3600001", "2147483648"] {
            assert!(!parses(&["flashsale", "serve", "--zk-session-ms", refused]));
        }
    }

    #[test]
    fn open_admin_only_on_loopback() {
        let parse = |args: &[&str]| match Cli::try_parse_from(args).expect("parses").command {
            Command::Serve(config) => config,
            _ => unreachable!(),
        };
        assert!(parse(&["flashsale", "serve"]).check().is_ok());
        assert!(
            parse(&["flashsale", "serve", "--bind", "0.0.0.0"])
                .check()
                .is_err()
        );
        let token = [
            "flashsale",
            "serve",
            "--bind",
            "0.0.0.0",
            "--admin-token",
            "0123456789abcdef",
        ];
        assert!(parse(&token).check().is_ok());
    }
}
