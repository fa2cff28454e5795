//! Logs: readable text by default, one JSON object per line with `--log-format json`
//! for a log pipeline. Every line logged while a request is served carries that
//! request's id (`http::router` gives each request one and echoes it in
//! `x-request-id`), so one order can be followed through its replica's log.
//!
//! The order path runs in debug-level spans (`acquire`, `read`, `commit`, `release`);
//! with `RUST_LOG=flashsale=debug` each span's close is logged with its duration, which
//! is how a slow order is taken apart. At the default level they cost nothing.

use clap::ValueEnum;
use tracing::level_filters::LevelFilter;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::FmtSpan;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn,tower_http=info"));
    // Span timings only when someone asked for debug: at info they would add a line
    // per request.
    let spans = if filter
        .max_level_hint()
        .is_some_and(|level| level >= LevelFilter::DEBUG)
    {
        FmtSpan::CLOSE
    } else {
        FmtSpan::NONE
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_span_events(spans);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .init(),
    }
}
