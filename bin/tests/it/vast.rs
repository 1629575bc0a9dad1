//! The `vast` provider against the Vast.ai mock (`swactor-vastmock`): real
//! HTTP on loopback, a real OpenSSH server per running instance, real agents
//! that join real daemons over iroh.
//!
//! The first tests drive the provider directly (creates, lookups, destroys,
//! under the mock's fault knobs); the later ones run `swactor up` against the
//! mock. Every test checks the mock's counters: at most one create per label,
//! and what is live at the end. The agent binary uploaded to instances is a
//! small script running this build's `swactor` (the instances are this
//! machine).
//!
//! Over 1,000 lines in one file: one subject's end-to-end tests, sharing the
//! mock's set-up helpers.

use crate::common;

use common::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use swactor_providers::vast::{ApiKey, Pacing, VastConfig, VastProvider};
use swactor_providers::{FaultKind, Provider, ProviderError, Release};
use swactor_provisioning::{
    BootParams, LeaseId, LogicalNodeId, NodeAttemptId, NodeLimits, NodeTemplate, ParamValue,
    ProviderShape, ResourceKey, RunId, SwarmJoin,
};
use swactor_vastmock::{Ambiguity, Death, Gone, MockConfig, Offer, Selector, VastMock};

const CONVERGE: Duration = Duration::from_secs(90);

/// `n` offers of one RTX 4090 each, on machines of their own, at `dph` each
/// (the first ones a little cheaper, so the order is known).
fn offers(n: u64, dph: f64) -> Vec<Offer> {
    (0..n)
        .map(|i| Offer {
            id: 5000 + i,
            machine_id: 700 + i,
            host_id: 70 + i,
            dph_total: dph + i as f64 * 0.001,
            ..Offer::default()
        })
        .collect()
}

struct World {
    tmp: tempfile::TempDir,
    mock: VastMock,
    agent: PathBuf,
}

impl World {
    fn new(offers: Vec<Offer>) -> Self {
        Self::with(MockConfig {
            offers,
            ..MockConfig::fast()
        })
    }

    fn with(config: MockConfig) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let mock = VastMock::start(MockConfig {
            state_dir: Some(tmp.path().join("mock")),
            ..config
        })
        .unwrap();
        let agent = tmp.path().join("agent.sh");
        std::fs::write(&agent, format!("#!/bin/sh\nexec {BIN} \"$@\"\n")).unwrap();
        std::fs::set_permissions(&agent, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        Self { tmp, mock, agent }
    }

    fn root(&self) -> &Path {
        self.tmp.path()
    }

    fn state(&self) -> PathBuf {
        self.root().join("state")
    }

    /// A provider on the mock (no pacing: the mock's limits are off).
    fn provider(&self, listing_lag: Duration, request_timeout: Duration) -> VastProvider {
        let mut config = VastConfig::new(
            self.root().join("pstate"),
            &self.agent,
            self.mock.url(),
            ApiKey::new(self.mock.api_key()).unwrap(),
        );
        config.pacing = Pacing::none();
        config.listing_lag = listing_lag;
        config.request_timeout = request_timeout;
        VastProvider::new(config).unwrap()
    }

    /// Live agents on the mock's machines: pids.
    fn agents(&self) -> Vec<u32> {
        let Ok(root) = self.mock.state_dir().join("machines").canonicalize() else {
            return Vec::new();
        };
        agent_cwds()
            .into_iter()
            .filter(|(_, cwd)| cwd.starts_with(&root))
            .map(|(pid, _)| pid)
            .collect()
    }

    /// The last lines of every agent's log on the mock's machines, for a
    /// failure's message (an agent that did not rejoin says why here).
    fn agent_logs(&self) -> String {
        let mut logs = paths_below(vec![self.mock.state_dir().join("machines")], |p| {
            p.file_name().is_some_and(|n| n == "agent.log")
        });
        logs.sort();
        let mut out = String::new();
        for path in logs {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(40)..];
            out.push_str(&format!(
                "--- {} (last {} lines)\n",
                path.display(),
                tail.len()
            ));
            for line in tail {
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }

    /// Kills the agents running in one machine's directory.
    fn kill_agents_in(&self, dir: &Path) {
        let Ok(dir) = dir.canonicalize() else {
            return;
        };
        for (pid, cwd) in agent_cwds() {
            if cwd.starts_with(&dir) {
                kill9(pid);
            }
        }
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("VAST_URL", self.mock.url().to_owned()),
            ("VAST_API_KEY", self.mock.api_key().to_owned()),
            ("HOME", self.root().display().to_string()),
            ("SWACTOR_VAST_PACING", "none".to_owned()),
            ("SWACTOR_VAST_LISTING_LAG_S", "5".to_owned()),
            ("SWACTOR_VAST_REQUEST_TIMEOUT_S", "3".to_owned()),
        ]
    }

    /// Waits until `count` nodes are ready; fails the test with the last
    /// status and `d`'s log when they are not within [`CONVERGE`].
    fn ready(&self, d: &Daemon, count: usize) -> swactor_actors::ClusterSnapshot {
        self.ready_in(&self.state(), d, count)
    }

    /// [`Self::ready`] for the daemon of `state`.
    fn ready_in(&self, state: &Path, d: &Daemon, count: usize) -> swactor_actors::ClusterSnapshot {
        try_wait_converged(state, CONVERGE, |s| {
            s.nodes.iter().filter(|n| n.ready).count() == count
        })
        .unwrap_or_else(|last| panic!("not converged: {last:#?}\n{}", d.log()))
    }

