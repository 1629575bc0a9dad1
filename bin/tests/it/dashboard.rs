//! The daemon's web surface with real process nodes: the dashboard in a real
//! headless chromium driven over the DevTools protocol, `/metrics` against
//! `status --json`, refused requests, and a load of pages and scrapes.
//!
//! Over 1,000 lines in one file: one subject's end-to-end tests, sharing its
//! helpers (the browser driver among them).

use crate::common;

use common::*;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn post(addr: SocketAddr, token: &str, path: &str, body: &str) -> (u16, String) {
    let origin = format!("http://{addr}");
    http(
        addr,
        "POST",
        path,
        &[
            ("Authorization", &bearer(token)),
            ("Origin", &origin),
            ("Content-Type", "application/json"),
        ],
        body.as_bytes(),
    )
}

/// The resident memory of a process, in KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// The workspace's `target/test-artifacts`.
fn artifacts() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let dir = target.join("test-artifacts");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const CHROMIUM: &str = "/usr/bin/chromium";

/// Whether the browser test can run; without chromium it is skipped with
/// one line, unless `SWACTOR_REQUIRE_CHROMIUM=1` (CI), where that fails.
fn chromium_present() -> bool {
    if Path::new(CHROMIUM).exists() {
        return true;
    }
    assert!(
        std::env::var("SWACTOR_REQUIRE_CHROMIUM").as_deref() != Ok("1"),
        "SWACTOR_REQUIRE_CHROMIUM=1 but there is no {CHROMIUM} (apt-get install chromium)"
    );
    eprintln!("dashboard browser test skipped: no {CHROMIUM} (apt-get install chromium)");
    false
}

mod browser {
    //! A headless chromium and the page's state, read by evaluating scripts.

    use super::*;
    use chromiumoxide::browser::{Browser, BrowserConfig};
    use chromiumoxide::page::{Page, ScreenshotParams};
    use futures_util::StreamExt;

    pub(crate) struct Chromium {
        pub(crate) browser: Browser,
        handler: tokio::task::JoinHandle<()>,
        _profile: tempfile::TempDir,
    }

    impl Chromium {
        pub(crate) async fn launch() -> Self {
            let profile = tempfile::tempdir().unwrap();
            let config = BrowserConfig::builder()
                .chrome_executable(CHROMIUM)
                // Root in a container has no user namespaces for the sandbox.
                .no_sandbox()
                .new_headless_mode()
                .user_data_dir(profile.path())
                .window_size(1280, 1000)
                .arg("--disable-gpu")
                .arg("--disable-dev-shm-usage")
                .launch_timeout(Duration::from_secs(60))
                .request_timeout(Duration::from_secs(30))
                .build()
                .expect("a browser configuration");
            let (browser, mut handler) = Browser::launch(config).await.expect("launch chromium");
            let handler = tokio::spawn(async move { while handler.next().await.is_some() {} });
            Self {
                browser,
                handler,
                _profile: profile,
            }
        }

        pub(crate) async fn close(mut self) {
            let _ = self.browser.close().await;
            let _ = self.browser.wait().await;
            self.handler.abort();
        }
    }

    /// Evaluates `js` in the page.
    pub(crate) async fn eval<T: serde::de::DeserializeOwned>(page: &Page, js: &str) -> T {
        page.evaluate(js)
            .await
            .unwrap_or_else(|e| panic!("evaluating {js}: {e}"))
            .into_value()
            .unwrap_or_else(|e| panic!("the value of {js}: {e}"))
    }

