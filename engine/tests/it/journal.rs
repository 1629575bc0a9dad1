//! The journal: round trips, refusals that leave the file untouched, and kill -9.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use swactor_engine::journal::{Journal, JournalBatch, JournalContents, JournalError};

const KIND: &str = "swactor-test";

/// A record type that postcard could not decode, as the daemon's are.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
enum Value {
    Slot { seq: u64, pad: String },
    Log(u64),
}

type Contents = JournalContents<u64, Value>;

fn open(path: &Path, format: u32) -> Result<(Journal, Contents), JournalError> {
    Journal::open::<u64, Value>(path, KIND, format)
}

fn batch(meta: Option<u64>, put: &[(&str, Value)], delete: &[&str]) -> JournalBatch<u64, Value> {
    JournalBatch {
        meta,
        put: put
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect(),
        delete: delete.iter().map(|k| (*k).to_owned()).collect(),
    }
}

fn slot(seq: u64) -> Value {
    Value::Slot {
        seq,
        pad: "x".repeat(64),
    }
}

/// A journal holding meta 1 and records "a" and "b", closed again.
async fn sample(dir: &Path) -> PathBuf {
    let path = dir.join("journal.redb");
    let (journal, contents) = open(&path, 1).unwrap();
    assert_eq!(contents, Contents::default(), "a new journal is empty");
    journal
        .commit(batch(Some(1), &[("a", slot(1)), ("b", Value::Log(7))], &[]))
        .await
        .unwrap();
    path
}

/// Runs `attempt` on the file at `path` and asserts it left the bytes as they were.
fn untouched<T>(path: &Path, attempt: impl FnOnce() -> T) -> T {
    let before = std::fs::read(path).unwrap();
    let out = attempt();
    let after = std::fs::read(path).unwrap();
    assert!(before == after, "a failed open changed {}", path.display());
    out
}

#[tokio::test]
async fn a_committed_batch_is_there_after_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample(dir.path()).await;
    let (journal, contents) = open(&path, 1).unwrap();
    assert_eq!(journal.path(), path);
    assert_eq!(contents.meta, Some(1));
    assert_eq!(
        contents.records,
        BTreeMap::from([("a".to_owned(), slot(1)), ("b".to_owned(), Value::Log(7))])
    );
}

#[tokio::test]
async fn one_batch_deletes_puts_and_replaces_the_meta_value() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample(dir.path()).await;
    let (journal, _) = open(&path, 1).unwrap();
    // A clone shares the open file.
    journal
        .clone()
        .commit(batch(
            Some(2),
            &[("b", Value::Log(8)), ("c", slot(2))],
            &["a", "never-existed"],
        ))
        .await
        .unwrap();
    // No meta: the stored one stays.
    journal
        .commit(batch(None, &[("d", Value::Log(9))], &[]))
        .await
        .unwrap();
    drop(journal);
    let (_journal, contents) = open(&path, 1).unwrap();
    assert_eq!(contents.meta, Some(2));
    assert_eq!(
        contents.records,
        BTreeMap::from([
            ("b".to_owned(), Value::Log(8)),
            ("c".to_owned(), slot(2)),
            ("d".to_owned(), Value::Log(9)),
        ])
    );
}

#[tokio::test]
async fn a_key_both_put_and_deleted_in_one_batch_ends_up_absent() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample(dir.path()).await;
    let (journal, _) = open(&path, 1).unwrap();
    journal
        .commit(batch(None, &[("e", Value::Log(1))], &["e"]))
        .await
        .unwrap();
    drop(journal);
    let (_journal, contents) = open(&path, 1).unwrap();
    assert!(!contents.records.contains_key("e"));
}

#[tokio::test]
async fn a_newer_format_is_refused_and_the_file_is_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.redb");
    let (journal, _) = open(&path, 3).unwrap();
    journal.commit(batch(Some(5), &[], &[])).await.unwrap();
    drop(journal);
    let err = untouched(&path, || open(&path, 2).unwrap_err());
    assert!(
        matches!(&err, JournalError::NewerFormat { path: p, found: 3, supported: 2 } if *p == path),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains(&path.display().to_string()) && message.contains("nothing was changed"),
        "{message}"
    );
}