    fn up(&self, shape: &Path, env: &[(&'static str, String)]) -> Result<Daemon, Exited> {
        self.up_in(&self.state(), shape, env)
    }

    /// [`Self::up`] with the state directory `state`.
    fn up_in(
        &self,
        state: &Path,
        shape: &Path,
        env: &[(&'static str, String)],
    ) -> Result<Daemon, Exited> {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        Daemon::spawn_env(
            state,
            Some(shape),
            &["--agent-binary", self.agent.to_str().unwrap()],
            &env,
        )
    }

    fn shape(&self, name: &str, count: u32, params: &str) -> PathBuf {
        shape_file(
            self.root(),
            name,
            &format!(
                "run = \"gpu\"\n[[group]]\nid = \"w\"\ncount = {count}\nprovider = \"vast\"\n\
                 image = \"pytorch/pytorch:latest\"\nboot_check = [\"true\"]\nlost_grace_s = 2\n\
                 endpoint_timeout_s = 60\n\
                 [group.params]\ngpu_name = \"RTX_4090\"\nmax_dph = 1.0\n{params}"
            ),
        )
    }

    /// `swactor down` succeeds, and within a minute no instance is live.
    fn down(&self) {
        let o = cli(&self.state(), &["down"]);
        assert!(o.status.success(), "{}", stderr(&o));
        wait_for(Duration::from_secs(60), "no live instance", || {
            self.mock.live_instances() == 0
        });
    }

    /// At most one create per label, ever.
    fn assert_one_create_per_label(&self) {
        let twice: BTreeMap<String, u64> = self
            .mock
            .creates_per_label()
            .into_iter()
            .filter(|(_, n)| *n > 1)
            .collect();
        assert!(twice.is_empty(), "labels created more than once: {twice:?}");
    }
}

impl Drop for World {
    fn drop(&mut self) {
        for pid in self.agents() {
            kill9(pid);
        }
    }
}

fn key(node: &str, attempt: u64) -> ResourceKey {
    ResourceKey {
        run_id: RunId::new("r"),
        node: LogicalNodeId::parse(node).unwrap(),
        attempt: NodeAttemptId(attempt),
    }
}

fn template(params: &[(&str, ParamValue)]) -> NodeTemplate {
    let mut all: BTreeMap<String, ParamValue> = BTreeMap::from([
        ("gpu_name".to_owned(), ParamValue::Str("RTX_4090".into())),
        ("max_dph".to_owned(), ParamValue::Float(1.0)),
    ]);
    for (k, v) in params {
        all.insert((*k).to_owned(), v.clone());
    }
    NodeTemplate {
        provider: ProviderShape {
            kind: "vast".into(),
            params: all,
            placement: BTreeMap::new(),
        },
        boot: BootParams {
            image: Some("pytorch/pytorch:latest".into()),
            ..BootParams::default()
        },
        role: "worker".into(),
        join: SwarmJoin::default(),
        limits: NodeLimits::default(),
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Looks `lease` up until it is not "not ready", for at most `within`.
async fn settle(
    p: &VastProvider,
    key: &ResourceKey,
    lease: &LeaseId,
    within: Duration,
) -> Result<String, ProviderError> {
    let start = Instant::now();
    loop {
        match p.lookup_endpoint(key, lease).await {
            Err(ProviderError::NotReady) if start.elapsed() < within => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => return other.map(|e| e.0.to_string()),
        }
    }
}

fn instance_id(lease: &LeaseId) -> u64 {
    lease.0.strip_prefix("vast:").unwrap().parse().unwrap()
}

#[test]
fn a_create_is_adopted_by_label_and_its_endpoint_is_the_instances_sshd() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(3, 0.3));
    let p = w.provider(Duration::from_secs(5), Duration::from_secs(5));
    let t = template(&[]);
    let k = key("w-0", 1);
    rt().block_on(async {
        let first = p.create_lease(&k, &t).await.unwrap();
        let again = p.create_lease(&k, &t).await.unwrap();
        assert_eq!(first.lease, again.lease);
        let ep = settle(&p, &k, &first.lease, Duration::from_secs(20))
            .await
            .unwrap();
        let view = w.mock.instance(instance_id(&first.lease)).unwrap();
        assert!(ep.starts_with("ssh:root@127.0.0.1:"), "{ep}");
        assert_eq!(view.label.as_deref(), Some("swactor:r:w-0:1"));
        // The daemon's key went in through `onstart`.
        assert_eq!(view.authorized_keys.len(), 1, "{view:?}");
        let inv = p.list(&RunId::new("r")).await.unwrap();
        assert_eq!(
            inv.get(&k).and_then(|o| o.lease.clone()),
            Some(first.lease.clone())
        );
        assert!(p.list(&RunId::new("other")).await.unwrap().is_empty());
        p.destroy_lease(&k, &first.lease).await.unwrap();
        p.destroy_lease(&k, &first.lease).await.unwrap();
    });
    assert_eq!(w.mock.live_instances(), 0);
    assert_eq!(w.mock.creates_total(), 1);
}

#[test]
fn an_ambiguous_create_is_never_sent_again_and_its_instance_is_adopted() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(4, 0.3));
    let p = w.provider(Duration::from_secs(4), Duration::from_millis(800));
    let t = template(&[]);
    let kinds = [
        Ambiguity::BadGateway,
        Ambiguity::Drop,
        Ambiguity::Timeout {
            hold: Duration::from_secs(3),
        },
        // A 200 whose body is cut off: the create may well have committed.
        Ambiguity::Malformed,
    ];
    rt().block_on(async {
        for (i, kind) in kinds.into_iter().enumerate() {
            let k = key("w-0", i as u64 + 1);
            w.mock.ambiguous_create(kind, 1);
            let err = p.create_lease(&k, &t).await.unwrap_err();
            assert!(
                matches!(err, ProviderError::Ambiguous(_)),
                "{kind:?}: {err}"
            );
            assert!(!err.to_string().contains(w.mock.api_key()));
            // Re-issued at once, and again and again: adopted, never re-sent.
            let mut grant = None;
            for _ in 0..20 {
                match p.create_lease(&k, &t).await {
                    Ok(g) => {
                        grant = Some(g);
                        break;
                    }
                    Err(e) => {
                        assert!(matches!(e, ProviderError::Ambiguous(_)), "{e}");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
            let grant = grant.expect("the committed instance is adopted");
            assert_eq!(
                w.mock
                    .creates_per_label()
                    .get(&format!("swactor:r:w-0:{}", i + 1)),
                Some(&1),
                "{kind:?}"
            );
            p.destroy_lease(&k, &grant.lease).await.unwrap();
        }
    });
    w.assert_one_create_per_label();
    assert_eq!(w.mock.creates_total(), 4);
    assert_eq!(w.mock.live_instances(), 0);
}

#[test]
fn a_lagging_listing_holds_the_next_create_until_the_label_shows() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(2, 0.3));
    let p = w.provider(Duration::from_secs(6), Duration::from_millis(800));
    let t = template(&[]);
    let k = key("w-0", 1);
    w.mock.listing_lag(Duration::from_secs(2));
    w.mock.ambiguous_create(Ambiguity::BadGateway, 1);
    rt().block_on(async {
        assert!(matches!(
            p.create_lease(&k, &t).await,
            Err(ProviderError::Ambiguous(_))
        ));
        // Not listed yet: the provider waits rather than renting again.
        let held = p.create_lease(&k, &t).await.unwrap_err();
        assert!(held.to_string().contains("unknown outcome"), "{held}");
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let g = p.create_lease(&k, &t).await.unwrap();
        p.destroy_lease(&k, &g.lease).await.unwrap();
    });
    assert_eq!(w.mock.creates_total(), 1);
    assert_eq!(w.mock.live_instances(), 0);
}

#[test]
fn a_gone_offer_is_a_capacity_failure_and_the_next_create_goes_elsewhere() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(3, 0.3));
    let p = w.provider(Duration::from_secs(5), Duration::from_secs(5));
    let t = template(&[]);
    w.mock.offer_gone(5000, Some(Gone::NotFound));
    w.mock.offer_gone(5001, Some(Gone::Unavailable));
    rt().block_on(async {
        let k = key("w-0", 1);
        let e1 = p.create_lease(&k, &t).await.unwrap_err();
        assert!(matches!(&e1, ProviderError::Definite(m) if m.kind() == FaultKind::NoCapacity && m.message().contains("machine 700")), "{e1}");
        let e2 = p.create_lease(&k, &t).await.unwrap_err();
        assert!(matches!(&e2, ProviderError::Definite(m) if m.kind() == FaultKind::NoCapacity && m.message().contains("machine 701")), "{e2}");
        let g = p.create_lease(&k, &t).await.unwrap();
        let view = w.mock.instance(instance_id(&g.lease)).unwrap();
        assert_eq!(view.offer_id, 5002, "{view:?}");
        // No offer at all: a capacity failure that says what was asked.
        let e3 = p.create_lease(&key("w-1", 2), &t).await.unwrap_err();
        assert!(matches!(&e3, ProviderError::Definite(m) if m.kind() == FaultKind::NoCapacity && m.message().contains("no capacity")), "{e3}");
        p.destroy_lease(&k, &g.lease).await.unwrap();
    });
    w.assert_one_create_per_label();
    assert_eq!(w.mock.live_instances(), 0);
}

/// Issue 30, renting right. The four cheapest offers each fail one rule:
/// no open port (its SSH may never answer while it bills), an external
/// machine, rentable for less than the group's `min_duration_h`, and one
/// whose price is under `max_dph` only without the 16 GB of storage the
/// rental pays for. None is rented; the node gets the fifth.
#[test]
fn offers_without_open_ports_external_too_short_or_over_with_storage_are_never_rented() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let mut all = offers(5, 0.3);
    all[0]
        .extra
        .insert("direct_port_count".into(), serde_json::json!(0));
    all[1]
        .extra
        .insert("external".into(), serde_json::json!(true));
    all[2]
        .extra
        .insert("duration".into(), serde_json::json!(3_600.0));
    // 0.303 $/h, and 0.0033 $/h of storage: over a max_dph of 0.305 only
    // with a dearer storage price (1 $ per GB and month: 0.022 $/h).
    all[3]
        .extra
        .insert("storage_cost".into(), serde_json::json!(1.0));
    let w = World::new(all);
    let p = w.provider(Duration::from_secs(5), Duration::from_secs(5));
    let t = template(&[
        ("min_duration_h", ParamValue::Int(24)),
        ("max_dph", ParamValue::Float(0.31)),
    ]);
    rt().block_on(async {
        let g = p.create_lease(&key("w-0", 1), &t).await.unwrap();
        let id = instance_id(&g.lease);
        assert_eq!(w.mock.instance(id).unwrap().offer_id, 5004);
        // Its price holds its storage: the offer's 0.304 $/h and 16 GB.
        let dph = w.mock.instance(id).unwrap().row["dph_total"]
            .as_f64()
            .unwrap();
        assert!((dph - (0.304 + 0.15 * 16.0 / 720.0)).abs() < 1e-9, "{dph}");
        p.destroy_lease(&key("w-0", 1), &g.lease).await.unwrap();
    });
    assert_eq!(w.mock.creates_total(), 1);
}

#[test]
fn the_spend_cap_refuses_a_create_over_it_with_the_numbers() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(4, 0.3));
    let p = w.provider(Duration::from_secs(5), Duration::from_secs(5));
    let t = template(&[("spend_cap_dph", ParamValue::Float(1.0))]);
    rt().block_on(async {
        let a = p.create_lease(&key("w-0", 1), &t).await.unwrap();
        let b = p.create_lease(&key("w-1", 2), &t).await.unwrap();
        let c = p.create_lease(&key("w-2", 3), &t).await.unwrap();
        let refused = p.create_lease(&key("w-3", 4), &t).await.unwrap_err();
        let text = refused.to_string();
        assert!(text.contains("spend cap is 1.000 $/h"), "{text}");
        // Each price holds its 16 GB of storage: 0.15 $ per GB and month.
        assert!(text.contains("3 live instance(s) cost 0.913 $/h"), "{text}");
        assert!(text.contains("1.219 $/h in all"), "{text}");
        assert_eq!(w.mock.live_instances(), 3);
        for (n, g) in [("w-0", &a), ("w-1", &b), ("w-2", &c)] {
            let attempt = n[2..].parse::<u64>().unwrap() + 1;
            p.destroy_lease(&key(n, attempt), &g.lease).await.unwrap();
        }
    });
    assert_eq!(w.mock.live_instances(), 0);
}