    /// Polls `js` (a boolean expression) every 50 ms until it is true.
    pub(crate) async fn until(page: &Page, timeout: Duration, what: &str, js: &str) {
        let start = Instant::now();
        loop {
            if eval::<bool>(page, js).await {
                return;
            }
            if start.elapsed() > timeout {
                let rows: String = eval(page, "document.querySelector('#nodes').innerText").await;
                let said: String = eval(page, "document.querySelector('#headline').innerText + ' | ' + document.querySelector('#message').innerText").await;
                panic!("the page did not show {what} within {timeout:?}: {said}\n{rows}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub(crate) async fn screenshot(page: &Page, path: &Path) {
        page.save_screenshot(ScreenshotParams::builder().full_page(true).build(), path)
            .await
            .expect("a screenshot");
    }
}

/// Rows of the node table that say ready, as a script.
fn ready_rows(n: usize) -> String {
    format!("document.querySelectorAll('#nodes tbody tr[data-ready=\"true\"]').length === {n}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_the_fleet_live_and_its_controls_steer_it() {
    if !chromium_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let shape = shape_file(dir.path(), "dash.toml", &workers("dash", 3));
    let mut daemon = Daemon::start(&state, &shape);
    wait_converged(&state, Duration::from_secs(60), |s| {
        s.nodes.iter().filter(|n| n.ready).count() == 3
    });
    let (addr, token) = web(&state);
    assert!(
        daemon
            .last_log()
            .contains(&format!("dashboard at http://{addr}/?token={token}")),
        "up prints the dashboard's URL: {}",
        daemon.last_log()
    );

    // Without the token: 401, with words saying where it is.
    let (code, body) = http(addr, "GET", "/", &[], b"");
    assert_eq!(code, 401, "{body}");
    assert!(body.contains("http.token"), "{body}");
    // A cross-origin POST is refused even with the page's cookie.
    let cookie = format!("swactor_token_{}={token}", addr.port());
    let (code, body) = http(
        addr,
        "POST",
        "/api/pause",
        &[("Cookie", &cookie), ("Origin", "http://evil.example")],
        b"{}",
    );
    assert_eq!(code, 403, "{body}");
    assert!(
        !status(&state).unwrap().paused,
        "the refused pause changed nothing"
    );

    let chromium = browser::Chromium::launch().await;
    // The browser without the token: 401, and the page says where it is.
    let page = chromium
        .browser
        .new_page(format!("http://{addr}/"))
        .await
        .expect("open the dashboard without a token");
    let code: u16 = browser::eval(
        &page,
        "performance.getEntriesByType('navigation')[0].responseStatus",
    )
    .await;
    assert_eq!(code, 401);
    let text: String = browser::eval(&page, "document.body.innerText").await;
    assert!(text.contains("access token"), "{text}");
    // A page of another origin (localhost is another site than 127.0.0.1)
    // posting to the daemon changes nothing.
    page.goto(format!("http://localhost:{}/healthz", addr.port()))
        .await
        .expect("another origin");
    let _: bool = browser::eval(
        &page,
        &format!(
            "fetch('http://{addr}/api/pause', {{method: 'POST', mode: 'no-cors', credentials: 'include', body: '{{}}'}}).then(() => true, () => true)"
        ),
    )
    .await;
    assert!(
        !status(&state).unwrap().paused,
        "the cross-origin pause changed nothing"
    );
    page.goto(format!("http://{addr}/?token={token}"))
        .await
        .expect("open the dashboard");
    // The token went into a cookie and out of the address.
    let url: String = browser::eval(&page, "location.href").await;
    assert_eq!(url, format!("http://{addr}/"));
    browser::until(&page, Duration::from_secs(20), "every node ready and a live stream", &format!(
        "{} && document.querySelector('#conn').textContent === 'live' && document.querySelector('#headline').textContent.startsWith('converged')",
        ready_rows(3)
    ))
    .await;
    browser::screenshot(&page, &artifacts().join("dashboard.png")).await;
    // A queued job is listed, with why it waits; cancelled, it reads so.
    let queued = std::process::Command::new(BIN)
        .arg("--state-dir")
        .arg(&state)
        .args(["run", "--nodes", "9", "--", "true"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    browser::until(
        &page,
        Duration::from_secs(10),
        "the queued job listed with its reason",
        "(() => { const r = document.querySelector('#jobs tr[data-job=\"job-1\"]'); \
         return !!r && r.dataset.state === 'queued' && r.innerText.includes('needs 9 node(s), 3 free') \
         && document.querySelector('#jobs-count').textContent.startsWith('1 queued'); })()",
    )
    .await;
    let o = cli(&state, &["job", "cancel", "job-1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let _ = queued.wait_with_output();
    browser::until(
        &page,
        Duration::from_secs(10),
        "the cancelled job listed as such",
        "document.querySelector('#jobs tr[data-job=\"job-1\"]')?.dataset.state === 'cancelled'",
    )
    .await;
    // Each node's lease: when it was last renewed, and how long the node
    // outlives its daemon (the default hour).
    browser::until(
        &page,
        Duration::from_secs(10),
        "every node's lease shown",
        "[...document.querySelectorAll('#nodes tbody tr')].filter((r) => /connected · lease renewed \\d+ s ago · ends itself 60 min after its daemon goes/.test(r.innerText)).length === 3",
    )
    .await;

    // kill -9 an agent: the page shows the node leave and come back with a
    // new attempt, without a reload.
    let _: bool = browser::eval(&page, "window.__noReload = true").await;
    let old: u64 = browser::eval(
        &page,
        "Number(document.querySelector('#node-worker-1').dataset.attempt)",
    )
    .await;
    let pids = agents(&state)
        .get(&("worker-1".to_owned(), old))
        .cloned()
        .expect("worker-1's agent");
    for pid in pids {
        kill9(pid);
    }
    browser::until(
        &page,
        Duration::from_secs(20),
        "worker-1 not ready",
        "document.querySelector('#node-worker-1').dataset.ready === 'false'",
    )
    .await;
    browser::until(
        &page,
        Duration::from_secs(60),
        "worker-1 replaced and ready",
        &format!(
            "Number(document.querySelector('#node-worker-1').dataset.attempt) > {old} && {}",
            ready_rows(3)
        ),
    )
    .await;
    let log: String = browser::eval(&page, "document.querySelector('#log').innerText").await;
    assert!(log.contains("worker-1"), "the event log tells of it: {log}");
    assert!(
        browser::eval::<bool>(&page, "window.__noReload === true").await,
        "the page was not reloaded"
    );

    // Scale from the page: the new nodes appear and become ready.
    let _: bool = browser::eval(
        &page,
        "document.querySelector('#count-worker').value = '5'; document.querySelector('[data-scale=\"worker\"]').click(); true",
    )
    .await;
    browser::until(
        &page,
        Duration::from_secs(60),
        "five ready workers",
        &format!(
            "{} && document.querySelector('#node-worker-4') !== null",
            ready_rows(5)
        ),
    )
    .await;
    let said: String = browser::eval(&page, "document.querySelector('#message').textContent").await;
    assert!(said.contains("worker scaled to 5"), "{said}");
    let s = status(&state).unwrap();
    assert_eq!(s.desired_nodes, 5);

    // Replace from the page.
    let before: u64 = browser::eval(
        &page,
        "Number(document.querySelector('#node-worker-0').dataset.attempt)",
    )
    .await;
    let _: bool = browser::eval(
        &page,
        "document.querySelector('[data-replace=\"worker-0\"]').click(); true",
    )
    .await;
    browser::until(
        &page,
        Duration::from_secs(60),
        "worker-0 replaced and ready",
        &format!(
            "Number(document.querySelector('#node-worker-0').dataset.attempt) > {before} && {}",
            ready_rows(5)
        ),
    )
    .await;

    // Pause and resume from the page, as `swactor pause` / `resume` would.
    let _: bool = browser::eval(&page, "document.querySelector('#pause').click(); true").await;
    wait_for(Duration::from_secs(10), "a pause", || {
        status(&state).is_some_and(|s| s.paused)
    });
    browser::until(
        &page,
        Duration::from_secs(10),
        "the pause",
        "document.querySelector('#headline').textContent.includes('paused')",
    )
    .await;
    let _: bool = browser::eval(&page, "document.querySelector('#resume').click(); true").await;
    wait_for(Duration::from_secs(10), "a resume", || {
        status(&state).is_some_and(|s| !s.paused)
    });

    // A scale-down destroys a node: the page asks first, as `apply` does.
    let _: bool = browser::eval(
        &page,
        "document.querySelector('#count-worker').value = '4'; document.querySelector('[data-scale=\"worker\"]').click(); true",
    )
    .await;
    browser::until(
        &page,
        Duration::from_secs(10),
        "the question",
        "document.querySelector('#confirm-dialog').open && document.querySelector('#confirm-text').textContent.includes('destroys 1 node')",
    )
    .await;
    assert_eq!(
        status(&state).unwrap().desired_nodes,
        5,
        "nothing changed before the answer"
    );
    let _: bool = browser::eval(&page, "document.querySelector('#confirm-go').click(); true").await;
    browser::until(
        &page,
        Duration::from_secs(60),
        "four workers, worker-4 gone",
        &format!(
            "{} && document.querySelector('#node-worker-4') === null",
            ready_rows(4)
        ),
    )
    .await;

    // The node view: its attempts and the end of its log.
    let _: bool = browser::eval(
        &page,
        "document.querySelector('a[data-node=\"worker-0\"]').click(); true",
    )
    .await;
    browser::until(
        &page,
        Duration::from_secs(10),
        "worker-0's detail",
        "document.querySelector('#detail').innerText.includes('replaced by the operator')",
    )
    .await;
    browser::screenshot(&page, &artifacts().join("dashboard-detail.png")).await;

    // Tear down, after the page's confirmation: every node goes, then the daemon.
    let _: bool = browser::eval(&page, "document.querySelector('#teardown').click(); true").await;
    browser::until(
        &page,
        Duration::from_secs(5),
        "the confirmation",
        "document.querySelector('#teardown-dialog').open",
    )
    .await;
    let _: bool = browser::eval(
        &page,
        "document.querySelector('#teardown-confirm').click(); true",
    )
    .await;
    assert_eq!(
        daemon.wait_exit(Duration::from_secs(60)),
        Some(0),
        "{}",
        daemon.last_log()
    );
    assert!(agents(&state).is_empty(), "no agent left");
    chromium.close().await;
}

/// A metric's value in a parsed exposition (the first sample of that name
/// whose labels include `labels`).
fn metric(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    scrape
        .samples
        .iter()
        .find(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => f64::NAN,
        })
}

fn parse_metrics(text: &str) -> prometheus_parse::Scrape {
    let lines = text.lines().map(|l| Ok(l.to_owned()));
    prometheus_parse::Scrape::parse(lines).expect("a Prometheus text exposition")
}

#[test]
fn metrics_match_status_and_bad_requests_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let shape = shape_file(dir.path(), "m.toml", &workers("metrics", 2));
    // A small telemetry file, so this test sees it rotate.
    let env = [
        ("SWACTOR_TELEMETRY_FILE_BYTES_MAX", "8192"),
        ("SWACTOR_TELEMETRY_FILES_KEPT", "2"),
    ];
    let mut daemon = Daemon::spawn_env(&state, Some(&shape), &[], &env).expect("a daemon");
    wait_converged(&state, Duration::from_secs(60), |s| {
        s.nodes.iter().filter(|n| n.ready).count() == 2
    });
    let (addr, token) = web(&state);

    // Scrape between two statuses that agree, so nothing moved meanwhile.
    let (text, s) = (0..20)
        .find_map(|_| {
            let before = status(&state)?;
            let (code, text) = get(addr, &token, "/metrics");
            assert_eq!(code, 200, "{text}");
            let after = status(&state)?;
            // When each lease was last renewed moves on by itself.
            let still = |s: &swactor_actors::ClusterSnapshot| {
                let mut nodes = s.nodes.clone();
                for n in &mut nodes {
                    n.lease_renewed_ms_ago = None;
                }
                nodes
            };
            (before.stats == after.stats && still(&before) == still(&after))
                .then_some((text, after))
        })
        .expect("a quiet moment to scrape in");
    let m = parse_metrics(&text);
    let ready = s.nodes.iter().filter(|n| n.ready).count() as f64;
    assert_eq!(
        metric(&m, "swactor_generation", &[]),
        Some(s.generation.0 as f64)
    );
    assert_eq!(
        metric(&m, "swactor_desired_nodes", &[]),
        Some(s.desired_nodes as f64)
    );
    assert_eq!(metric(&m, "swactor_ready_nodes", &[]), Some(ready));
    assert_eq!(
        metric(&m, "swactor_group_ready_nodes", &[("group", "worker")]),
        Some(ready)
    );
    assert_eq!(
        metric(&m, "swactor_group_desired_nodes", &[("group", "worker")]),
        Some(2.0)
    );
    assert_eq!(
        metric(&m, "swactor_converged", &[]),
        Some(f64::from(u8::from(s.converged)))
    );
    assert_eq!(
        metric(&m, "swactor_passes_total", &[]),
        Some(s.stats.passes as f64)
    );
    assert_eq!(
        metric(&m, "swactor_dispatched_operations_total", &[]),
        Some(s.stats.dispatched as f64)
    );
    assert_eq!(
        metric(&m, "swactor_executor_queue_depth", &[]),
        Some(s.in_flight as f64)
    );
    // Both endpoints' handshakes are exported; none is under way at rest.
    for endpoint in ["swarm", "control"] {
        assert_eq!(
            metric(
                &m,
                "swactor_handshakes_under_way",
                &[("endpoint", endpoint)]
            ),
            Some(0.0),
            "{endpoint}"
        );
    }
    let by_stage: f64 = m
        .samples
        .iter()
        .filter(|x| x.metric == "swactor_nodes")
        .map(|x| match x.value {
            prometheus_parse::Value::Gauge(v) => v,
            _ => 0.0,
        })
        .sum();
    assert_eq!(
        by_stage,
        s.nodes.len() as f64,
        "nodes by stage add up to the nodes"
    );
    // Every create went through the metered provider, and was dispatched.
    assert_eq!(
        metric(
            &m,
            "swactor_dispatches_total",
            &[("effect", "create_lease")]
        ),
        Some(2.0)
    );
    assert!(
        text.contains("swactor_provider_call_duration_seconds_count{provider=\"process\",call=\"create_lease\"} 2"),
        "{text}"
    );
    assert!(
        metric(
            &m,
            "swactor_last_convergence_seconds",
            &[("generation", "1")]
        )
        .is_some_and(|v| v > 0.0)
    );

    // Refused requests: each answered 4xx with words, nothing changed.
    let wrong = "0".repeat(token.len());
    let big = format!(
        "{{\"group\": \"worker\", \"count\": 3, \"pad\": \"{}\"}}",
        "x".repeat(20_000)
    );
    let origin = format!("http://{addr}");
    let refused: Vec<(u16, (u16, String))> = vec![
        (401, http(addr, "GET", "/metrics", &[], b"")),
        (401, get(addr, &wrong, "/metrics")),
        (
            401,
            http(addr, "GET", &format!("/api/status?token={wrong}"), &[], b""),
        ),
        (
            401,
            http(
                addr,
                "POST",
                "/api/pause",
                &[("Authorization", &bearer(&wrong)), ("Origin", &origin)],
                b"{}",
            ),
        ),
        (413, post(addr, &token, "/api/scale", &big)),
        (
            400,
            post(addr, &token, "/api/scale", "{\"group\": \"worker\", "),
        ),
        (
            400,
            post(addr, &token, "/api/scale", "{\"group\": \"worker\"}"),
        ),
        (
            400,
            post(
                addr,
                &token,
                "/api/scale",
                "{\"group\": \"worker\", \"count\": -1}",
            ),
        ),
        (
            400,
            post(
                addr,
                &token,
                "/api/scale",
                "{\"group\": \"worker\", \"count\": 1.5}",
            ),
        ),
        (
            400,
            post(
                addr,
                &token,
                "/api/scale",
                "{\"group\": \"worker\", \"count\": 100000}",
            ),
        ),
        (
            400,
            post(
                addr,
                &token,
                "/api/scale",
                "{\"group\": \"worker\", \"count\": 99999999999}",
            ),
        ),
        (
            404,
            post(
                addr,
                &token,
                "/api/scale",
                "{\"group\": \"nope\", \"count\": 1}",
            ),
        ),
        // A scale-down destroys nodes: like `apply`, it needs a yes.
        (
            409,
            post(
                addr,
                &token,
                "/api/scale",
                "{\"group\": \"worker\", \"count\": 1}",
            ),
        ),
        (
            404,
            post(addr, &token, "/api/replace", "{\"node\": \"worker-9\"}"),
        ),
        (
            400,
            post(addr, &token, "/api/replace", "{\"node\": \"not a node\"}"),
        ),
        (404, get(addr, &token, "/api/node/worker-9")),
        (400, post(addr, &token, "/api/teardown", "{}")),
        (
            403,
            http(
                addr,
                "POST",
                "/api/pause",
                &[
                    ("Authorization", &bearer(&token)),
                    ("Origin", "http://evil.example"),
                ],
                b"{}",
            ),
        ),
        (
            403,
            http(
                addr,
                "POST",
                "/api/pause",
                &[("Cookie", &format!("swactor_token_{}={token}", addr.port()))],
                b"{}",
            ),
        ),
        (
            403,
            http(
                addr,
                "GET",
                "/metrics",
                &[("Authorization", &bearer(&token)), ("Host", "evil.example")],
                b"",
            ),
        ),
    ];
    for (i, (want, (code, body))) in refused.iter().enumerate() {
        assert_eq!(code, want, "request {i}: {body}");
        if *code != 401 || !body.is_empty() {
            let v: serde_json::Value =
                serde_json::from_str(body).unwrap_or_else(|e| panic!("request {i}: {e}: {body}"));
            assert!(
                v["error"].as_str().is_some_and(|e| e.len() > 10),
                "request {i}: {body}"
            );
        }
    }
    assert_eq!(http(addr, "GET", "/healthz", &[], b"").0, 200);
    assert!(daemon.running(), "the daemon is alive");
    let after = status(&state).unwrap();
    assert_eq!(after.generation, s.generation, "no new generation");
    assert!(!after.paused);
    assert_eq!(
        after
            .nodes
            .iter()
            .map(|n| (n.node.to_string(), n.attempt))
            .collect::<Vec<_>>(),
        s.nodes
            .iter()
            .map(|n| (n.node.to_string(), n.attempt))
            .collect::<Vec<_>>(),
        "no node was touched"
    );

    // And the same controls, asked for properly, do what the CLI's do.
    let (code, body) = post(addr, &token, "/api/pause", "{}");
    assert_eq!(code, 200, "{body}");
    assert!(status(&state).unwrap().paused);
    let (code, body) = post(addr, &token, "/api/resume", "");
    assert_eq!(code, 200, "{body}");
    let o = cli(&state, &["replace", "worker-1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("replaced by the operator"),
        "{}",
        stdout(&o)
    );
    wait_converged(&state, Duration::from_secs(60), |s| {
        s.nodes.iter().filter(|n| n.ready).count() == 2
            && s.nodes[1].attempt > after.nodes[1].attempt
    });
    let (_, text) = get(addr, &token, "/metrics");
    let m = parse_metrics(&text);
    assert_eq!(
        metric(&m, "swactor_replacements_total", &[("reason", "operator")]),
        Some(1.0),
        "{text}"
    );
    // The daemon's own time to answer: the one replace and the statuses.
    let answered = |request: &str| {
        let head =
            format!("swactor_control_request_duration_seconds_count{{request=\"{request}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(head.as_str()))
            .and_then(|n| n.trim().parse::<f64>().ok())
    };
    assert_eq!(answered("replace"), Some(1.0), "{text}");
    assert!(answered("status").is_some_and(|n| n >= 1.0), "{text}");
    let o = cli(&state, &["replace", "worker-7"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("has no node worker-7"),
        "{}",
        stderr(&o)
    );

    // Teardown from the web surface: every node goes, then the daemon.
    let (code, body) = post(addr, &token, "/api/teardown", "{\"confirm\": true}");
    assert_eq!(code, 202, "{body}");
    assert_eq!(
        daemon.wait_exit(Duration::from_secs(60)),
        Some(0),
        "{}",
        daemon.last_log()
    );
    assert!(agents(&state).is_empty(), "no agent left");

    // telemetry.ndjson rotated at 8 KiB, keeping two old files; every
    // record is stamped, and the sequence runs on across the files.
    let files = [
        state.join("telemetry.ndjson.2"),
        state.join("telemetry.ndjson.1"),
        state.join("telemetry.ndjson"),
    ];
    assert!(
        !state.join("telemetry.ndjson.3").exists(),
        "only two old files are kept"
    );
    let mut last = None;
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        assert!(
            text.len() <= 8192,
            "{} has {} bytes",
            f.display(),
            text.len()
        );
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            assert!(
                v["at_ms"].as_u64().is_some_and(|t| t > 1_600_000_000_000),
                "{line}"
            );
            let seq = v["seq"].as_u64().unwrap();
            assert!(last.is_none_or(|l| seq == l + 1), "{seq} after {last:?}");
            last = Some(seq);
        }
    }
}

#[test]
fn a_hundred_streams_and_a_thousand_scrapes_do_not_stop_a_hundred_nodes_converging() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let shape = shape_file(
        dir.path(),
        "load.toml",
        &workers("load", 100).replace("lost_grace_s = 1.0\n", ""),
    );
    let started = Instant::now();
    let daemon = Daemon::start(&state, &shape);
    let pid = daemon.pid().unwrap();
    let (addr, token) = web(&state);
    let rss_before = rss_kib(pid);

    // 100 pages' event streams, each read by a thread until the end.
    let streams: Vec<_> = (0..100)
        .map(|_| {
            let mut s = TcpStream::connect(addr).unwrap();
            let req = format!(
                "GET /events HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\r\n"
            );
            s.write_all(req.as_bytes()).unwrap();
            let reader = s.try_clone().unwrap();
            let thread = std::thread::spawn(move || {
                let mut reader = reader;
                let mut buf = [0u8; 16 * 1024];
                let mut total = 0usize;
                while let Ok(n) = reader.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    total += n;
                }
                total
            });
            (s, thread)
        })
        .collect();
    // 1,000 scrapes from four threads while the nodes converge.
    let scrapers: Vec<_> = (0..4)
        .map(|_| {
            let token = token.clone();
            std::thread::spawn(move || {
                for _ in 0..250 {
                    let (code, text) = get(addr, &token, "/metrics");
                    assert_eq!(code, 200, "{text}");
                }
            })
        })
        .collect();
    let scrape_start = Instant::now();
    for s in scrapers {
        s.join().unwrap();
    }
    let scrape_took = scrape_start.elapsed();
    let s = wait_converged(&state, Duration::from_secs(120), |s| {
        s.nodes.iter().filter(|n| n.ready).count() == 100
    });
    let converged_after = started.elapsed();
    let (_, text) = get(addr, &token, "/metrics");
    let m = parse_metrics(&text);
    assert_eq!(metric(&m, "swactor_ready_nodes", &[]), Some(100.0));
    assert!(
        metric(&m, "swactor_telemetry_subscribers", &[]).is_some_and(|v| v >= 100.0),
        "every stream is a subscriber: {text}"
    );
    let rss_after = rss_kib(pid);
    for (s, _) in &streams {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
    let read: Vec<usize> = streams
        .into_iter()
        .map(|(_, t)| t.join().unwrap())
        .collect();
    assert!(
        read.iter().all(|n| *n > 1000),
        "every stream got the snapshot and events: {read:?}"
    );
    eprintln!(
        "load: 100 nodes converged in {:.1} s (generation {}) with 100 event streams open; \
         1,000 scrapes took {:.1} s; daemon RSS {} MiB before, {} MiB after; streams read {}..{} KiB",
        converged_after.as_secs_f64(),
        s.generation.0,
        scrape_took.as_secs_f64(),
        rss_before / 1024,
        rss_after / 1024,
        read.iter().min().unwrap() / 1024,
        read.iter().max().unwrap() / 1024,
    );
    // Generous: the point is that 100 streams and 1,000 scrapes hold no
    // unbounded memory, not a tight budget.
    assert!(
        rss_after < rss_before + 256 * 1024,
        "RSS grew from {rss_before} KiB to {rss_after} KiB"
    );
    drop(daemon);
}
#[test]
fn an_http_address_that_cannot_be_used_is_refused_in_one_line_and_no_raw_error() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let shape = shape_file(dir.path(), "h.toml", &workers("http", 1));
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = holder.local_addr().unwrap().to_string();
    // Taken; not this machine's (TEST-NET-1); and a start refused later,
    // once the daemon's endpoint is bound (a setting the vast provider reads).
    // `up`'s arguments and environment, and how its one line begins.
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], String);
    let cases: [Case; 3] = [
        (
            &["--http", &taken],
            &[],
            format!("swactor: cannot listen on {taken} for the web surface (--http): "),
        ),
        (
            &["--http", "192.0.2.1:1"],
            &[],
            "swactor: cannot listen on 192.0.2.1:1 for the web surface (--http): ".to_owned(),
        ),
        (
            &[],
            &[
                ("VAST_API_KEY", "k"),
                ("SWACTOR_VAST_LISTING_LAG_S", "soon"),
            ],
            "swactor: SWACTOR_VAST_LISTING_LAG_S=\"soon\" is not a number of seconds".to_owned(),
        ),
    ];
    for (args, env, refusal) in cases {
        let exited = Daemon::spawn_env(&state, Some(&shape), args, env)
            .err()
            .unwrap_or_else(|| panic!("{args:?} {env:?} was not refused"));
        assert_eq!(exited.code, Some(1), "{}", exited.log);
        let said: Vec<&str> = exited
            .log
            .lines()
            .filter(|l| !l.starts_with("=== ") && !l.starts_with("swactor: plan: "))
            .collect();
        assert_eq!(said.len(), 1, "one line: {said:#?}");
        assert!(said[0].starts_with(&refusal), "{said:#?}");
        assert!(agents(&state).is_empty(), "nothing was started");
    }
    // An address that is not one: the usage error names --http.
    let o = cli(
        &state,
        &["up", shape.to_str().unwrap(), "--http", "256.0.0.1:1"],
    );
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.starts_with("error: invalid value '256.0.0.1:1' for '--http <ADDR:PORT>'"),
        "{err}"
    );
    assert!(!err.contains("ERROR"), "{err}");
    drop(holder);
}

#[test]
fn a_kept_dashboard_port_that_is_taken_is_named_with_the_port_used_instead() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    // The port the last daemon used, now held by someone else.
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = holder.local_addr().unwrap();
    std::fs::write(state.join("http.addr"), taken.to_string()).unwrap();
    let shape = shape_file(dir.path(), "p.toml", &workers("port", 1));
    let mut daemon = Daemon::spawn(&state, Some(&shape)).expect("a daemon");
    let (addr, _) = web(&state);
    assert_ne!(addr.port(), taken.port());
    let log = daemon.last_log();
    let said: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(&format!("port {}", taken.port())))
        .collect();
    assert_eq!(said.len(), 1, "one line says so: {log}");
    assert!(
        said[0].contains("is taken") && said[0].contains(&format!("uses port {}", addr.port())),
        "{}",
        said[0]
    );
    assert!(cli(&state, &["down"]).status.success());
    daemon.wait_exit(Duration::from_secs(30));
    drop(holder);
}
#[test]
fn dispatches_by_effect_add_up_to_the_total_and_count_a_resumed_daemons_first_lookups() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let shape = shape_file(dir.path(), "d.toml", &workers("dispatch", 3));
    let ready = |s: &swactor_actors::ClusterSnapshot| s.nodes.iter().filter(|n| n.ready).count();
    let mut first = Daemon::start(&state, &shape);
    wait_converged(&state, Duration::from_secs(60), |s| ready(s) == 3);
    first.kill9();
    // The next daemon adopts the three agents: it looks up each one's
    // endpoint and takes its session over, as soon as it starts.
    let _second = Daemon::spawn(&state, None).expect("a resumed daemon");
    wait_converged(&state, Duration::from_secs(60), |s| ready(s) == 3);
    let (addr, token) = web(&state);
    let (text, s) = (0..20)
        .find_map(|_| {
            let before = status(&state)?;
            let (code, text) = get(addr, &token, "/metrics");
            assert_eq!(code, 200, "{text}");
            let after = status(&state)?;
            (before.stats == after.stats).then_some((text, after))
        })
        .expect("a quiet moment to scrape in");
    let m = parse_metrics(&text);

    // What this daemon dispatched, by its events in telemetry.ndjson
    // (from its first event on: each daemon numbers its own from 1).
    let ndjson = std::fs::read_to_string(state.join("telemetry.ndjson")).unwrap();
    let lines: Vec<serde_json::Value> = ndjson
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let from = lines.iter().rposition(|l| l["seq"] == 1).unwrap();
    let mut dispatched: std::collections::BTreeMap<String, f64> = Default::default();
    for line in &lines[from..] {
        if let Some(effect) = line["event"]["Dispatched"]["effect"].as_str() {
            *dispatched.entry(effect.to_owned()).or_default() += 1.0;
        }
    }
    let effects = [
        ("create_lease", "CreateLease"),
        ("lookup_endpoint", "LookupEndpoint"),
        ("start_bootstrap", "StartBootstrap"),
        ("cancel_bootstrap", "CancelBootstrap"),
        ("destroy_lease", "DestroyLease"),
    ];
    let mut sum = 0.0;
    for (label, event) in effects {
        let value = metric(&m, "swactor_dispatches_total", &[("effect", label)])
            .unwrap_or_else(|| panic!("no series for {label}: {text}"));
        assert_eq!(
            value,
            dispatched.get(event).copied().unwrap_or(0.0),
            "{label}: {dispatched:?}\n{text}"
        );
        sum += value;
    }
    assert_eq!(
        metric(
            &m,
            "swactor_dispatches_total",
            &[("effect", "lookup_endpoint")]
        ),
        Some(3.0),
        "{text}"
    );
    assert_eq!(
        metric(&m, "swactor_dispatched_operations_total", &[]),
        Some(sum),
        "{text}"
    );
    assert_eq!(sum, s.stats.dispatched as f64);
}

