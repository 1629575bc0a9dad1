//! Listings, shows, searches, errors and authentication over real HTTP.

use crate::common;

use common::Api;
use serde_json::{Value, json};
use std::time::Duration;
use swactor_vastmock::{MockConfig, Offer, Timings, VastMock};

/// No SSH and a long boot: these tests look at the API, not at machines.
fn config() -> MockConfig {
    MockConfig {
        real_ssh: false,
        timings: Timings {
            provisioning: Duration::from_secs(600),
            ..MockConfig::fast().timings
        },
        ..MockConfig::fast()
    }
}

fn many_offers(n: u64) -> Vec<Offer> {
    (0..n)
        .map(|i| Offer {
            id: 5_000_000 + i,
            machine_id: 70_000 + i,
            host_id: 800 + i % 5,
            dph_total: 0.1 + i as f64 / 100.0,
            ..Offer::default()
        })
        .collect()
}

fn ids(page: &Value) -> Vec<u64> {
    page["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_u64().unwrap())
        .collect()
}

fn v1(api: &Api, params: &[(&str, &str)]) -> Value {
    let query: Vec<String> = params
        .iter()
        .map(|(k, v)| format!("{k}={}", encode(v)))
        .collect();
    let r = api.get(&format!("/api/v1/instances/?{}", query.join("&")));
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

/// Percent-encodes like Python's `quote_plus`.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            b' ' => "+".to_owned(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[test]
fn v1_pages_through_more_than_25_instances_and_filters_by_label() {
    let mock = VastMock::start(MockConfig {
        offers: many_offers(32),
        ..config()
    })
    .unwrap();
    let api = Api::new(mock.url(), mock.api_key());
    let mut made = Vec::new();
    for i in 0..32u64 {
        let label = if i % 2 == 0 { "even" } else { "odd" };
        made.push(api.create(5_000_000 + i, label));
    }

    // All of them, 25 then 7, ordered by id.
    let p1 = v1(
        &api,
        &[
            ("limit", "25"),
            ("order_by", r#"[{"col":"id","dir":"asc"}]"#),
        ],
    );
    assert_eq!(p1["total_instances"], 32);
    assert_eq!(ids(&p1), made[..25].to_vec());
    let token = p1["next_token"].as_str().expect("a next token").to_owned();
    let p2 = v1(&api, &[("limit", "25"), ("after_token", &token)]);
    assert_eq!(ids(&p2), made[25..].to_vec());
    assert!(p2["next_token"].is_null(), "{}", p2["next_token"]);
    assert_eq!(p1["label_counts"], json!({"even": 16, "odd": 16}));

    // A limit above 25 is 25.
    assert_eq!(ids(&v1(&api, &[("limit", "100")])).len(), 25);

    // Label filter, descending, 10 a page.
    let filter = r#"{"label":{"eq":"odd"}}"#;
    let order = r#"[{"col":"id","dir":"desc"}]"#;
    let mut seen = Vec::new();
    let mut token: Option<String> = None;
    for _ in 0..5 {
        let mut params = vec![
            ("select_filters", filter),
            ("order_by", order),
            ("limit", "10"),
        ];
        if let Some(t) = &token {
            params.push(("after_token", t.as_str()));
        }
        let page = v1(&api, &params);
        assert_eq!(page["total_instances"], 16);
        seen.extend(ids(&page));
        match page["next_token"].as_str() {
            Some(t) => token = Some(t.to_owned()),
            None => break,
        }
    }
    let mut odd: Vec<u64> = made.iter().copied().skip(1).step_by(2).collect();
    odd.reverse();
    assert_eq!(seen, odd);

    // `in` with null selects unlabeled ones too, as the CLI's `--label ''` does.
    let page = v1(
        &api,
        &[("select_filters", r#"{"label":{"in":[null,"even"]}}"#)],
    );
    assert_eq!(page["total_instances"], 16);

    // Ordered by another column: offset tokens.
    let by_price = r#"[{"col":"dph_total","dir":"desc"}]"#;
    let p1 = v1(&api, &[("order_by", by_price), ("limit", "20")]);
    let t = p1["next_token"].as_str().unwrap().to_owned();
    let p2 = v1(
        &api,
        &[("order_by", by_price), ("limit", "20"), ("after_token", &t)],
    );
    let mut all = ids(&p1);
    all.extend(ids(&p2));
    let mut want = made.clone();
    want.reverse();
    assert_eq!(all, want);

    // select_cols narrows rows.
    let page = v1(&api, &[("select_cols", r#"["label"]"#), ("limit", "1")]);
    let row = page["instances"][0].as_object().unwrap();
    assert_eq!(row.keys().collect::<Vec<_>>(), ["id", "label"]);

    // v0 lists every instance.
    let v0 = api.get("/api/v0/instances/?owner=me").json();
    assert_eq!(ids(&v0), made);
}

#[test]
fn show_of_an_absent_instance_is_null_and_destroy_and_label_answer_404() {
    let mock = VastMock::start(config()).unwrap();
    let api = Api::new(mock.url(), mock.api_key());
    assert_eq!(
        api.get("/api/v0/instances/77/?owner=me").json(),
        json!({"instances": null})
    );
    let r = api.delete("/api/v0/instances/77/");
    assert_eq!(r.status, 404);
    assert_eq!(
        r.json(),
        json!({"success": false, "error": "not_found", "msg": "Instance not found"})
    );
    let r = api.put("/api/v0/instances/77/", json!({"label": "x"}));
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"], "no_such_instance");
    // Without the trailing slash too.
    assert_eq!(
        api.get("/api/v0/instances/77").json(),
        json!({"instances": null})
    );
    assert_eq!(
        api.get("/api/v0/instances").json(),
        json!({"instances": []})
    );
}

#[test]
fn create_refuses_rented_and_unknown_offers_and_bad_arguments() {
    let mock = VastMock::start(config()).unwrap();
    let api = Api::new(mock.url(), mock.api_key());
    let offer = 3_100_003;
    let body = |extra: Value| {
        let mut b = json!({"client_id": "me", "image": "ubuntu", "disk": 16.0, "label": "x"});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    api.create(offer, "first");
    for id in [offer, 999] {
        let r = api.put(&format!("/api/v0/asks/{id}/"), body(json!({})));
        assert_eq!(r.status, 404);
        assert_eq!(
            r.json(),
            json!({"success": false, "error": "invalid_args",
                   "msg": format!("error 404/3603: no_such_ask Instance type by id {id} is not available."),
                   "ask_id": id})
        );
    }
    let free = 3_100_004;
    for (extra, error) in [
        (json!({"disk": 4}), "invalid_args"),
        (json!({"image": null}), "invalid_args"),
        (json!({"label": "x".repeat(257)}), "invalid_args"),
        (json!({"env": 5}), "invalid_args"),
        (json!({"price": 0.0001}), "invalid_price"),
        (json!({"price": -1}), "invalid_price"),
    ] {
        let r = api.put(&format!("/api/v0/asks/{free}/"), body(extra.clone()));
        assert_eq!(r.status, 400, "{extra}: {}", r.body);
        assert_eq!(r.json()["error"], error, "{extra}");
        assert_eq!(r.json()["success"], false);
    }
    // A bid at the minimum and the client's env string are fine.
    let r = api.put(
        &format!("/api/v0/asks/{free}/"),
        body(json!({"price": 1.0, "env": "-e TZ=UTC -p 8080:8080"})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let id = r.json()["new_contract"].as_u64().unwrap();
    let row = api.show(id);
    assert_eq!(row["is_bid"], true);
    // The bid plus the storage of its disk (0.15 $ per GB and month).
    let storage = 0.15 * row["disk_space"].as_f64().unwrap() / 720.0;
    assert!(
        (row["dph_total"].as_f64().unwrap() - (1.0 + storage)).abs() < 1e-9,
        "{row}"
    );
    assert_eq!(
        row["extra_env"],
        json!([["TZ", "UTC"], ["-p 8080:8080", "1"]])
    );
    assert_eq!(mock.creates_total(), 2);
}

#[test]
fn a_wrong_or_missing_key_gets_401_and_the_legacy_query_key_works() {
    let mock = VastMock::start(config()).unwrap();
    let good = Api::new(mock.url(), mock.api_key());
    let mut bad = good.clone();
    bad.key = Some("nope".to_owned());
    let mut none = good.clone();
    none.key = None;
    for api in [&bad, &none] {
        for (method, path) in [
            ("GET", "/api/v0/instances/"),
            ("POST", "/api/v0/bundles/"),
            ("PUT", "/api/v0/asks/3100001/"),
            ("DELETE", "/api/v0/instances/1/"),
        ] {
            let r = api.call(method, path, Some(&json!({})));
            assert_eq!(r.status, 401, "{method} {path}");
            assert_eq!(r.json()["error"], "auth_error");
        }
    }
    let r = none.get(&format!("/api/v0/instances/?api_key={}", mock.api_key()));
    assert_eq!(r.status, 200);
    assert_eq!(mock.creates_total(), 0);
}

#[test]
fn search_filters_orders_and_limits_offers() {
    let mock = VastMock::start(config()).unwrap();
    let api = Api::new(mock.url(), mock.api_key());
    let search = |q: Value| {
        let r = api.post("/api/v0/bundles/", q);
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(
            r.head.contains("content-type: application/json"),
            "{}",
            r.head
        );
        r.json()["offers"].as_array().unwrap().clone()
    };
    let all = search(json!({}));
    assert_eq!(all.len(), 9);
    let scores: Vec<f64> = all.iter().map(|o| o["score"].as_f64().unwrap()).collect();
    assert!(
        scores.windows(2).all(|w| w[0] >= w[1]),
        "not by score desc: {scores:?}"
    );

    let q = json!({"verified": {"eq": true}, "rentable": {"eq": true}, "rented": {"eq": false},
                   "num_gpus": {"eq": 1}, "gpu_name": {"eq": "RTX_4090"}, "dph_total": {"lte": 0.5},
                   "order": [["dph_total", "asc"]], "type": "on-demand", "limit": 5});
    let found = search(q.clone());
    let ids: Vec<u64> = found.iter().map(|o| o["id"].as_u64().unwrap()).collect();
    assert_eq!(ids, [3_100_008, 3_100_001, 3_100_009]);

    // The CLI's forms: numbers as strings, in/notin lists.
    let found =
        search(json!({"num_gpus": {"gte": "2"}, "geolocation": {"notin": ["Finland, FI"]}}));
    assert_eq!(found.len(), 1);
    assert_eq!(found[0]["id"], 3_100_002);
    let found = search(
        json!({"gpu_name": {"in": ["RTX_3090", "RTX 3060"]}, "order": [["gpu_ram", "desc"]]}),
    );
    let names: Vec<&str> = found
        .iter()
        .map(|o| o["gpu_name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["RTX 3090", "RTX 3060"]);
    assert_eq!(search(json!({"limit": 3})).len(), 3);
    // Interruptible searches show the minimum bid as the price.
    let bids = search(json!({"type": "bid", "id": {"eq": 3_100_001}}));
    assert_eq!(bids[0]["dph_total"], 0.175);
    assert_eq!(
        api.post("/api/v0/bundles/", json!({"type": "lease"}))
            .status,
        400
    );

    // A rented offer leaves `rentable` searches.
    api.create(3_100_001, "x");
    assert_eq!(search(q).len(), 2);

    let r = api.post("/api/v0/bundles/", json!({"num_gpus": {"like": 1}}));
    assert_eq!(r.status, 400);
}

#[test]
fn racing_creates_rent_an_offer_once_and_it_is_rentable_again_after_the_destroy() {
    let mock = VastMock::start(config()).unwrap();
    let api = Api::new(mock.url(), mock.api_key());
    let offer = 3_100_005;
    let statuses: Vec<u16> = std::thread::scope(|s| {
        let racers: Vec<_> = (0..12)
            .map(|i| {
                let api = api.clone();
                s.spawn(move || {
                    api.put(
                        &format!("/api/v0/asks/{offer}/"),
                        json!({"image": "x", "disk": 10, "label": format!("racer-{i}")}),
                    )
                    .status
                })
            })
            .collect();
        racers.into_iter().map(|r| r.join().unwrap()).collect()
    });
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        1,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|s| **s == 404).count(),
        11,
        "{statuses:?}"
    );
    assert_eq!(mock.creates_total(), 1);
    let winner = mock.instances()[0].id;
    assert_eq!(
        api.delete(&format!("/api/v0/instances/{winner}/")).status,
        200
    );
    api.create(offer, "second-tenant");
    assert_eq!(mock.creates_total(), 2);
    assert_eq!(mock.live_instances(), 1);
}
