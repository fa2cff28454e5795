//! A crowd split across machines: `--part K/N` plays one share of the crowd, and
//! `loadtest merge` (merge.rs) turns the shares' partial reports into one report. One
//! process cannot always make the crowd a sale needs (its cores, its connections, its
//! network), and a crowd from several machines is what a real sale gets.
//!
//! The parts never talk to each other, only to the service and to the clock, so they
//! agree in advance: strategy i (from 0) opens its doors at `--doors-open` + i ×
//! (max-seconds + `SLOT_GAP`). Part 1 does what a single process does around each sale
//! (switch the strategy and restock before it; read the service's records once every
//! part has stopped); the other parts wait until the sale is visibly prepared (its
//! SKUs restocked, the strategy active) before their shoppers gather. Each sale's SKUs
//! are new, named after the run and the slot (`split-<doors-open ms>-<slot>-<n>`), so
//! "its SKUs are there" can only mean this sale was prepared, never an earlier one.
//!
//! A part keeps its raw latency histogram (HdrHistogram's compressed V2 encoding in
//! base64, which HdrHistogram's own tools read), so the merge computes the whole
//! crowd's percentiles instead of averaging the parts'.

use std::str::FromStr;
use std::time::Duration;

use anyhow::{Context, bail};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use chrono::{DateTime, TimeDelta, Utc};
use flashsale_wire::report::LoadConfig;
use hdrhistogram::serialization::{Deserializer, Serializer as _, V2DeflateSerializer};
use serde::{Deserialize, Serialize};

use crate::crowd::{CrowdPlan, Sale, Share};
use crate::options::{Options, Switch};
use crate::report::{ServiceFigures, Times};
use crate::service::Service;
use crate::{GATHER_CROWD, GATHER_OPEN};

/// From one strategy's time bound to the next one's doors: the crowd's tail (Goose
/// stops up to 1.5 s after the bound), part 1 reading the records, then switching and
/// restocking for the next sale.
pub const SLOT_GAP: Duration = Duration::from_secs(6);
/// Part 1 reads the records this long after the time bound, when every part stopped.
const READ_AFTER: Duration = Duration::from_millis(2500);
/// Part 1 switches and restocks this long before the doors open; the other parts start
/// looking for the prepared sale then.
const PREPARE_LEAD: Duration = Duration::from_secs(3);
/// How often a part that waits for part 1 looks.
const POLL: Duration = Duration::from_millis(100);

/// Marks a part's report in its standard output, so `loadtest merge` finds it among
/// other lines (`kubectl logs` mixes in the progress written to stderr).
pub const MARKER: &str = "flashsale-loadtest-part ";

/// Share `number` of `of` (`--part 2/4`), from 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub number: u32,
    pub of: u32,
}

impl FromStr for Part {
    type Err = String;
    fn from_str(raw: &str) -> Result<Part, String> {
        let parsed = raw
            .split_once('/')
            .and_then(|(k, n)| Some((k.trim().parse::<u32>().ok()?, n.trim().parse().ok()?)));
        match parsed {
            Some((number, of)) if (1..=1000).contains(&of) && (1..=of).contains(&number) => {
                Ok(Part { number, of })
            }
            _ => Err("K/N: share K (from 1) of N (at most 1000), e.g. 2/4".into()),
        }
    }
}

impl Part {
    /// Part 1 prepares each sale and reads its records.
    pub fn coordinates(self) -> bool {
        self.number == 1
    }

    /// This part's shoppers of `users`: an even split, the first parts taking one more
    /// when it does not divide; and its arrivals of the open model: every N-th.
    pub fn share(self, users: u64) -> (Share, u64) {
        let (index, of) = (u64::from(self.number - 1), u64::from(self.of));
        let (base, extra) = (users / of, users % of);
        let share = Share {
            first_user: index * base + index.min(extra),
            stride: of,
            phase: index,
        };
        (share, base + u64::from(index < extra))
    }
}

