//! The client and the store against real etcd clusters on loopback.

use super::testing::{EtcdCluster, unique_prefix};
use super::*;
use crate::journal::JournalBatch;
use std::time::{Duration, Instant};

fn put_op(key: &str, value: &str) -> Op {
    Op::Put {
        key: key.as_bytes().to_vec(),
        value: value.as_bytes().to_vec(),
        lease: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_puts_reads_pages_and_deletes_on_three_members() {
    let Some(cluster) = EtcdCluster::shared() else {
        return;
    };
    let client = cluster.client();
    let prefix = unique_prefix("kv");
    let first = client.put(format!("{prefix}/a"), b"1", None).await.unwrap();
    let second = client.put(format!("{prefix}/a"), b"2", None).await.unwrap();
    assert!(second > first, "{first} then {second}");
    let kv = client.get(format!("{prefix}/a")).await.unwrap().unwrap();
    assert_eq!(kv.value, b"2");
    assert_eq!(
        (kv.create_revision, kv.mod_revision, kv.version),
        (first, second, 2)
    );
    assert_eq!(client.get(format!("{prefix}/none")).await.unwrap(), None);

    for i in 0..5 {
        client
            .put(format!("{prefix}/p/{i}"), [i], None)
            .await
            .unwrap();
    }
    let mut range = Range::prefix(format!("{prefix}/p/"));
    range.limit = 2;
    let page = client.range(&range).await.unwrap();
    assert_eq!((page.kvs.len(), page.more, page.count), (2, true, 5));
    assert_eq!(page.kvs[1].key, format!("{prefix}/p/1").into_bytes());

    // Binary keys and values survive the gateway's base64.
    client
        .put([0xff, 0x00, b'/'], [0u8, 0xfe], None)
        .await
        .unwrap();
    assert_eq!(
        client.get([0xff, 0x00, b'/']).await.unwrap().unwrap().value,
        [0, 0xfe]
    );
    assert_eq!(client.delete([0xff, 0x00, b'/'], false).await.unwrap(), 1);

    assert_eq!(
        client.delete(format!("{prefix}/p/"), true).await.unwrap(),
        5
    );
    assert_eq!(client.delete(&prefix, true).await.unwrap(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transactions_comparison_decides_which_branch_runs() {
    let Some(cluster) = EtcdCluster::shared() else {
        return;
    };
    let client = cluster.client();
    let key = format!("{}/leader", unique_prefix("txn"));
    // Create-if-absent, as an election does: the winner learns its revision.
    let claim = |who: &str| Txn {
        compare: vec![Compare::created_at(key.as_bytes(), 0)],
        success: vec![put_op(&key, who)],
        failure: vec![Op::Get(Range::key(key.as_bytes()))],
    };
    let won = client.txn(&claim("a")).await.unwrap();
    assert!(won.succeeded);
    assert_eq!(won.responses, [OpResponse::Put]);
    let lost = client.txn(&claim("b")).await.unwrap();
    let e = lost.clone().check().unwrap_err();
    assert!(
        matches!(e, EtcdError::CompareFailed { revision } if revision >= won.revision),
        "{e}"
    );
    let [OpResponse::Get(page)] = lost.responses.as_slice() else {
        panic!("{lost:?}");
    };
    assert_eq!(page.kvs[0].value, b"a");
    assert_eq!(page.kvs[0].create_revision, won.revision);

    let by_value = Txn {
        compare: vec![Compare::value_is(key.as_bytes(), "a")],
        success: vec![Op::Delete {
            key: key.as_bytes().to_vec(),
            end: None,
        }],
        failure: vec![],
    };
    let deleted = client.txn(&by_value).await.unwrap();
    assert_eq!(
        (deleted.succeeded, deleted.responses),
        (true, vec![OpResponse::Delete(1)])
    );
    // The value is gone, so the same comparison now fails and nothing runs.
    let again = client.txn(&by_value).await.unwrap();
    assert_eq!((again.succeeded, again.responses), (false, vec![]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_kept_alive_outlives_its_ttl_and_expires_once_let_go() {
    let Some(cluster) = EtcdCluster::shared() else {
        return;
    };
    let client = cluster.client();
    let key = format!("{}/held", unique_prefix("lease"));
    let lease = client.lease_grant(2).await.unwrap();
    assert_eq!(lease.ttl_s, 2);
    client.put(&key, b"x", Some(lease.id)).await.unwrap();
    let kept_until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < kept_until {
        assert_eq!(client.lease_keep_alive(lease.id).await.unwrap(), Some(2));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        client.get(&key).await.unwrap().is_some(),
        "kept past its 2 s TTL"
    );
    assert!(client.lease_time_to_live(lease.id).await.unwrap().is_some());

    let let_go = Instant::now();
    while client.get(&key).await.unwrap().is_some() {
        assert!(
            let_go.elapsed() < Duration::from_secs(6),
            "the lease never expired"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let expired_after = let_go.elapsed();
    assert!(
        expired_after >= Duration::from_millis(1_500),
        "{expired_after:?}"
    );
    assert_eq!(client.lease_time_to_live(lease.id).await.unwrap(), None);
    assert_eq!(client.lease_keep_alive(lease.id).await.unwrap(), None);

    let revoked = client.lease_grant(30).await.unwrap();
    client.put(&key, b"y", Some(revoked.id)).await.unwrap();
    client.lease_revoke(revoked.id).await.unwrap();
    assert_eq!(client.get(&key).await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_member_is_skipped_and_a_frozen_one_costs_at_most_the_request_timeout() {
    let Some(mut cluster) = EtcdCluster::start(3) else {
        return;
    };
    let client = cluster.client();
    client.put("k", "v", None).await.unwrap();

    // Followers are the ones killed and frozen here: losing the leader
    // costs an election besides, which is not what is measured.
    let leader = cluster.leader().expect("a leader");
    let (dead, frozen) = ((leader + 1) % 3, (leader + 2) % 3);

    // A killed member refuses connections: the next one answers at once.
    let dead_first = {
        let mut config = cluster.config();
        config.endpoints = vec![cluster.endpoint(dead), cluster.endpoint(leader)];
        Client::new(config).unwrap()
    };
    dead_first.get("k").await.unwrap();
    cluster.kill(dead);
    let started = Instant::now();
    assert_eq!(dead_first.get("k").await.unwrap().unwrap().value, b"v");
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );

    cluster.restart(dead);

    // A frozen member takes connections and never answers: one request
    // timeout (1 s) is lost on it, no more.
    cluster.freeze(frozen);
    let frozen_first = {
        let mut config = cluster.config();
        config.endpoints = vec![cluster.endpoint(frozen), cluster.endpoint(leader)];
        Client::new(config).unwrap()
    };
    let started = Instant::now();
    assert_eq!(frozen_first.get("k").await.unwrap().unwrap().value, b"v");
    let took = started.elapsed();
    assert!(
        // Well under the 3 s a call may take: only the frozen member's 1 s was lost.
        (Duration::from_millis(900)..Duration::from_millis(2_500)).contains(&took),
        "{took:?}"
    );
    // The client then sticks to the member that answered.
    let started = Instant::now();
    frozen_first.get("k").await.unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );
    cluster.thaw(frozen);
    client.put("k", "w", None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_with_no_answer_poisons_the_store_until_it_is_opened_again() {
    let Some(cluster) = EtcdCluster::start(3) else {
        return;
    };
    let root = "/poison/swactor/v1/r";
    let open = || EtcdStore::open::<String, u32>(cluster.client(), root, "k", 1, Limits::default());
    let (store, _) = open().await.unwrap();
    let batch = |n: u32| JournalBatch {
        meta: Some(format!("meta {n}")),
        put: vec![(format!("n{n}"), n)],
        delete: vec![],
    };
    store.commit(&batch(1), None).await.unwrap();

    for i in 0..3 {
        cluster.freeze(i);
    }
    let started = Instant::now();
    let e = store.commit(&batch(2), None).await.unwrap_err();
    let took = started.elapsed();
    for i in 0..3 {
        cluster.thaw(i);
    }
    assert!(
        matches!(&e, EtcdStoreError::Etcd { source, .. } if source.is_ambiguous()),
        "{e}"
    );
    assert!(
        took < Duration::from_millis(3_500),
        "{took:?} for a 3 s call timeout"
    );
    let e = store.commit(&batch(3), None).await.unwrap_err();
    assert!(matches!(e, EtcdStoreError::Poisoned { .. }), "{e}");

    // Reopened, it reads what landed and writes again. The frozen commit
    // may land only now, after a thawed member reads what waited in its
    // socket: then the reopened store's first commit finds the journal
    // changed under it (`Changed`, nothing written), and opening once more
    // reads it. So at most two opens.
    let mut landed_late = false;
    loop {
        let (store, contents) = open().await.unwrap();
        assert!(contents.records.contains_key("n1"));
        match store.commit(&batch(4), None).await {
            Ok(()) => break,
            Err(EtcdStoreError::Changed { .. }) if !landed_late => landed_late = true,
            Err(e) => panic!("{e}"),
        }
    }
    let (_, contents) = open().await.unwrap();
    assert_eq!(contents.meta.as_deref(), Some("meta 4"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_refuses_to_write_over_a_journal_someone_else_wrote() {
    let Some(cluster) = EtcdCluster::shared() else {
        return;
    };
    let root = format!("{}/swactor/v1/r", unique_prefix("changed"));
    let open =
        || EtcdStore::open::<String, u32>(cluster.client(), &root, "k", 1, Limits::default());
    let (a, _) = open().await.unwrap();
    let (b, _) = open().await.unwrap();
    let batch = JournalBatch {
        meta: Some("a".to_owned()),
        put: vec![("x".to_owned(), 1)],
        delete: vec![],
    };
    a.commit(&batch, None).await.unwrap();
    let e = b.commit(&batch, None).await.unwrap_err();
    assert!(matches!(e, EtcdStoreError::Changed { .. }), "{e}");
    assert!(e.to_string().contains("another daemon"), "{e}");
    // The prefix deleted under a running store: its next commit is refused too.
    cluster
        .client()
        .delete(format!("{root}/"), true)
        .await
        .unwrap();
    let e = a.commit(&batch, None).await.unwrap_err();
    assert!(e.to_string().contains("journal was deleted"), "{e}");
    assert!(open().await.unwrap().1.meta.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn basic_auth_logs_in_and_logs_in_again_when_its_token_expires() {
    let Some(cluster) = EtcdCluster::start_with(1, &["--auth-token-ttl", "1"]) else {
        return;
    };
    let admin = reqwest::Client::builder()
        .no_proxy()
        .tls_backend_preconfigured(super::config::unused_tls().unwrap())
        .build()
        .unwrap();
    for (path, body) in [
        (
            "/v3/auth/user/add",
            r#"{"name":"root","password":"s3cret-pw"}"#,
        ),
        ("/v3/auth/user/grant", r#"{"user":"root","role":"root"}"#),
        ("/v3/auth/enable", "{}"),
    ] {
        let answer = admin
            .post(format!("{}{path}", cluster.endpoint(0)))
            .body(body)
            .send()
            .await
            .unwrap();
        assert!(answer.status().is_success(), "{path}: {}", answer.status());
    }
    let mut config = cluster.config();
    config.auth = Some(Credentials::new("root", "s3cret-pw"));
    let client = Client::new(config.clone()).unwrap();
    client.put("k", "v", None).await.unwrap();
    // Simple tokens of this cluster expire after a second unused.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(client.get("k").await.unwrap().unwrap().value, b"v");

    let e = cluster.client().get("k").await.unwrap_err();
    assert!(matches!(e, EtcdError::Refused { .. }), "{e}");
    config.auth = Some(Credentials::new("root", "wrong-pw"));
    let e = Client::new(config).unwrap().get("k").await.unwrap_err();
    assert!(matches!(e, EtcdError::Auth { .. }), "{e}");
    let words = format!("{e} {e:?}");
    assert!(
        !words.contains("wrong-pw") && !words.contains("s3cret"),
        "{words}"
    );
}

/// Makes a CA, a server certificate for 127.0.0.1 and a client
/// certificate with `openssl` in `dir`; false when openssl is missing.
fn make_certificates(dir: &std::path::Path) -> bool {
    let openssl = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl runs");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    if std::process::Command::new("openssl")
        .arg("version")
        .output()
        .is_err()
    {
        return false;
    }
    let key = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    for ca in ["ca", "other-ca"] {
        let mut args = vec!["req", "-x509", "-days", "1", "-subj"];
        let subject = format!("/CN=swactor test {ca}");
        args.push(&subject);
        args.extend(key);
        let (keyout, out) = (format!("{ca}.key"), format!("{ca}.pem"));
        args.extend(["-keyout", &keyout, "-out", &out]);
        openssl(&args);
    }
    std::fs::write(dir.join("server.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
    for (who, cn) in [("server", "/CN=127.0.0.1"), ("client", "/CN=swactor")] {
        let (keyout, csr, pem, ext) = (
            format!("{who}.key"),
            format!("{who}.csr"),
            format!("{who}.pem"),
            format!("{who}.ext"),
        );
        let mut args = vec!["req", "-new", "-subj", cn];
        args.extend(key);
        args.extend(["-keyout", &keyout, "-out", &csr]);
        openssl(&args);
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            &ext,
            "-out",
            &pem,
        ]);
    }
    true
}

/// A member that serves clients over TLS and asks each for a certificate
/// of its CA: the client reaches it with `--etcd-cacert`, `--etcd-cert`
/// and `--etcd-key`, and is refused without its certificate or when it
/// trusts another CA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_with_tls_and_client_certificates_is_reached_only_with_them() {
    if !super::testing::etcd_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    if !make_certificates(d) {
        assert!(
            std::env::var("SWACTOR_REQUIRE_ETCD").as_deref() != Ok("1"),
            "SWACTOR_REQUIRE_ETCD=1 but openssl is missing"
        );
        return;
    }
    let ports: Vec<std::net::TcpListener> = (0..2)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let port = |i: usize| ports[i].local_addr().unwrap().port();
    let (client_url, peer_url) = (
        format!("https://127.0.0.1:{}", port(0)),
        format!("http://127.0.0.1:{}", port(1)),
    );
    drop(ports);
    let path = |f: &str| d.join(f).to_str().unwrap().to_owned();
    let mut etcd = std::process::Command::new("/usr/bin/etcd")
        .args(["--name", "tls", "--data-dir", &path("data")])
        .args(["--listen-client-urls", &client_url])
        .args(["--advertise-client-urls", &client_url])
        .args(["--listen-peer-urls", &peer_url])
        .args(["--initial-advertise-peer-urls", &peer_url])
        .args(["--initial-cluster", &format!("tls={peer_url}")])
        .args([
            "--cert-file",
            &path("server.pem"),
            "--key-file",
            &path("server.key"),
        ])
        .args(["--client-cert-auth", "--trusted-ca-file", &path("ca.pem")])
        .args(["--logger", "zap", "--log-level", "warn"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(d.join("etcd.log")).unwrap())
        .spawn()
        .expect("etcd starts");
    struct Kill<'a>(&'a mut std::process::Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _kill = Kill(&mut etcd);
    let client = |tls: TlsFiles| {
        let mut config = EtcdConfig::new([client_url.clone()]);
        config.request_timeout = Duration::from_secs(1);
        config.call_timeout = Duration::from_secs(2);
        config.tls = Some(tls);
        Client::new(config).unwrap()
    };
    let full = TlsFiles {
        ca: d.join("ca.pem"),
        cert: Some(d.join("client.pem")),
        key: Some(d.join("client.key")),
    };
    let with_certificate = client(full.clone());
    // The member takes a moment to serve.
    let started = Instant::now();
    loop {
        match with_certificate.put("/tls/k", b"v", None).await {
            Ok(_) => break,
            Err(e) if started.elapsed() < Duration::from_secs(20) => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!(
                "no TLS answer: {e}\n{}",
                std::fs::read_to_string(d.join("etcd.log")).unwrap_or_default()
            ),
        }
    }
    let kv = with_certificate.get("/tls/k").await.unwrap().unwrap();
    assert_eq!(kv.value, b"v");
    let without = client(TlsFiles {
        cert: None,
        key: None,
        ..full.clone()
    });
    assert!(
        without.get("/tls/k").await.is_err(),
        "a client without a certificate was served"
    );
    let other_ca = client(TlsFiles {
        ca: d.join("other-ca.pem"),
        ..full
    });
    assert!(
        other_ca.get("/tls/k").await.is_err(),
        "a client trusting another CA took the member's certificate"
    );
}
