//! The lock timeline shows the race: under `none` critical sections of different
//! replicas overlap; under a lock they never do.

use serde_json::Value;

use crate::support::TestCluster;

/// Pairs of sections that overlap in time.
fn overlaps(sections: &[Value]) -> usize {
    let spans: Vec<(f64, f64)> = sections
        .iter()
        .map(|s| {
            (
                s["start_ms"].as_f64().expect("start"),
                s["end_ms"].as_f64().expect("end"),
            )
        })
        .collect();
    let mut count = 0;
    for (i, a) in spans.iter().enumerate() {
        for b in &spans[i + 1..] {
            if a.0 < b.1 && b.0 < a.1 {
                count += 1;
            }
        }
    }
    count
}

/// The orders a section answered: one, or a combined batch's.
fn orders_of(section: &Value) -> u64 {
    section["orders"].as_u64().unwrap_or(1)
}

/// The crowd bought the 10 units: ten `created` sections, or with combining, sections
/// of at least ten orders (a batch that sold any is `created`, its sold-out ones
/// included).
fn assert_ten_sold(sections: &[Value]) {
    let created: u64 = sections
        .iter()
        .filter(|s| s["outcome"] == "created")
        .map(orders_of)
        .sum();
    if sections.iter().all(|s| orders_of(s) == 1) {
        assert_eq!(created, 10);
    } else {
        assert!(created >= 10, "{sections:?}");
    }
}

async fn timeline_after_a_crowd(strategy: &str) -> Vec<Value> {
    let cluster = TestCluster::start(2, &["--work-ms", "20", "--lock-wait-ms", "30000"]).await;
    cluster.set_strategy(strategy).await;
    let sku = "timeline";
    cluster.reset(sku, 10).await;
    cluster.crowd(sku, 16).await;
    // Sections are written in the background: wait until all 16 orders are there
    // (a section answers more than one when combining is on: FLASHSALE_TEST_COMBINE).
    for _ in 0..100 {
        let timeline = cluster
            .get_json(1, &format!("/api/timeline?sku={sku}"))
            .await;
        let sections = timeline["sections"].as_array().cloned().unwrap_or_default();
        if sections.iter().map(orders_of).sum::<u64>() >= 16 {
            for section in &sections {
                assert_eq!(section["strategy"], strategy, "{section}");
                assert!(section["end_ms"].as_f64() >= section["start_ms"].as_f64());
            }
            return sections;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("{strategy}: the timeline never showed the 16 orders");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sections_overlap_without_a_lock() {
    let sections = timeline_after_a_crowd("none").await;
    assert!(overlaps(&sections) > 0, "{sections:?}");
    let replicas: std::collections::BTreeSet<_> =
        sections.iter().map(|s| s["replica"].to_string()).collect();
    assert_eq!(replicas.len(), 2, "both replicas recorded theirs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sections_line_up_under_a_lock() {
    let sections = timeline_after_a_crowd("redis-lock").await;
    assert_eq!(overlaps(&sections), 0, "{sections:?}");
    assert!(
        sections.iter().all(|s| s["fence"].as_u64().is_some()),
        "each holder's token is shown"
    );
    assert_ten_sold(&sections);
}

/// Under db-for-update the lock is the row, held until COMMIT: a section ends there,
/// and the next holder's section (its row lock granted at that COMMIT) starts after
/// it. Recording the section to after the cache write, as before, drew almost every
/// pair of holders on different replicas as overlapping (9 of 10 sold sections).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sections_line_up_under_the_row_lock() {
    let sections = timeline_after_a_crowd("db-for-update").await;
    assert_eq!(overlaps(&sections), 0, "{sections:?}");
    assert_ten_sold(&sections);
}
