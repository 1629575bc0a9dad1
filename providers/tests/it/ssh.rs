//! The SSH substrate against a real OpenSSH server on 127.0.0.1 (see `ssh::testing::Sshd`).

use std::path::PathBuf;
use std::time::{Duration, Instant};
use swactor_providers::ProviderError;
use swactor_providers::ssh::testing::Sshd;
use swactor_providers::ssh::{
    ConnectOptions, KnownHosts, OUTPUT_KEEP_BYTES, RemoteLine, SshError, SshIdentity, SshSession,
    SshTarget, command_line, quote,
};
use tempfile::TempDir;

/// A server, a client key it accepts and an empty known hosts file.
struct World {
    tmp: TempDir,
    sshd: Sshd,
    identity: SshIdentity,
    known: KnownHosts,
}

fn world() -> World {
    let tmp = tempfile::tempdir().unwrap();
    let identity = SshIdentity::load_or_generate(&tmp.path().join("keys")).unwrap();
    let sshd_dir = tmp.path().join("sshd");
    std::fs::create_dir(&sshd_dir).unwrap();
    let sshd = Sshd::start(&sshd_dir, &[identity.public_openssh()]);
    let known = KnownHosts::open(&tmp.path().join("known_hosts"));
    World {
        tmp,
        sshd,
        identity,
        known,
    }
}

fn options(trust_on_first_use: bool) -> ConnectOptions {
    ConnectOptions {
        connect_timeout: Duration::from_secs(5),
        trust_on_first_use,
    }
}

impl World {
    async fn connect(&self, trust_on_first_use: bool) -> Result<SshSession, SshError> {
        SshSession::connect(
            &self.sshd.target(),
            &self.identity,
            &self.known,
            &options(trust_on_first_use),
        )
        .await
    }

    async fn session(&self) -> SshSession {
        match self.connect(true).await {
            Ok(session) => session,
            Err(e) => panic!("{e}\nsshd log:\n{}", self.sshd.log()),
        }
    }

    fn path(&self, name: &str) -> String {
        self.tmp.path().join(name).display().to_string()
    }
}

fn text(bytes: &[u8]) -> &str {
    std::str::from_utf8(bytes).unwrap()
}

#[tokio::test]
async fn exec_returns_stdout_stderr_and_the_exit_status_or_the_killing_signal() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = world();
    let session = w.session().await;

    let out = session
        .exec("echo out; echo err >&2; exit 3", None)
        .await
        .unwrap();
    assert_eq!(text(&out.stdout), "out\n");
    assert_eq!(text(&out.stderr), "err\n");
    assert_eq!((out.status, out.signal.as_deref()), (Some(3), None));
    assert!(!out.success());
    assert!(session.exec("true", None).await.unwrap().success());

    // The shell kills itself: no exit status, the signal instead.
    let out = session
        .exec("echo before; kill -KILL $$", None)
        .await
        .unwrap();
    assert_eq!(text(&out.stdout), "before\n");
    assert_eq!((out.status, out.signal.as_deref()), (None, Some("KILL")));
    assert_eq!(out.describe_exit(), "killed by signal 9 (SIGKILL)");

    // Output beyond the bound keeps its end.
    let out = session
        .exec("head -c 3000000 /dev/zero; echo end", None)
        .await
        .unwrap();
    assert_eq!(out.stdout.len(), OUTPUT_KEEP_BYTES);
    assert!(out.stdout.ends_with(b"\0end\n"));
    assert!(out.success());
}

