//! `cargo bench -p swactor-actors --bench scale [-- --nodes N ...]`: cold
//! convergence of 1k, 10k and 100k nodes (or the sizes given) through the
//! real actors over the zero-latency fake provider, with messages, passes,
//! resident and heap memory per node (split into the cluster state, the
//! actors with the host and the driver's other bookkeeping, and the fake
//! provider) and the full-walk cost per node. One cold run per size; the
//! figures in `docs/benchmarks.md` come from it. `--json` adds one JSON line
//! of the same figures after each row (`scripts/bench-peer.sh` reads it).
//! `--flight` records the driver's inputs as a daemon does (into a
//! temporary directory, or `--flight-dir DIR`, with the daemon's default
//! limits) and says how much it wrote and whether it had to drop any, to
//! weigh the flight recorder against a run without it. `--flight-queue-mib
//! N` raises the writer's queue past the daemon's 16 MiB: under valgrind,
//! which runs one thread at a time, the writer falls behind and the
//! recording would otherwise be cut part-way (the run says so).

// A benchmark harness owns its runtime and reads the clock to measure runs.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

#[path = "scale/measure.rs"]
mod measure;

fn main() {
    let mut sizes: Vec<u32> = Vec::new();
    let mut json = false;
    let mut flight = false;
    let mut keep: Option<String> = None;
    let mut queue_mib: Option<u64> = None;
    let mut args = std::env::args().skip(1).peekable();
    while let Some(arg) = args.next() {
        // `cargo bench` passes `--bench`; sizes come after `--nodes`.
        match arg.as_str() {
            "--nodes" => {
                while let Some(n) = args.peek().and_then(|n| n.parse().ok()) {
                    sizes.push(n);
                    args.next();
                }
            }
            "--json" => json = true,
            "--flight" => flight = true,
            // Keeps the recordings there (to look at what they hold).
            "--flight-dir" => {
                flight = true;
                keep = args.next();
            }
            "--flight-queue-mib" => {
                flight = true;
                queue_mib = args.next().and_then(|n| n.parse().ok());
            }
            _ => {}
        }
    }
    if sizes.is_empty() {
        sizes = vec![1_000, 10_000, 100_000];
    }
    println!("{}", measure::HEADER);
    for n in sizes {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let at = keep
            .as_ref()
            .map_or(dir.path().to_owned(), std::path::PathBuf::from);
        let recorder = flight.then(|| {
            // The daemon's own limits (64 MiB on disk, a 16 MiB queue).
            let mut limits = swactor_engine::flight::FlightLimits::on_disk(
                swactor_engine::flight::FlightLimits::DISK_MAX_DEFAULT,
            );
            if let Some(mib) = queue_mib {
                limits.queued_max = mib << 20;
            }
            swactor_actors::FlightRecorder::open(&at, limits).expect("a flight directory")
        });
        let figures = measure::measure(n, recorder.as_ref());
        println!("{}", figures.row());
        if let Some(r) = &recorder {
            r.sync();
            let c = r.counts();
            println!(
                "flight: {} bytes written ({:.0} per node), {} chunks dropped, {} lives cut",
                c.written_bytes,
                c.written_bytes as f64 / f64::from(n.max(1)),
                c.dropped_chunks,
                c.cut_lives
            );
        }
        if json {
            println!("{}", json_line(&figures));
        }
    }
}

/// `--json`: the figures of one size as one JSON line (after its table row),
/// for scripts such as `scripts/bench-peer.sh`.
fn json_line(f: &measure::Figures) -> String {
    format!(
        "{{\"bench\":\"swactor scale\",\"nodes\":{},\"converge_secs\":{:.4},\"cpu_secs\":{:.3},\"thread_cpu_secs\":{:.4},\
         \"driver_msgs\":{},\"passes\":{},\"peak_rss_bytes\":{},\"rss_per_node_bytes\":{:.0},\
         \"heap_per_node_bytes\":{:.0},\"state_per_node_bytes\":{:.0},\
         \"actors_per_node_bytes\":{:.0},\"provider_per_node_bytes\":{:.0},\
         \"walk_ns_per_node\":{:.1}}}",
        f.nodes,
        f.converge.as_secs_f64(),
        f.converge_cpu.as_secs_f64(),
        f.converge_thread_cpu.as_secs_f64(),
        f.messages,
        f.passes,
        f.peak_rss,
        f.per_node(f.rss_growth),
        f.per_node(f.heap),
        f.per_node(f.state),
        f.per_node(f.actors()),
        f.per_node(f.provider),
        f.walk.as_nanos() as f64 / f64::from(f.nodes.max(1)),
    )
}
