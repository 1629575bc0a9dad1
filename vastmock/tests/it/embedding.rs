//! The mock as a process (the `swactor-vastmock` binary) and inside a test's own tokio runtime.

use crate::common;

use common::{Api, sshds_under};
use serde_json::json;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;
use swactor_vastmock::{MockConfig, VastMock};

#[test]
fn the_binary_prints_its_url_first_serves_and_stops_its_sshds_on_sigterm() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    /// Kills the mock if the test fails before it is stopped, so no server
    /// outlives the test (holding its output pipe open).
    struct Reap(std::process::Child);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let state = tempfile::tempdir().unwrap();
    let mut child = Reap(
        Command::new(env!("CARGO_BIN_EXE_swactor-vastmock"))
            .args(["--api-key", "k3y", "--state-dir"])
            .arg(state.path())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    let url = lines.next().unwrap().unwrap();
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    assert_eq!(lines.next().unwrap().unwrap(), "api_key=k3y");

    let api = Api::new(&url, "k3y");
    let r = api.post("/admin/rate_scale", json!({"scale": 0}));
    assert_eq!(r.status, 200, "{}", r.body);
    let r = api.post(
        "/admin/timings",
        json!({"provisioning_ms": 0, "loading_ms": 100, "restart_ms": 100}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let id = api.create(3_100_001, "bin");
    api.wait_status(id, Some("running"), Duration::from_secs(5));
    assert_eq!(sshds_under(state.path()), 1);

    // SIGTERM, by the pid of the child this test started.
    let status = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = child.0.wait().unwrap();
    assert!(exit.success(), "{exit}");
    assert_eq!(sshds_under(state.path()), 0);
    assert!(state.path().exists(), "a given state directory is kept");
}

#[tokio::test(flavor = "current_thread")]
async fn the_mock_serves_a_test_that_runs_its_own_runtime() {
    let mock = VastMock::start(MockConfig {
        real_ssh: false,
        ..MockConfig::fast()
    })
    .unwrap();
    let api = Api::new(mock.url(), mock.api_key());
    let id = tokio::task::spawn_blocking(move || api.create(3_100_002, "async"))
        .await
        .unwrap();
    assert_eq!(mock.instance(id).unwrap().label.as_deref(), Some("async"));
    drop(mock);
}
