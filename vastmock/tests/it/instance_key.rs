//! An instance's own key (`CONTAINER_API_KEY`): it starts, stops and destroys its own instance, is refused everything else, and dies with it.

use crate::common;

use common::{Api, Resp};
use serde_json::{Value, json};
use std::path::Path;
use std::time::{Duration, Instant};
use swactor_vastmock::{Destroy, KeyUse, MockConfig, Timings, VastMock};

const OFFER: u64 = 3_100_001;

/// A mock without sshds (these tests look at the API and at `onstart`), fast boots.
fn start(destroyed_visible: Duration) -> (VastMock, Api) {
    let mock = VastMock::start(MockConfig {
        timings: Timings {
            provisioning: Duration::from_millis(50),
            loading: Duration::from_millis(100),
            restart: Duration::from_millis(100),
            destroyed_visible,
        },
        real_ssh: false,
        ..MockConfig::fast()
    })
    .unwrap();
    let api = Api::new(mock.url(), mock.api_key());
    (mock, api)
}

/// Asserts the 403 an instance's own key gets for a call it may not make.
#[track_caller]
fn assert_refused(r: &Resp, own: u64) {
    assert_eq!(r.status, 403, "{}", r.body);
    let body = r.json();
    assert_eq!(body["success"], false, "{body}");
    assert_eq!(body["error"], "permission_denied", "{body}");
    let msg = body["msg"].as_str().unwrap();
    assert!(
        msg.ends_with(&format!(
            "this key may only start, stop or destroy instance {own}"
        )),
        "{msg}"
    );
}

/// Asserts the 401 of a key the mock does not know.
#[track_caller]
fn assert_unknown_key(r: &Resp) {
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(
        r.json(),
        json!({"success": false, "error": "auth_error", "msg": "Invalid user key"})
    );
}