#[tokio::test]
async fn stdin_is_piped_to_the_command_then_closed() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = world();
    let session = w.session().await;

    let input = b"line one\nline 'two' \x00\xff\n";
    let out = session.exec("cat", Some(input)).await.unwrap();
    assert_eq!(out.stdout, input);

    // More input than any window or buffer, read while output is produced.
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let out = session.exec("cat | wc -c", Some(&big)).await.unwrap();
    assert_eq!(text(&out.stdout).trim(), "3000000");
    let out = session.exec("cat", Some(&big)).await.unwrap();
    assert_eq!(out.stdout, big[big.len() - OUTPUT_KEEP_BYTES..]);

    // No input is an immediate end of file, and unread input is no obstacle.
    let out = session.exec("cat; echo done", None).await.unwrap();
    assert_eq!(text(&out.stdout), "done\n");
    let out = session.exec("exit 4", Some(&big)).await.unwrap();
    assert_eq!(out.status, Some(4));
}

#[tokio::test]
async fn exec_lines_delivers_each_line_as_it_is_written_then_the_exit() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = world();
    let session = w.session().await;

    let start = Instant::now();
    let mut lines = session
        .exec_lines(
            "echo first; sleep 0.5; echo second >&2; sleep 0.2; printf 'third\\r\\nno end'; exit 7",
        )
        .await
        .unwrap();
    assert_eq!(
        lines.lines.recv().await,
        Some(RemoteLine::Stdout("first".into()))
    );
    let first_at = start.elapsed();
    assert_eq!(
        lines.lines.recv().await,
        Some(RemoteLine::Stderr("second".into()))
    );
    let second_at = start.elapsed();
    assert!(
        second_at >= first_at + Duration::from_millis(400),
        "the first line came at {first_at:?}, only shortly before the second at {second_at:?}: \
         it was not streamed"
    );
    let mut rest = Vec::new();
    while let Some(line) = lines.lines.recv().await {
        rest.push(line);
    }
    assert_eq!(
        rest,
        vec![
            RemoteLine::Stdout("third".into()),
            RemoteLine::Stdout("no end".into()),
            RemoteLine::Exit(Some(7)),
        ]
    );

    let mut lines = session.exec_lines("echo x; kill -TERM $$").await.unwrap();
    assert_eq!(
        lines.lines.recv().await,
        Some(RemoteLine::Stdout("x".into()))
    );
    assert_eq!(lines.lines.recv().await, Some(RemoteLine::Exit(None)));
    assert_eq!(lines.lines.recv().await, None);
}

#[tokio::test]
async fn dropping_a_stream_closes_its_channel_and_a_chatty_command_ends() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = world();
    let session = w.session().await;
    let marker = format!("swactor-drop-{}", w.sshd.port());
    let mut lines = session
        .exec_lines(&format!("while :; do echo {marker}; sleep 0.05; done"))
        .await
        .unwrap();
    assert_eq!(
        lines.lines.recv().await,
        Some(RemoteLine::Stdout(marker.clone()))
    );
    // `[s]` keeps the pattern from matching pgrep's own command line.
    let running = || {
        std::process::Command::new("pgrep")
            .args(["-f", &format!("[s]{}", &marker[1..])])
            .status()
            .unwrap()
            .success()
    };
    assert!(running());
    drop(lines);
    let deadline = Instant::now() + Duration::from_secs(3);
    while running() {
        assert!(Instant::now() < deadline, "the remote loop still runs");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The session itself is unharmed.
    assert!(session.exec("true", None).await.unwrap().success());
}

