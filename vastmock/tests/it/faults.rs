//! Each fault knob shows its effect over real HTTP (Rust API and admin routes).

use crate::common;

use common::{Api, host_port};
use serde_json::{Value, json};
use std::net::TcpStream;
use std::time::{Duration, Instant};
use swactor_vastmock::{
    Ambiguity, Death, Endpoint, Gone, MockConfig, RateLimits, Selector, Timings, VastMock,
};

const OFFER: u64 = 3_100_001;

fn quick(real_ssh: bool) -> MockConfig {
    MockConfig {
        real_ssh,
        timings: Timings {
            provisioning: Duration::from_millis(50),
            loading: Duration::from_millis(150),
            restart: Duration::from_millis(50),
            destroyed_visible: Duration::ZERO,
        },
        ..MockConfig::fast()
    }
}

fn start(config: MockConfig) -> (VastMock, Api) {
    let mock = VastMock::start(config).unwrap();
    let api = Api::new(mock.url(), mock.api_key());
    (mock, api)
}

fn listed_ids(api: &Api, path: &str) -> Vec<u64> {
    api.get(path).json()["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_u64().unwrap())
        .collect()
}

#[test]
fn a_call_inside_the_rate_limit_interval_gets_429_without_retry_after_then_one_after_it_passes() {
    let (mock, api) = start(MockConfig {
        rate_limits: RateLimits {
            scale: 0.25, // create: 1125 ms, list: 250 ms
            ..RateLimits::default()
        },
        ..quick(false)
    });
    api.create(OFFER, "a");
    let t0 = Instant::now();
    let r = api.put(
        &format!("/api/v0/asks/{}/", OFFER + 1),
        json!({"image": "x", "disk": 10, "label": "b"}),
    );
    assert_eq!(r.status, 429, "{}", r.body);
    assert!(
        r.json()["msg"]
            .as_str()
            .unwrap()
            .starts_with("API requests too frequent")
    );
    assert!(
        !r.head.to_ascii_lowercase().contains("retry-after"),
        "{}",
        r.head
    );
    assert_eq!(mock.creates_total(), 1, "a refused create committed");
    // Another endpoint has its own window.
    assert_eq!(api.get("/api/v0/instances/").status, 200);
    std::thread::sleep(Duration::from_millis(1150).saturating_sub(t0.elapsed()));
    api.create(OFFER + 1, "b");
    assert_eq!(mock.creates_total(), 2);

    // Scale 0 turns the limits off.
    mock.set_rate_scale(0.0).unwrap();
    for _ in 0..5 {
        assert_eq!(api.get("/api/v0/instances/").status, 200);
    }
}

#[test]
fn a_rate_burst_refuses_the_next_calls_of_one_endpoint() {
    let (mock, api) = start(quick(false));
    mock.rate_burst(Endpoint::List, 2);
    assert_eq!(api.get("/api/v0/instances/").status, 429);
    assert_eq!(api.get("/api/v1/instances/").status, 429);
    assert_eq!(api.get("/api/v0/instances/").status, 200);
    // Through the admin route, for creates.
    let r = api.post(
        "/admin/faults/rate_burst",
        json!({"endpoint": "create", "count": 1}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let r = api.put(
        &format!("/api/v0/asks/{OFFER}/"),
        json!({"image": "x", "disk": 10}),
    );
    assert_eq!(r.status, 429);
    api.create(OFFER, "after-burst");

    // Plain-text 429s.
    let r = api.post("/admin/faults/rate_limit_text", json!({"text": true}));
    assert_eq!(r.status, 200, "{}", r.body);
    mock.rate_burst(Endpoint::Show, 1);
    let r = api.get("/api/v0/instances/1/");
    assert_eq!(r.status, 429);
    assert!(
        r.body.starts_with("API requests too frequent"),
        "{}",
        r.body
    );
    assert!(r.head.contains("content-type: text/plain"), "{}", r.head);
    mock.rate_limit_text(false);
}

#[test]
fn a_malformed_answer_is_a_200_cut_off_mid_json_for_the_next_calls_of_one_endpoint() {
    let (mock, api) = start(quick(false));
    let id = api.create(OFFER, "cut-1");
    let show = format!("/api/v0/instances/{id}/");
    mock.malformed(Endpoint::List, 2);
    for path in ["/api/v0/instances/", "/api/v1/instances/"] {
        let r = api.get(path);
        assert_eq!(r.status, 200);
        assert!(
            serde_json::from_str::<serde_json::Value>(&r.body).is_err(),
            "{path} answered whole JSON: {}",
            r.body
        );
        assert!(r.body.starts_with('{'), "{}", r.body);
    }
    let whole = api.get("/api/v0/instances/");
    assert_eq!(whole.json()["instances"].as_array().unwrap().len(), 1);

    // Through the admin route, for shows; an error answer is never cut.
    let r = api.post(
        "/admin/faults/malformed",
        json!({"endpoint": "show", "count": 1}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    mock.rate_burst(Endpoint::Show, 1);
    assert_eq!(api.get(&show).status, 429);
    let r = api.get(&show);
    assert_eq!(r.status, 200);
    assert!(serde_json::from_str::<serde_json::Value>(&r.body).is_err());
    assert_eq!(api.get(&show).status, 200);
    assert!(
        api.get(&show).json()["instances"].is_object(),
        "the knob was used up"
    );
}

#[test]
fn a_gone_offer_answers_404_or_410_or_makes_an_instance_that_never_runs() {
    let (mock, api) = start(quick(false));
    let body =
        |cancel: bool| json!({"image": "x", "disk": 10, "label": "gone", "cancel_unavail": cancel});
    mock.offer_gone(OFFER, Some(Gone::NotFound));
    let r = api.put(&format!("/api/v0/asks/{OFFER}/"), body(true));
    assert_eq!(r.status, 404);
    assert_eq!(
        r.json()["msg"],
        format!("error 404/3603: no_such_ask Instance type by id {OFFER} is not available.")
    );

    let r = api.post(
        "/admin/faults/offer_gone",
        json!({"offer_id": OFFER, "kind": "unavailable"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let r = api.put(&format!("/api/v0/asks/{OFFER}/"), body(true));
    assert_eq!(r.status, 410);
    assert_eq!(
        r.json(),
        json!({"success": false, "error": "no_such_ask",
               "msg": format!("error 410/3907: no_such_ask Instance type by id {OFFER} is no longer available."),
               "ask_id": OFFER})
    );
    assert_eq!(mock.creates_total(), 0);

    // Without cancel_unavail the create commits, but the instance never runs.
    let r = api.put(&format!("/api/v0/asks/{OFFER}/"), body(false));
    assert_eq!(r.status, 200);
    let id = r.json()["new_contract"].as_u64().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let row = api.show(id);
    assert_eq!(row["actual_status"], "exited", "{row}");
    assert_eq!(mock.creates_per_label()["gone"], 1);

    mock.offer_gone(OFFER + 1, Some(Gone::NotFound));
    mock.offer_gone(OFFER + 1, None);
    api.create(OFFER + 1, "cleared");
}

#[test]
fn slow_loading_takes_longer_and_stuck_loading_never_ends() {
    let (mock, api) = start(quick(false));
    mock.slow_loading(Selector::Label("slow".into()), Duration::from_millis(1200));
    mock.stuck_loading(Selector::Next(1));
    let stuck = api.create(OFFER, "stuck");
    let slow = api.create(OFFER + 1, "slow");
    let normal = api.create(OFFER + 2, "normal");
    api.wait_status(normal, Some("running"), Duration::from_secs(3));
    assert_eq!(api.show(slow)["actual_status"], "loading");
    api.wait_status(slow, Some("running"), Duration::from_secs(3));
    assert_eq!(api.show(stuck)["actual_status"], "loading");

    // Set on an existing booting instance through the admin route.
    let other = api.create(OFFER + 3, "late");
    let r = api.post(
        "/admin/faults/stuck_loading",
        json!({"target": {"id": other}}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(api.show(other)["actual_status"], "loading");
    assert_eq!(api.show(stuck)["actual_status"], "loading");
}

#[test]
fn a_boot_failure_ends_created_with_an_oci_error() {
    let (mock, api) = start(quick(false));
    mock.boot_failure(Selector::AllNew);
    let id = api.create(OFFER, "doomed");
    assert!(api.show(id)["actual_status"].is_null());
    let row = api.wait_status(id, Some("created"), Duration::from_secs(3));
    assert!(
        row["status_msg"]
            .as_str()
            .unwrap()
            .contains("OCI runtime create failed"),
        "{row}"
    );
    assert!(row["ports"].is_null());
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(api.show(id)["actual_status"], "created");
}

#[test]
fn killed_instances_exit_go_offline_or_vanish() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let (mock, api) = start(quick(true));
    let a = api.create(OFFER, "a");
    let b = api.create(OFFER + 1, "b");
    let c = api.create(OFFER + 2, "c");
    let row = api.wait_status(a, Some("running"), Duration::from_secs(5));
    let port = host_port(&row).unwrap();
    assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());

    assert_eq!(mock.kill(Selector::Id(a), Death::Exited), 1);
    let row = api.show(a);
    assert_eq!(row["actual_status"], "exited");
    assert_eq!(row["intended_status"], "running");
    assert!(row["ports"].is_null());
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "sshd outlived the death"
    );

    let r = api.post(
        "/admin/faults/kill",
        json!({"target": {"label": "b"}, "death": "offline"}),
    );
    assert_eq!(r.json()["killed"], 1);
    assert_eq!(api.show(b)["actual_status"], "offline");

    assert_eq!(mock.kill(Selector::Label("c".into()), Death::Vanished), 1);
    assert!(api.show(c).is_null());
    assert!(!listed_ids(&api, "/api/v0/instances/").contains(&c));
    assert_eq!(mock.live_instances(), 2);
    assert_eq!(mock.offer_rented(OFFER + 2), Some(false));
    assert_eq!(mock.kill(Selector::Id(c), Death::Exited), 0);
}

/// Interruptible rentals: an outbid instance is paused (stopped, though
/// still meant to run, its SSH gone) until its bid wins again; on-demand
/// instances are never outbid.
#[test]
fn an_outbid_instance_is_paused_until_its_bid_wins_again() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let (mock, api) = start(quick(true));
    let r = api.put(
        &format!("/api/v0/asks/{OFFER}/"),
        json!({"client_id": "me", "image": "ubuntu:22.04", "disk": 16.0, "label": "bid",
               "runtype": "ssh_direct", "env": {}, "price": 1.0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let bid = r.json()["new_contract"].as_u64().unwrap();
    let demand = api.create(OFFER + 1, "demand");
    let row = api.wait_status(bid, Some("running"), Duration::from_secs(5));
    let port = host_port(&row).unwrap();
    api.wait_status(demand, Some("running"), Duration::from_secs(5));

    assert_eq!(
        mock.outbid(Selector::Id(demand)),
        0,
        "on demand: never outbid"
    );
    assert_eq!(mock.outbid(Selector::Label("bid".into())), 1);
    let row = api.show(bid);
    assert_eq!(row["actual_status"], "stopped");
    assert_eq!(row["intended_status"], "running");
    assert!(
        row["status_msg"].as_str().unwrap().contains("outbid"),
        "{row}"
    );
    assert!(row["ports"].is_null());
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
    assert_eq!(mock.live_instances(), 2, "paused, not gone");

    assert_eq!(mock.bid_wins(Selector::Id(bid)), 1);
    api.wait_status(bid, Some("running"), Duration::from_secs(5));
    assert_eq!(mock.bid_wins(Selector::Id(bid)), 0, "not outbid any more");
}

#[test]
fn ssh_never_ready_runs_with_a_port_on_which_nothing_answers() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let (mock, api) = start(quick(true));
    mock.ssh_never_ready(Selector::Next(1));
    let mute = api.create(OFFER, "mute");
    let fine = api.create(OFFER + 1, "fine");
    let row = api.wait_status(mute, Some("running"), Duration::from_secs(5));
    let port = host_port(&row).expect("ports while running");
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
    let row = api.wait_status(fine, Some("running"), Duration::from_secs(5));
    assert!(TcpStream::connect(("127.0.0.1", host_port(&row).unwrap())).is_ok());
    // On a running instance: its sshd goes.
    mock.ssh_never_ready(Selector::Id(fine));
    assert!(TcpStream::connect(("127.0.0.1", host_port(&row).unwrap())).is_err());
    assert_eq!(api.show(fine)["actual_status"], "running");
}

#[test]
fn an_ambiguous_create_commits_exactly_once_and_is_counted() {
    let (mock, api) = start(quick(false));
    mock.ambiguous_create(
        Ambiguity::Timeout {
            hold: Duration::from_millis(1500),
        },
        1,
    );
    mock.ambiguous_create(Ambiguity::Drop, 1);
    mock.ambiguous_create(Ambiguity::BadGateway, 1);
    let create = |offer: u64, label: &str| {
        api.try_call(
            "PUT",
            &format!("/api/v0/asks/{offer}/"),
            Some(&json!({"image": "x", "disk": 10, "label": label})),
        )
    };
    let t0 = Instant::now();
    let r = create(OFFER, "timeout");
    assert!(r.is_err(), "a held create answered: {r:?}");
    assert!(
        t0.elapsed() >= Duration::from_millis(1500),
        "{:?}",
        t0.elapsed()
    );
    let t0 = Instant::now();
    assert!(create(OFFER + 1, "drop").is_err());
    assert!(
        t0.elapsed() < Duration::from_millis(1000),
        "{:?}",
        t0.elapsed()
    );
    let r = create(OFFER + 2, "502").unwrap();
    assert_eq!(r.status, 502);
    assert!(r.body.contains("502 Bad Gateway"));
    let r = create(OFFER + 3, "clean").unwrap();
    assert_eq!(r.status, 200);

    let per_label = mock.creates_per_label();
    for label in ["timeout", "drop", "502", "clean"] {
        assert_eq!(per_label[label], 1, "{label}: {per_label:?}");
    }
    assert_eq!(mock.creates_total(), 4);
    assert_eq!(mock.live_instances(), 4);
    // Each one is findable by label, as a careful provider would look.
    let page = api
        .get("/api/v1/instances/?select_filters=%7B%22label%22%3A%7B%22eq%22%3A%22drop%22%7D%7D")
        .json();
    assert_eq!(page["total_instances"], 1);
    // A retry of the same offer finds it rented.
    assert_eq!(create(OFFER, "timeout").unwrap().status, 404);
}

#[test]
fn a_new_instance_is_missing_from_listings_during_the_lag_but_shows_by_id() {
    let (mock, api) = start(quick(false));
    let early = api.create(OFFER, "early");
    mock.listing_lag(Duration::from_millis(600));
    let late = api.create(OFFER + 1, "late");
    let filter =
        "/api/v1/instances/?select_filters=%7B%22label%22%3A%7B%22eq%22%3A%22late%22%7D%7D";
    assert_eq!(listed_ids(&api, "/api/v0/instances/"), [early]);
    assert_eq!(listed_ids(&api, "/api/v1/instances/"), [early]);
    assert_eq!(listed_ids(&api, filter), Vec::<u64>::new());
    assert_eq!(api.show(late)["label"], "late");
    std::thread::sleep(Duration::from_millis(650));
    assert_eq!(listed_ids(&api, filter), [late]);
    assert_eq!(listed_ids(&api, "/api/v0/instances/"), [early, late]);
}

#[test]
fn a_flaky_destroy_fails_without_destroying_then_destroys() {
    let (mock, api) = start(quick(false));
    let id = api.create(OFFER, "x");
    mock.flaky_destroy(2, 503).unwrap();
    for _ in 0..2 {
        let r = api.delete(&format!("/api/v0/instances/{id}/"));
        assert_eq!(r.status, 503);
        assert!(!api.show(id).is_null());
    }
    assert_eq!(api.delete(&format!("/api/v0/instances/{id}/")).status, 200);
    assert!(api.show(id).is_null());
    assert!(mock.flaky_destroy(1, 404).is_err());
}

#[test]
fn random_5xx_follow_the_seed_and_change_nothing() {
    let statuses = |seed: u64| {
        let (mock, api) = start(quick(false));
        mock.random_5xx(0.3, seed).unwrap();
        let s: Vec<u16> = (0..60)
            .map(|_| api.get("/api/v0/instances/").status)
            .collect();
        // A failed create commits nothing.
        let mut made = 0;
        for i in 0..8 {
            let r = api.put(
                &format!("/api/v0/asks/{}/", OFFER + i),
                json!({"image": "x", "disk": 10}),
            );
            if r.status == 200 {
                made += 1;
            } else {
                assert!(matches!(r.status, 500 | 502 | 503), "{}", r.status);
            }
        }
        assert_eq!(mock.creates_total(), made);
        s
    };
    let a = statuses(42);
    assert_eq!(a, statuses(42));
    assert_ne!(a, statuses(43));
    let failed = a.iter().filter(|s| **s != 200).count();
    assert!((5..=35).contains(&failed), "{failed} of 60 failed");
}

#[test]
fn destroyed_instances_can_show_destroyed_for_a_while() {
    let (mock, api) = start(MockConfig {
        timings: Timings {
            destroyed_visible: Duration::from_millis(300),
            ..quick(false).timings
        },
        ..quick(false)
    });
    let id = api.create(OFFER, "x");
    assert_eq!(api.delete(&format!("/api/v0/instances/{id}/")).status, 200);
    assert_eq!(api.show(id)["actual_status"], "destroyed");
    assert_eq!(api.delete(&format!("/api/v0/instances/{id}/")).status, 404);
    assert_eq!(mock.live_instances(), 0);
    assert_eq!(mock.offer_rented(OFFER), Some(false));
    std::thread::sleep(Duration::from_millis(350));
    assert!(api.show(id).is_null());
}

#[test]
fn the_admin_routes_report_counters_and_state_and_take_offers_and_keys() {
    let (_mock, api) = start(quick(false));
    let r = api.post(
        "/admin/offers",
        json!({"id": 9_000_001, "gpu_name": "L40S", "num_gpus": 2, "dph_total": 1.5}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        api.post("/admin/offers", json!({"id": 9_000_001})).status,
        400
    );
    let found = api
        .post("/api/v0/bundles/", json!({"gpu_name": {"eq": "L40S"}}))
        .json();
    assert_eq!(found["offers"][0]["num_gpus"], 2);
    let r = api.post(
        "/admin/ssh_keys",
        json!({"ssh_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl x"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    api.create(9_000_001, "l40s");
    api.create(OFFER, "");
    let c = api.get("/admin/counters").json();
    assert_eq!(
        c,
        json!({"creates_total": 2, "creates_per_label": {"": 1, "l40s": 1}, "live_instances": 2})
    );
    let s = api.get("/admin/state").json();
    assert_eq!(s["instances"].as_array().unwrap().len(), 2);
    assert_eq!(s["offers"].as_array().unwrap().len(), 10);
    let rows: Vec<&Value> = s["instances"].as_array().unwrap().iter().collect();
    assert_eq!(rows[0]["gpu_name"], "L40S");
    let r = api.post("/admin/faults/random_5xx", json!({"probability": 2.0}));
    assert_eq!(r.status, 400);
    assert_eq!(api.post("/admin/faults/clear", json!({})).status, 200);
    assert_eq!(
        api.post("/admin/rate_scale", json!({"scale": 0.5})).status,
        200
    );
}

#[test]
fn the_listing_allows_a_burst_for_paging_unless_rate_limits_are_strict() {
    let limits = RateLimits {
        list_burst: 3,
        ..RateLimits::default()
    };
    let (_mock, api) = start(MockConfig {
        rate_limits: limits,
        ..quick(false)
    });
    for _ in 0..3 {
        assert_eq!(api.get("/api/v1/instances/").status, 200);
    }
    let r = api.get("/api/v0/instances/");
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(
        r.json(),
        json!({"success": false, "error": "rate_limited",
               "msg": "API requests too frequent: endpoint threshold=1.00s"})
    );
    // Other endpoints have no burst.
    assert_eq!(api.get("/api/v0/instances/1/").status, 200);
    assert_eq!(api.get("/api/v0/instances/1/").status, 429);

    // Strict (admin route): one listing per interval.
    let (mock, api) = start(MockConfig {
        rate_limits: limits,
        ..quick(false)
    });
    let r = api.post("/admin/faults/strict_rate_limits", json!({"strict": true}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(api.get("/api/v1/instances/").status, 200);
    assert_eq!(api.get("/api/v1/instances/").status, 429);
    // Cleared with the other knobs: the burst is back once the window passed.
    mock.clear_faults();
    std::thread::sleep(Duration::from_millis(1050));
    for _ in 0..3 {
        assert_eq!(api.get("/api/v1/instances/").status, 200);
    }
    assert_eq!(api.get("/api/v1/instances/").status, 429);
}