/// `--doors-open`: RFC 3339, or Unix time in milliseconds.
pub fn parse_doors_open(raw: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(ms) = raw.trim().parse::<i64>() {
        return DateTime::from_timestamp_millis(ms).ok_or_else(|| format!("{ms} ms is no time"));
    }
    DateTime::parse_from_rfc3339(raw.trim())
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| format!("RFC 3339 (2030-01-01T12:00:00Z) or Unix milliseconds: {e}"))
}

/// What `--part` needs, checked before any load is sent.
pub fn check(options: &Options) -> anyhow::Result<()> {
    match (options.part, options.doors_open) {
        (None, None) => Ok(()),
        (Some(_), None) => bail!("--part needs --doors-open: the moment every part agrees on"),
        (None, Some(_)) => {
            bail!("--doors-open (or FLASHSALE_DOORS_OPEN) is for a split crowd: give --part K/N")
        }
        (Some(_), Some(_)) if options.fault.is_some() => {
            bail!("--fault is for a single process: the parts cannot agree on who claims the pause")
        }
        (Some(part), Some(_)) if options.rate.is_none() && options.users < u64::from(part.of) => {
            bail!(
                "--users {} cannot be split into {} parts",
                options.users,
                part.of
            )
        }
        (Some(_), Some(_)) => Ok(()),
    }
}

/// One part's figures of a whole run (`docs/report.md`, "A crowd split across
/// machines").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PartialReport {
    /// K of `--part K/N`.
    pub part: u32,
    /// N of `--part K/N`.
    pub parts: u32,
    /// `--doors-open`: every part of one run has the same.
    pub doors_open: DateTime<Utc>,
    pub generated_at: DateTime<Utc>,
    /// The whole run's settings (users: the whole crowd), the same in every part.
    pub config: LoadConfig,
    pub runs: Vec<PartialRun>,
}

/// One part's figures of one strategy's sale. Times count from `doors_open`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PartialRun {
    pub strategy: String,
    pub repeat: u32,
    /// When this sale's doors opened, by the schedule.
    pub doors_open: DateTime<Utc>,
    pub skus: Vec<String>,
    /// This part's shoppers (0 in the open model).
    pub users: u64,
    /// How late this part's crowd came to the doors (it started late).
    pub late_s: f64,
    pub requests: u64,
    pub orders_acknowledged: u64,
    pub sold_out: u64,
    pub busy: u64,
    pub errors: u64,
    pub duration_s: f64,
    /// When each SKU first answered this part sold out (`null`: it never did).
    pub sold_out_s: Vec<Option<f64>>,
    /// Response times in µs of the requests sent before this part saw everything sold
    /// out: a histogram in HdrHistogram's V2 encoding, compressed, in base64.
    pub latency_us: String,
    /// Part 1 only: the service's records of the sale, read once every part stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<ServiceFigures>,
}

/// The histogram in HdrHistogram's compressed V2 encoding, in base64.
pub fn encode_times(times: &Times) -> anyhow::Result<String> {
    let mut bytes = Vec::new();
    V2DeflateSerializer::new()
        .serialize(times, &mut bytes)
        .map_err(|e| anyhow::anyhow!("encoding the latency histogram: {e:?}"))?;
    Ok(BASE64.encode(bytes))
}

pub fn decode_times(encoded: &str) -> anyhow::Result<Times> {
    let bytes = BASE64
        .decode(encoded.trim())
        .context("latency_us is not base64")?;
    Deserializer::new()
        .deserialize(&mut bytes.as_slice())
        .map_err(|e| anyhow::anyhow!("latency_us is not an HdrHistogram: {e:?}"))
}

/// The SKUs of slot `slot` (from 0) of the run whose doors open at `doors_open`.
pub fn slot_skus(doors_open: DateTime<Utc>, slot: usize, skus: u64) -> Vec<String> {
    let run = doors_open.timestamp_millis();
    (1..=skus)
        .map(|n| format!("split-{run}-{}-{n}", slot + 1))
        .collect()
}