#[tokio::test]
async fn upload_replaces_the_file_whole_with_its_mode_and_makes_its_directories() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = world();
    let session = w.session().await;
    let path = w.path("deep/er/file.bin");
    let quoted = quote(&path);

    let first: Vec<u8> = (0..=255u8).cycle().take(200_000).collect();
    session.upload(&path, &first, 0o640).await.unwrap();
    let out = session
        .exec(&format!("stat -c %a {quoted}; cat {quoted}"), None)
        .await
        .unwrap();
    let (mode, content) = out.stdout.split_at(4);
    assert_eq!(text(mode), "640\n");
    assert_eq!(content, &first[..]);

    // A hard link to the old file keeps the old content: the new one was
    // renamed in, never written over the old one in place.
    session
        .exec(&format!("ln {quoted} {}", quote(&w.path("old"))), None)
        .await
        .unwrap();
    session
        .upload(&path, b"#!/bin/sh\necho new\n", 0o755)
        .await
        .unwrap();
    let out = session
        .exec(&format!("{quoted}; stat -c %a {quoted}"), None)
        .await
        .unwrap();
    assert_eq!(text(&out.stdout), "new\n755\n");
    assert_eq!(std::fs::read(w.path("old")).unwrap(), first);
    let out = session
        .exec(&format!("ls -A {}", quote(&w.path("deep/er"))), None)
        .await
        .unwrap();
    assert_eq!(text(&out.stdout), "file.bin\n", "no temporary file left");

    // An empty file is a file too.
    let empty = w.path("empty");
    session.upload(&empty, b"", 0o600).await.unwrap();
    assert_eq!(std::fs::read(&empty).unwrap(), b"");

    // A failed step is a definite error with the remote message.
    let err = session
        .upload(&format!("{path}/under-a-file"), b"x", 0o600)
        .await
        .unwrap_err();
    assert!(matches!(err, SshError::Remote { .. }), "{err:?}");
    assert!(err.is_definite());
    assert!(err.to_string().contains("cannot create directory"), "{err}");
}

#[tokio::test]
async fn quoted_arguments_reach_a_remote_shell_unchanged() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = world();
    let session = w.session().await;
    let pwned = w.path("pwned");
    let mut hostile: Vec<String> = [
        "plain",
        "",
        " spaced  out ",
        "it's",
        "''",
        "\"double\"",
        "`id`",
        "$HOME ${HOME} $0",
        "line\nbreak",
        "-n",
        "--",
        "-e\\n",
        "\\back\\slash\\",
        "*",
        "~",
        "!bang #hash ;&|<>(){}[]",
        "A=b",
        "tab\there",
        "é ü 日本 🦀",
    ]
    .map(String::from)
    .into();
    hostile.push(format!("$(touch {pwned})"));
    hostile.push(format!("`touch {pwned}`; touch {pwned}"));
    let mut argv = vec!["printf".to_owned(), "%s\\0".to_owned()];
    argv.extend(hostile.iter().cloned());
    let line = command_line(&argv);
    // Once through the login shell, and once more through a nested `sh -c`.
    let nested = command_line(&["sh".into(), "-c".into(), line.clone()]);
    for command in [line, nested] {
        let out = session.exec(&command, None).await.unwrap();
        assert!(out.success(), "{}", text(&out.stderr));
        let mut got: Vec<String> = text(&out.stdout).split('\0').map(String::from).collect();
        assert_eq!(
            got.pop().as_deref(),
            Some(""),
            "every argument ends with NUL"
        );
        assert_eq!(got, hostile, "through {command}");
    }
    assert!(
        !std::path::Path::new(&pwned).exists(),
        "an argument ran as a command"
    );
}

#[tokio::test]
async fn trust_on_first_use_records_the_host_key_and_later_sessions_need_no_trust() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = world();
    assert!(!w.known.path().exists());
    let first = w.session().await;
    assert!(first.exec("true", None).await.unwrap().success());
    let recorded = std::fs::read_to_string(w.known.path()).unwrap();
    let name = format!("[127.0.0.1]:{}", w.sshd.port());
    assert!(
        recorded.starts_with(&format!("{name} ssh-ed25519 AAAA")),
        "{recorded}"
    );
    assert_eq!(recorded.lines().count(), 1);

    // ssh-keygen finds the recorded key and agrees on its fingerprint.
    let out = std::process::Command::new("ssh-keygen")
        .args(["-l", "-E", "sha256", "-F", &name, "-f"])
        .arg(w.known.path())
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&out.stdout);
    assert!(
        listing.contains(&w.sshd.host_key_fingerprint()),
        "{listing}"
    );

    let second = w.connect(false).await.unwrap();
    assert!(second.exec("true", None).await.unwrap().success());
    // Concurrent sessions to a known host record nothing more.
    let (a, b) = tokio::join!(w.connect(true), w.connect(true));
    a.unwrap();
    b.unwrap();
    assert_eq!(std::fs::read_to_string(w.known.path()).unwrap(), recorded);
}

