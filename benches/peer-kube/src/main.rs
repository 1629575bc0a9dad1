//! The peer of Swactor's scale benchmark (`actors/benches/scale.rs`):
//! kube-runtime's `applier`, the engine under its `Controller`, asked to
//! reconcile N objects once each.
//!
//! Each run builds a fresh in-memory store the way a reflector fills it from
//! a watcher's initial list (N `ConfigMap`s with a name and a namespace),
//! then hands the applier a queue that yields one reconcile request per
//! object (made as the applier pulls them, then left open as a live watch
//! stays open), a reconciler that counts its calls and returns
//! `Action::await_change()`, and the default `Config` (no debounce, no
//! concurrency limit). Everything runs on a current-thread tokio runtime.
//!
//! Per run it prints the wall time from the first poll of the applier (when
//! it takes the first request) to the N-th completed reconcile, the process's
//! processor time over the same span (`getrusage`), the time filling the
//! store took (not in the wall time), the growth of the resident set from
//! before the store was made to the N-th reconcile, and the peak resident set
//! (VmHWM) so far. A last line is JSON: every run's seconds, their median and
//! the first run's resident bytes per object (later runs reuse memory the
//! allocator kept from earlier ones, so only the first is a cold figure).
//!
//! `peer-kube [--objects N] [--runs R]` (defaults 100000 and 3).

use std::convert::Infallible;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube_runtime::controller::{Action, Config, applier};
use kube_runtime::reflector::{self, ObjectRef};
use kube_runtime::watcher::Event;

/// The kube-runtime version this binary was built against (from Cargo.lock).
const VERSION: &str = env!("PEER_KUBE_RUNTIME_VERSION");

/// The namespace every object lives in.
const NAMESPACE: &str = "bench";

const USAGE: &str = "usage: peer-kube [--objects N] [--runs R]";

/// What the command line asked for.
struct Args {
    objects: u32,
    runs: u32,
}