/// When slot `slot` opens its doors.
pub fn slot_doors(doors_open: DateTime<Utc>, max_seconds: u64, slot: usize) -> DateTime<Utc> {
    let length = Duration::from_secs(max_seconds) + SLOT_GAP;
    plus(doors_open, length * u32::try_from(slot).unwrap_or(u32::MAX))
}

fn plus(t: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    TimeDelta::from_std(d)
        .ok()
        .and_then(|d| t.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

fn minus(t: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    TimeDelta::from_std(d)
        .ok()
        .and_then(|d| t.checked_sub_signed(d))
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

/// Sleeps until the wall clock reads `t` (at once if it is past).
async fn sleep_until(t: DateTime<Utc>) {
    if let Ok(wait) = (t - Utc::now()).to_std() {
        tokio::time::sleep(wait).await;
    }
}

/// Plays this part's share of every strategy's sale, on the shared schedule.
pub async fn run_part(
    options: &Options,
    service: &Service,
    strategies: &[String],
    part: Part,
    doors_open: DateTime<Utc>,
) -> anyhow::Result<PartialReport> {
    let lead = (doors_open - Utc::now()).num_milliseconds() as f64 / 1000.0;
    eprintln!(
        "part {}/{}: doors open in {lead:.1} s",
        part.number, part.of
    );
    let cohort = crate::options::cohort_setting(options.cohort, options.combine)?;
    if part.coordinates() && (options.fencing.is_some() || cohort.is_some()) {
        sleep_until(minus(doors_open, PREPARE_LEAD)).await;
        if let Some(switch) = options.fencing {
            service.set_fencing(switch == Switch::On).await?;
        }
        if let Some(setting) = cohort {
            service.set_cohort(setting).await?;
        }
    }
    let slots: Vec<(u32, &String)> = (1..=options.repeat)
        .flat_map(|repeat| strategies.iter().map(move |s| (repeat, s)))
        .collect();
    let mut runs = Vec::new();
    for (slot, &(repeat, strategy)) in slots.iter().enumerate() {
        let doors = slot_doors(doors_open, options.max_seconds, slot);
        let skus = slot_skus(doors_open, slot, options.skus);
        let label = format!("[{}/{}] {strategy}", slot + 1, slots.len());
        sleep_until(minus(doors, PREPARE_LEAD)).await;
        if part.coordinates() {
            eprintln!("{label}: restocking and switching the cluster");
            service.switch_strategy(strategy).await?;
            for sku in &skus {
                service
                    .reset(sku, options.stock_of(strategy), options.limit_per_user)
                    .await?;
            }
        } else {
            let bound = plus(doors, Duration::from_secs(options.max_seconds));
            wait_prepared(service, strategy, &skus, bound)
                .await
                .with_context(|| format!("waiting for part 1 to prepare {strategy}"))?;
        }
        let run = play(options, service, part, (strategy, repeat), doors, skus)
            .await
            .with_context(|| format!("running {strategy}"))?;
        eprintln!(
            "{label}: part {}/{}: {} requests, {} orders acknowledged{}",
            part.number,
            part.of,
            run.requests,
            run.orders_acknowledged,
            run.service.as_ref().map_or(String::new(), |s| format!(
                "; the records: {} orders for {} units, {} oversold",
                s.orders, s.initial_stock, s.oversold
            ))
        );
        runs.push(run);
    }
    let switches = crate::Switches::of(&service.stats(None).await?);
    Ok(PartialReport {
        part: part.number,
        parts: part.of,
        doors_open,
        generated_at: Utc::now(),
        config: crate::load_config(options, strategies, switches),
        runs,
    })
}

/// Writes the part's report to `out/part-K-of-N.json` and prints it on stdout, one
/// line after `MARKER`, for `loadtest merge` to find in the part's logs. Returns the
/// file's path.
pub fn publish(
    partial: &PartialReport,
    out: &std::path::Path,
) -> anyhow::Result<std::path::PathBuf> {
    std::fs::create_dir_all(out)?;
    let path = out.join(format!("part-{}-of-{}.json", partial.part, partial.parts));
    std::fs::write(&path, serde_json::to_string_pretty(partial)? + "\n")?;
    println!("{MARKER}{}", serde_json::to_string(partial)?);
    Ok(path)
}

/// Waits until part 1 has prepared the sale: every SKU restocked (in MySQL and Redis)
/// and the strategy active. Gives up at `bound`, the sale's time bound.
async fn wait_prepared(
    service: &Service,
    strategy: &str,
    skus: &[String],
    bound: DateTime<Utc>,
) -> anyhow::Result<()> {
    loop {
        if prepared(service, strategy, skus).await {
            return Ok(());
        }
        if Utc::now() >= bound {
            bail!(
                "the sale was not prepared (SKUs {} restocked, {strategy} active) by its time \
                 bound: is part 1 running, with the same --doors-open and options?",
                skus.join(", ")
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

async fn prepared(service: &Service, strategy: &str, skus: &[String]) -> bool {
    let mut active = None;
    for sku in skus {
        match service.stats(Some(sku)).await {
            Ok(stats) if stats.skus.iter().all(|s| s.stock_redis.is_some()) => {
                active = Some(stats.strategy);
            }
            _ => return false,
        }
    }
    active.as_deref() == Some(strategy)
}

/// This part's crowd at one sale, from its doors to its time bound (or sold out plus
/// the grace period, as this part saw it); part 1 then reads the records.
async fn play(
    options: &Options,
    service: &Service,
    part: Part,
    (strategy, repeat): (&str, u32),
    doors: DateTime<Utc>,
    skus: Vec<String>,
) -> anyhow::Result<PartialRun> {
    let gather = if options.rate.is_some() {
        GATHER_OPEN
    } else {
        GATHER_CROWD
    };
    let max = Duration::from_secs(options.max_seconds);
    let bound = plus(doors, max);
    sleep_until(minus(doors, gather)).await;
    // A part that comes late (started after the doors opened, or part 1 was late
    // preparing) still gathers first, and stops at the same bound as the others. A
    // quarter of the gathering is slack: Goose starts its shoppers within a second,
    // and a timer's wake-up comes a little after the moment asked.
    let now = Utc::now();
    let opens = doors.max(plus(now, gather - gather / 4));
    let late = (opens - doors).to_std().unwrap_or_default();
    let remaining = (bound - opens).to_std().unwrap_or_default();
    let (share, users) = part.share(options.users);
    let mut run = PartialRun {
        strategy: strategy.to_owned(),
        repeat,
        doors_open: doors,
        skus: skus.clone(),
        users: if options.rate.is_some() { 0 } else { users },
        late_s: late.as_secs_f64(),
        requests: 0,
        orders_acknowledged: 0,
        sold_out: 0,
        busy: 0,
        errors: 0,
        duration_s: 0.0,
        sold_out_s: skus.iter().map(|_| None).collect(),
        latency_us: encode_times(&crate::report::new_times())?,
        service: None,
    };
    if remaining >= Duration::from_secs(1) {
        if late > Duration::ZERO {
            eprintln!(
                "      {strategy}: part {}/{} is {:.1} s late",
                part.number,
                part.of,
                late.as_secs_f64()
            );
        }
        let sale = Sale::new(CrowdPlan {
            targets: options.targets.clone(),
            skus: skus.clone(),
            users,
            max_seconds: remaining.as_secs(),
            grace: Duration::from_millis(options.grace_ms),
            gather: (opens - Utc::now()).to_std().unwrap_or_default(),
            goose_options: options.goose_options.clone(),
            share,
            habits: options.habits(),
        });
        std::fs::create_dir_all(&options.out)?;
        let html = options
            .out
            .join(format!("goose-{strategy}-part{}.html", part.number));
        crate::play(
            &sale,
            format!("{strategy} (part {}/{})", part.number, part.of),
            options.stock_of(strategy) * skus.len() as i64,
            options.rate,
            &html,
        )
        .await?;
        let o = &sale.outcomes;
        let count = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        run.requests = o.requests();
        run.orders_acknowledged = count(&o.orders);
        run.sold_out = count(&o.sold_out);
        run.busy = count(&o.busy);
        run.errors = count(&o.errors);
        run.duration_s = (late + sale.elapsed()).as_secs_f64();
        run.sold_out_s = sale
            .sold_out_times()
            .into_iter()
            .map(|t| t.map(|t| (late + t).as_secs_f64()))
            .collect();
        run.latency_us = encode_times(&sale.selling_times())?;
    } else {
        eprintln!(
            "      {strategy}: part {}/{} came after the time bound: it sits this sale out",
            part.number, part.of
        );
    }
    if part.coordinates() {
        sleep_until(plus(bound, READ_AFTER)).await;
        let stats = crate::settled_stats(service, &skus).await?;
        run.service = Some(ServiceFigures::sum(&stats));
    }
    Ok(run)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_k_of_n_from_one() {
        assert_eq!("2/4".parse(), Ok(Part { number: 2, of: 4 }));
        assert_eq!("1/1".parse(), Ok(Part { number: 1, of: 1 }));
        for bad in ["0/4", "5/4", "2", "a/4", "1/0", "2/4/6", ""] {
            assert!(bad.parse::<Part>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn shares_cover_the_crowd_once() {
        for (users, of) in [(60, 4), (61, 4), (7, 3), (2, 2), (5, 1)] {
            let mut next = 0;
            for number in 1..=of {
                let (share, count) = Part { number, of }.share(users);
                assert_eq!(share.first_user, next, "{users} users, part {number}/{of}");
                assert_eq!(
                    (share.stride, share.phase),
                    (u64::from(of), u64::from(number - 1))
                );
                assert!(count == users / u64::from(of) || count == users / u64::from(of) + 1);
                next += count;
            }
            assert_eq!(next, users);
        }
    }

    #[test]
    fn doors_open_reads_rfc3339_and_unix_milliseconds() {
        let t = parse_doors_open("2030-01-01T12:00:00Z").expect("RFC 3339");
        assert_eq!(parse_doors_open(&t.timestamp_millis().to_string()), Ok(t));
        assert_eq!(parse_doors_open("2030-01-01T13:00:00+01:00"), Ok(t));
        assert!(parse_doors_open("tomorrow").is_err());
    }

    #[test]
    fn every_slot_has_its_own_skus_and_doors() {
        let t = parse_doors_open("2030-01-01T12:00:00Z").expect("time");
        assert_eq!(
            slot_skus(t, 0, 2),
            ["split-1893499200000-1-1", "split-1893499200000-1-2"]
        );
        assert_ne!(slot_skus(t, 1, 1), slot_skus(t, 0, 1));
        assert!(
            slot_skus(t, 999, 1000)
                .iter()
                .all(|s| flashsale_wire::Sku::parse(s).is_ok())
        );
        assert_eq!(slot_doors(t, 30, 0), t);
        assert_eq!((slot_doors(t, 30, 2) - t).num_seconds(), 72);
    }

    #[test]
    fn a_histogram_survives_its_encoding() {
        let mut times = crate::report::new_times();
        for us in [350, 1_200, 4_000, 4_100, 90_000, 2_500_000] {
            times.record(us).expect("in range");
        }
        let decoded = decode_times(&encode_times(&times).expect("encodes")).expect("decodes");
        assert_eq!(decoded.len(), times.len());
        for q in [0.5, 0.9, 0.99, 1.0] {
            assert_eq!(decoded.value_at_quantile(q), times.value_at_quantile(q));
        }
        assert!(decode_times("not base64!").is_err());
    }
}
