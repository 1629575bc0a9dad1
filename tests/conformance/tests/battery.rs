//! The conformance battery: seeded traces in both delivery modes, every invariant after every step.

use std::rc::Rc;
use swactor_conformance::battery::{BatteryConfig, Suite, run_suite};
use swactor_conformance::{Factory, Mode, RUN};
use swactor_provisioning::{Driver, RunId};

fn battery(suite: Suite, mode: Mode) {
    if !BatteryConfig::wants(mode) {
        return;
    }
    let config = BatteryConfig::for_suite(suite);
    let make: Factory<Driver> = Rc::new(move || {
        let c = suite.world(mode).reconciler;
        Driver::new(RunId::new(RUN), c).expect("valid config")
    });
    let report = run_suite(&make, suite, mode, &config, false);
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
    battery(Suite::Base, Mode::InOrder);
}

#[test]
fn every_invariant_holds_under_adversarial_reordering_and_duplication() {
    battery(Suite::Base, Mode::Adversarial);
}

#[test]
fn every_invariant_holds_with_short_leases_under_in_order_delivery() {
    battery(Suite::Leases, Mode::InOrder);
}

#[test]
fn every_invariant_holds_with_short_leases_under_adversarial_delivery() {
    battery(Suite::Leases, Mode::Adversarial);
}

#[test]
fn every_invariant_holds_with_a_leadership_lease_under_in_order_delivery() {
    battery(Suite::Leadership, Mode::InOrder);
}

#[test]
fn every_invariant_holds_with_a_leadership_lease_under_adversarial_delivery() {
    battery(Suite::Leadership, Mode::Adversarial);
}
