//! Renting as the service does it: `onstart` runs at every container start, SSH through a proxy (and directly only on machines with open ports), listings and contracts that end.

use crate::common;

use common::{Api, host_port, keypair, proxy, ssh, ssh_to};
use serde_json::{Value, json};
use std::path::Path;
use std::time::{Duration, Instant};
use swactor_vastmock::{MockConfig, Offer, PROXY_HOST, Selector, Timings, VastMock};

const OFFER: u64 = 3_100_001;
/// An offer added by the tests whose machine has no open port.
const PROXY_ONLY: u64 = 3_300_001;

fn config(real_ssh: bool) -> MockConfig {
    MockConfig {
        timings: Timings {
            provisioning: Duration::from_millis(50),
            loading: Duration::from_millis(100),
            restart: Duration::from_millis(100),
            destroyed_visible: Duration::ZERO,
        },
        real_ssh,
        ..MockConfig::fast()
    }
}

fn start(real_ssh: bool) -> (VastMock, Api) {
    let mock = VastMock::start(config(real_ssh)).unwrap();
    let api = Api::new(mock.url(), mock.api_key());
    (mock, api)
}

fn proxy_only_offer() -> Offer {
    let mut extra = serde_json::Map::new();
    extra.insert("direct_port_count".into(), json!(0));
    Offer {
        id: PROXY_ONLY,
        machine_id: 77_001,
        host_id: 7_701,
        extra,
        ..Offer::default()
    }
}