#[tokio::test]
async fn an_unknown_host_is_refused_without_trust_on_first_use() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = world();
    let err = w.connect(false).await.unwrap_err();
    let SshError::UnknownHost {
        target,
        offered,
        file,
    } = &err
    else {
        panic!("{err:?}");
    };
    assert_eq!(target, &w.sshd.target().to_string());
    assert_eq!(offered, &w.sshd.host_key_fingerprint());
    assert_eq!(file, w.known.path());
    assert!(err.is_definite());
    assert!(!w.known.path().exists(), "nothing recorded");
    let shown = err.to_string();
    assert!(
        shown.contains("trust on first use") && shown.contains("known_hosts"),
        "{shown}"
    );
    assert!(matches!(
        ProviderError::from(err),
        ProviderError::Definite(_)
    ));
}

#[tokio::test]
async fn a_changed_host_key_is_refused_naming_both_fingerprints() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let mut w = world();
    w.session().await;
    let old = w.sshd.host_key_fingerprint();
    w.sshd.rotate_host_key();
    let new = w.sshd.host_key_fingerprint();
    assert_ne!(old, new);
    // Trust on first use does not cover a host already recorded.
    let err = w.connect(true).await.unwrap_err();
    let SshError::HostKeyChanged {
        known,
        offered,
        file,
        ..
    } = &err
    else {
        panic!("{err:?}");
    };
    assert_eq!((known, offered), (&old, &new));
    assert_eq!(file, w.known.path());
    assert!(err.is_definite());
    let shown = err.to_string();
    assert!(shown.contains(&old) && shown.contains(&new), "{shown}");
    assert!(
        shown.contains(&w.known.path().display().to_string()),
        "{shown}"
    );
}

#[tokio::test]
async fn a_key_the_server_does_not_accept_is_refused_at_once_and_for_good() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = world();
    let stranger = SshIdentity::load_or_generate(&w.tmp.path().join("stranger")).unwrap();
    let start = Instant::now();
    let err = SshSession::connect(&w.sshd.target(), &stranger, &w.known, &options(true))
        .await
        .unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    assert!(matches!(err, SshError::Auth { .. }), "{err:?}");
    assert!(err.is_definite());
    let shown = err.to_string();
    assert!(shown.contains(&stranger.fingerprint()), "{shown}");
    assert!(shown.contains("user root"), "{shown}");
    assert!(shown.contains(&stranger.public_openssh()), "{shown}");
    assert!(matches!(
        ProviderError::from(err),
        ProviderError::Definite(_)
    ));
    // The server saw the attempt: it was a real refusal.
    assert!(
        w.sshd.log().contains("Failed publickey for root"),
        "{}",
        w.sshd.log()
    );
}

#[tokio::test]
async fn a_host_that_is_down_is_not_ready_and_its_open_sessions_break() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let mut w = world();
    let session = w.session().await;
    let running = {
        let session = session.clone();
        tokio::spawn(async move { session.exec("echo started; sleep 20", None).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    w.sshd.stop();
    let err = tokio::time::timeout(Duration::from_secs(5), running)
        .await
        .expect("a broken connection is noticed")
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, SshError::Broken { .. }), "{err:?}");
    assert!(!err.is_definite());
    assert!(matches!(
        ProviderError::from(err),
        ProviderError::Ambiguous(_)
    ));

    let start = Instant::now();
    let err = w.connect(true).await.unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    assert!(matches!(err, SshError::NotReady { .. }), "{err:?}");
    assert!(err.to_string().contains("connection refused"), "{err}");
    assert!(!err.is_definite());
    assert!(matches!(
        ProviderError::from(err),
        ProviderError::Ambiguous(_)
    ));

    // The same host back: same port, same host key, still trusted.
    w.sshd.start_again();
    let again = w.connect(false).await.unwrap();
    assert!(again.exec("true", None).await.unwrap().success());
    again.close().await;
    let err = again.exec("true", None).await.unwrap_err();
    assert!(matches!(err, SshError::Broken { .. }), "{err:?}");
}

