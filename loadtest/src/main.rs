//! `cargo run --release -p loadtest -- --targets … --strategies all --users N …`

use std::process::ExitCode;

use clap::Parser;
use loadtest::options::Options;

#[tokio::main]
async fn main() -> ExitCode {
    let options = Options::parse();
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
            return ExitCode::FAILURE;
        }
    };
    println!("\n{}", loadtest::report::text_table(&report));
    if let Err(error) = loadtest::report::write_files(&report, &options.out) {
        eprintln!("loadtest: writing the report: {error:#}");
        return ExitCode::FAILURE;
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
    ExitCode::SUCCESS
}
