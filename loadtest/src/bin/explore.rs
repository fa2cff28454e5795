//! `explore --seed S --rounds N`: the seeded fault explorer (`loadtest::explore`).

use std::process::ExitCode;

use clap::Parser;
use loadtest::explore::{self, ExploreOptions};

#[tokio::main]
async fn main() -> ExitCode {
    let options = ExploreOptions::parse();
    let summary = match explore::run(&options).await {
        Ok(summary) => summary,
        Err(error) => {
            eprintln!("explore: {error:#}");
            return ExitCode::from(2);
        }
    };
    let json = serde_json::to_string_pretty(&summary).unwrap_or_default();
    if let Some(dir) = options.out.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    if let Err(error) = std::fs::write(&options.out, &json) {
        eprintln!("explore: writing {}: {error}", options.out.display());
    }
    println!(
        "{} rounds, seed {}, faults {:?}, {} violation(s)",
        summary.rounds,
        summary.seed,
        summary.faults,
        summary.violations.len()
    );
    if summary.violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