fn wait_until(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ok() {
        assert!(Instant::now() < deadline, "{what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn is_key(key: &str) -> bool {
    key.len() == 64
        && key
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[test]
fn every_create_single_or_bulk_gives_its_instance_a_random_key_of_its_own() {
    let (mock, api) = start(Duration::ZERO);
    let a = api.create(OFFER, "a");
    let r = api.post(
        "/api/v0/asks/bulk/",
        json!({"ids": [OFFER + 1, OFFER + 2], "image": "ubuntu:22.04", "disk": 16.0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let mut ids = vec![a];
    ids.extend(
        r.json()["new_contracts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|id| id.as_u64().unwrap()),
    );
    let keys: Vec<String> = ids
        .iter()
        .map(|id| mock.instance_key(*id).expect("a live instance has a key"))
        .collect();
    for key in &keys {
        assert!(is_key(key), "{key}");
        assert_ne!(key, mock.api_key());
    }
    assert_ne!(keys[0], keys[1]);
    assert_ne!(keys[1], keys[2]);
    assert_ne!(keys[0], keys[2]);
    assert_eq!(mock.instance_key(ids[2] + 1), None);
    // The key is the container's, not the listing's.
    let row = api.show(a).to_string();
    assert!(!row.contains(&keys[0]), "{row}");
}

#[test]
fn an_instance_key_stops_starts_and_destroys_its_own_instance_and_then_stops_working() {
    let (mock, api) = start(Duration::ZERO);
    let (a, b) = (api.create(OFFER, "a"), api.create(OFFER + 1, "b"));
    let own = Api::new(mock.url(), &mock.instance_key(a).unwrap());
    api.wait_status(a, Some("running"), Duration::from_secs(5));

    let r = own.put(
        &format!("/api/v0/instances/{a}/"),
        json!({"state": "stopped"}),
    );
    assert_eq!(r.json(), json!({"success": true}));
    assert_eq!(api.show(a)["actual_status"], "stopped");
    let r = own.put(
        &format!("/api/v0/instances/{a}/"),
        json!({"state": "running"}),
    );
    assert_eq!(r.json(), json!({"success": true}));
    api.wait_status(a, Some("running"), Duration::from_secs(5));
    // The bulk forms, listing its own id alone.
    let r = own.put(
        "/api/v0/instances/",
        json!({"ids": [a], "state": "stopped"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(api.show(a)["actual_status"], "stopped");
    let r = own.put(
        "/api/v0/instances/",
        json!({"ids": [a], "state": "running"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(api.show(a)["intended_status"], "running");
    // `?api_key=` works as the header does.
    let by_query = Api {
        key: None,
        ..own.clone()
    };
    assert_refused(
        &by_query.get(&format!(
            "/api/v0/instances/{a}/?api_key={}",
            own.key.as_deref().unwrap()
        )),
        a,
    );

    assert!(mock.destroys().is_empty());
    let r = own.delete(&format!("/api/v0/instances/{a}/"));
    assert_eq!(r.json(), json!({"success": true}));
    assert_eq!(
        mock.destroys(),
        [Destroy {
            instance: a,
            by: KeyUse::Instance(a)
        }]
    );
    assert!(mock.instance(a).is_none());
    assert_eq!(mock.offer_rented(OFFER), Some(false));
    assert_eq!(mock.instance_key(a), None);

    // Gone with its instance: any call with it is an unknown key's.
    assert_unknown_key(&own.delete(&format!("/api/v0/instances/{a}/")));
    assert_unknown_key(&own.put(
        &format!("/api/v0/instances/{a}/"),
        json!({"state": "running"}),
    ));
    assert_unknown_key(&own.get("/api/v0/instances/"));
    // The account's destroy is logged as the account's.
    let r = api.delete(&format!("/api/v0/instances/{b}/"));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        mock.destroys(),
        [
            Destroy {
                instance: a,
                by: KeyUse::Instance(a)
            },
            Destroy {
                instance: b,
                by: KeyUse::Account
            },
        ]
    );
    assert_eq!(mock.live_instances(), 0);
}

#[test]
fn an_instance_key_is_refused_403_for_anything_but_its_own_start_stop_and_destroy() {
    let (mock, api) = start(Duration::ZERO);
    let (a, b) = (api.create(OFFER, "a"), api.create(OFFER + 1, "b"));
    let own = Api::new(mock.url(), &mock.instance_key(a).unwrap());
    api.wait_status(a, Some("running"), Duration::from_secs(5));
    api.wait_status(b, Some("running"), Duration::from_secs(5));

    let refused: Vec<(&str, String, Option<Value>)> = vec![
        // Another instance.
        ("DELETE", format!("/api/v0/instances/{b}/"), Some(json!({}))),
        (
            "PUT",
            format!("/api/v0/instances/{b}/"),
            Some(json!({"state": "stopped"})),
        ),
        (
            "PUT",
            format!("/api/v0/instances/{b}/"),
            Some(json!({"state": "running"})),
        ),
        // Its own, but not a start, stop or destroy.
        (
            "PUT",
            format!("/api/v0/instances/{a}/"),
            Some(json!({"label": "mine"})),
        ),
        (
            "PUT",
            format!("/api/v0/instances/{a}/"),
            Some(json!({"state": "stopped", "label": "mine"})),
        ),
        ("GET", format!("/api/v0/instances/{a}/"), None),
        (
            "PUT",
            format!("/api/v0/instances/reboot/{a}/"),
            Some(json!({})),
        ),
        (
            "PUT",
            format!("/api/v0/instances/request_logs/{a}/"),
            Some(json!({"tail": 10})),
        ),
        (
            "PUT",
            format!("/api/v0/instances/command/{a}/"),
            Some(json!({"command": "ls"})),
        ),
        (
            "PUT",
            format!("/api/v0/instances/bid_price/{a}/"),
            Some(json!({"price": 1.0})),
        ),
        (
            "POST",
            format!("/api/v0/instances/{a}/ssh/"),
            Some(
                json!({"ssh_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"}),
            ),
        ),
        // The account's.
        ("POST", "/api/v0/bundles/".to_owned(), Some(json!({}))),
        (
            "PUT",
            format!("/api/v0/asks/{}/", OFFER + 2),
            Some(json!({"image": "ubuntu:22.04", "disk": 16.0})),
        ),
        (
            "POST",
            "/api/v0/asks/bulk/".to_owned(),
            Some(json!({"ids": [OFFER + 2], "image": "ubuntu:22.04", "disk": 16.0})),
        ),
        ("GET", "/api/v0/instances/".to_owned(), None),
        ("GET", "/api/v1/instances/".to_owned(), None),
        ("GET", "/api/v0/instances/filters/".to_owned(), None),
        ("GET", "/api/v0/ssh/".to_owned(), None),
        ("GET", "/api/v0/users/current/".to_owned(), None),
        // Bulk calls that list another id with its own are refused whole.
        (
            "DELETE",
            "/api/v0/instances/".to_owned(),
            Some(json!({"instance_ids": [a, b]})),
        ),
        (
            "PUT",
            "/api/v0/instances/".to_owned(),
            Some(json!({"ids": [a, b], "state": "stopped"})),
        ),
        (
            "PUT",
            "/api/v0/instances/".to_owned(),
            Some(json!({"ids": [a], "label": "mine"})),
        ),
    ];
    for (method, path, body) in &refused {
        let r = own.call(method, path, body.as_ref());
        assert_refused(&r, a);
    }
    // Nothing changed: both run with the labels they had, nothing created
    // nor destroyed.
    for (id, label) in [(a, "a"), (b, "b")] {
        let row = api.show(id);
        assert_eq!(row["actual_status"], "running", "{row}");
        assert_eq!(row["intended_status"], "running", "{row}");
        assert_eq!(row["label"], label, "{row}");
    }
    assert_eq!(mock.live_instances(), 2);
    assert_eq!(mock.creates_total(), 2);
    assert!(mock.destroys().is_empty());
    // Keys that are neither the account's nor an instance's keep their 401.
    let stranger = Api::new(mock.url(), &"0".repeat(64));
    assert_unknown_key(&stranger.delete(&format!("/api/v0/instances/{a}/")));
    let nobody = Api {
        key: None,
        ..stranger
    };
    assert_unknown_key(&nobody.get("/api/v0/instances/"));

    // Its bulk destroy of its own id alone passes, and is logged as its own.
    let r = own.call(
        "DELETE",
        "/api/v0/instances/",
        Some(&json!({"instance_ids": [a]})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["destroyed"], json!([a]));
    assert_eq!(
        mock.destroys(),
        [Destroy {
            instance: a,
            by: KeyUse::Instance(a)
        }]
    );
    assert_eq!(mock.live_instances(), 1);
}

#[test]
fn a_destroyed_instances_key_is_unknown_while_it_still_shows_as_destroyed() {
    let (mock, api) = start(Duration::from_secs(30));
    let a = api.create(OFFER, "a");
    let key = mock.instance_key(a).unwrap();
    let own = Api::new(mock.url(), &key);
    let r = api.call(
        "DELETE",
        "/api/v0/instances/",
        Some(&json!({"instance_ids": [a]})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(api.show(a)["actual_status"], "destroyed");
    assert_eq!(mock.instance_key(a), None);
    assert_unknown_key(&own.delete(&format!("/api/v0/instances/{a}/")));
    assert_eq!(
        mock.destroys(),
        [Destroy {
            instance: a,
            by: KeyUse::Account
        }]
    );
}

#[test]
fn onstart_sees_the_instance_id_and_its_key_at_every_start_over_a_same_named_env() {
    let (mock, api) = start(Duration::ZERO);
    let r = api.put(
        &format!("/api/v0/asks/{OFFER}/"),
        json!({"image": "ubuntu:22.04", "disk": 16.0, "label": "env",
               "onstart": "echo \"$CONTAINER_ID:$CONTAINER_API_KEY:$FOO\" > \"$HOME/own.txt\"",
               "env": {"CONTAINER_ID": "1", "CONTAINER_API_KEY": "spoofed", "FOO": "bar"}}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let id = r.json()["new_contract"].as_u64().unwrap();
    let key = mock.instance_key(id).unwrap();
    let file = mock.instance(id).unwrap().dir.join("home/own.txt");
    let want = format!("{id}:{key}:bar\n");
    let written = |file: &Path| {
        api.show(id);
        std::fs::read_to_string(file).unwrap_or_default()
    };
    wait_until("onstart wrote its file", Duration::from_secs(5), || {
        written(&file) == want
    });

    // A start after a stop runs it again, with the same values.
    std::fs::remove_file(&file).unwrap();
    for state in ["stopped", "running"] {
        let r = api.put(&format!("/api/v0/instances/{id}/"), json!({"state": state}));
        assert_eq!(r.status, 200, "{}", r.body);
    }
    wait_until("onstart wrote it again", Duration::from_secs(5), || {
        written(&file) == want
    });
    // And the key it read works as the key it is.
    let own = Api::new(mock.url(), want.split(':').nth(1).unwrap());
    assert_eq!(own.delete(&format!("/api/v0/instances/{id}/")).status, 200);
    assert_eq!(
        mock.destroys(),
        [Destroy {
            instance: id,
            by: KeyUse::Instance(id)
        }]
    );
}
