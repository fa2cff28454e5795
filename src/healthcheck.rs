//! `flashsale healthcheck`: the container's health check, run by the binary itself so
//! that the image carries no curl just for that.

use std::time::Duration;

/// Asks `url` once; Ok when it answers 2xx within 2 s.
pub async fn ask(url: &str) -> anyhow::Result<()> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()?;
    let status = client.get(url).send().await?.status();
    anyhow::ensure!(status.is_success(), "{url} answered {status}");
    Ok(())
}