fn parse_args() -> Result<Args, String> {
    let mut parsed = Args {
        objects: 100_000,
        runs: 3,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let slot = match arg.as_str() {
            "--objects" => &mut parsed.objects,
            "--runs" => &mut parsed.runs,
            "-h" | "--help" => return Err(USAGE.to_string()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        };
        let value = args
            .next()
            .ok_or_else(|| format!("{arg} needs a number\n{USAGE}"))?;
        *slot = value
            .parse()
            .ok()
            .filter(|&v| v > 0)
            .ok_or_else(|| format!("{arg} takes a positive number, not {value:?}"))?;
    }
    Ok(parsed)
}

/// What one run measured.
struct Run {
    /// Filling the store with N objects (outside `reconcile`).
    fill: Duration,
    /// First poll of the applier to the N-th completed reconcile.
    reconcile: Duration,
    /// Processor time (user and system) over the same span.
    cpu: Duration,
    /// Reconciler calls counted.
    calls: u64,
    /// Resident set growth from before the store to the N-th reconcile.
    rss_growth: u64,
    /// Peak resident set of the process so far.
    peak_rss: u64,
}

/// The name of object `i`.
fn name(i: u32) -> String {
    format!("cm-{i}")
}

/// A `/proc/self/status` field in bytes (0 where there is no procfs).
fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Processor time (user and system) the process has used so far.
fn cpu_time() -> Duration {
    // SAFETY: `getrusage` only writes the struct it is given, which is
    // plain old data and valid when zeroed.
    #[allow(unsafe_code)]
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// One cold run: a fresh store of `n` objects and a fresh applier that
/// reconciles each once.
fn run(n: u32) -> Run {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a current-thread runtime");
    let rss_before = status_bytes("VmRSS:");

    // The store, filled as a reflector fills it from a watcher's initial list.
    let fill_start = Instant::now();
    let (store, mut writer) = reflector::store::<ConfigMap>();
    writer.apply_watcher_event(&Event::Init);
    for i in 0..n {
        let object = ConfigMap {
            metadata: ObjectMeta {
                name: Some(name(i)),
                namespace: Some(NAMESPACE.to_string()),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        };
        writer.apply_watcher_event(&Event::InitApply(object));
    }
    writer.apply_watcher_event(&Event::InitDone);
    let fill = fill_start.elapsed();
    assert_eq!(store.len(), n as usize, "the store holds every object");

    let calls = Arc::new(AtomicU64::new(0));
    // One request per object, made when the applier asks for it; the queue
    // then stays open, as a controller's watch stream does.
    let queue = stream::iter(0..n)
        .map(|i| Ok::<_, Infallible>(ObjectRef::<ConfigMap>::new(&name(i)).within(NAMESPACE)))
        .chain(stream::pending());
    let (reconcile, cpu, rss_growth) = rt.block_on(async {
        let mut results = pin!(applier(
            |_object: Arc<ConfigMap>, calls: Arc<AtomicU64>| {
                calls.fetch_add(1, Ordering::Relaxed);
                std::future::ready(Ok::<_, Infallible>(Action::await_change()))
            },
            |_object, error: &Infallible, _calls| match *error {},
            Arc::clone(&calls),
            store.clone(),
            queue,
            Config::default(),
        ));
        let cpu_start = cpu_time();
        let start = Instant::now();
        let mut done = 0;
        while done < n {
            match results.next().await {
                Some(Ok(_)) => done += 1,
                Some(Err(e)) => panic!("the applier failed: {e}"),
                None => panic!("the applier ended after {done} of {n} reconciles"),
            }
        }
        let reconcile = start.elapsed();
        let cpu = cpu_time().saturating_sub(cpu_start);
        let rss_growth = status_bytes("VmRSS:").saturating_sub(rss_before);
        // Stopping the applier: dropping its stream drops its scheduler and queue.
        (reconcile, cpu, rss_growth)
    });
    let peak_rss = status_bytes("VmHWM:");
    let calls = calls.load(Ordering::Relaxed);
    drop((store, writer, rt));
    Run {
        fill,
        reconcile,
        cpu,
        calls,
        rss_growth,
        peak_rss,
    }
}

/// The median of `values` (the mean of the middle two for an even count).
fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len().is_multiple_of(2) {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    } else {
        sorted[mid]
    }
}

/// `values` as a JSON array with `decimals` digits after the point.
fn json_array(values: &[f64], decimals: usize) -> String {
    let items: Vec<String> = values.iter().map(|v| format!("{v:.decimals$}")).collect();
    format!("[{}]", items.join(","))
}

fn main() {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}");
            std::process::exit(2);
        }
    };
    let n = args.objects;
    let mut runs = Vec::new();
    for i in 1..=args.runs {
        let r = run(n);
        assert_eq!(r.calls, u64::from(n), "one reconcile per object");
        println!(
            "run {i}/{}: kube-runtime {VERSION} applier, {n} objects: {} reconciles in {:.3} s \
             (CPU {:.3} s); store filled in {:.3} s (not counted); RSS +{:.1} MB ({:.0} B/object), \
             peak RSS {:.1} MB",
            args.runs,
            r.calls,
            r.reconcile.as_secs_f64(),
            r.cpu.as_secs_f64(),
            r.fill.as_secs_f64(),
            r.rss_growth as f64 / 1e6,
            r.rss_growth as f64 / f64::from(n),
            r.peak_rss as f64 / 1e6,
        );
        runs.push(r);
    }
    let secs: Vec<f64> = runs.iter().map(|r| r.reconcile.as_secs_f64()).collect();
    let cpu: Vec<f64> = runs.iter().map(|r| r.cpu.as_secs_f64()).collect();
    let fill: Vec<f64> = runs.iter().map(|r| r.fill.as_secs_f64()).collect();
    let rss: Vec<f64> = runs
        .iter()
        .map(|r| r.rss_growth as f64 / f64::from(n))
        .collect();
    let peak = runs.iter().map(|r| r.peak_rss).max().unwrap_or(0);
    println!(
        "{{\"peer\":\"kube-runtime applier\",\"version\":\"{VERSION}\",\"objects\":{n},\
         \"secs\":{},\"median_secs\":{:.4},\"rss_per_object_bytes\":{:.0},\
         \"cpu_secs\":{},\"fill_secs\":{},\"rss_per_object_bytes_runs\":{},\"peak_rss_bytes\":{peak},\
         \"runtime\":\"current_thread\"}}",
        json_array(&secs, 4),
        median(&secs),
        rss[0],
        json_array(&cpu, 4),
        json_array(&fill, 4),
        json_array(&rss, 0),
    );
}
