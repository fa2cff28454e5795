//! The `flashsale` binary: `serve` runs one replica, `cluster` runs several.

use clap::Parser;
use flashsale::config::{Cli, Command};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn,tower_http=info")),
        )
        .init();
    match Cli::parse().command {
        Command::Serve(config) => {
            let supervisor = config.supervisor_pid;
            let server = flashsale::app::Server::bind(config).await?;
            server
                .run(async move {
                    tokio::select! {
                        () = flashsale::app::shutdown_signal() => {}
                        () = flashsale::cluster::supervisor_gone(supervisor) => {}
                    }
                })
                .await
        }
        Command::Cluster(config) => flashsale::cluster::run(config).await,
    }
}
