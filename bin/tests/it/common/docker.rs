//! Driving and watching the real Docker engine from tests: whether it is
//! there, the static agent its containers run, and the containers of a run.
//!
//! Without an engine, tests that need one pass after printing one line
//! saying so, unless `SWACTOR_REQUIRE_DOCKER=1` (set by `.ci/run`), which
//! makes them fail. The agent is `SWACTOR_TEST_AGENT_BINARY` when set,
//! otherwise the static build `scripts/build-static-agent.sh --debug` makes
//! (once per test binary; cargo makes it a no-op when nothing changed).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::{Once, OnceLock};
use std::time::{Duration, Instant};

use super::Watcher;

/// Whether the engine answers; prints the skip line once when it does not.
pub fn engine_up() -> bool {
    static UP: OnceLock<bool> = OnceLock::new();
    static SKIPPED: Once = Once::new();
    let up = *UP.get_or_init(|| {
        Command::new("docker")
            .args(["version", "--format", "{{.Server.Version}}"])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if !up {
        assert!(
            std::env::var("SWACTOR_REQUIRE_DOCKER").as_deref() != Ok("1"),
            "SWACTOR_REQUIRE_DOCKER=1 but no Docker engine answers `docker version` \
             (is dockerd running, is the docker CLI installed, may this user use the socket?)"
        );
        SKIPPED.call_once(|| {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "docker tests skipped: no Docker engine answers (SWACTOR_REQUIRE_DOCKER=1 fails instead)"
            );
        });
    }
    up
}

/// The static agent binary, built once per test binary.
pub fn agent_binary() -> PathBuf {
    static AGENT: OnceLock<PathBuf> = OnceLock::new();
    AGENT
        .get_or_init(|| {
            if let Some(path) = std::env::var_os("SWACTOR_TEST_AGENT_BINARY") {
                return PathBuf::from(path);
            }
            let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
            let started = Instant::now();
            let out = Command::new("bash")
                .arg(root.join("scripts/build-static-agent.sh"))
                .arg("--debug")
                .current_dir(&root)
                .output()
                .expect("cannot run scripts/build-static-agent.sh");
            assert!(
                out.status.success(),
                "scripts/build-static-agent.sh --debug failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            eprintln!(
                "static agent: {} in {:.1?}",
                String::from_utf8_lossy(&out.stdout).trim(),
                started.elapsed()
            );
            // The script leaves it in cargo's target directory, wherever
            // that is (CARGO_TARGET_DIR included): the one holding the
            // profile directory of the `swactor` under test.
            let profile_dir = std::path::Path::new(super::BIN)
                .parent()
                .expect("the swactor binary is in a directory");
            profile_dir.with_file_name("debug").join("swactor-agent")
        })
        .clone()
}

/// Runs the docker CLI.
pub fn docker(args: &[&str]) -> Output {
    Command::new("docker")
        .args(args)
        .output()
        .expect("run the docker CLI")
}

/// One container of a run, as the engine lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Container {
    pub id: String,
    pub name: String,
    /// `created`, `running`, `paused`, `exited`, `dead`, `removing`.
    pub state: String,
    pub node: String,
    pub attempt: u64,
}

/// Every container labelled with `run`, in any state.
pub fn containers(run: &str) -> Vec<Container> {
    let filter = format!("label=swactor.run={run}");
    let out = docker(&[
        "ps",
        "-a",
        "--no-trunc",
        "--filter",
        &filter,
        "--format",
        "{{.ID}}\t{{.Names}}\t{{.State}}\t{{.Label \"swactor.node\"}}\t{{.Label \"swactor.attempt\"}}",
    ]);
    assert!(
        out.status.success(),
        "docker ps failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            let [id, name, state, node, attempt] = f.as_slice() else {
                return None;
            };
            Some(Container {
                id: (*id).to_owned(),
                name: (*name).to_owned(),
                state: (*state).to_owned(),
                node: (*node).to_owned(),
                attempt: attempt.parse().ok()?,
            })
        })
        .collect()
}

/// The run's containers by slot.
pub fn by_slot(run: &str) -> BTreeMap<String, Vec<Container>> {
    let mut out: BTreeMap<String, Vec<Container>> = BTreeMap::new();
    for c in containers(run) {
        out.entry(c.node.clone()).or_default().push(c);
    }
    out
}

/// Records any moment a slot of `run` has two containers (in any state: a
/// lease lives until its container is removed, and a replacement may be
/// created only after its predecessor's cleanup).
pub fn slot_watcher(run: &str) -> Watcher {
    let run = run.to_owned();
    Watcher::start(Duration::from_millis(50), move || {
        by_slot(&run)
            .into_iter()
            .filter(|(_, cs)| cs.len() > 1)
            .map(|(slot, cs)| {
                let what: Vec<String> = cs
                    .iter()
                    .map(|c| format!("{} ({})", c.name, c.state))
                    .collect();
                format!("slot {slot}: {}", what.join(", "))
            })
            .collect()
    })
}

/// The containers of a run, removed before the test uses the run's name
/// and again however the test ends.
pub struct RunContainers(String);

impl RunContainers {
    /// Clears `run` of containers a failed earlier test may have left.
    pub fn new(run: &str) -> Self {
        remove_run(run);
        Self(run.to_owned())
    }
}

impl Drop for RunContainers {
    fn drop(&mut self) {
        remove_run(&self.0);
    }
}

/// Removes every container of `run` (a test's cleanup, pass or fail).
pub fn remove_run(run: &str) {
    let ids: Vec<String> = containers(run).into_iter().map(|c| c.id).collect();
    if ids.is_empty() {
        return;
    }
    let mut args = vec!["rm", "-f", "-v"];
    args.extend(ids.iter().map(String::as_str));
    let _ = docker(&args);
}

/// A docker group of `count` nodes (no boot check: the agent image holds
/// nothing but the agent), with `extra` lines appended to the group.
pub fn docker_shape(run: &str, count: u32, extra: &str) -> String {
    format!(
        "run = \"{run}\"\n[[group]]\nid = \"w\"\ncount = {count}\nprovider = \"docker\"\n\
         boot_check = []\nlost_grace_s = 1.0\n{extra}"
    )
}
