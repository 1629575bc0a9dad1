//! Fidelity: the official `vastai` CLI (1.9.1) drives the mock through an instance's whole life.
//!
//! The CLI comes from `SWACTOR_VASTAI` or `target/vastai-venv/bin/vastai`
//! under the workspace root (`.ci/run` makes that venv). Without it the test
//! says it is skipped, unless `SWACTOR_REQUIRE_VASTAI=1`, when it fails.
//! The CLI runs with `HOME` (and the XDG directories) in a temporary
//! directory, so it never reads a real key, and with `VAST_URL`/`--url` on
//! the mock, so it never dials anything else (the `result_url`s of logs and
//! commands are the mock's own). Rate limits are off here, except in the
//! test of paging under the default limits and of the 429 messages.

use crate::common;

use common::{keypair, ssh};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use swactor_vastmock::{
    Destroy, Endpoint, KeyUse, MockConfig, Offer, RateLimits, Timings, VastMock,
};

/// The CLI, or `None` (the test is skipped) when there is none and
/// `SWACTOR_REQUIRE_VASTAI` is not `1`.
fn cli_or_skip() -> Option<PathBuf> {
    let found = find_cli();
    if found.is_none() {
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
    }
    found
}

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
    fn new(exe: PathBuf, mock: &VastMock) -> Self {
        Self {
            exe,
            home: tempfile::tempdir().unwrap(),
            url: mock.url().to_owned(),
            key: mock.api_key().to_owned(),
        }
    }

    /// Runs `vastai --url U --api-key K [--raw] ARGS`; panics unless it exits 0.
    fn run(&self, raw: bool, args: &[&str]) -> String {
        let (ok, stdout, stderr) = self.run_full(raw, args);
        assert!(
            ok,
            "vastai {args:?} failed:\nstdout: {stdout}\nstderr: {stderr}"
        );
        stdout
    }

    /// Runs the CLI; whether it exited 0, its stdout and its stderr. (An
    /// HTTP error is printed on stderr, and 1.9.1 still exits 0.)
    fn run_full(&self, raw: bool, args: &[&str]) -> (bool, String, String) {
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
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Runs `vastai.sdk.VastAI(api_key, server_url).METHOD(*ARGS)` with the
    /// CLI's Python (`python` next to it) and returns what it printed.
    fn sdk(&self, method: &str, args: &[&str]) -> String {
        let python = self.exe.with_file_name("python");
        let script = "import sys\nfrom vastai.sdk import VastAI\n\
            v = VastAI(api_key=sys.argv[1], server_url=sys.argv[2])\n\
            print(getattr(v, sys.argv[3])(*[int(a) if a.isdigit() else a for a in sys.argv[4:]]))\n";
        let h = self.home.path();
        let out = Command::new(&python)
            .arg("-c")
            .arg(script)
            .arg(&self.key)
            .arg(&self.url)
            .arg(method)
            .args(args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", h)
            .env("XDG_CONFIG_HOME", h.join("config"))
            .env("XDG_CACHE_HOME", h.join("cache"))
            .env("VAST_URL", &self.url)
            .env("VASTAI_NO_UPDATE_CHECK", "1")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "sdk {method}{args:?} failed:\nstdout: {stdout}\nstderr: {}",
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
    let Some(exe) = cli_or_skip() else {
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
    let cli = Cli::new(exe, &mock);
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
    // Prices hold the storage the search names (`--storage`, 5 GB by
    // default) at the offer's `storage_cost` per GB and month.
    let priced = |storage: &str| -> f64 {
        let found = cli.raw(&[
            "search",
            "offers",
            &format!("id={offer}"),
            "--storage",
            storage,
        ]);
        found[0]["dph_total"].as_f64().unwrap()
    };
    let listed = mock
        .offers()
        .into_iter()
        .find(|o| o["id"] == offer)
        .unwrap();
    let base = listed["dph_total"].as_f64().unwrap();
    let per_gb_month = listed["storage_cost"].as_f64().unwrap();
    for gb in [5.0, 100.0] {
        let want = base + per_gb_month * gb / 720.0;
        let got = priced(&gb.to_string());
        assert!((got - want).abs() < 1e-9, "{gb} GB: {got} vs {want}");
    }

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
    // `ssh_host`/`ssh_port` are the proxy, another way to the same sshd.
    assert_eq!(shown["ssh_host"], "localhost", "{shown}");
    let proxy_port = shown["ssh_port"].as_u64().unwrap();
    assert_ne!(proxy_port, u64::from(port), "{shown}");
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
    assert_eq!(listed[0]["ssh_port"], proxy_port);
    let none = cli.raw(&["show", "instances", "--label", "fidelity"]);
    assert_eq!(none, serde_json::json!([]));

    // Stop, start.
    let out = cli.run(false, &["stop", "instance", &id.to_string()]);
    assert!(out.contains("stopping instance"), "{out}");
    let v = mock.instance(id).unwrap();
    assert_eq!(v.intended_status, "stopped");
    assert!(!v.ssh_up);
    let shown = cli.raw(&["show", "instance", &id.to_string()]);
    assert_eq!(shown["actual_status"], "stopped", "{shown}");
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

/// A mock without sshds (these tests look at the API's answers), fast boots.
fn mock_without_ssh(rate_limits: Option<RateLimits>) -> VastMock {
    let fast = MockConfig::fast();
    VastMock::start(MockConfig {
        real_ssh: false,
        rate_limits: rate_limits.unwrap_or(fast.rate_limits),
        ..fast
    })
    .unwrap()
}

fn wait_status(mock: &VastMock, ids: &[u64], status: &str) {
    wait_until(status, Duration::from_secs(5), || {
        ids.iter()
            .all(|id| mock.instance(*id).unwrap().actual_status.as_deref() == Some(status))
    });
}

/// The ids of the mock's live instances, in id order.
fn live_ids(mock: &VastMock) -> Vec<u64> {
    mock.instances()
        .into_iter()
        .filter(|i| !i.destroyed)
        .map(|i| i.id)
        .collect()
}

#[test]
fn the_official_cli_creates_stops_starts_and_destroys_instances_in_bulk() {
    let Some(exe) = cli_or_skip() else {
        return;
    };
    let mock = mock_without_ssh(None);
    let cli = Cli::new(exe, &mock);
    let offers = [3_100_001u64, 3_100_003, 3_100_004];
    let offer_args: Vec<String> = offers.iter().map(u64::to_string).collect();

    // `create instances`: one `POST /asks/bulk/` with `ids`; the CLI prints
    // "Started. {answer}".
    let mut args = vec!["create", "instances"];
    args.extend(offer_args.iter().map(String::as_str));
    args.extend(["--image", "ubuntu:22.04", "--disk", "16", "--label", "bulk"]);
    let out = cli.run(false, &args);
    let ids = live_ids(&mock);
    assert_eq!(ids.len(), 3, "{out}");
    assert!(out.starts_with("Started. "), "{out}");
    assert!(out.contains("'success': True"), "{out}");
    assert!(
        out.contains(&format!(
            "'new_contracts': [{}, {}, {}]",
            ids[0], ids[1], ids[2]
        )),
        "{out}"
    );
    assert_eq!(mock.creates_per_label()["bulk"], 3);
    let mut rented: Vec<u64> = ids
        .iter()
        .map(|id| mock.instance(*id).unwrap().offer_id)
        .collect();
    rented.sort_unstable();
    assert_eq!(rented, offers);
    for id in &ids {
        let v = mock.instance(*id).unwrap();
        assert_eq!(v.label.as_deref(), Some("bulk"));
        assert_eq!(v.row["image_uuid"], "ubuntu:22.04");
        assert_eq!(v.row["disk_space"], 16.0);
    }
    wait_status(&mock, &ids, "running");

    // `stop instances A B`: one `PUT /instances/` with `ids`.
    let (a, b, c) = (ids[0].to_string(), ids[1].to_string(), ids[2].to_string());
    let out = cli.run(false, &["stop", "instances", &a, &b]);
    assert!(
        out.contains(&format!("stopping instance [{a}, {b}].")),
        "{out}"
    );
    for id in &ids[..2] {
        let v = mock.instance(*id).unwrap();
        assert_eq!(v.intended_status, "stopped");
        assert_eq!(v.actual_status.as_deref(), Some("stopped"));
    }
    assert_eq!(
        mock.instance(ids[2]).unwrap().actual_status.as_deref(),
        Some("running")
    );
    let listed = cli.raw(&["show", "instances", "--label", "bulk"]);
    let statuses: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["actual_status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses, ["stopped", "stopped", "running"], "{listed}");

    // `start instances A B`.
    let out = cli.run(false, &["start", "instances", &a, &b]);
    assert!(
        out.contains(&format!("starting instance [{a}, {b}].")),
        "{out}"
    );
    for id in &ids[..2] {
        assert_eq!(mock.instance(*id).unwrap().intended_status, "running");
    }
    wait_status(&mock, &ids, "running");

    // `destroy instances A B C -y`: one `DELETE /instances/` with `instance_ids`.
    let out = cli.run(false, &["destroy", "instances", &a, &b, &c, "-y"]);
    assert!(
        out.contains(&format!("destroying instance [{a}, {b}, {c}].")),
        "{out}"
    );
    assert_eq!(mock.live_instances(), 0);
    for offer in offers {
        assert_eq!(mock.offer_rented(offer), Some(false));
    }
    assert_eq!(mock.creates_total(), 3);
}

#[test]
fn the_official_cli_pages_29_instances_under_the_default_rate_limits_and_prints_429_messages() {
    let Some(exe) = cli_or_skip() else {
        return;
    };
    // The real service's intervals (list: 1 s, with a burst for paging).
    let mock = mock_without_ssh(Some(RateLimits::default()));
    let cli = Cli::new(exe, &mock);
    // 29 offers (the 9 of the catalogue and 20 more), rented in one bulk create.
    for i in 0..20 {
        mock.add_offer(Offer {
            id: 3_200_001 + i,
            machine_id: 52_000 + i,
            host_id: 1_000 + i,
            ..Offer::default()
        })
        .unwrap();
    }
    let offers: Vec<String> = mock
        .offers()
        .iter()
        .map(|o| o["id"].as_u64().unwrap().to_string())
        .collect();
    assert_eq!(offers.len(), 29);
    let mut args = vec!["create", "instances"];
    args.extend(offers.iter().map(String::as_str));
    args.extend(["--image", "ubuntu:22.04", "--disk", "16"]);
    cli.run(false, &args);
    let ids = live_ids(&mock);
    assert_eq!(ids.len(), 29);

    // Strict limits (one listing a second): the second page meets 429s and
    // the client, after its three tries, prints the 429's `msg`.
    mock.strict_rate_limits(true);
    let (_, out, err) = cli.run_full(true, &["show", "instances"]);
    assert!(out.trim().is_empty(), "{out}");
    let error: Value = serde_json::from_str(err.trim())
        .unwrap_or_else(|e| panic!("not a JSON error ({e}): {err}"));
    assert_eq!(error["status_code"], 429, "{err}");
    assert_eq!(
        error["msg"], "API requests too frequent: endpoint threshold=1.00s",
        "{err}"
    );

    // The default limits: the client pages through both pages at once.
    mock.strict_rate_limits(false);
    let listed = cli.raw(&["show", "instances"]);
    let listed_ids: Vec<u64> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_u64().unwrap())
        .collect();
    assert_eq!(listed_ids, ids);
    // The table form too (`select_cols`, the filters breakdown, every page).
    let table = cli.run(false, &["show", "instances"]);
    for id in [ids[0], ids[24], ids[28]] {
        assert!(table.contains(&id.to_string()), "{id} missing:\n{table}");
    }
    // And the quiet form, which pages on its own.
    let quiet = cli.run(false, &["show", "instances", "-q"]);
    let quiet_ids: Vec<u64> = quiet.lines().map(|l| l.trim().parse().unwrap()).collect();
    assert_eq!(quiet_ids, ids);

    // A 429 the client cannot retry away: it prints the `msg` as the error.
    mock.rate_burst(Endpoint::Show, 3);
    let (_, _, err) = cli.run_full(false, &["show", "instance", &ids[0].to_string()]);
    assert!(
        err.contains("Failed with error 429: API requests too frequent: endpoint threshold="),
        "{err}"
    );
}

#[test]
fn the_official_cli_filters_offers_by_two_letter_country_codes() {
    let Some(exe) = cli_or_skip() else {
        return;
    };
    let mock = mock_without_ssh(None);
    let cli = Cli::new(exe, &mock);
    let search = |query: &str| -> Vec<u64> {
        let offers = cli.raw(&["search", "offers", query]);
        let mut ids: Vec<u64> = offers
            .as_array()
            .unwrap_or_else(|| panic!("{offers}"))
            .iter()
            .map(|o| o["id"].as_u64().unwrap())
            .collect();
        ids.sort_unstable();
        ids
    };
    // "United States, US" ×3 and "Canada, CA"; the unverified Polish offer
    // is left out by the CLI's default `verified=true`.
    assert_eq!(
        search("geolocation in [US,CA]"),
        [3_100_002, 3_100_004, 3_100_005, 3_100_009]
    );
    assert_eq!(
        search("geolocation notin [US,CA]"),
        [3_100_001, 3_100_003, 3_100_006, 3_100_008]
    );
    assert_eq!(search("geolocation=SE"), [3_100_001]);
    assert_eq!(search("geolocation in [CA] num_gpus=1"), [3_100_004]);
}

#[test]
fn the_official_cli_reads_logs_executes_changes_the_bid_and_reboots() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let Some(exe) = cli_or_skip() else {
        return;
    };
    let mock = VastMock::start(MockConfig {
        timings: Timings {
            provisioning: Duration::from_millis(100),
            loading: Duration::from_millis(200),
            // Long enough to see `rebooting` through the CLI.
            restart: Duration::from_millis(3000),
            destroyed_visible: Duration::ZERO,
        },
        ..MockConfig::fast()
    })
    .unwrap();
    let cli = Cli::new(exe, &mock);
    let (key, public) = keypair(cli.home.path(), "id_ed25519");
    cli.run(false, &["create", "ssh-key", &public]);

    // An interruptible instance (bid 0.2; the offer's minimum is 0.175).
    let created = cli.raw(&[
        "create",
        "instance",
        "3100001",
        "--image",
        "ubuntu:22.04",
        "--disk",
        "16",
        "--ssh",
        "--direct",
        "--bid_price",
        "0.2",
    ]);
    let id = created["new_contract"].as_u64().unwrap();
    let ids = id.to_string();
    wait_status(&mock, &[id], "running");
    let view = mock.instance(id).unwrap();
    assert_eq!(view.row["is_bid"], true);
    let port = view.ssh_port.unwrap();

    // Logs: requested, then fetched from the mock's `result_url`.
    let started = format!("vastmock: container of instance {id} started from ubuntu:22.04");
    let out = cli.run(false, &["logs", &ids]);
    assert!(out.contains(&started), "{out}");
    let out = cli.run(
        false,
        &["logs", &ids, "--tail", "1", "--filter", "nothing-like-this"],
    );
    assert!(!out.contains("vastmock"), "{out}");

    // The SDK's logs: the same text.
    let out = cli.sdk("logs", &[&ids]);
    assert!(out.contains(&started), "{out}");

    // Execute: `ls`, `du`, `rm` in the instance; a path outside it is refused.
    // `vastai execute` of 1.9.1 fetches the output from `result_url`, then
    // fails on it (`'str' object has no attribute 'get'`: its API function
    // already returns the text); the SDK's `execute` returns it.
    let home = view.home.clone().unwrap();
    std::fs::write(home.join("hello-from-test.txt"), "hi").unwrap();
    let out = cli.sdk("execute", &[&ids, "ls -a"]);
    assert!(out.contains("hello-from-test.txt"), "{out}");
    let out = cli.sdk("execute", &[&ids, "du -s hello-from-test.txt"]);
    assert!(out.contains("hello-from-test.txt"), "{out}");
    let (_, _, err) = cli.run_full(false, &["execute", &ids, "rm hello-from-test.txt"]);
    assert!(
        err.contains("AttributeError: 'str' object has no attribute 'get'"),
        "the CLI's execute no longer fails on the text: check what it prints now\n{err}"
    );
    assert!(!home.join("hello-from-test.txt").exists());
    let (_, _, err) = cli.run_full(false, &["execute", &ids, "ls /etc"]);
    assert!(
        err.contains("Failed with error 400: path \"/etc\" is outside the instance"),
        "{err}"
    );
    let (_, _, err) = cli.run_full(false, &["execute", &ids, "cat /etc/passwd"]);
    assert!(err.contains("Failed with error 400"), "{err}");

    // Change bid: the new price shows; one under the minimum is refused.
    let out = cli.run(false, &["change", "bid", &ids, "--price", "0.3"]);
    assert!(out.contains("Per gpu bid price changed"), "{out}");
    let shown = cli.raw(&["show", "instance", &ids]);
    // The bid, and the storage of the instance's disk on top.
    let with_storage = 0.3 + 0.15 * shown["disk_space"].as_f64().unwrap() / 720.0;
    assert!(
        (shown["dph_total"].as_f64().unwrap() - with_storage).abs() < 1e-9,
        "{shown}"
    );
    assert_eq!(shown["is_bid"], true, "{shown}");
    let (_, _, err) = cli.run_full(false, &["change", "bid", &ids, "--price", "0.01"]);
    assert!(
        err.contains("Failed with error 400: bid price 0.01 is below the minimum bid"),
        "{err}"
    );
    assert_eq!(
        mock.instance(id).unwrap().row["dph_total"].as_f64(),
        Some(with_storage)
    );

    // Reboot: `rebooting` (no sshd) for the restart time, then running again
    // on the same port.
    assert!(ssh(&key, port, "true").0);
    let out = cli.run(false, &["reboot", "instance", &ids]);
    assert!(out.contains(&format!("Rebooting instance {id}.")), "{out}");
    let v = mock.instance(id).unwrap();
    assert_eq!(v.actual_status.as_deref(), Some("rebooting"));
    assert_eq!(v.intended_status, "running");
    assert!(!v.ssh_up);
    let shown = cli.raw(&["show", "instance", &ids]);
    assert_eq!(shown["actual_status"], "rebooting", "{shown}");
    wait_until("running after the reboot", Duration::from_secs(8), || {
        mock.instance(id).unwrap().ssh_up
    });
    assert_eq!(mock.instance(id).unwrap().ssh_port, Some(port));
    assert!(ssh(&key, port, "true").0);
    let out = cli.run(false, &["logs", &ids]);
    assert!(out.contains("vastmock: container rebooting"), "{out}");
    assert_eq!(out.matches(&started).count(), 2, "{out}");

    // A stopped instance is not rebooted, nor does it execute.
    cli.run(false, &["stop", "instance", &ids]);
    let (_, _, err) = cli.run_full(false, &["reboot", "instance", &ids]);
    assert!(
        err.contains(&format!(
            "Failed with error 400: Instance {id} is not running."
        )),
        "{err}"
    );
    let (_, _, err) = cli.run_full(false, &["execute", &ids, "ls"]);
    assert!(err.contains("is not running"), "{err}");
    cli.run(false, &["destroy", "instance", &ids, "-y"]);
    assert_eq!(mock.live_instances(), 0);
}

#[test]
fn the_official_cli_shows_a_proxy_only_instance_and_leaves_its_offer_out_of_direct_searches() {
    let Some(exe) = cli_or_skip() else {
        return;
    };
    let real_ssh = swactor_providers::ssh::testing::sshd_available();
    let mock = VastMock::start(MockConfig {
        real_ssh,
        ..MockConfig::fast()
    })
    .unwrap();
    let cli = Cli::new(exe, &mock);
    let (key, public) = keypair(cli.home.path(), "id_ed25519");
    cli.run(false, &["create", "ssh-key", &public]);
    let proxy_only = 3_300_001u64;
    let mut extra = serde_json::Map::new();
    extra.insert("direct_port_count".into(), serde_json::json!(0));
    mock.add_offer(Offer {
        id: proxy_only,
        machine_id: 77_001,
        host_id: 7_701,
        dph_total: 0.1,
        extra,
        ..Offer::default()
    })
    .unwrap();
    let search = |query: &str| -> Vec<u64> {
        let offers = cli.raw(&["search", "offers", query]);
        offers
            .as_array()
            .unwrap_or_else(|| panic!("{offers}"))
            .iter()
            .map(|o| o["id"].as_u64().unwrap())
            .collect()
    };
    assert!(search("gpu_name=RTX_4090").contains(&proxy_only));
    let direct = search("direct_port_count>=1");
    assert!(!direct.contains(&proxy_only), "{direct:?}");
    assert!(direct.contains(&3_100_001), "{direct:?}");

    // `--ssh` without `--direct`: the proxy runtype.
    let created = cli.raw(&[
        "create",
        "instance",
        &proxy_only.to_string(),
        "--image",
        "ubuntu:22.04",
        "--disk",
        "16",
        "--ssh",
    ]);
    let id = created["new_contract"].as_u64().unwrap();
    let ids = id.to_string();
    wait_status(&mock, &[id], "running");
    let shown = cli.raw(&["show", "instance", &ids]);
    assert_eq!(shown["image_runtype"], "ssh_proxy", "{shown}");
    assert_eq!(shown["direct_port_count"], 0, "{shown}");
    assert_eq!(shown["ssh_host"], "localhost", "{shown}");
    let port = shown["ssh_port"].as_u64().expect("a proxy port");
    assert_eq!(
        shown["ports"],
        serde_json::json!({}),
        "no direct port: {shown}"
    );
    assert!(shown["end_date"].as_f64().is_some(), "{shown}");
    assert_eq!(
        mock.instance(id).unwrap().proxy_port.map(u64::from),
        Some(port)
    );
    // The client's own choice of endpoint: the proxy, for want of a 22.
    let url = cli.run(false, &["ssh-url", &ids]);
    assert_eq!(url.trim(), format!("ssh://root@localhost:{port}"));
    if real_ssh {
        let (ok, out) = common::ssh_to(&key, "localhost", port as u16, "echo through-proxy");
        assert!(ok && out == "through-proxy\n", "{out}");
    }
    cli.run(false, &["destroy", "instance", &ids, "-y"]);
    assert_eq!(mock.live_instances(), 0);
}

#[test]
fn the_official_cli_with_an_instance_key_stops_starts_and_destroys_its_own_instance_only() {
    let Some(exe) = cli_or_skip() else {
        return;
    };
    let mock = mock_without_ssh(None);
    let account = Cli::new(exe.clone(), &mock);
    // `a` is destroyed with its key by `destroy instance`, `c` with its own
    // by `destroy instances`; `b` is the other instance neither may touch.
    let mut ids = Vec::new();
    for offer in ["3100001", "3100003", "3100004"] {
        let created = account.raw(&[
            "create",
            "instance",
            offer,
            "--image",
            "ubuntu:22.04",
            "--disk",
            "16",
            "--label",
            "mine",
        ]);
        ids.push(created["new_contract"].as_u64().unwrap());
    }
    let (a, b, c) = (ids[0], ids[1], ids[2]);
    wait_status(&mock, &ids, "running");
    let with_key_of = |id: u64| Cli {
        key: mock.instance_key(id).expect("a live instance's key"),
        ..Cli::new(exe.clone(), &mock)
    };
    let own = with_key_of(a);
    let (sa, sb) = (a.to_string(), b.to_string());

    // Refused: 1.9.1 prints `Failed with error 403: {msg}` on stderr (and
    // exits 0, as for every HTTP error), `--raw` a JSON error.
    let denied = format!(
        "Failed with error 403: Permission denied: this key may only start, stop or destroy instance {a}"
    );
    let refused: [&[&str]; 8] = [
        &["destroy", "instance", &sb, "-y"],
        &["stop", "instance", &sb],
        &["search", "offers"],
        &["show", "instances"],
        &["show", "instance", &sa],
        &["label", "instance", &sa, "renamed"],
        &["reboot", "instance", &sa],
        &[
            "create",
            "instance",
            "3100005",
            "--image",
            "ubuntu:22.04",
            "--disk",
            "16",
        ],
    ];
    for args in refused {
        let (_, out, err) = own.run_full(false, args);
        assert!(err.contains(&denied), "vastai {args:?}:\n{out}\n{err}");
        assert!(!out.contains("instance"), "vastai {args:?}:\n{out}");
    }
    let (_, _, err) = own.run_full(true, &["destroy", "instance", &sb, "-y"]);
    let error: Value = serde_json::from_str(err.trim())
        .unwrap_or_else(|e| panic!("not a JSON error ({e}): {err}"));
    assert_eq!(error["status_code"], 403, "{err}");
    // The bulk form listing another id is refused whole: 1.9.1 retries it
    // (printing the HTTP error and `retrying in …` on stdout), then gives up.
    let (_, out, _) = own.run_full(false, &["destroy", "instances", &sa, &sb, "-y"]);
    assert!(out.contains("403 Client Error: Forbidden"), "{out}");
    assert!(!out.contains("destroying instance"), "{out}");
    assert_eq!(live_ids(&mock), ids);
    for id in &ids {
        let v = mock.instance(*id).unwrap();
        assert_eq!(v.actual_status.as_deref(), Some("running"));
        assert_eq!(v.label.as_deref(), Some("mine"));
    }
    assert_eq!(mock.creates_total(), 3);
    assert!(mock.destroys().is_empty());

    // Its own instance: stop, start, destroy.
    let out = own.run(false, &["stop", "instance", &sa]);
    assert!(out.contains(&format!("stopping instance {a}.")), "{out}");
    assert_eq!(
        mock.instance(a).unwrap().actual_status.as_deref(),
        Some("stopped")
    );
    let out = own.run(false, &["start", "instance", &sa]);
    assert!(out.contains(&format!("starting instance {a}.")), "{out}");
    wait_status(&mock, &[a], "running");
    let out = own.run(false, &["destroy", "instance", &sa, "-y"]);
    assert!(out.contains(&format!("destroying instance {a}.")), "{out}");
    assert!(mock.instance(a).is_none());
    // Gone with it: the client's 401.
    let (_, _, err) = own.run_full(false, &["stop", "instance", &sa]);
    assert!(
        err.contains("Failed with error 401: Invalid user key"),
        "{err}"
    );

    // The bulk forms with its own id alone pass.
    let own_c = with_key_of(c);
    let sc = c.to_string();
    let out = own_c.run(false, &["stop", "instances", &sc]);
    assert!(out.contains(&format!("stopping instance [{c}].")), "{out}");
    let out = own_c.run(false, &["destroy", "instances", &sc, "-y"]);
    assert!(
        out.contains(&format!("destroying instance [{c}].")),
        "{out}"
    );

    account.run(false, &["destroy", "instance", &sb, "-y"]);
    assert_eq!(mock.live_instances(), 0);
    assert_eq!(
        mock.destroys(),
        [
            Destroy {
                instance: a,
                by: KeyUse::Instance(a)
            },
            Destroy {
                instance: c,
                by: KeyUse::Instance(c)
            },
            Destroy {
                instance: b,
                by: KeyUse::Account
            },
        ]
    );
}