/// Creates an instance on `offer` with `onstart` and `env`; returns its id.
fn create_with(api: &Api, offer: u64, onstart: &str, env: Value) -> u64 {
    let r = api.put(
        &format!("/api/v0/asks/{offer}/"),
        json!({"client_id": "me", "image": "ubuntu:22.04", "disk": 16.0, "label": "onstart",
               "onstart": onstart, "runtype": "ssh_proxy", "env": env, "cancel_unavail": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["new_contract"].as_u64().unwrap()
}

/// The instance's log as `request_logs` gives it (fetched from its `result_url`).
fn logs(api: &Api, id: u64) -> String {
    let r = api.put(
        &format!("/api/v0/instances/request_logs/{id}/"),
        json!({"tail": 1000}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let url = r.json()["result_url"].as_str().unwrap().to_owned();
    let path = &url[url.find("/results/").unwrap()..];
    api.get(path).body
}

/// Waits for `ok`. The mock moves instances on only when asked, so a
/// condition on files alone must ask it too (see [`Api::show`]).
fn wait_until(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ok() {
        assert!(Instant::now() < deadline, "{what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// Whether process `pid` is gone (or a zombie nobody has reaped yet).
fn gone(pid: u32) -> bool {
    let stat = read(Path::new(&format!("/proc/{pid}/stat")));
    stat.is_empty() || stat.contains(") Z ")
}

#[test]
fn onstart_runs_at_every_container_start_in_the_home_with_the_env_and_logs_its_output() {
    let (mock, api) = start(false);
    let script = "echo \"start $FOO ${BAR:-unset} $(nvidia-smi -L | head -n 1)\" >> started.txt; \
                  echo \"home=$HOME\"; echo to-stderr >&2";
    let id = create_with(&api, OFFER, script, json!({"FOO": "from-dict", "BAR": 7}));
    // The CLI's flag string: `-e` pairs are exported, the port flag is not.
    let other = create_with(
        &api,
        OFFER + 1,
        "echo \"$FOO\" > env.txt; env > all-env.txt",
        json!("-e FOO=from-flags -p 8080:8080"),
    );
    let home = mock.instance(id).unwrap().dir.join("home");
    let started = home.join("started.txt");
    wait_until("onstart wrote its file", Duration::from_secs(5), || {
        api.show(id);
        read(&started).contains("start")
    });
    assert_eq!(
        read(&started),
        "start from-dict 7 GPU 0: NVIDIA RTX 4090 (UUID: GPU-00000000-mock-0000-0000-000000000000)\n"
    );
    let other_home = mock.instance(other).unwrap().dir.join("home");
    wait_until("the second onstart ran", Duration::from_secs(5), || {
        api.show(other);
        read(&other_home.join("env.txt")) == "from-flags\n"
    });
    assert!(!read(&other_home.join("all-env.txt")).contains("8080"));

    // Its output (stdout and stderr) is in the instance's log.
    wait_until("the output in the log", Duration::from_secs(5), || {
        logs(&api, id).contains("to-stderr")
    });
    let log = logs(&api, id);
    assert!(log.contains(&format!("home={}", home.display())), "{log}");
    assert!(
        log.contains("vastmock: onstart exited with status 0"),
        "{log}"
    );
    assert_eq!(
        mock.instance(id).unwrap().actual_status.as_deref(),
        Some("running")
    );

    // A reboot starts the container again, and onstart with it; so does a
    // start after a stop.
    let r = api.put(&format!("/api/v0/instances/reboot/{id}/"), json!({}));
    assert_eq!(r.status, 200, "{}", r.body);
    wait_until(
        "onstart ran after the reboot",
        Duration::from_secs(5),
        || {
            api.show(id);
            read(&started).lines().count() == 2
        },
    );
    api.put(
        &format!("/api/v0/instances/{id}/"),
        json!({"state": "stopped"}),
    );
    api.put(
        &format!("/api/v0/instances/{id}/"),
        json!({"state": "running"}),
    );
    wait_until(
        "onstart ran after the start",
        Duration::from_secs(5),
        || {
            api.show(id);
            read(&started).lines().count() == 3
        },
    );
}

#[test]
fn a_failing_onstart_exits_the_container_with_its_status() {
    let (mock, api) = start(false);
    let id = create_with(&api, OFFER, "echo about to fail; exit 3", json!({}));
    let row = api.wait_status(id, Some("exited"), Duration::from_secs(5));
    assert_eq!(row["intended_status"], "running", "{row}");
    assert_eq!(
        row["status_msg"], "Container exited: onstart exited with status 3",
        "{row}"
    );
    assert!(row["ports"].is_null(), "{row}");
    let log = logs(&api, id);
    assert!(log.contains("about to fail"), "{log}");
    assert!(
        log.contains("vastmock: container exited: onstart exited with status 3"),
        "{log}"
    );
    assert!(!mock.instance(id).unwrap().destroyed);

    // Started again, it runs onstart again (and fails again).
    let r = api.put(
        &format!("/api/v0/instances/{id}/"),
        json!({"state": "running"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    wait_until("a second failure", Duration::from_secs(5), || {
        logs(&api, id).matches("about to fail").count() == 2
            && api.show(id)["actual_status"] == "exited"
    });
}

#[test]
fn a_long_running_onstart_leaves_the_instance_running_and_ends_with_it() {
    let (mock, api) = start(false);
    let script = "sleep 1000 & echo $! > bg.pid; echo $$ > fg.pid; exec sleep 1001";
    let a = create_with(&api, OFFER, script, json!({}));
    let b = create_with(&api, OFFER + 1, script, json!({}));
    let pids = |id: u64| -> (u32, u32) {
        let home = mock.instance(id).unwrap().dir.join("home");
        let mut out = (0, 0);
        wait_until("the pid files", Duration::from_secs(5), || {
            api.show(id);
            let bg = read(&home.join("bg.pid")).trim().parse().unwrap_or(0);
            let fg = read(&home.join("fg.pid")).trim().parse().unwrap_or(0);
            out = (bg, fg);
            bg > 0 && fg > 0
        });
        out
    };
    let (a_bg, a_fg) = pids(a);
    let (b_bg, b_fg) = pids(b);
    std::thread::sleep(Duration::from_millis(200));
    for id in [a, b] {
        assert_eq!(api.show(id)["actual_status"], "running");
    }
    for pid in [a_bg, a_fg, b_bg, b_fg] {
        assert!(!gone(pid), "process {pid} ended early");
    }

    // A destroy ends a's processes; dropping the mock ends b's.
    let r = api.delete(&format!("/api/v0/instances/{a}/"));
    assert_eq!(r.status, 200, "{}", r.body);
    wait_until("a's processes ended", Duration::from_secs(2), || {
        gone(a_bg) && gone(a_fg)
    });
    assert!(!gone(b_bg) && !gone(b_fg));
    drop(mock);
    wait_until("b's processes ended", Duration::from_secs(2), || {
        gone(b_bg) && gone(b_fg)
    });
}

#[test]
fn keys_written_by_onstart_still_log_in() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let keys = tempfile::tempdir().unwrap();
    let (key, public) = keypair(keys.path(), "onstart");
    let (_mock, api) = start(true);
    let id = create_with(
        &api,
        OFFER,
        &format!("mkdir -p ~/.ssh && echo '{public}' >> ~/.ssh/authorized_keys"),
        json!({}),
    );
    let row = api.wait_status(id, Some("running"), Duration::from_secs(5));
    assert!(ssh(&key, host_port(&row).unwrap(), "true").0);
}

#[test]
fn every_instance_has_a_proxy_and_only_machines_with_open_ports_a_direct_endpoint() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let keys = tempfile::tempdir().unwrap();
    let (key, public) = keypair(keys.path(), "account");
    let (mock, api) = start(true);
    mock.add_ssh_key(&public).unwrap();
    mock.add_offer(proxy_only_offer()).unwrap();

    // A search for open ports leaves the proxy-only machine out.
    let found = |q: Value| -> Vec<u64> {
        let r = api.post("/api/v0/bundles/", q);
        r.json()["offers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o["id"].as_u64().unwrap())
            .collect()
    };
    let all = found(json!({}));
    assert!(all.contains(&PROXY_ONLY), "{all:?}");
    let direct = found(json!({"direct_port_count": {"gte": 1}}));
    assert!(
        !direct.contains(&PROXY_ONLY) && direct.contains(&OFFER),
        "{direct:?}"
    );

    let d = api.create(OFFER, "direct");
    let p = api.create(PROXY_ONLY, "proxy-only");
    let d_row = api.wait_status(d, Some("running"), Duration::from_secs(5));
    let p_row = api.wait_status(p, Some("running"), Duration::from_secs(5));

    // On a machine with open ports: two endpoints, both log in.
    let d_direct = host_port(&d_row).expect("a direct port");
    let (d_host, d_proxy) = proxy(&d_row).expect("a proxy");
    assert_eq!(d_host, PROXY_HOST);
    assert_ne!(d_proxy, d_direct);
    assert_eq!(d_row["direct_port_count"], 64);
    let (ok, direct_home) = ssh(&key, d_direct, "pwd");
    assert!(ok, "direct login failed");
    let (ok, proxied_home) = ssh_to(&key, &d_host, d_proxy, "pwd");
    assert!(ok, "login through the proxy failed");
    assert_eq!(direct_home, proxied_home);

    // Without open ports: no 22 in `ports`, but the proxy logs in.
    assert_eq!(p_row["ports"], json!({}), "{p_row}");
    assert_eq!(host_port(&p_row), None);
    assert_eq!(p_row["direct_port_count"], 0);
    assert_eq!(p_row["public_ipaddr"], "127.0.0.1");
    let (p_host, p_proxy) = proxy(&p_row).expect("a proxy");
    assert_eq!(p_host, PROXY_HOST);
    let view = mock.instance(p).unwrap();
    assert!(!view.direct);
    assert_eq!(view.proxy_port, Some(p_proxy));
    let target = view.proxy_target().unwrap();
    assert_eq!((target.host.as_str(), target.port), (PROXY_HOST, p_proxy));
    let (ok, out) = ssh_to(&key, &p_host, p_proxy, "echo via-proxy; nvidia-smi -L");
    assert!(ok, "login through the proxy failed");
    assert!(
        out.starts_with("via-proxy\nGPU 0: NVIDIA RTX 4090"),
        "{out}"
    );

    // Stopped: the proxy refuses logins, the port stays; started again, it
    // serves again on the same port.
    api.put(
        &format!("/api/v0/instances/{p}/"),
        json!({"state": "stopped"}),
    );
    assert!(!ssh_to(&key, &p_host, p_proxy, "true").0);
    assert!(api.show(p)["ports"].is_null());
    api.put(
        &format!("/api/v0/instances/{p}/"),
        json!({"state": "running"}),
    );
    let row = api.wait_status(p, Some("running"), Duration::from_secs(5));
    assert_eq!(proxy(&row), Some((p_host.clone(), p_proxy)));
    assert!(ssh_to(&key, &p_host, p_proxy, "true").0);

    // Destroyed: the proxy's port is closed.
    api.delete(&format!("/api/v0/instances/{p}/"));
    assert!(std::net::TcpStream::connect(("127.0.0.1", p_proxy)).is_err());
}

#[test]
fn an_offer_whose_listing_ends_is_no_longer_searched_nor_rented() {
    let (mock, api) = start(false);
    let search = |id: u64| -> Vec<Value> {
        api.post("/api/v0/bundles/", json!({"id": {"eq": id}}))
            .json()["offers"]
            .as_array()
            .unwrap()
            .clone()
    };
    // Listed with the seconds it has left: 30 days unless it says otherwise.
    let listed = search(OFFER);
    let left = listed[0]["duration"].as_f64().unwrap();
    assert!(left > 29.9 * 86_400.0 && left <= 30.0 * 86_400.0, "{left}");

    // An offer listed for half a second ends by itself.
    let mut extra = serde_json::Map::new();
    extra.insert("duration".into(), json!(0.5));
    mock.add_offer(Offer {
        id: 3_400_001,
        extra,
        ..Offer::default()
    })
    .unwrap();
    assert_eq!(search(3_400_001).len(), 1);
    // The knob ends another soon, and the admin route one at once.
    mock.expire_offer(OFFER, Duration::from_millis(300))
        .unwrap();
    assert!(mock.expire_offer(9_999, Duration::ZERO).is_err());
    let r = api.post(
        "/admin/faults/expire",
        json!({"offer_id": OFFER + 1, "in_ms": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(search(OFFER + 1).is_empty());
    let left = search(OFFER)[0]["duration"].as_f64().unwrap();
    assert!(left <= 0.3, "{left}");
    std::thread::sleep(Duration::from_millis(600));

    for offer in [OFFER, OFFER + 1, 3_400_001] {
        assert!(search(offer).is_empty(), "{offer} still listed");
        let r = api.put(
            &format!("/api/v0/asks/{offer}/"),
            json!({"image": "ubuntu:22.04", "disk": 16, "cancel_unavail": true}),
        );
        assert_eq!(r.status, 404, "{}", r.body);
        assert_eq!(
            r.json()["msg"],
            format!("error 404/3603: no_such_ask Instance type by id {offer} is not available.")
        );
        let row = mock
            .offers()
            .into_iter()
            .find(|o| o["id"] == offer)
            .unwrap();
        assert_eq!(row["rentable"], false);
        assert_eq!(row["duration"], 0.0);
    }
    assert_eq!(mock.creates_total(), 0);
    // Others are still rented.
    api.create(OFFER + 2, "still-listed");
}

#[test]
fn an_instance_whose_contract_ends_is_stopped_by_its_host_and_cannot_start_again() {
    let ssh_ok = swactor_providers::ssh::testing::sshd_available();
    let keys = tempfile::tempdir().unwrap();
    let (mock, api) = start(ssh_ok);
    let key = ssh_ok.then(|| {
        let (key, public) = keypair(keys.path(), "account");
        mock.add_ssh_key(&public).unwrap();
        key
    });
    let id = create_with(&api, OFFER, "sleep 1000 & echo $! > bg.pid", json!({}));
    let other = api.create(OFFER + 1, "expiring");
    let row = api.wait_status(id, Some("running"), Duration::from_secs(5));
    api.wait_status(other, Some("running"), Duration::from_secs(5));

    // The contract ends with the machine's listing: 30 days from now.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let end = row["end_date"].as_f64().expect("an end_date");
    assert!(
        (end - (now + 30.0 * 86_400.0)).abs() < 60.0,
        "{end} vs {now}"
    );

    let home = mock.instance(id).unwrap().dir.join("home");
    let mut bg = 0;
    wait_until("the pid file", Duration::from_secs(5), || {
        bg = read(&home.join("bg.pid")).trim().parse().unwrap_or(0);
        bg > 0
    });
    let (proxy_host, proxy_port) = proxy(&row).unwrap();
    if let Some(key) = &key {
        assert!(ssh_to(key, &proxy_host, proxy_port, "true").0);
    }

    // Its end comes soon: `end_date` says so, then the host stops it.
    assert_eq!(mock.expire(Selector::Id(id), Duration::from_millis(300)), 1);
    let end = api.show(id)["end_date"].as_f64().unwrap();
    assert!(end < now + 60.0, "{end}");
    assert_eq!(api.show(id)["actual_status"], "running");
    let row = api.wait_status(id, Some("stopped"), Duration::from_secs(5));
    assert_eq!(row["intended_status"], "running", "{row}");
    assert!(
        row["status_msg"]
            .as_str()
            .unwrap()
            .contains("contract reached its end date"),
        "{row}"
    );
    assert!(row["ports"].is_null(), "{row}");
    assert!(!mock.instance(id).unwrap().ssh_up);
    wait_until("its processes ended", Duration::from_secs(2), || gone(bg));
    if let Some(key) = &key {
        assert!(!ssh_to(key, &proxy_host, proxy_port, "true").0);
    }
    assert!(
        logs(&api, id).contains("vastmock: container stopped: the contract reached its end_date")
    );

    // It cannot start again; it can still be destroyed, freeing its offer.
    let r = api.put(
        &format!("/api/v0/instances/{id}/"),
        json!({"state": "running"}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"], "invalid_state");
    assert_eq!(api.show(id)["actual_status"], "stopped");
    api.delete(&format!("/api/v0/instances/{id}/"));
    assert_eq!(mock.offer_rented(OFFER), Some(false));

    // The admin route, by label.
    let r = api.post(
        "/admin/faults/expire",
        json!({"target": {"label": "expiring"}, "in_ms": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["expiring"], 1);
    assert_eq!(api.show(other)["actual_status"], "stopped");
    let r = api.post(
        "/admin/faults/expire",
        json!({"target": "all_new", "in_ms": 0}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
}
