//! The `flashsale` binary: `serve` runs one replica, `cluster` runs several,
//! `healthcheck` asks one whether it is ready.

use clap::Parser;
use flashsale::config::{Cli, Command};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    flashsale::logging::init(cli.log_format);
    match cli.command {
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
        Command::Cluster(config) => flashsale::cluster::run(config, cli.log_format).await,
        Command::Healthcheck(config) => {
            if let Err(why) = flashsale::healthcheck::ask(&config.url).await {
                eprintln!("not ready: {why}");
                std::process::exit(1);
            }
            Ok(())
        }
    }
}
