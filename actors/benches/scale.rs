//! `cargo bench -p swactor-actors --bench scale [-- --nodes N ...]`: cold
//! convergence of 1k, 10k and 100k nodes (or the sizes given) through the
//! real actors over the zero-latency fake provider, with messages, passes,
//! resident and heap memory per node (split into the cluster state, the
//! actors with the host and the driver's other bookkeeping, and the fake
//! provider) and the full-walk cost per node. One cold run per size; the
//! figures in `docs/benchmarks.md` come from it.

// A benchmark harness owns its runtime and reads the clock to measure runs.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

#[path = "scale/measure.rs"]
mod measure;

fn main() {
    let mut sizes: Vec<u32> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        // `cargo bench` passes `--bench`; sizes come after `--nodes`.
        if arg == "--nodes" {
            for n in args.by_ref() {
                match n.parse() {
                    Ok(n) => sizes.push(n),
                    Err(_) => break,
                }
            }
        }
    }
    if sizes.is_empty() {
        sizes = vec![1_000, 10_000, 100_000];
    }
    println!("{}", measure::HEADER);
    for n in sizes {
        println!("{}", measure::measure(n).row());
    }
}
