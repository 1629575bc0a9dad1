//! Fidelity: the official `vastai` CLI (1.9.1) drives the mock through an instance's whole life.
//!
//! The CLI comes from `SWACTOR_VASTAI` or `target/vastai-venv/bin/vastai`
//! under the workspace root (`.ci/run` makes that venv). Without it the test
//! says it is skipped, unless `SWACTOR_REQUIRE_VASTAI=1`, when it fails.
//! The CLI runs with `HOME` (and the XDG directories) in a temporary
//! directory, so it never reads a real key, and with `VAST_URL`/`--url` on
//! the mock, so it never dials anything else. Rate limits are off here: the
//! client's own retries of 429s would only make the test slower.

mod common;

use common::{keypair, ssh};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use swactor_vastmock::{MockConfig, Timings, VastMock};

fn find_cli() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SWACTOR_VASTAI") {
        return Some(PathBuf::from(p)).filter(|p| p.exists());
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent()?;
    Some(root.join("target/vastai-venv/bin/vastai")).filter(|p| p.exists())
}

struct Cli {
    exe: PathBuf,
    home: tempfile::TempDir,
    url: String,
    key: String,
}

impl Cli {
    /// Runs `vastai --url U --api-key K [--raw] ARGS`; panics unless it exits 0.
    fn run(&self, raw: bool, args: &[&str]) -> String {
        let h = self.home.path();
        let mut cmd = Command::new(&self.exe);
        cmd.arg("--url")
            .arg(&self.url)
            .arg("--api-key")
            .arg(&self.key);
        if raw {
            cmd.arg("--raw");
        }
        let out = cmd
            .args(args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", h)
            .env("XDG_CONFIG_HOME", h.join("config"))
            .env("XDG_CACHE_HOME", h.join("cache"))
            .env("XDG_STATE_HOME", h.join("state"))
            .env("XDG_DATA_HOME", h.join("data"))
            .env("VAST_URL", &self.url)
            .env("VASTAI_NO_UPDATE_CHECK", "1")
            .env("CI", "1")
            .env("NO_COLOR", "1")
            .env("COLUMNS", "200")
            .stdin(std::process::Stdio::null())
            .output()
            .expect("cannot run the vastai CLI");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "vastai {args:?} failed ({}):\nstdout: {stdout}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    }

    fn raw(&self, args: &[&str]) -> Value {
        let out = self.run(true, args);
        serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("vastai {args:?}: not JSON ({e}): {out}"))
    }
}

fn wait_until(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ok() {
        assert!(Instant::now() < deadline, "{what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

#[test]
fn the_official_cli_searches_creates_shows_labels_stops_starts_and_destroys() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let Some(exe) = find_cli() else {
        if std::env::var("SWACTOR_REQUIRE_VASTAI").as_deref() == Ok("1") {
            panic!(
                "SWACTOR_REQUIRE_VASTAI=1 but no vastai CLI: set SWACTOR_VASTAI or make \
                 target/vastai-venv (python3 -m venv target/vastai-venv && \
                 target/vastai-venv/bin/pip install vastai==1.9.1; .ci/run does)"
            );
        }
        println!(
            "skipped: no vastai CLI (set SWACTOR_VASTAI or make target/vastai-venv; see .ci/run)"
        );
        return;
    };
    let mock = VastMock::start(MockConfig {
        timings: Timings {
            provisioning: Duration::from_millis(100),
            loading: Duration::from_millis(300),
            restart: Duration::from_millis(200),
            destroyed_visible: Duration::ZERO,
        },
        ..MockConfig::fast()
    })
    .unwrap();
    let cli = Cli {
        exe,
        home: tempfile::tempdir().unwrap(),
        url: mock.url().to_owned(),
        key: mock.api_key().to_owned(),
    };
    let (key, public) = keypair(cli.home.path(), "id_ed25519");

    // Account key.
    let out = cli.run(false, &["create", "ssh-key", &public]);
    assert!(out.contains("ssh-key created"), "{out}");

    // Search: the CLI's default filters plus ours, ordered by price.
    let offers = cli.raw(&[
        "search",
        "offers",
        "gpu_name=RTX_4090 num_gpus=1",
        "-o",
        "dph+",
    ]);
    let ids: Vec<u64> = offers
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids, [3_100_008, 3_100_001, 3_100_009], "{offers}");
    let offer = ids[0];

    // Create.
    let created = cli.raw(&[
        "create",
        "instance",
        &offer.to_string(),
        "--image",
        "ubuntu:22.04",
        "--disk",
        "16",
        "--label",
        "fidelity",
        "--ssh",
        "--direct",
        "--env",
        "-e FOO=bar -p 8080:8080",
        "--onstart-cmd",
        "echo started",
        "--cancel-unavail",
    ]);
    assert_eq!(created["success"], true, "{created}");
    let id = created["new_contract"].as_u64().unwrap();
    let view = mock.instance(id).expect("the create reached the mock");
    assert_eq!(view.offer_id, offer);
    assert_eq!(view.label.as_deref(), Some("fidelity"));
    assert_eq!(view.authorized_keys, std::slice::from_ref(&public));
    assert_eq!(view.row["image_runtype"], "ssh_direc ssh_proxy");
    assert_eq!(view.row["onstart"], "echo started");
    assert_eq!(view.row["disk_space"], 16.0);
    assert_eq!(mock.offer_rented(offer), Some(true));
    assert_eq!(mock.creates_per_label()["fidelity"], 1);

    // Show instance (v0).
    wait_until("running", Duration::from_secs(5), || {
        mock.instance(id).unwrap().actual_status.as_deref() == Some("running")
    });
    let shown = cli.raw(&["show", "instance", &id.to_string()]);
    assert_eq!(shown["actual_status"], "running", "{shown}");
    let port: u16 = shown["ports"]["22/tcp"][0]["HostPort"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(shown["ssh_port"], port);
    assert!(
        ssh(&key, port, "true").0,
        "the key added through the CLI does not log in"
    );

    // Label.
    cli.run(false, &["label", "instance", &id.to_string(), "renamed"]);
    assert_eq!(mock.instance(id).unwrap().label.as_deref(), Some("renamed"));

    // Show instances: v1, every page, filtered by label (`{"label":{"in":[…]}}`).
    let listed = cli.raw(&["show", "instances", "--label", "renamed"]);
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed[0]["id"], id);
    assert_eq!(listed[0]["extra_env"]["FOO"], "bar");
    assert_eq!(listed[0]["ssh_port"], port);
    let none = cli.raw(&["show", "instances", "--label", "fidelity"]);
    assert_eq!(none, serde_json::json!([]));

    // Stop, start.
    let out = cli.run(false, &["stop", "instance", &id.to_string()]);
    assert!(out.contains("stopping instance"), "{out}");
    let v = mock.instance(id).unwrap();
    assert_eq!(v.intended_status, "stopped");
    assert!(!v.ssh_up);
    let out = cli.run(false, &["start", "instance", &id.to_string()]);
    assert!(out.contains("starting instance"), "{out}");
    assert_eq!(mock.instance(id).unwrap().intended_status, "running");
    wait_until("running again", Duration::from_secs(5), || {
        mock.instance(id).unwrap().ssh_up
    });
    assert!(ssh(&key, port, "true").0);

    // Destroy.
    // (`destroy instance` prints text even with --raw in 1.9.1.)
    let out = cli.run(false, &["destroy", "instance", &id.to_string(), "-y"]);
    assert!(out.contains(&format!("destroying instance {id}")), "{out}");
    assert_eq!(mock.live_instances(), 0);
    assert_eq!(mock.offer_rented(offer), Some(false));
    assert!(!view.dir.exists());
    let shown = cli.raw(&["show", "instance", &id.to_string()]);
    assert!(shown["instances"].is_null(), "{shown}");
    assert_eq!(mock.creates_total(), 1);
}