#[tokio::test]
async fn a_port_that_accepts_but_never_speaks_ssh_is_not_ready_after_the_timeout() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let target = SshTarget {
        user: "root".into(),
        host: "127.0.0.1".into(),
        port: silent.local_addr().unwrap().port(),
    };
    let tmp = tempfile::tempdir().unwrap();
    let identity = SshIdentity::load_or_generate(tmp.path()).unwrap();
    let known = KnownHosts::open(&tmp.path().join("known_hosts"));
    let opts = ConnectOptions {
        connect_timeout: Duration::from_millis(500),
        trust_on_first_use: true,
    };
    let start = Instant::now();
    let err = SshSession::connect(&target, &identity, &known, &opts)
        .await
        .unwrap_err();
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_secs(2),
        "{took:?}"
    );
    assert!(matches!(err, SshError::NotReady { .. }), "{err:?}");
    assert!(err.to_string().contains("no SSH handshake"), "{err}");
}

#[tokio::test]
async fn commands_run_concurrently_on_one_session() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let w = world();
    let session = w.session().await;
    let start = Instant::now();
    let mut runs = tokio::task::JoinSet::new();
    for i in 0..6 {
        let session = session.clone();
        runs.spawn(async move { (i, session.exec(&format!("sleep 0.5; echo {i}"), None).await) });
    }
    let mut seen = 0;
    while let Some(joined) = runs.join_next().await {
        let (i, out) = joined.unwrap();
        assert_eq!(text(&out.unwrap().stdout), format!("{i}\n"));
        seen += 1;
    }
    assert_eq!(seen, 6);
    assert!(
        start.elapsed() < Duration::from_millis(2500),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn a_generated_key_is_private_reused_and_accepted_by_openssh_tools() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("state/ssh");
    let identity = SshIdentity::load_or_generate(&dir).unwrap();
    let key: PathBuf = dir.join("id_ed25519");
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&key), 0o600);
    assert_eq!(mode(&dir), 0o700);
    let again = SshIdentity::load_or_generate(&dir).unwrap();
    assert_eq!(again.public_openssh(), identity.public_openssh());
    assert_eq!(
        SshIdentity::load(&key).unwrap().fingerprint(),
        identity.fingerprint()
    );
    // OpenSSH reads the private key file and derives the same public key.
    let out = std::process::Command::new("ssh-keygen")
        .arg("-y")
        .arg("-f")
        .arg(&key)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let derived = String::from_utf8(out.stdout).unwrap();
    let ours = identity.public_openssh();
    assert_eq!(
        derived.split_whitespace().take(2).collect::<Vec<_>>(),
        ours.split_whitespace().take(2).collect::<Vec<_>>()
    );
    assert!(ours.ends_with(" swactor"));
}

#[test]
fn a_malformed_target_names_the_entry_and_the_expected_form() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let err = "10.0.0.5:22".parse::<SshTarget>().unwrap_err().to_string();
    assert!(
        err.contains("`10.0.0.5:22`") && err.contains("user is missing"),
        "{err}"
    );
    assert!(err.contains("user@host:port"), "{err}");
    let target: SshTarget = "root@[::1]:2222".parse().unwrap();
    assert_eq!((target.host.as_str(), target.port), ("::1", 2222));
    assert_eq!(target.to_string(), "root@[::1]:2222");
}