#[test]
fn failed_boots_dead_instances_and_stuck_loads_end_the_attempt() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(8, 0.3));
    let p = w.provider(Duration::from_secs(2), Duration::from_secs(5));
    let t = template(&[("load_timeout_s", ParamValue::Float(2.0))]);
    rt().block_on(async {
        // A boot that fails (OCI error).
        w.mock.boot_failure(Selector::Next(1));
        let k = key("w-0", 1);
        let g = p.create_lease(&k, &t).await.unwrap();
        let e = settle(&p, &k, &g.lease, Duration::from_secs(10))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, ProviderError::Gone(m) if m.kind() == FaultKind::MachineFailed && m.message().contains("failed boot")),
            "{e}"
        );
        let failed_offer = w.mock.instance(instance_id(&g.lease)).unwrap().offer_id;
        p.destroy_lease(&k, &g.lease).await.unwrap();
        // The failed machine is skipped by the next create, though its
        // offer is rentable again (and the cheapest).
        let k2 = key("w-0", 2);
        let g2 = p.create_lease(&k2, &t).await.unwrap();
        assert_ne!(
            w.mock.instance(instance_id(&g2.lease)).unwrap().offer_id,
            failed_offer
        );
        settle(&p, &k2, &g2.lease, Duration::from_secs(10))
            .await
            .unwrap();
        // Death after running.
        w.mock
            .kill(Selector::Id(instance_id(&g2.lease)), Death::Exited);
        let e = p.lookup_endpoint(&k2, &g2.lease).await.unwrap_err();
        assert!(
            matches!(&e, ProviderError::Gone(m) if m.kind() == FaultKind::MachineFailed && m.message().contains("exited")),
            "{e}"
        );
        p.destroy_lease(&k2, &g2.lease).await.unwrap();
        // Loading forever: bounded by load_timeout_s.
        w.mock.stuck_loading(Selector::Next(1));
        let k3 = key("w-0", 3);
        let g3 = p.create_lease(&k3, &t).await.unwrap();
        let e = settle(&p, &k3, &g3.lease, Duration::from_secs(10))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, ProviderError::Gone(m) if m.kind() == FaultKind::LoadTimeout && m.message().contains("load_timeout_s")),
            "{e}"
        );
        p.destroy_lease(&k3, &g3.lease).await.unwrap();
        // Running, but SSH never answers: bounded by load_timeout_s too.
        w.mock.ssh_never_ready(Selector::Next(1));
        let k5 = key("w-0", 5);
        let g5 = p.create_lease(&k5, &t).await.unwrap();
        let e = settle(&p, &k5, &g5.lease, Duration::from_secs(15))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, ProviderError::Gone(m) if m.kind() == FaultKind::LoadTimeout && m.message().contains("SSH is not ready")),
            "{e}"
        );
        p.destroy_lease(&k5, &g5.lease).await.unwrap();
        // Vanished: gone once the listing lag has passed.
        let k4 = key("w-0", 4);
        let g4 = p.create_lease(&k4, &t).await.unwrap();
        settle(&p, &k4, &g4.lease, Duration::from_secs(10))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        w.mock
            .kill(Selector::Id(instance_id(&g4.lease)), Death::Vanished);
        let e = p.lookup_endpoint(&k4, &g4.lease).await.unwrap_err();
        assert_eq!(e.kind(), Some(FaultKind::Deleted), "{e}");
        assert!(matches!(&e, ProviderError::Gone(_)), "{e}");
        p.destroy_lease(&k4, &g4.lease).await.unwrap();
        // Frozen by its host: the GPU is held and billed, nothing runs.
        let k6 = key("w-0", 6);
        let g6 = p.create_lease(&k6, &t).await.unwrap();
        settle(&p, &k6, &g6.lease, Duration::from_secs(10))
            .await
            .unwrap();
        w.mock
            .kill(Selector::Id(instance_id(&g6.lease)), Death::Frozen);
        let shown = w.mock.instance(instance_id(&g6.lease)).unwrap();
        assert_eq!(
            shown.actual_status.as_deref(),
            Some("frozen"),
            "{}",
            shown.row
        );
        let e = p.lookup_endpoint(&k6, &g6.lease).await.unwrap_err();
        assert!(
            matches!(&e, ProviderError::Gone(m) if m.kind() == FaultKind::MachineFailed && m.message().contains("frozen")),
            "{e}"
        );
        p.destroy_lease(&k6, &g6.lease).await.unwrap();
    });
    w.assert_one_create_per_label();
    assert_eq!(w.mock.live_instances(), 0);
}

#[test]
fn rate_limits_and_flaky_destroys_are_waited_out_without_a_second_rental() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(2, 0.3));
    let p = w.provider(Duration::from_secs(5), Duration::from_secs(5));
    let t = template(&[]);
    let k = key("w-0", 1);
    rt().block_on(async {
        w.mock.rate_burst(swactor_vastmock::Endpoint::Create, 2);
        w.mock.rate_burst(swactor_vastmock::Endpoint::Search, 1);
        let start = Instant::now();
        let g = p.create_lease(&k, &t).await.unwrap();
        // Backed off: 1 s after the first 429, 2 s after the second.
        assert!(
            start.elapsed() >= Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        w.mock.flaky_destroy(2, 500).unwrap();
        let mut tries = 0;
        loop {
            tries += 1;
            match p.destroy_lease(&k, &g.lease).await {
                Ok(Release::Done) => break,
                Ok(other) => panic!("{other:?}"),
                Err(e) => assert!(tries < 5, "{e}"),
            }
        }
        assert_eq!(tries, 3);
    });
    assert_eq!(w.mock.creates_total(), 1);
    assert_eq!(w.mock.live_instances(), 0);
}

#[test]
fn a_wrong_key_is_refused_in_words_that_never_hold_a_key() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(1, 0.3));
    let mut config = VastConfig::new(
        w.root().join("pstate"),
        &w.agent,
        w.mock.url(),
        ApiKey::new("wrong-key-0123456789").unwrap(),
    );
    config.pacing = Pacing::none();
    let p = VastProvider::new(config).unwrap();
    rt().block_on(async {
        let e = p.check_access().await.unwrap_err();
        assert!(
            matches!(e, swactor_providers::vast::AccessError::Refused(_)),
            "a refused key is final: {e:?}"
        );
        let e = e.to_string();
        assert!(e.contains("refused the API key"), "{e}");
        assert!(!e.contains("wrong-key-0123456789") && !e.contains(w.mock.api_key()));
        let e = p
            .create_lease(&key("w-0", 1), &template(&[]))
            .await
            .unwrap_err();
        assert!(!e.to_string().contains("wrong-key-0123456789"), "{e}");
    });
    assert_eq!(w.mock.creates_total(), 0);
}

/// Every line of the daemon's log, checked for the key.
fn assert_no_key(log: &str, key: &str) {
    assert!(
        !log.contains(key),
        "the API key appears in the daemon's output"
    );
}

#[test]
fn four_nodes_converge_on_the_mock_and_down_leaves_no_instance() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(6, 0.3));
    let shape = w.shape("four.toml", 4, "");
    let started = Instant::now();
    let d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("{:?}: {}", e.code, e.log));
    let snap = w.ready(&d, 4);
    eprintln!(
        "4 vast nodes converged in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(snap.nodes.len(), 4);
    assert_eq!(w.mock.live_instances(), 4);
    assert_eq!(w.agents().len(), 4, "one agent per instance");
    w.assert_one_create_per_label();
    // Status shows each node's offer, machine and price, and the total.
    assert_eq!(snap.rentals.len(), 4, "{:#?}", snap.rentals);
    let total: u64 = snap.rentals.iter().map(|r| r.usd_per_hour_micros).sum();
    // 0.300 + 0.301 + 0.302 + 0.303 $/h, and 16 GB of storage each at
    // 0.15 $ per GB and month (0.00333 $/h).
    assert!(
        total.abs_diff(1_219_333) <= 4,
        "{total}: 0.300 + 0.301 + 0.302 + 0.303 $/h and storage"
    );
    assert!(
        snap.rentals
            .iter()
            .all(|r| !r.offer.is_empty() && r.machine.starts_with("70"))
    );
    // Each node names its instance, offer, machine and price.
    for n in &snap.nodes {
        let r = snap.rentals.iter().find(|r| r.node == n.node).unwrap();
        let shown = format!(
            "instance {} · offer {} · machine {} · {:.3} $/h · ",
            r.instance,
            r.offer,
            r.machine,
            r.usd_per_hour_micros as f64 / 1e6
        );
        let resource = n.resource.as_deref().unwrap_or_default();
        assert!(resource.starts_with(&shown), "{resource:?} vs {shown:?}");
    }
    let o = cli(&w.state(), &["status"]);
    let text = stdout(&o);
    assert!(
        text.contains("rented machines: 4 · 1.219 $/h in all"),
        "{text}"
    );
    // /metrics says the same price.
    let (code, metrics) = web_get(&w.state(), "/metrics");
    assert_eq!(code, 200, "{metrics}");
    let price: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("swactor_cluster_usd_per_hour{provider=\"vast\"} "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no price in {metrics}"));
    assert!((price - 1.219_333).abs() < 1e-5, "{price}");
    // `swactor logs` reads a node's agent log on its instance, over SSH.
    let node = snap.nodes[0].node.to_string();
    let o = cli(&w.state(), &["logs", &node]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stdout(&o).is_empty(), "{}", stderr(&o));
    assert!(stderr(&o).contains("(vast node"), "{}", stderr(&o));
    let o = cli(&w.state(), &["down"]);
    assert!(o.status.success(), "{}\n{}", stderr(&o), d.log());
    wait_for(Duration::from_secs(30), "no live instance", || {
        w.mock.live_instances() == 0
    });
    let out = format!("{}{}{}", stdout(&o), stderr(&o), d.log());
    assert_no_key(&out, w.mock.api_key());
    w.assert_one_create_per_label();
    assert_eq!(w.mock.creates_total(), 4);
}

#[test]
fn a_daemon_killed_mid_create_adopts_the_instance_when_it_starts_again() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(3, 0.3));
    let shape = w.shape("one.toml", 1, "");
    // The create commits, then its answer is held past the kill.
    w.mock.ambiguous_create(
        Ambiguity::Timeout {
            hold: Duration::from_secs(20),
        },
        1,
    );
    let mut env = w.env();
    env.retain(|(k, _)| *k != "SWACTOR_VAST_REQUEST_TIMEOUT_S");
    env.push(("SWACTOR_VAST_REQUEST_TIMEOUT_S", "30".to_owned()));
    let mut d = w.up(&shape, &env).unwrap_or_else(|e| panic!("{}", e.log));
    wait_for(Duration::from_secs(30), "the create to commit", || {
        w.mock.creates_total() == 1
    });
    d.kill9();
    let first_log = d.log();
    drop(d);
    let d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    w.ready(&d, 1);
    assert_eq!(w.mock.creates_total(), 1, "{}", d.log());
    assert_eq!(w.mock.live_instances(), 1);
    w.assert_one_create_per_label();
    let o = cli(&w.state(), &["down"]);
    assert!(o.status.success(), "{}", stderr(&o));
    wait_for(Duration::from_secs(30), "no live instance", || {
        w.mock.live_instances() == 0
    });
    assert_no_key(&format!("{first_log}{}", d.log()), w.mock.api_key());
}

