//! Deliberate policy violations, compiled only under `--cfg swactor_policy_probe`.
//!
//! `tests/policy/provisioning-probe.sh` builds this crate, and `swactor-jobs`
//! (which compiles this same file), with that cfg and asserts that clippy
//! rejects every line marked `PROBE:` below, proving that each crate's
//! `clippy.toml` really forbids these paths there. Never enabled in a normal
//! build.
#![allow(dead_code, unused_imports, missing_docs, unreachable_pub)]

use std::thread::spawn as go;

pub fn renamed_thread_spawn() {
    let _ = go(|| ()); // PROBE: renamed-thread-spawn
}

pub fn clock_read() -> u128 {
    std::time::SystemTime::now() // PROBE: system-time-now
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

pub fn sleep() {
    std::thread::sleep(std::time::Duration::from_millis(1)); // PROBE: thread-sleep
}

pub fn file_io() -> std::io::Result<String> {
    std::fs::read_to_string("/etc/hostname") // PROBE: fs-read
}

pub fn random_order() -> usize {
    let m: std::collections::HashMap<u8, u8> = Default::default(); // PROBE: hashmap
    m.len()
}

mod helpers {
    pub use std::thread::sleep as nap;
}

pub fn reexported_sleep() {
    helpers::nap(std::time::Duration::from_millis(1)); // PROBE: reexported-sleep
}
