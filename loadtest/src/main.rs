//! `cargo run --release -p loadtest -- --targets … --strategies all --users N …`: the
//! load test (`--part K/N --doors-open T`: one share of a crowd split over machines);
//! `… -- merge PART_REPORTS…`: the split crowd's report; `… -- explore --seed S
//! --rounds N`: the fault explorer.

use std::path::Path;
use std::process::ExitCode;

use clap::Parser;
use flashsale_wire::report::LoadReport;
use loadtest::merge::MergeOptions;
use loadtest::options::{Cli, Command, Options};
use loadtest::service::Service;
use loadtest::slo::Objectives;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Explore(options)) => explore(options).await,
        Some(Command::Merge(options)) => merge(options).await,
        None => load_test(cli.load).await,
    }
}

/// Exit 0: every lock strategy sold within its stock and ended consistent, and every
/// run met the objectives given (`--max-p99-ms`, `--min-orders-per-s`); 1: one did not
/// (after the report is written); 2: the run itself failed. A part of a split
/// crowd exits 0 once its partial report is written: the merge judges the run.
async fn load_test(options: Options) -> ExitCode {
    let (service, strategies) = match loadtest::prepare(&options).await {
        Ok(prepared) => prepared,
        Err(error) => {
            eprintln!("loadtest: {error:#}");
            return ExitCode::from(2);
        }
    };
    if let (Some(part), Some(doors_open)) = (options.part, options.doors_open) {
        let played =
            loadtest::split::run_part(&options, &service, &strategies, part, doors_open).await;
        return match played.and_then(|partial| loadtest::split::publish(&partial, &options.out)) {
            Ok(path) => {
                eprintln!(
                    "Part {}/{} report: {} (merge the parts with `loadtest merge`)",
                    part.number,
                    part.of,
                    path.display()
                );
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("loadtest: {error:#}");
                ExitCode::from(2)
            }
        };
    }
    let report = match loadtest::run(&options, &service, &strategies).await {
        Ok(report) => report,
        Err(error) => {
            eprintln!("loadtest: {error:#}");
            return ExitCode::from(2);
        }
    };
    let history = (!options.no_history).then_some(&service);
    let objectives = Objectives {
        max_p99_ms: options.max_p99_ms.clone(),
        min_orders_per_s: options.min_orders_per_s.clone(),
    };
    let goose = "/goose-<strategy>.html";
    conclude(&report, &options.out, history, goose, &objectives).await
}

/// Exit as `load_test` does, for the split crowd's report; 2 also when the parts'
/// reports do not make one run.
async fn merge(options: MergeOptions) -> ExitCode {
    let merged = loadtest::merge::read_inputs(&options.inputs).and_then(loadtest::merge::merge);
    let report = match merged {
        Ok(report) => report,
        Err(error) => {
            eprintln!("loadtest merge: {error:#}");
            return ExitCode::from(2);
        }
    };
    let history = match options
        .history
        .as_deref()
        .map(|url| Service::new(&[url.to_owned()], options.admin_token.as_deref()))
    {
        None => None,
        Some(Ok(service)) => Some(service),
        Some(Err(error)) => {
            eprintln!("loadtest merge: --history: {error:#}");
            return ExitCode::from(2);
        }
    };
    let objectives = Objectives::default();
    conclude(&report, &options.out, history.as_ref(), "", &objectives).await
}

/// Prints the table, writes the files, saves the report to the history, and judges.
async fn conclude(
    report: &LoadReport,
    out: &Path,
    history: Option<&Service>,
    goose_reports: &str,
    objectives: &Objectives,
) -> ExitCode {
    println!("\n{}", loadtest::report::text_table(report));
    if let Err(error) = loadtest::report::write_files(report, out) {
        eprintln!("loadtest: writing the report: {error:#}");
        return ExitCode::from(2);
    }
    let goose = if goose_reports.is_empty() {
        String::new()
    } else {
        format!(", {}{goose_reports}", out.display())
    };
    println!(
        "Reports: {0}/report.json, {0}/report.md{goose}",
        out.display()
    );
    if let Some(service) = history
        && let Err(error) = service.save_report(report).await
    {
        eprintln!("loadtest: warning: {error:#}");
    }
    let violations = loadtest::slo::judge(report, objectives);
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
