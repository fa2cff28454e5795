//! `cargo run --release -p loadtest -- --targets … --strategies all --users N …`: the
//! load test; `… -p loadtest -- explore --seed S --rounds N`: the fault explorer.

use std::process::ExitCode;

use clap::Parser;
use loadtest::options::{Cli, Command, Options};

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Explore(options)) => explore(options).await,
        None => load_test(cli.load).await,
    }
}

/// Exit 0: every lock strategy sold within its stock and ended consistent; 1: one did
/// not (after the report is written); 2: the run itself failed.
async fn load_test(options: Options) -> ExitCode {
    let (service, strategies) = match loadtest::prepare(&options).await {
        Ok(prepared) => prepared,
        Err(error) => {
            eprintln!("loadtest: {error:#}");
            return ExitCode::from(2);
        }
    };
    let report = match loadtest::run(&options, &service, &strategies).await {
        Ok(report) => report,
        Err(error) => {
            eprintln!("loadtest: {error:#}");
            return ExitCode::from(2);
        }
    };
    println!("\n{}", loadtest::report::text_table(&report));
    if let Err(error) = loadtest::report::write_files(&report, &options.out) {
        eprintln!("loadtest: writing the report: {error:#}");
        return ExitCode::from(2);
    }
    println!(
        "Reports: {0}/report.json, {0}/report.md, {0}/goose-<strategy>.html",
        options.out.display()
    );
    if !options.no_history
        && let Err(error) = service.save_report(&report).await
    {
        eprintln!("loadtest: warning: {error:#}");
    }
    let violations = loadtest::report::violations(&report);
    for violation in &violations {
        eprintln!("loadtest: FAILED: {violation}");
    }
    if violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Exit 0: no violation; 1: a violation (printed with its replay); 2: the run itself
/// failed (a target down before it began, a setup call refused).
async fn explore(options: loadtest::explore::ExploreOptions) -> ExitCode {
    let summary = match loadtest::explore::run(&options).await {
        Ok(summary) => summary,
        Err(error) => {
            eprintln!("loadtest explore: {error:#}");
            return ExitCode::from(2);
        }
    };
    if let Err(error) = loadtest::explore::finish(&summary, &options.out) {
        eprintln!("loadtest explore: {error:#}");
        return ExitCode::from(2);
    }
    if !summary.violations.is_empty() {
        ExitCode::FAILURE
    } else if summary.aborted.is_some() {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    }
}
