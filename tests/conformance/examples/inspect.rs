//! Prints what one seed's run did: `cargo run -p swactor-conformance --example inspect -- <mode> <seed>`.

use swactor_conformance::battery::trace_for_seed;
use swactor_conformance::{Mode, WorldConfig, run_trace};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = args
        .get(1)
        .and_then(|m| Mode::parse(m))
        .unwrap_or(Mode::InOrder);
    let seeds: Vec<u64> = match args.get(2) {
        Some(s) => vec![s.parse().expect("a seed")],
        None => (0..8).collect(),
    };
    for seed in seeds {
        let trace = trace_for_seed(mode, seed);
        let report = run_trace(&WorldConfig::for_mode(mode), &trace);
        println!(
            "seed {seed}: {} inputs, {} steps, tail {:?}, violations {:?}",
            trace.inputs.len(),
            report.steps,
            report.tail,
            report
                .violations
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
        );
        if args.len() > 2 {
            for i in &trace.inputs {
                println!("  {i:?}");
            }
            println!("{}", report.digest);
        }
    }
}