#[test]
fn a_listing_cut_off_mid_json_is_an_error_never_an_empty_account() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(3, 0.3));
    let p = w.provider(Duration::from_secs(5), Duration::from_secs(5));
    let t = template(&[]);
    let k = key("w-0", 1);
    rt().block_on(async {
        let made = p.create_lease(&k, &t).await.unwrap();
        // One cut-off answer is read again.
        w.mock.malformed(swactor_vastmock::Endpoint::List, 1);
        let inv = p.list(&RunId::new("r")).await.unwrap();
        assert_eq!(inv.len(), 1);
        // Past the read's retries it is an error, never an empty account.
        w.mock.malformed(swactor_vastmock::Endpoint::List, 10);
        let err = p
            .list(&RunId::new("r"))
            .await
            .expect_err("a cut-off listing was read as an account");
        assert!(format!("{err}").contains("not JSON"), "{err}");
        // The create is not sent while the listing that would adopt its
        // label cannot be read.
        let other = key("w-1", 1);
        assert!(p.create_lease(&other, &t).await.is_err());
        assert_eq!(w.mock.creates_total(), 1);
        w.mock.malformed(swactor_vastmock::Endpoint::List, 0);
        let inv = p.list(&RunId::new("r")).await.unwrap();
        assert_eq!(inv.get(&k).and_then(|o| o.lease.clone()), Some(made.lease));
    });
}

#[test]
fn a_restarted_daemon_reading_cut_off_answers_rents_nothing_twice() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(4, 0.3));
    let shape = w.shape("two.toml", 2, "");
    let mut d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    w.ready(&d, 2);
    d.kill9();
    drop(d);
    // The restarted daemon's first listings and shows are cut off mid-JSON
    // (as many as a read retries): it reads them again, and never takes
    // them for "nothing rented".
    w.mock.malformed(swactor_vastmock::Endpoint::List, 3);
    w.mock.malformed(swactor_vastmock::Endpoint::Show, 3);
    let d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    w.ready(&d, 2);
    assert_eq!(w.mock.creates_total(), 2, "{}", d.log());
    assert_eq!(w.mock.live_instances(), 2);

    // Now more cut-off listings than any read retries, while an instance
    // vanishes: its replacement waits for a listing it can read (the label
    // may be there), and is rented once.
    w.mock.malformed(swactor_vastmock::Endpoint::List, 8);
    let victim = w
        .mock
        .instances()
        .into_iter()
        .find(|i| !i.destroyed)
        .expect("a live instance");
    assert_eq!(w.mock.kill(Selector::Id(victim.id), Death::Vanished), 1);
    wait_for(CONVERGE, "the replacement", || w.mock.creates_total() == 3);
    w.ready(&d, 2);
    assert_eq!(w.mock.creates_total(), 3, "{}", d.log());
    assert_eq!(w.mock.live_instances(), 2);
    w.assert_one_create_per_label();
    let o = cli(&w.state(), &["down"]);
    assert!(o.status.success(), "{}", stderr(&o));
    wait_for(Duration::from_secs(30), "no live instance", || {
        w.mock.live_instances() == 0
    });
    assert_no_key(&d.log(), w.mock.api_key());
}

#[test]
fn a_shape_renting_vast_machines_without_a_key_is_refused_before_anything_is_rented() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(2, 0.3));
    let shape = w.shape("one.toml", 1, "");
    let mut env = w.env();
    env.retain(|(k, _)| *k != "VAST_API_KEY");
    env.push(("VAST_API_KEY", String::new()));
    let e = w.up(&shape, &env).err().expect("refused");
    assert!(
        e.log.contains("no Vast.ai API key") && e.log.contains("VAST_API_KEY"),
        "{}",
        e.log
    );
    let mut env = w.env();
    env.retain(|(k, _)| *k != "VAST_API_KEY");
    env.push(("VAST_API_KEY", "not-the-key-987654321".to_owned()));
    let e = w.up(&shape, &env).err().expect("refused");
    assert!(e.log.contains("refused the API key"), "{}", e.log);
    assert!(!e.log.contains("not-the-key-987654321"), "{}", e.log);
    // A cap of 0 and a spend cap below the price are shape errors.
    let bad = w.shape("bad.toml", 1, "spend_cap_dph = 0.5\n");
    let e = w.up(&bad, &w.env()).err().expect("refused");
    assert!(e.log.contains("below `max_dph`"), "{}", e.log);
    assert_eq!(w.mock.creates_total(), 0);
}

#[test]
fn a_query_no_offer_matches_shows_no_capacity_per_node_and_backs_off() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(2, 0.3));
    let shape = w.shape("none.toml", 2, "min_gpu_ram_gb = 200\n");
    let d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    let mut last = None;
    wait_for(Duration::from_secs(30), "no capacity on every node", || {
        last = status(&w.state());
        last.as_ref().is_some_and(|s| {
            s.nodes.len() == 2
                && s.nodes.iter().all(|n| {
                    n.last_error.as_deref().is_some_and(|e| {
                        e.contains("no capacity: no offer matches")
                            && e.contains("≥ 200 GB GPU RAM")
                    })
                })
        })
    });
    // Retried with backoff: a handful of tries in 8 s, not a hot loop.
    std::thread::sleep(Duration::from_secs(8));
    let s = status(&w.state()).unwrap();
    for n in &s.nodes {
        assert!(
            (1..=8).contains(&n.failures),
            "{} failed {} times in ~10 s",
            n.node,
            n.failures
        );
        assert!(n.next_retry_at.is_some(), "{n:?}");
    }
    assert_eq!(w.mock.creates_total(), 0);
    let o = cli(&w.state(), &["down"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_no_key(&d.log(), w.mock.api_key());
}

#[test]
fn an_image_the_service_rejects_is_a_per_node_reason_without_a_rental_or_a_hot_loop() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(2, 0.3));
    let shape = w.shape("bad-image.toml", 1, "");
    let body = std::fs::read_to_string(&shape)
        .unwrap()
        .replace("pytorch/pytorch:latest", "PyTorch/Latest");
    std::fs::write(&shape, body).unwrap();
    let d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    wait_for(
        Duration::from_secs(30),
        "the service's reason on the node",
        || {
            status(&w.state()).is_some_and(|s| {
                s.nodes.iter().any(|n| {
                    n.last_error.as_deref().is_some_and(|e| {
                        e.contains("invalid image") && e.contains("PyTorch/Latest")
                    })
                })
            })
        },
    );
    std::thread::sleep(Duration::from_secs(8));
    let s = status(&w.state()).unwrap();
    let n = &s.nodes[0];
    assert!((1..=8).contains(&n.failures), "{n:?}");
    assert_eq!(w.mock.creates_total(), 0, "nothing was rented");
    let o = cli(&w.state(), &["down"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(w.mock.live_instances(), 0);
    assert_no_key(&d.log(), w.mock.api_key());
}

#[test]
fn under_the_services_own_rate_limits_the_paced_daemon_converges() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    // The mock with the real service's intervals (search 6 s, create 4.5 s,
    // show 2 s, list 1 s, destroy 3 s), and the daemon's own pacing.
    let w = World::with(MockConfig {
        offers: offers(3, 0.3),
        rate_limits: swactor_vastmock::RateLimits::default(),
        ..MockConfig::fast()
    });
    // No listing burst: one listing a second, strictly.
    w.mock.strict_rate_limits(true);
    let shape = w.shape("paced.toml", 2, "");
    let mut env = w.env();
    env.retain(|(k, _)| *k != "SWACTOR_VAST_PACING");
    let started = Instant::now();
    let d = w.up(&shape, &env).unwrap_or_else(|e| panic!("{}", e.log));
    w.ready(&d, 2);
    eprintln!(
        "2 nodes converged under the service's rate limits in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    w.assert_one_create_per_label();
    w.down();
    assert_eq!(w.mock.creates_total(), 2);
}

#[test]
fn random_5xx_on_every_route_end_converged_without_a_second_rental() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(6, 0.3));
    w.mock.random_5xx(0.3, 7).unwrap();
    let shape = w.shape("flaky.toml", 3, "");
    let d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    try_wait_converged(&w.state(), CONVERGE, |s| {
        s.nodes.iter().filter(|n| n.ready).count() == 3 && w.mock.live_instances() == 3
    })
    .unwrap_or_else(|last| panic!("not converged: {last:#?}\n{}", d.log()));
    w.assert_one_create_per_label();
    w.down();
    w.assert_one_create_per_label();
    assert_no_key(&d.log(), w.mock.api_key());
}

