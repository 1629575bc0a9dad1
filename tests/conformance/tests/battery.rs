//! The conformance battery: seeded traces in both delivery modes, every invariant after every step.

use std::rc::Rc;
use swactor_conformance::battery::{BatteryConfig, run_battery};
use swactor_conformance::{Factory, Mode, RUN};
use swactor_provisioning::{Driver, RunId};

fn battery(mode: Mode) {
    if !BatteryConfig::wants(mode) {
        return;
    }
    let config = BatteryConfig::from_env();
    let make: Factory<Driver> = Rc::new(move || {
        let c = swactor_conformance::WorldConfig::for_mode(mode).reconciler;
        Driver::new(RunId::new(RUN), c).expect("valid config")
    });
    let report = run_battery(&make, mode, &config, false);
    let failures: Vec<String> = report.failures.iter().map(ToString::to_string).collect();
    assert!(
        failures.is_empty(),
        "{} of {} seeds failed:\n{}",
        failures.len(),
        report.seeds_run,
        failures.join("\n")
    );
}

#[test]
fn every_invariant_holds_under_in_order_delivery() {
    battery(Mode::InOrder);
}

#[test]
fn every_invariant_holds_under_adversarial_reordering_and_duplication() {
    battery(Mode::Adversarial);
}