#[tokio::test]
async fn an_older_format_is_accepted_and_the_first_commit_records_the_newer_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample(dir.path()).await;
    // Opening alone does not raise the format: an old build can still open it.
    drop(open(&path, 2).unwrap());
    let (journal, contents) = open(&path, 1).unwrap();
    assert_eq!(contents.meta, Some(1));
    drop(journal);

    let (journal, _) = open(&path, 2).unwrap();
    journal.commit(batch(Some(2), &[], &[])).await.unwrap();
    drop(journal);
    let err = open(&path, 1).unwrap_err();
    assert!(
        matches!(
            err,
            JournalError::NewerFormat {
                found: 2,
                supported: 1,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(open(&path, 2).unwrap().1.meta, Some(2));
}

#[tokio::test]
async fn another_kind_is_refused_and_the_file_is_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample(dir.path()).await;
    let err = untouched(&path, || {
        Journal::open::<u64, Value>(&path, "something-else", 1).unwrap_err()
    });
    match &err {
        JournalError::OtherKind {
            path: p,
            found,
            expected,
        } => {
            assert_eq!(*p, path);
            assert_eq!(found, KIND);
            assert_eq!(expected, "something-else");
        }
        other => panic!("expected OtherKind, got {other:?}"),
    }
}

fn assert_corrupt(path: &Path, err: &JournalError) {
    assert!(
        matches!(err, JournalError::Corrupt { path: p, .. } if p == path),
        "expected Corrupt, got {err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains(&path.display().to_string()) && message.contains("nothing was changed"),
        "{message}"
    );
}

#[test]
fn a_garbage_file_is_refused_and_left_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.redb");
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let garbage: Vec<u8> = (0..64 * 1024)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    std::fs::write(&path, &garbage).unwrap();
    let err = untouched(&path, || open(&path, 1).unwrap_err());
    assert_corrupt(&path, &err);
    assert!(
        std::error::Error::source(&err).is_some(),
        "redb's error is kept"
    );
}

#[test]
fn an_empty_file_is_refused_and_left_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.redb");
    std::fs::write(&path, b"").unwrap();
    let err = untouched(&path, || open(&path, 1).unwrap_err());
    assert_corrupt(&path, &err);
}

#[tokio::test]
async fn a_truncated_file_is_refused_and_left_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample(dir.path()).await;
    let whole = std::fs::read(&path).unwrap();
    for len in [whole.len() / 2, 4096, 100] {
        std::fs::write(&path, &whole[..len]).unwrap();
        let err = untouched(&path, || open(&path, 1).unwrap_err());
        assert_corrupt(&path, &err);
    }
}

#[tokio::test]
async fn a_value_that_does_not_decode_is_refused_and_the_file_is_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample(dir.path()).await;
    // Record "a" is a Slot, not a number.
    let err = untouched(&path, || {
        Journal::open::<u64, u64>(&path, KIND, 1).unwrap_err()
    });
    match &err {
        JournalError::Undecodable { path: p, what, .. } => {
            assert_eq!(*p, path);
            assert!(what.contains("\"a\""), "{what}");
        }
        other => panic!("expected Undecodable, got {other:?}"),
    }
    assert!(std::error::Error::source(&err).is_some());
}

#[tokio::test]
async fn a_held_journal_is_in_use_until_every_clone_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample(dir.path()).await;
    let (journal, _) = open(&path, 1).unwrap();
    let clone = journal.clone();
    drop(journal);
    let err = untouched(&path, || open(&path, 1).unwrap_err());
    assert!(
        matches!(&err, JournalError::InUse { path: p } if *p == path),
        "{err:?}"
    );
    assert!(err.to_string().contains("in use"), "{err}");
    drop(clone);
    open(&path, 1).unwrap();
}

#[tokio::test]
async fn a_lock_let_go_of_a_moment_later_is_waited_for() {
    // A process started just as a journal closed holds a copy of its file,
    // and so its lock, until it runs its program: here, another open file
    // locked, and closed 100 ms later.
    let dir = tempfile::tempdir().unwrap();
    let path = sample(dir.path()).await;
    let held = std::fs::File::open(&path).unwrap();
    held.lock().unwrap();
    let let_go = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(100));
        drop(held);
    });
    let (journal, contents) = open(&path, 1).unwrap();
    assert!(contents.meta.is_some());
    let_go.join().unwrap();
    drop(journal);
}

#[test]
fn a_new_journal_is_private_and_needs_its_parent() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.redb");
    drop(open(&path, 1).unwrap());
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != "journal.redb")
        .collect();
    assert!(
        leftovers.is_empty(),
        "no temporary files are left: {leftovers:?}"
    );

    let orphan = dir.path().join("missing").join("journal.redb");
    let err = open(&orphan, 1).unwrap_err();
    assert!(matches!(err, JournalError::NoParent { .. }), "{err:?}");
    assert!(err.to_string().contains("parent"), "{err}");
    assert!(!orphan.parent().unwrap().exists());
}

/// Selects the writer mode of `writer_child_commits_until_killed`: the journal's path.
const WRITER_ENV: &str = "SWACTOR_TEST_JOURNAL_WRITER";
/// Records "log-N" are kept for the newest this many batches.
const LOG_KEEP: u64 = 3;

