//! Writes the flight recordings of one seed's run, one file per host life, or finds seeds worth recording.
//!
//! ```text
//! cargo run -p swactor-conformance --example record -- write <suite> <mode> <seed> [<dir>]
//! cargo run -p swactor-conformance --example record -- find <suite> <mode> <first> <last>
//! cargo run -p swactor-conformance --example record -- show <file.flight>
//! ```
//!
//! `suite` is `base`, `leases` or `leadership`; `mode` is `in-order` or
//! `adversarial`. `write` runs the seed's trace with
//! [`WorldConfig::record`] on (the battery's world otherwise), checks each
//! life's recording as `tests/recordings.rs` does, and writes it to `dir`
//! (default `tests/conformance/recordings/`) as
//! `<label>-<seed>-life<k>.flight`, `label` being the suite's label for
//! the mode (`in-order`, `leases-adversarial`, ...). `find` lists the seeds
//! in a range whose runs crash, lose agents, scale a group down and change
//! a template, with the size of their largest life. `show` prints a
//! recording input by input and what checking it finds.

use std::borrow::Cow;
use std::path::PathBuf;
use swactor_conformance::battery::{Suite, suite_trace_for_seed};
use swactor_conformance::recording::check_recording;
use swactor_conformance::{Input, Mode, WorldConfig, run_trace};
use swactor_provisioning::flight::{self, FlightInput, Recording};

fn suite(name: &str) -> Suite {
    match name {
        "base" => Suite::Base,
        "leases" => Suite::Leases,
        "leadership" => Suite::Leadership,
        other => panic!("no suite {other:?}: base, leases or leadership"),
    }
}

/// What a run holds that makes it worth committing.
#[derive(Default)]
struct Holds {
    lives: usize,
    crashes: usize,
    agents_lost: usize,
    scale_downs: usize,
    template_changes: usize,
    largest: usize,
}

impl std::fmt::Display for Holds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} lives ({} crash inputs), {} agents gone, {} scale-downs, {} template changes, largest life {} bytes",
            self.lives,
            self.crashes,
            self.agents_lost,
            self.scale_downs,
            self.template_changes,
            self.largest
        )
    }
}

impl Holds {
    fn all(&self) -> bool {
        self.crashes > 0
            && self.agents_lost > 0
            && self.scale_downs > 0
            && self.template_changes > 0
    }
}

/// What the recordings of a run show: lives, agents gone, and, between
/// consecutive applies a host accepted, groups that shrank or changed template.
fn holds(trace_inputs: &[Input], recordings: &[Vec<u8>]) -> Holds {
    let mut h = Holds {
        lives: recordings.len(),
        crashes: trace_inputs
            .iter()
            .filter(|i| matches!(i, Input::HostCrash { .. }))
            .count(),
        largest: recordings.iter().map(Vec::len).max().unwrap_or(0),
        ..Holds::default()
    };
    for bytes in recordings {
        let recording = Recording::read(bytes).expect("a world's recording reads");
        let mut last = recording
            .header
            .resume
            .as_ref()
            .and_then(|j| j.meta.shape.clone());
        for frame in recording.frames() {
            let frame = frame.expect("a world's frame reads");
            match &frame.input {
                FlightInput::AgentGone { .. } => h.agents_lost += 1,
                FlightInput::Apply { shape, .. } if shape.validate().is_ok() => {
                    if let Some(before) = &last
                        && shape.generation > before.generation
                    {
                        for g in &shape.groups {
                            let Some(b) = before.groups.iter().find(|b| b.id == g.id) else {
                                continue;
                            };
                            h.scale_downs += usize::from(g.count < b.count);
                            h.template_changes += usize::from(g.boot != b.boot && g.count > 0);
                        }
                    }
                    if last
                        .as_ref()
                        .is_none_or(|b| shape.generation > b.generation)
                    {
                        last = Some(shape.as_ref().clone());
                    }
                }
                _ => {}
            }
        }
    }
    h
}

/// Prints a recording input by input, then the case's verdict.
fn show(path: &str) {
    let bytes = std::fs::read(path).expect("the recording can be read");
    let recording = Recording::read(&bytes).expect("a flight recording");
    let h = &recording.header;
    println!(
        "{path}: {}, run {}, {} host, built at {}",
        h.build,
        h.run_id,
        if h.resume.is_some() { "resumed" } else { "new" },
        h.now
    );
    for frame in recording.frames() {
        let frame = frame.expect("a frame that reads");
        let at = frame.input.now().map(|t| t.to_string()).unwrap_or_default();
        let answer = match frame.answer {
            flight::Answer::Digest(d) => format!("{d:016x}"),
            other => other.describe(),
        };
        println!(
            "{:>5} {at:>12} {answer:>16} {}",
            frame.index,
            frame.input.describe()
        );
        if let FlightInput::Inventory {
            listed: Cow::Owned(Ok(listed)) | Cow::Borrowed(Ok(listed)),
            ..
        } = &frame.input
        {
            for l in listed {
                println!("{:>36} {} {:?} {:?}", "", l.key, l.lease, l.session);
            }
        }
    }
    match check_recording(&bytes) {
        Ok(case) => println!("{case}"),
        Err(e) => println!("{e}"),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: record write <suite> <mode> <seed> [<dir>] | record find <suite> <mode> <first> <last> | record show <file>";
    if let (Some("show"), Some(path)) = (args.first().map(String::as_str), args.get(1)) {
        return show(path);
    }
    let (Some(command), Some(s), Some(m)) = (args.first(), args.get(1), args.get(2)) else {
        panic!("{usage}");
    };
    let suite = suite(s);
    let mode = Mode::parse(m).expect("a mode: in-order or adversarial");
    let config = WorldConfig {
        record: true,
        ..suite.world(mode)
    };
    let number = |i: usize| -> u64 {
        args.get(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("{usage}"))
    };
    match command.as_str() {
        "find" => {
            for seed in number(3)..=number(4) {
                let trace = suite_trace_for_seed(suite, mode, seed);
                let report = run_trace(&config, &trace);
                let h = holds(&trace.inputs, &report.recordings);
                if h.all() && report.violations.is_empty() {
                    println!("{} {seed}: {h}", suite.label(mode));
                }
            }
        }
        "write" => {
            let seed = number(3);
            let dir = args.get(4).map_or_else(
                || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("recordings"),
                PathBuf::from,
            );
            let trace = suite_trace_for_seed(suite, mode, seed);
            let report = run_trace(&config, &trace);
            assert!(
                report.violations.is_empty(),
                "the seed's run fails in the world: {:?}",
                report.violations
            );
            println!(
                "{} {seed}: {}",
                suite.label(mode),
                holds(&trace.inputs, &report.recordings)
            );
            std::fs::create_dir_all(&dir).expect("the output directory can be made");
            for (life, bytes) in report.recordings.iter().enumerate() {
                let case = check_recording(bytes).expect("a world's recording can be checked");
                let path = dir.join(format!("{}-{seed}-life{life}.flight", suite.label(mode)));
                std::fs::write(&path, bytes).expect("the recording can be written");
                println!(
                    "{}: {} bytes, {case}; inputs {:?}",
                    path.display(),
                    bytes.len(),
                    case.kinds
                );
            }
        }
        _ => panic!("{usage}"),
    }
}
