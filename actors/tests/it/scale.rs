//! The `scale` benchmark (`actors/benches/scale.rs`) at a tiny size: every
//! figure it prints is present and sane. Nothing here asserts a timing.

#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

#[path = "../../benches/scale/measure.rs"]
#[allow(dead_code)]
mod measure;

#[test]
fn the_scale_benchmark_measures_a_small_cluster() {
    let f = measure::measure(200, None);
    assert_eq!(f.nodes, 200);
    // Every node walks the ladder (a lease, a bootstrap, observations), but
    // results and observations reach the driver in batches: far fewer
    // messages than nodes, and at least one per pass.
    assert!(f.messages < 200, "{f:?}");
    assert!(f.passes >= 2 && f.passes < f.messages, "{f:?}");
    assert!(f.converge > std::time::Duration::ZERO, "{f:?}");
    // Memory: the run held some heap, the state is part of it, and the
    // provider measured alone holds something for its leases and sessions.
    assert!(f.state > 0 && f.provider > 0, "{f:?}");
    assert!(f.heap >= f.state, "{f:?}");
    if cfg!(target_os = "linux") {
        assert!(f.peak_rss > 0, "{f:?}");
    }
    let row = f.row();
    assert_eq!(
        row.matches('|').count(),
        measure::HEADER.lines().next().unwrap().matches('|').count(),
        "{row}"
    );
    assert!(row.starts_with("| 200 | "), "{row}");
}