/// Not a test on its own: with `WRITER_ENV` set, it is the child process of
/// `acknowledged_batches_survive_kill_9`, and commits numbered batches until
/// it is killed, printing `@ack N` only after batch N's commit returned.
#[test]
fn writer_child_commits_until_killed() {
    let Some(path) = std::env::var_os(WRITER_ENV) else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let (journal, contents) = open(Path::new(&path), 1).unwrap();
        let mut out = std::io::stdout().lock();
        let first = contents.meta.unwrap_or(0) + 1;
        writeln!(out, "@start {first}").unwrap();
        out.flush().unwrap();
        for seq in first.. {
            // Both slots carry the batch number, so a torn batch shows as a mismatch.
            let pad = "p".repeat(usize::try_from(seq % 7).unwrap() * 1500);
            let both = Value::Slot { seq, pad };
            let log = format!("log-{seq}");
            let old = seq.checked_sub(LOG_KEEP).map(|s| format!("log-{s}"));
            journal
                .commit(JournalBatch {
                    meta: Some(seq),
                    put: vec![
                        ("a".to_owned(), both.clone()),
                        ("b".to_owned(), both),
                        (log, Value::Log(seq)),
                    ],
                    delete: old.into_iter().collect(),
                })
                .await
                .unwrap();
            writeln!(out, "@ack {seq}").unwrap();
            out.flush().unwrap();
        }
    });
}

/// Checks a journal the writer left: every acknowledged batch is there, and
/// the contents are those after exactly one whole batch.
fn check_writer_journal(contents: &Contents, acked: u64, context: &str) -> u64 {
    let seq = contents
        .meta
        .unwrap_or_else(|| panic!("{context}: no meta"));
    assert!(
        seq >= acked,
        "{context}: batch {acked} was acknowledged but the journal stops at {seq}"
    );
    assert!(
        seq <= acked + 1,
        "{context}: the journal is at {seq}, but only {acked} was acknowledged and one more was under way"
    );
    for key in ["a", "b"] {
        match contents.records.get(key) {
            Some(Value::Slot { seq: s, pad }) => {
                assert_eq!(*s, seq, "{context}: record {key} is from another batch");
                assert_eq!(pad.len(), usize::try_from(seq % 7).unwrap() * 1500);
            }
            other => panic!("{context}: record {key} is {other:?}"),
        }
    }
    let logs: BTreeSet<&str> = contents
        .records
        .keys()
        .filter(|k| k.starts_with("log-"))
        .map(String::as_str)
        .collect();
    let want: BTreeSet<String> = (seq.saturating_sub(LOG_KEEP - 1).max(1)..=seq)
        .map(|s| format!("log-{s}"))
        .collect();
    let want: BTreeSet<&str> = want.iter().map(String::as_str).collect();
    assert_eq!(
        logs, want,
        "{context}: the log records are not a consistent prefix"
    );
    assert_eq!(
        contents.records.len(),
        2 + want.len(),
        "{context}: stray records"
    );
    seq
}

#[test]
fn acknowledged_batches_survive_kill_9() {
    const ROUNDS: usize = 5;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.redb");
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    let mut rng = seed;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut reached = 0;
    for round in 0..ROUNDS {
        let context = format!("round {round} (seed {seed})");
        let stderr = std::fs::File::create(dir.path().join(format!("child{round}.log"))).unwrap();
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "journal::writer_child_commits_until_killed",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(WRITER_ENV, &path)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // libtest's "test … ..." may share the first line.
                let line = line.rsplit_once('@').map_or("", |(_, marker)| marker);
                if let Some(n) = line.strip_prefix("ack ") {
                    let _ = tx.send(n.parse::<u64>().unwrap());
                } else if let Some(n) = line.strip_prefix("start ") {
                    // The child starts right after what the journal held.
                    let _ = tx.send(n.parse::<u64>().unwrap() - 1);
                }
            }
        });
        let started = rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| {
                let log = std::fs::read_to_string(dir.path().join(format!("child{round}.log")));
                panic!("{context}: the writer did not start: {log:?}")
            });
        assert_eq!(started, reached, "{context}: the writer resumed elsewhere");
        // Kill at a random moment once a few batches are in.
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut acked = started;
        while acked < started + 2 {
            assert!(Instant::now() < deadline, "{context}: the writer is stuck");
            if let Ok(n) = rx.recv_timeout(Duration::from_secs(1)) {
                acked = acked.max(n);
            }
        }
        std::thread::sleep(Duration::from_micros(next() % 150_000));
        child.kill().unwrap();
        child.wait().unwrap();
        reader.join().unwrap();
        acked = rx.try_iter().fold(acked, u64::max);

        // The file needs recovery now, and a refused open must not perform it.
        let err = untouched(&path, || {
            Journal::open::<u64, Value>(&path, "another-kind", 1).unwrap_err()
        });
        assert!(matches!(err, JournalError::OtherKind { .. }), "{err:?}");
        let (journal, contents) = open(&path, 1).unwrap();
        reached = check_writer_journal(&contents, acked, &context);
        eprintln!("{context}: acked {acked}, journal at {reached}");
        drop(journal);
    }
    assert!(
        reached >= 2 * ROUNDS as u64,
        "every round committed something"
    );
}