/// Issue 29, item 3: the web surface had no header or idle timeout and no
/// cap, so 1,100 idle TCP connections filled a 1,024-descriptor limit:
/// `/healthz` stopped and `replace` stuck at `CreateLease: … Too many open
/// files`. Now 20,000 idle connections (held by four helper processes,
/// since one process may hold 20,000 descriptors at most here) change
/// neither: the surface holds at most its cap, closes the rest at once,
/// and closes idle ones after its header timeout.
#[test]
fn twenty_thousand_idle_connections_starve_neither_healthz_nor_a_replacement() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let shape = shape_file(dir.path(), "idle.toml", &workers("idle", 2));
    let _daemon = Daemon::start(&state, &shape);
    let worker0 = |s: &swactor_actors::ClusterSnapshot| {
        s.nodes
            .iter()
            .find(|n| n.node.to_string() == "worker-0")
            .map(|n| (n.ready, n.attempt))
    };
    let before = wait_converged(&state, Duration::from_secs(60), |s| {
        s.nodes.iter().filter(|n| n.ready).count() == 2
    });
    let before = worker0(&before).unwrap().1;
    let (addr, token) = web(&state);
    // Each holder opens its share and says `held`, then sends nothing.
    let script = "import socket,sys,time\n\
                  host,port,n=sys.argv[1],int(sys.argv[2]),int(sys.argv[3])\n\
                  held=[]\n\
                  for i in range(n):\n    s=socket.socket()\n    s.connect((host,port))\n    held.append(s)\n\
                  print('held',flush=True)\n\
                  time.sleep(300)\n";
    let started = Instant::now();
    let mut holders: Vec<std::process::Child> = (0..4)
        .map(|_| {
            std::process::Command::new("python3")
                .args([
                    "-c",
                    script,
                    &addr.ip().to_string(),
                    &addr.port().to_string(),
                ])
                .arg("5000")
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("python3 runs the connection holders")
        })
        .collect();
    for h in &mut holders {
        let mut line = String::new();
        let mut out = std::io::BufReader::new(h.stdout.take().unwrap());
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert_eq!(
            line.trim(),
            "held",
            "a holder could not open its connections"
        );
    }
    eprintln!("20,000 connections opened in {:.1?}", started.elapsed());
    // The surface still answers at once.
    let asked = Instant::now();
    let (code, text) = get(addr, &token, "/healthz");
    assert_eq!((code, text.trim()), (200, "ok"));
    assert!(
        asked.elapsed() < Duration::from_secs(2),
        "{:?}",
        asked.elapsed()
    );
    // A replacement still gets the descriptors a create needs.
    let o = cli(&state, &["replace", "worker-0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    wait_converged(&state, Duration::from_secs(60), |s| {
        worker0(s).is_some_and(|(ready, attempt)| ready && attempt != before)
    });
    let (code, _) = get(addr, &token, "/healthz");
    assert_eq!(code, 200);
    for mut h in holders {
        let _ = h.kill();
        let _ = h.wait();
    }
}