/// Applies one fault chosen by `rng`; returns its description.
fn inject(w: &World, rng: &mut Rng, seed: u64) -> String {
    use swactor_vastmock::Endpoint as E;
    match rng.below(10) {
        0 => {
            let offer = 5000 + rng.below(10);
            let kind = if rng.below(2) == 0 {
                Gone::NotFound
            } else {
                Gone::Unavailable
            };
            w.mock.offer_gone(offer, Some(kind));
            format!("offer {offer} gone ({kind:?})")
        }
        1 => {
            let e = [E::Create, E::Search, E::List, E::Show, E::Destroy][rng.below(5) as usize];
            let n = 1 + rng.below(4) as u32;
            w.mock.rate_burst(e, n);
            format!("{n} × 429 on {e:?}")
        }
        2 => {
            w.mock.boot_failure(Selector::Next(1));
            "a failed boot".to_owned()
        }
        3 => {
            w.mock.stuck_loading(Selector::Next(1));
            "a stuck load".to_owned()
        }
        4 => {
            let kind = match rng.below(3) {
                0 => Ambiguity::BadGateway,
                1 => Ambiguity::Drop,
                _ => Ambiguity::Timeout {
                    hold: Duration::from_secs(3),
                },
            };
            w.mock.ambiguous_create(kind, 1);
            format!("an ambiguous create ({kind:?})")
        }
        5 => {
            let ms = 300 + rng.below(1200);
            w.mock.listing_lag(Duration::from_millis(ms));
            format!("a listing lag of {ms} ms")
        }
        6 => {
            let n = 1 + rng.below(3) as u32;
            w.mock.flaky_destroy(n, 500).unwrap();
            format!("{n} flaky destroys")
        }
        7 => {
            w.mock.random_5xx(0.1, seed).unwrap();
            "random 5xx (10 %)".to_owned()
        }
        8 => {
            w.mock.ssh_never_ready(Selector::Next(1));
            "an sshd that never answers".to_owned()
        }
        _ => {
            w.mock
                .slow_loading(Selector::Next(1), Duration::from_secs(2));
            "a slow load".to_owned()
        }
    }
}

/// Seeds to run: `SWACTOR_VAST_SEEDS` (default 16), from `SWACTOR_VAST_SEED0`.
fn seeds() -> std::ops::Range<u64> {
    let n = env_or("SWACTOR_VAST_SEEDS", 16);
    let first = env_or("SWACTOR_VAST_SEED0", 1);
    first..first + n
}

#[test]
fn a_seeded_battery_of_faults_ends_converged_with_one_create_per_label_and_nothing_left() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    for seed in seeds() {
        let started = Instant::now();
        let mut rng = Rng(seed);
        let w = World::new(offers(10, 0.3));
        let shape = w.shape("battery.toml", 3, "load_timeout_s = 4\n");
        let faults: Vec<String> = (0..2 + rng.below(3))
            .map(|_| inject(&w, &mut rng, seed))
            .collect();
        let mut env = w.env();
        env.retain(|(k, _)| *k != "SWACTOR_VAST_LISTING_LAG_S");
        env.push(("SWACTOR_VAST_LISTING_LAG_S", "3".to_owned()));
        let d = w
            .up(&shape, &env)
            .unwrap_or_else(|e| panic!("seed {seed}: {:?}: {}", e.code, e.log));
        std::thread::sleep(Duration::from_millis(1500 + rng.below(1500)));
        let mut killed = String::new();
        if rng.below(2) == 0 {
            let death = [Death::Exited, Death::Offline, Death::Vanished][rng.below(3) as usize];
            let live: Vec<_> = w
                .mock
                .instances()
                .into_iter()
                .filter(|i| !i.destroyed)
                .collect();
            if !live.is_empty() {
                let victim = &live[rng.below(live.len() as u64) as usize];
                // The machine dies, and what ran on it with it.
                w.kill_agents_in(&victim.dir);
                w.mock.kill(Selector::Id(victim.id), death);
                killed = format!(", then instance {} {death:?}", victim.id);
            }
        }
        std::thread::sleep(Duration::from_secs(2));
        w.mock.clear_faults();
        for o in 5000..5010 {
            w.mock.offer_gone(o, None);
        }
        let what = format!("seed {seed}: {}{killed}", faults.join(", "));
        try_wait_converged(&w.state(), CONVERGE, |s| {
            s.nodes.iter().filter(|n| n.ready).count() == 3 && w.mock.live_instances() == 3
        })
        .unwrap_or_else(|last| {
            panic!(
                "{what}: not converged: {last:#?}\ninstances: {:#?}\n{}",
                w.mock
                    .instances()
                    .iter()
                    .map(|i| (i.id, i.label.clone(), i.actual_status.clone(), i.destroyed))
                    .collect::<Vec<_>>(),
                d.log()
            )
        });
        w.assert_one_create_per_label();
        assert_eq!(w.mock.live_instances(), 3, "{what}\n{}", d.log());
        let o = cli(&w.state(), &["down"]);
        assert!(o.status.success(), "{what}: {}\n{}", stderr(&o), d.log());
        wait_for(Duration::from_secs(30), "no live instance", || {
            w.mock.live_instances() == 0
        });
        assert_no_key(&format!("{}{}", stderr(&o), d.log()), w.mock.api_key());
        w.assert_one_create_per_label();
        eprintln!(
            "{what}: converged and torn down in {:.1} s ({} creates)",
            started.elapsed().as_secs_f64(),
            w.mock.creates_total()
        );
    }
}

/// Issue 30's restart test: ten vast nodes and ten `kill -9` restarts of the
/// daemon. Agents still running rejoin the restarted daemon; none is
/// refused, so no healthy node is replaced and no machine rented again.
/// `SWACTOR_VAST_RESTARTS` sets the restarts (default 10).
#[test]
fn ten_restarts_replace_no_healthy_vast_node() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let restarts: u32 = env_or("SWACTOR_VAST_RESTARTS", 10);
    let w = World::new(offers(12, 0.3));
    let shape = w.shape("ten.toml", 10, "");
    let mut d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    let first = w.ready(&d, 10);
    let attempts = |s: &swactor_actors::ClusterSnapshot| -> BTreeMap<String, u64> {
        s.nodes
            .iter()
            .map(|n| (n.node.to_string(), n.attempt.0))
            .collect()
    };
    let before = attempts(&first);
    assert_eq!(w.mock.creates_total(), 10, "{}", d.log());
    for i in 0..restarts {
        d.kill9();
        drop(d);
        let started = std::time::Instant::now();
        d = w
            .up(&shape, &w.env())
            .unwrap_or_else(|e| panic!("restart {i}: {}", e.log));
        let snap = w.ready(&d, 10);
        eprintln!("restart {i}: 10 ready again in {:?}", started.elapsed());
        assert_eq!(
            attempts(&snap),
            before,
            "restart {i}: a healthy node was replaced\n{}\nthe agents' logs:\n{}",
            d.last_log(),
            w.agent_logs()
        );
        assert_eq!(w.mock.creates_total(), 10, "restart {i}: {}", d.last_log());
        assert!(
            !d.last_log().contains("is not a node of this cluster"),
            "restart {i}: a rejoin was refused\n{}",
            d.last_log()
        );
    }
    assert_eq!(w.mock.live_instances(), 10);
    w.down();
}

