//! An instance's life over real HTTP, with a real sshd: create, boot, SSH login, stop, start, destroy; and the bulk calls.

use crate::common;

use common::{Api, host_port, keypair, proxy, ssh, ssh_to, sshds_under};
use serde_json::json;
use std::time::Duration;
use swactor_vastmock::{MockConfig, PROXY_HOST, Timings, VastMock};

const OFFER: u64 = 3_100_001;

fn config() -> MockConfig {
    MockConfig {
        timings: Timings {
            provisioning: Duration::from_millis(300),
            loading: Duration::from_millis(400),
            restart: Duration::from_millis(300),
            destroyed_visible: Duration::ZERO,
        },
        ..MockConfig::fast()
    }
}

#[test]
fn an_instance_boots_serves_ssh_to_registered_keys_stops_starts_and_is_destroyed() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let keys = tempfile::tempdir().unwrap();
    let (account_key, account_pub) = keypair(keys.path(), "account");
    let (onstart_key, onstart_pub) = keypair(keys.path(), "onstart");
    let (stranger_key, _) = keypair(keys.path(), "stranger");
    let mock = VastMock::start(config()).unwrap();
    let api = Api::new(mock.url(), mock.api_key());

    let r = api.post("/api/v0/ssh/", json!({"ssh_key": account_pub}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["key"]["public_key"], account_pub.as_str());
    let listed = api.get("/api/v0/ssh/").json();
    assert_eq!(listed.as_array().unwrap().len(), 1);

    let offer_row = |id: u64| {
        let offers = api
            .post("/api/v0/bundles/", json!({"id": {"eq": id}}))
            .json();
        offers["offers"][0].clone()
    };
    assert_eq!(offer_row(OFFER)["rented"], false);
    assert_eq!(offer_row(OFFER)["rentable"], true);

    let r = api.put(
        &format!("/api/v0/asks/{OFFER}/"),
        json!({"client_id": "me", "image": "ubuntu:22.04", "disk": 16.0, "label": "life",
               "onstart": format!("mkdir -p ~/.ssh && echo '{onstart_pub}' >> ~/.ssh/authorized_keys"),
               "runtype": "ssh_direct", "env": {"FOO": "bar"}, "cancel_unavail": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let id = r.json()["new_contract"].as_u64().unwrap();
    assert_eq!(r.json()["success"], true);

    // null → loading → running, with the offer rented meanwhile.
    let row = api.show(id);
    assert!(row["actual_status"].is_null(), "{row}");
    assert!(row["ports"].is_null());
    assert_eq!(row["label"], "life");
    assert_eq!(row["extra_env"], json!([["FOO", "bar"]]));
    assert_eq!(row["intended_status"], "running");
    assert_eq!(offer_row(OFFER)["rented"], true);
    assert_eq!(offer_row(OFFER)["rentable"], false);
    api.wait_status(id, Some("loading"), Duration::from_secs(5));
    let row = api.wait_status(id, Some("running"), Duration::from_secs(5));
    assert_eq!(row["public_ipaddr"], "127.0.0.1");
    let port = host_port(&row).expect("ports while running");
    assert_eq!(row["ports"]["22/tcp"][0]["HostIp"], "0.0.0.0");
    // The proxy is another endpoint of the same sshd.
    let (proxy_host, proxy_port) = proxy(&row).expect("a proxy while running");
    assert_eq!(proxy_host, PROXY_HOST);
    assert_ne!(proxy_port, port);
    assert_eq!(row["direct_port_count"], 64);

    // The account key and the onstart key log in; a stranger's does not.
    let (ok, out) = ssh(&account_key, port, "echo hello; pwd");
    assert!(ok, "account key login failed");
    let view = mock.instance(id).unwrap();
    assert!(out.starts_with("hello\n"), "{out}");
    assert_eq!(out.lines().nth(1).map(std::path::PathBuf::from), view.home);
    assert!(view.dir.starts_with(mock.state_dir()));
    let target = view.ssh_target().unwrap();
    assert_eq!(
        (target.user.as_str(), target.host.as_str(), target.port),
        ("root", "127.0.0.1", port)
    );
    assert!(
        ssh(&onstart_key, port, "true").0,
        "onstart key login failed"
    );
    let (ok, out) = ssh_to(&account_key, &proxy_host, proxy_port, "pwd");
    assert!(ok, "login through the proxy failed");
    assert_eq!(
        out.trim_end(),
        view.home.as_ref().unwrap().to_str().unwrap()
    );
    assert_eq!(view.proxy_port, Some(proxy_port));
    assert!(!ssh(&stranger_key, port, "true").0, "a stranger logged in");
    assert_eq!(sshds_under(&view.dir), 1);

    // Stop: the sshd goes, ports are null.
    let r = api.put(
        &format!("/api/v0/instances/{id}/"),
        json!({"state": "stopped"}),
    );
    assert_eq!(r.json(), json!({"success": true}));
    let row = api.show(id);
    assert_eq!(row["actual_status"], "stopped");
    assert_eq!(row["intended_status"], "stopped");
    assert!(row["ports"].is_null());
    assert!(
        !ssh(&account_key, port, "true").0,
        "stopped instance answered SSH"
    );
    assert!(
        !ssh_to(&account_key, &proxy_host, proxy_port, "true").0,
        "stopped instance answered SSH through the proxy"
    );
    assert_eq!(sshds_under(&view.dir), 0);

    // Start: loading again, then running on the same port.
    let r = api.put(
        &format!("/api/v0/instances/{id}/"),
        json!({"state": "running"}),
    );
    assert_eq!(r.json(), json!({"success": true}));
    assert_eq!(api.show(id)["actual_status"], "loading");
    let row = api.wait_status(id, Some("running"), Duration::from_secs(5));
    assert_eq!(host_port(&row), Some(port));
    assert_eq!(proxy(&row), Some((proxy_host.clone(), proxy_port)));
    assert!(
        ssh(&account_key, port, "true").0,
        "restarted instance refused SSH"
    );
    // A process left running by an SSH session ends with the machine.
    let (ok, out) = ssh(
        &account_key,
        port,
        "setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $!",
    );
    assert!(ok, "{out}");
    let sleeper: u32 = out.trim().parse().expect("a pid");
    assert!(std::path::Path::new(&format!("/proc/{sleeper}")).exists());

    // Label.
    let r = api.put(
        &format!("/api/v0/instances/{id}/"),
        json!({"label": "renamed"}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(api.show(id)["label"], "renamed");

    // Destroy: gone, its sshd and directory too; the offer is rentable again.
    let r = api.delete(&format!("/api/v0/instances/{id}/"));
    assert_eq!(r.json(), json!({"success": true}));
    assert!(api.show(id).is_null());
    assert!(!view.dir.exists());
    assert_eq!(sshds_under(&view.dir), 0);
    let stat = std::fs::read_to_string(format!("/proc/{sleeper}/stat")).unwrap_or_default();
    assert!(
        stat.is_empty() || stat.contains(") Z "),
        "a process the destroyed machine started still runs: {stat}"
    );
    assert_eq!(offer_row(OFFER)["rented"], false);
    assert_eq!(offer_row(OFFER)["rentable"], true);
    assert_eq!(mock.live_instances(), 0);
    assert_eq!(mock.creates_total(), 1);
}

#[test]
fn dropping_the_mock_stops_every_sshd_and_a_key_attached_later_logs_in() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let keys = tempfile::tempdir().unwrap();
    let (late_key, late_pub) = keypair(keys.path(), "late");
    let mock = VastMock::start(MockConfig {
        timings: Timings {
            provisioning: Duration::ZERO,
            loading: Duration::from_millis(100),
            ..config().timings
        },
        ..config()
    })
    .unwrap();
    let api = Api::new(mock.url(), mock.api_key());
    let a = api.create(OFFER, "a");
    let b = api.create(OFFER + 1, "b");
    let row = api.wait_status(a, Some("running"), Duration::from_secs(5));
    api.wait_status(b, Some("running"), Duration::from_secs(5));
    let port = host_port(&row).unwrap();
    assert!(!ssh(&late_key, port, "true").0);
    let r = api.post(
        &format!("/api/v0/instances/{a}/ssh/"),
        json!({"ssh_key": late_pub}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(ssh(&late_key, port, "true").0, "attached key refused");

    let machines = mock.state_dir().join("machines");
    assert_eq!(sshds_under(&machines), 2);
    drop(mock);
    assert_eq!(sshds_under(&machines), 0);
    assert!(
        !machines.exists(),
        "the temporary state directory outlived the mock"
    );
}

#[test]
fn bulk_calls_check_their_ids_and_partial_answers_say_what_was_done() {
    let mock = VastMock::start(MockConfig {
        real_ssh: false,
        ..MockConfig::fast()
    })
    .unwrap();
    let api = Api::new(mock.url(), mock.api_key());
    // One offer rentable, one unknown: the known one is rented.
    let r = api.post(
        "/api/v0/asks/bulk/",
        json!({"ids": [3_100_001, 9_999], "image": "ubuntu:22.04", "disk": 10}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["success"], false);
    let id = v["new_contracts"][0].as_u64().unwrap();
    assert_eq!(v["results"][1]["ask_id"], 9_999);
    assert_eq!(v["results"][1]["success"], false);
    assert_eq!(mock.creates_total(), 1);
    // None committed: the refusal as a single create gives it.
    let r = api.post(
        "/api/v0/asks/bulk/",
        json!({"ids": [3_100_002], "image": "Not An Image"}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"], "invalid_args");
    // Ids: a list of 1 to 64.
    for ids in [json!([]), json!("1"), json!((0..65).collect::<Vec<u64>>())] {
        let r = api.put(
            "/api/v0/instances/",
            json!({"ids": ids, "state": "stopped"}),
        );
        assert_eq!(r.status, 400, "{}", r.body);
    }
    // Stop the instance and a missing one: partly done.
    let r = api.put(
        "/api/v0/instances/",
        json!({"ids": [id, 1], "state": "stopped"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["updated"], json!([id]));
    assert_eq!(r.json()["failed"][0]["id"], 1);
    assert_eq!(
        mock.instance(id).unwrap().actual_status.as_deref(),
        Some("stopped")
    );
    // Destroy it and a missing one.
    let r = api.call(
        "DELETE",
        "/api/v0/instances/",
        Some(&json!({"instance_ids": [id, 1]})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["destroyed"], json!([id]));
    assert_eq!(r.json()["not_found"], json!([1]));
    assert_eq!(mock.live_instances(), 0);
    // An unknown result URL.
    let r = api.get("/results/0123456789abcdef");
    assert_eq!(r.status, 404);
    assert!(r.body.contains("NoSuchKey"), "{}", r.body);
}
