//! Counters read from the server's Prometheus `/metrics` before and after a run, for what no
//! response shows: the switchyard router continues a preempted generation seamlessly, so only
//! its `switchyard_preemptions_total` says it happened. Other servers lack the counter and
//! the figure is then unknown, not zero.

use std::time::Duration;

/// The switchyard router's count of generations an engine preempted and the router continued.
pub const PREEMPTIONS: &str = "switchyard_preemptions_total";

/// How long a scrape may take before the figure is given up as unknown.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);

/// The value of the unlabelled sample `name` in Prometheus text exposition, if there is one.
pub fn counter(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let mut fields = line.split_whitespace();
            if fields.next()? != name {
                return None;
            }
            let value: f64 = fields.next()?.parse().ok()?;
            (value.is_finite() && value >= 0.0).then_some(value as u64)
        })
}

/// `name` from `GET {url}/metrics`; `None` when the server has no `/metrics` or no such counter.
pub async fn fetch_counter(client: &reqwest::Client, url: &str, name: &str) -> Option<u64> {
    let scrape = async {
        let response = client.get(format!("{url}/metrics")).send().await.ok()?;
        if !response.status().is_success() {
            return None;
        }
        counter(&response.text().await.ok()?, name)
    };
    tokio::time::timeout(SCRAPE_TIMEOUT, scrape)
        .await
        .ok()
        .flatten()
}

/// How much a counter grew from `before` to `after`; `None` if either is unknown or it went down
/// (the server restarted in between).
pub fn growth(before: Option<u64>, after: Option<u64>) -> Option<u64> {
    after?.checked_sub(before?)
}