/// A 429 burst and answers cut off mid-JSON, more than one read retries,
/// when the daemon starts: it waits, says so, and converges once the service
/// answers (it used to exit). A refused key still stops it at once.
#[test]
fn faults_at_start_are_waited_out_and_said() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(4, 0.3));
    let shape = w.shape("two.toml", 2, "");
    w.mock.rate_burst(swactor_vastmock::Endpoint::List, 2);
    w.mock.malformed(swactor_vastmock::Endpoint::List, 8);
    let d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("the daemon exited: {}", e.log));
    w.ready(&d, 2);
    let log = d.last_log();
    assert!(
        log.contains("asking again in 1 s"),
        "the wait is said: {log}"
    );
    assert_eq!(w.mock.creates_total(), 2, "{log}");
    let o = cli(&w.state(), &["down"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Issue 30, fix 3: a machine whose node failed after it was ready (its
/// instance exited, or its agent died) is not rented again for the node's
/// replacement, and the skip survives a restart of the daemon (it is kept
/// on disk, with its reason and expiry).
#[test]
fn a_machine_whose_node_failed_is_skipped_across_restarts() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    // Machines 700, 701, 702, cheapest first.
    let w = World::new(offers(3, 0.3));
    let shape = w.shape("one.toml", 1, "");
    let live_offer = || {
        let live: Vec<u64> = w
            .mock
            .instances()
            .into_iter()
            .filter(|i| !i.destroyed && i.actual_status.as_deref() != Some("exited"))
            .map(|i| i.offer_id)
            .collect();
        assert!(live.len() <= 1, "one node, one live instance: {live:?}");
        live.first().copied()
    };
    let kill_live = || {
        let victim = w
            .mock
            .instances()
            .into_iter()
            .find(|i| !i.destroyed && i.actual_status.as_deref() == Some("running"))
            .expect("a running instance");
        assert_eq!(w.mock.kill(Selector::Id(victim.id), Death::Exited), 1);
        victim.offer_id
    };
    let mut d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    w.ready(&d, 1);
    assert_eq!(live_offer(), Some(5000));

    // Its instance exits: the node fails and is replaced elsewhere.
    assert_eq!(kill_live(), 5000);
    wait_for(CONVERGE, "a second rental", || w.mock.creates_total() == 2);
    w.ready(&d, 1);
    assert_eq!(live_offer(), Some(5001), "{}", d.last_log());

    // A restart forgets nothing. The next node fails another way (its agent
    // dies while the instance runs on): its machine is skipped too, and the
    // replacement goes to the third machine, not back to the cheapest.
    d.kill9();
    drop(d);
    let d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    w.ready(&d, 1);
    let second = w
        .mock
        .instances()
        .into_iter()
        .find(|i| !i.destroyed && i.actual_status.as_deref() == Some("running"))
        .expect("a running instance");
    assert_eq!(second.offer_id, 5001);
    w.kill_agents_in(&second.dir);
    wait_for(CONVERGE, "a third rental", || w.mock.creates_total() == 3);
    w.ready(&d, 1);
    assert_eq!(live_offer(), Some(5002), "{}", d.last_log());
    w.assert_one_create_per_label();
    let o = cli(&w.state(), &["down"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Issue 30, fix 5: `examples/vast.toml`, as written, converges on the mock
/// with its default offers: two offers fit its query, and its boot check,
/// `nvidia-smi`, finds the mock's, which reports the offer's GPU.
#[test]
fn the_example_converges_on_the_default_mock_as_written() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::with(MockConfig::fast());
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/vast.toml");
    let shape = w.root().join("vast.toml");
    std::fs::copy(&example, &shape).unwrap();
    let d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    let snap = w.ready(&d, 2);
    assert_eq!(w.mock.creates_total(), 2, "{}", d.log());
    assert!(snap.nodes.iter().all(|n| n.ready), "{snap:#?}");
    // What the boot check ran, run again on one of the machines.
    let i = w
        .mock
        .instances()
        .into_iter()
        .find(|i| !i.destroyed)
        .unwrap();
    let out = std::process::Command::new(i.dir.join("bin/nvidia-smi"))
        .args(["--query-gpu=name,memory.total", "--format=csv,noheader"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "NVIDIA RTX 4090, 24564 MiB"
    );
    w.down();
}

/// Issue 30, fix 2: two daemons with the same run on one account, each with
/// its own state directory (two people trying `examples/vast.toml`). Each
/// labels its instances with its own deployment, never adopts or destroys
/// the other's, and lists them in `status` as foreign with their price; a
/// restart adopts only its own, and `down` removes only its own. (Before:
/// the second took the first's instances as its own, then each replaced
/// the other's, renting some labels twice.)
#[test]
fn two_deployments_of_one_run_on_one_account_never_touch_each_other() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(10, 0.3));
    let shape = w.shape("three.toml", 3, "");
    let (a, b) = (w.root().join("state-a"), w.root().join("state-b"));
    let mut da = w
        .up_in(&a, &shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    let first_a = w.ready_in(&a, &da, 3);
    let db = w
        .up_in(&b, &shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    let first_b = w.ready_in(&b, &db, 3);
    let (dep_a, dep_b) = (deployment_of(&a), deployment_of(&b));
    assert_ne!(dep_a, dep_b);
    assert_eq!(first_a.deployment.as_deref(), Some(dep_a.as_str()));
    assert!(
        db.log().contains("another deployment made") && db.log().contains(&dep_a),
        "the second daemon says at start what it found: {}",
        db.log()
    );
    let attempts = |s: &swactor_actors::ClusterSnapshot| -> BTreeMap<String, u64> {
        s.nodes
            .iter()
            .map(|n| (n.node.to_string(), n.attempt.0))
            .collect()
    };
    // Six instances, each label made once, three per deployment.
    assert_eq!(w.mock.live_instances(), 6);
    assert_eq!(w.mock.creates_total(), 6, "{}\n{}", da.log(), db.log());
    w.assert_one_create_per_label();
    let labels: Vec<String> = w
        .mock
        .instances()
        .into_iter()
        .filter_map(|i| i.label)
        .collect();
    for dep in [&dep_a, &dep_b] {
        let prefix = format!("swactor/{dep}:gpu:");
        assert_eq!(
            labels.iter().filter(|l| l.starts_with(&prefix)).count(),
            3,
            "{labels:?}"
        );
    }
    // B, started second, lists A's three as foreign, with their price.
    let text = stdout(&cli(&b, &["status"]));
    assert!(
        text.contains("foreign: 3 resource(s) of run gpu made by another deployment")
            && text.contains(&format!("deployment {dep_a}"))
            && text.contains("0.30"),
        "{text}"
    );
    // A restart of A adopts its own three and nothing else, and A now
    // lists B's as foreign (as of its listing at start).
    da.kill9();
    drop(da);
    let da = w
        .up_in(&a, &shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    let again = w.ready_in(&a, &da, 3);
    assert_eq!(attempts(&again), attempts(&first_a), "{}", da.log());
    assert_eq!(w.mock.creates_total(), 6, "{}", da.log());
    let snap_a = wait_converged(&a, CONVERGE, |s| s.foreign.len() == 3);
    assert!(
        snap_a
            .foreign
            .iter()
            .all(|f| f.deployment.as_deref() == Some(dep_b.as_str())
                && f.provider == "vast"
                && f.usd_per_hour_micros.is_some()),
        "{:#?}",
        snap_a.foreign
    );
    // `down` on A removes A's three only; B's run on, unreplaced.
    let o = cli(&a, &["down"]);
    assert!(o.status.success(), "{}", stderr(&o));
    wait_for(Duration::from_secs(60), "A's instances gone", || {
        w.mock.live_instances() == 3
    });
    let live: Vec<String> = w
        .mock
        .instances()
        .into_iter()
        .filter(|i| !i.destroyed)
        .filter_map(|i| i.label)
        .collect();
    assert!(
        live.iter()
            .all(|l| l.starts_with(&format!("swactor/{dep_b}:"))),
        "{live:?}"
    );
    std::thread::sleep(Duration::from_secs(3));
    let snap_b = w.ready_in(&b, &db, 3);
    assert_eq!(attempts(&snap_b), attempts(&first_b), "{}", db.log());
    assert_eq!(w.mock.creates_total(), 6);
    let o = cli(&b, &["down"]);
    assert!(o.status.success(), "{}", stderr(&o));
    wait_for(Duration::from_secs(60), "no live instance", || {
        w.mock.live_instances() == 0
    });
}

/// Issue 30: `budget_usd`. Four instances at about 3 $/h each (0.2 $ a
/// minute together) and a budget of 0.183 $: `status` and `/metrics` show
/// the spend, the daemon says as the end nears, and it tears the run down
/// (as `down` does) before the budget is spent: what the mock billed, from
/// each instance's start to its destroy, is never over the budget by more
/// than a minute of spend, nor short of it by more than the lead the
/// daemon keeps (30 s) and a few seconds.
#[test]
fn a_budget_tears_the_run_down_before_it_is_overspent() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(6, 3.0));
    let budget = 0.183;
    let shape = shape_file(
        w.root(),
        "budget.toml",
        &format!(
            "run = \"gpu\"\nbudget_usd = {budget}\n[[group]]\nid = \"w\"\ncount = 4\n\
             provider = \"vast\"\nimage = \"pytorch/pytorch:latest\"\nboot_check = [\"true\"]\n\
             [group.params]\ngpu_name = \"RTX_4090\"\nmax_dph = 5.0\n"
        ),
    );
    // Each instance's start and price, and when it was seen destroyed.
    let mut ended: BTreeMap<u64, f64> = BTreeMap::new();
    let mut started: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    let now_unix = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
    };
    let mut d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    let mut seen_status = String::new();
    let deadline = Instant::now() + Duration::from_secs(150);
    let exit = loop {
        if let Some(status) = d.child.as_mut().unwrap().try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "not torn down: {}", d.log());
        std::thread::sleep(Duration::from_millis(100));
        for i in w.mock.instances() {
            let dph = i.row["dph_total"].as_f64().unwrap_or(0.0);
            let start = i.row["start_date"].as_f64().unwrap_or(0.0);
            started.entry(i.id).or_insert((start, dph));
            if i.destroyed {
                ended.entry(i.id).or_insert_with(now_unix);
            }
        }
        if seen_status.is_empty() && w.mock.live_instances() == 4 {
            let text = stdout(&cli(&w.state(), &["status"]));
            if text.contains("budget: ") {
                seen_status = text;
            }
        }
    };
    assert!(exit.success(), "the daemon exited {exit}: {}", d.log());
    let end = now_unix();
    for i in w.mock.instances() {
        if i.destroyed || !started.contains_key(&i.id) {
            ended.entry(i.id).or_insert(end);
        }
    }
    assert_eq!(w.mock.live_instances(), 0, "{}", d.log());
    assert!(
        seen_status.contains("of 0.183 $ spent")
            && seen_status.contains("then the run is torn down"),
        "{seen_status}"
    );
    let log = d.log();
    assert!(log.contains("tearing the run down"), "{log}");
    let billed: f64 = started
        .iter()
        .map(|(id, (start, dph))| {
            dph * (ended.get(id).copied().unwrap_or(end) - start).max(0.0) / 3600.0
        })
        .sum();
    let rate: f64 = started.values().map(|(_, dph)| dph).sum::<f64>() / 60.0;
    eprintln!(
        "budget {budget} $: billed {billed:.4} $ over {} instances at {:.3} $/min",
        started.len(),
        rate
    );
    assert!(
        billed <= budget + rate,
        "overspent: {billed} $ of {budget} $"
    );
    assert!(
        billed >= budget - rate * 40.0 / 60.0,
        "torn down too early: {billed} $ of {budget} $"
    );
}

/// Issue 30: interruptible rentals. Four nodes rented at a bid of 0.5 $/h;
/// running instances are outbid at random (`SWACTOR_VAST_OUTBIDS` times,
/// 4 by default; seed `SWACTOR_VAST_OUTBID_SEED`). An outbid instance is
/// paused (stopped, still billing storage); its node is replaced, and the
/// paused instance is destroyed before its replacement is rented: no node
/// ever has a paused instance beside another. Every label is rented once,
/// and `down` leaves nothing.
#[test]
fn outbid_nodes_are_replaced_and_never_leave_a_paused_instance_beside_the_new_one() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let outbids: u64 = env_or("SWACTOR_VAST_OUTBIDS", 4);
    let seed: u64 = env_or("SWACTOR_VAST_OUTBID_SEED", 7);
    let w = World::new(offers(12, 0.3));
    let shape = w.shape("bid.toml", 4, "rental = \"interruptible\"\nbid_dph = 0.5\n");
    let d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    let first = w.ready(&d, 4);
    // Rented at the bid: 0.5 $/h and 16 GB of storage.
    for i in w.mock.instances() {
        assert_eq!(i.row["is_bid"], true, "{}", i.row);
        let dph = i.row["dph_total"].as_f64().unwrap();
        assert!((dph - (0.5 + 0.15 * 16.0 / 720.0)).abs() < 1e-9, "{dph}");
    }
    let node_of = |label: &str| label.rsplit(':').nth(1).unwrap_or("").to_owned();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let mut rng = Rng(seed);
    let mut outbid_ids = Vec::new();
    let violations = std::thread::scope(|s| {
        let watcher = s.spawn(|| {
            let mut seen = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut by_node: BTreeMap<String, Vec<(u64, String)>> = BTreeMap::new();
                for i in w.mock.instances().into_iter().filter(|i| !i.destroyed) {
                    let status = i.actual_status.clone().unwrap_or_default();
                    by_node
                        .entry(node_of(i.label.as_deref().unwrap_or("")))
                        .or_default()
                        .push((i.id, status));
                }
                for (node, list) in by_node {
                    if list.len() > 1 && list.iter().any(|(_, s)| s == "stopped") {
                        seen.push(format!("{node}: {list:?}"));
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            seen
        });
        for round in 0..outbids {
            let running: Vec<u64> = w
                .mock
                .instances()
                .into_iter()
                .filter(|i| !i.destroyed && i.actual_status.as_deref() == Some("running"))
                .map(|i| i.id)
                .collect();
            let id = running[rng.below(running.len() as u64) as usize];
            assert_eq!(w.mock.outbid(Selector::Id(id)), 1, "round {round}");
            outbid_ids.push(id);
            // Paused, then replaced: a new attempt for its node, ready.
            wait_for(
                Duration::from_secs(60),
                "the outbid instance destroyed",
                || w.mock.instance(id).is_none_or(|i| i.destroyed),
            );
            w.ready(&d, 4);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        watcher.join().unwrap()
    });
    assert!(violations.is_empty(), "paused beside live: {violations:?}");
    let last = w.ready(&d, 4);
    let replaced = first
        .nodes
        .iter()
        .zip(&last.nodes)
        .filter(|(a, b)| a.attempt != b.attempt)
        .count();
    assert!(replaced >= 1, "{:#?}", last.nodes);
    assert_eq!(w.mock.creates_total(), 4 + outbids, "{}", d.log());
    w.assert_one_create_per_label();
    w.down();
}

/// Issue 30: `on_preempt = "wait"`. Two nodes rented at a bid; their group
/// waits 12 s for a paused machine, far past its 2 s grace. One instance
/// is outbid and its bid wins again 6 s later: its agent is started again
/// by the instance's own `onstart`, rejoins, and the node keeps its
/// attempt and its machine (nothing rented). The other is outbid and never
/// resumes: it is kept for the wait, then destroyed and its node rented
/// elsewhere, never at its grace's end.
#[test]
fn a_waiting_group_keeps_a_paused_node_that_resumes_and_replaces_one_that_does_not() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(8, 0.3));
    let shape = shape_file(
        w.root(),
        "wait.toml",
        "run = \"gpu\"\n[[group]]\nid = \"w\"\ncount = 2\nprovider = \"vast\"\n\
         image = \"pytorch/pytorch:latest\"\nboot_check = [\"true\"]\nlost_grace_s = 2\n\
         endpoint_timeout_s = 60\non_preempt = \"wait\"\npreempt_wait_s = 12\n\
         [group.params]\ngpu_name = \"RTX_4090\"\nmax_dph = 1.0\n\
         rental = \"interruptible\"\nbid_dph = 0.5\n",
    );
    let d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    let first = w.ready(&d, 2);
    let ids: Vec<u64> = w
        .mock
        .instances()
        .into_iter()
        .filter(|i| !i.destroyed)
        .map(|i| i.id)
        .collect();
    assert_eq!(ids.len(), 2);

    // The first comes back.
    assert_eq!(w.mock.outbid(Selector::Id(ids[0])), 1);
    let noticed = Instant::now();
    while !d.log().contains("paused by its provider") {
        assert!(
            noticed.elapsed() < Duration::from_secs(20),
            "the pause not noticed: {}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(6));
    let paused = w.mock.instance(ids[0]).expect("the paused instance");
    assert!(!paused.destroyed, "destroyed while waited for: {}", d.log());
    assert_eq!(w.mock.creates_total(), 2, "{}", d.log());
    assert_eq!(w.mock.bid_wins(Selector::Id(ids[0])), 1);
    let back = w.ready(&d, 2);
    assert_eq!(
        first
            .nodes
            .iter()
            .map(|n| (n.node, n.attempt))
            .collect::<Vec<_>>(),
        back.nodes
            .iter()
            .map(|n| (n.node, n.attempt))
            .collect::<Vec<_>>(),
        "no node replaced: {}",
        d.log()
    );
    assert_eq!(w.mock.creates_total(), 2, "{}", d.log());

    // The second does not.
    let outbid_at = Instant::now();
    assert_eq!(w.mock.outbid(Selector::Id(ids[1])), 1);
    wait_for(
        Duration::from_secs(60),
        "the paused instance destroyed",
        || w.mock.instance(ids[1]).is_none_or(|i| i.destroyed),
    );
    let waited = outbid_at.elapsed();
    assert!(
        waited >= Duration::from_secs(12),
        "replaced after {waited:?}, before the wait's end: {}",
        d.log()
    );
    w.ready(&d, 2);
    assert_eq!(w.mock.creates_total(), 3, "{}", d.log());
    w.assert_one_create_per_label();
    w.down();
}

/// Issue 30: `ssh = "proxy"`. The two cheapest offers have no open port:
/// a group that reaches its machines through the service's SSH proxy rents
/// them and converges through it (their instances show no direct port), and
/// `down` leaves nothing.
#[test]
fn a_proxy_group_rents_machines_without_open_ports_and_converges_through_the_proxy() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let mut all = offers(4, 0.3);
    for o in &mut all[..2] {
        o.extra
            .insert("direct_port_count".into(), serde_json::json!(0));
    }
    let w = World::new(all);
    let shape = w.shape("proxy.toml", 2, "ssh = \"proxy\"\n");
    let d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    w.ready(&d, 2);
    let live: Vec<_> = w
        .mock
        .instances()
        .into_iter()
        .filter(|i| !i.destroyed)
        .collect();
    assert_eq!(live.len(), 2);
    for i in &live {
        assert!([5000, 5001].contains(&i.offer_id), "{}", i.row);
        assert!(
            i.row["ports"].get("22/tcp").is_none(),
            "no direct port: {}",
            i.row
        );
        assert_eq!(i.row["ssh_host"], "localhost", "{}", i.row);
    }
    assert_eq!(w.mock.creates_total(), 2, "{}", d.log());
    w.down();
}

/// Issue 30: what a run has spent is kept in its journal. Two nodes at
/// about 3 $/h, one replaced (its rental ended); the daemon is killed and
/// the provider's own spend records (`vast/spent.json` and every create
/// record) are deleted. The restarted daemon adopts the instances by label,
/// and `status` still shows at least what was spent before (less the last
/// cent, which the journal may not have been told yet); the provider alone
/// would say 0.
#[test]
fn the_spend_survives_the_provider_losing_its_records() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = World::new(offers(6, 3.0));
    let shape = shape_file(
        w.root(),
        "spent.toml",
        "run = \"gpu\"\nbudget_usd = 100.0\n[[group]]\nid = \"w\"\ncount = 2\n\
         provider = \"vast\"\nimage = \"pytorch/pytorch:latest\"\nboot_check = [\"true\"]\n\
         [group.params]\ngpu_name = \"RTX_4090\"\nmax_dph = 5.0\n",
    );
    let mut d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    w.ready(&d, 2);
    let o = cli(&w.state(), &["replace", "w-0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    wait_for(Duration::from_secs(60), "w-0 replaced", || {
        status(&w.state()).is_some_and(|s| {
            s.nodes.iter().filter(|n| n.ready).count() == 2
                && s.nodes
                    .iter()
                    .any(|n| n.node.to_string() == "w-0" && n.attempt.0 > 2)
        })
    });
    let spent = |s: &swactor_actors::ClusterSnapshot| s.spend.map_or(0, |s| s.spent_micros);
    let mut before = 0;
    wait_for(Duration::from_secs(60), "5 cents spent", || {
        before = status(&w.state()).map_or(0, |s| spent(&s));
        before >= 50_000
    });
    // Two budget checks (5 s apart) tell the journal.
    std::thread::sleep(Duration::from_secs(11));
    before = status(&w.state()).map_or(0, |s| spent(&s)).max(before);
    d.kill9();
    drop(d);
    let vast = w.state().join("vast");
    std::fs::remove_file(vast.join("spent.json")).expect("the ended rental's cost was kept");
    std::fs::remove_dir_all(vast.join("leases")).unwrap();
    let d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    let after = w.ready(&d, 2);
    let after = spent(&after).max(status(&w.state()).map_or(0, |s| spent(&s)));
    assert!(
        after + swactor_provisioning::SPENT_RECORD_STEP_MICROS * 2 >= before,
        "spent {before} µ$ before, {after} µ$ after losing the records: {}",
        d.last_log()
    );
    assert_eq!(w.mock.creates_total(), 3, "{}", d.last_log());
    w.down();
}

/// The dead-man's switch on Vast.ai: with the daemon back within the
/// lease nothing changes; with it gone for good, every instance destroys
/// itself with its own restricted key (never the account's), and a daemon
/// started afterwards rents each slot exactly once more. No agent ever
/// holds the account key: not in its environment, arguments or files.
#[test]
fn instances_of_a_daemon_gone_for_good_destroy_themselves_with_their_own_keys() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    const LEASE: Duration = Duration::from_secs(5);
    const MARGIN: Duration = Duration::from_secs(3);
    let w = World::new(offers(6, 0.3));
    let shape = shape_file(
        w.root(),
        "orphan.toml",
        "run = \"gpu\"\n[[group]]\nid = \"w\"\ncount = 2\nprovider = \"vast\"\n\
         image = \"pytorch/pytorch:latest\"\nboot_check = [\"true\"]\nlost_grace_s = 2\n\
         endpoint_timeout_s = 60\norphan_after_s = 5\n\
         [group.params]\ngpu_name = \"RTX_4090\"\nmax_dph = 1.0\n",
    );
    let mut d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    let before = w.ready(&d, 2);
    let mut ids: Vec<u64> = before
        .rentals
        .iter()
        .map(|r| r.instance.parse().unwrap())
        .collect();
    ids.sort_unstable();
    assert_eq!(ids.len(), 2, "{:#?}", before.rentals);
    assert_no_account_key_on_instances(&w, &ids);

    // Back within the lease: every instance kept, nothing rented.
    d.kill9();
    let killed = Instant::now();
    drop(d);
    std::thread::sleep(Duration::from_secs(2));
    let d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    std::thread::sleep((LEASE + MARGIN).saturating_sub(killed.elapsed()));
    let after = w.ready(&d, 2);
    assert_eq!(w.mock.creates_total(), 2, "{}", d.log());
    assert!(w.mock.destroys().is_empty(), "{:?}", w.mock.destroys());
    for n in &after.nodes {
        let old = before.nodes.iter().find(|b| b.node == n.node).unwrap();
        assert_eq!(
            n.attempt, old.attempt,
            "{}: adopted, not made again",
            n.node
        );
    }

    // Gone for good: each instance ends itself, with its own key.
    let mut d = d;
    d.kill9();
    let killed = Instant::now();
    let log = d.log();
    drop(d);
    std::thread::sleep(LEASE - Duration::from_millis(1_500));
    assert_eq!(
        w.mock.live_instances(),
        2,
        "an instance ended before its lease"
    );
    wait_for(
        (LEASE + MARGIN).saturating_sub(killed.elapsed()),
        "every instance to destroy itself",
        || w.mock.live_instances() == 0,
    );
    eprintln!(
        "every instance gone {:?} after the daemon",
        killed.elapsed()
    );
    let mut by: Vec<_> = w
        .mock
        .destroys()
        .into_iter()
        .map(|d| (d.instance, d.by))
        .collect();
    by.sort_by_key(|(id, _)| *id);
    let own: Vec<_> = ids
        .iter()
        .map(|id| (*id, swactor_vastmock::KeyUse::Instance(*id)))
        .collect();
    assert_eq!(by, own, "each destroyed by its own key");
    wait_for(Duration::from_secs(5), "no agent left", || {
        w.agents().is_empty()
    });

    // A daemon started afterwards rents each slot once more.
    let d = w
        .up(&shape, &w.env())
        .unwrap_or_else(|e| panic!("{}", e.log));
    w.ready(&d, 2);
    assert_eq!(w.mock.creates_total(), 4, "{}", d.log());
    assert_eq!(w.mock.live_instances(), 2);
    w.assert_one_create_per_label();
    w.down();
    assert_no_key(&format!("{log}{}", d.log()), w.mock.api_key());
}

/// Neither the account key nor another instance's own key is in any agent's
/// environment or arguments, or in any file on the instances; each
/// instance's own key is where its agent will look for it.
fn assert_no_account_key_on_instances(w: &World, ids: &[u64]) {
    let account = w.mock.api_key().to_owned();
    let agents = w.agents();
    assert_eq!(agents.len(), ids.len(), "one agent per instance");
    for pid in agents {
        for what in ["environ", "cmdline"] {
            let bytes = std::fs::read(format!("/proc/{pid}/{what}")).unwrap();
            assert!(
                !holds(&bytes, account.as_bytes()),
                "the account key is in agent {pid}'s {what}"
            );
        }
    }
    for id in ids {
        let dir = w.mock.state_dir().join("machines").join(id.to_string());
        let own = w
            .mock
            .instance_key(*id)
            .expect("a live instance has its own key");
        // `onstart` runs beside the sshd, so it may still be writing.
        let file = dir
            .join("home")
            .join(swactor_providers::vast::INSTANCE_FILE);
        wait_for(Duration::from_secs(10), "onstart to keep the key", || {
            file.exists()
        });
        let kept = std::fs::read_to_string(&file).unwrap();
        assert_eq!(
            kept,
            format!("CONTAINER_ID={id}\nCONTAINER_API_KEY={own}\n")
        );
        let others: Vec<String> = ids
            .iter()
            .filter(|o| *o != id)
            .filter_map(|o| w.mock.instance_key(*o))
            .collect();
        for (path, bytes) in files_under(&dir) {
            assert!(
                !holds(&bytes, account.as_bytes()),
                "the account key is in {}",
                path.display()
            );
            for other in &others {
                assert!(
                    !holds(&bytes, other.as_bytes()),
                    "another instance's key is in {}",
                    path.display()
                );
            }
        }
    }
}
