//! An acknowledged control request is durable, even when the state directory
//! turns read-only or fills up under a running daemon.
//!
//! Each test puts the state directory on an ext4 file system of its own, in
//! a file attached through a loop device, so it can be made read-only (the
//! kernel's own `trigger_fs_error`, with `errors=remount-ro`, while the
//! daemon holds its journal open) or filled, as a failing disk would. That
//! needs root and a loop device: without them the tests say so and skip,
//! unless `SWACTOR_REQUIRE_LOOP=1` (CI), where that fails.

use crate::common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// A small ext4 file system mounted from an image file under `dir`.
struct LoopFs {
    image: PathBuf,
    mount: PathBuf,
}

impl LoopFs {
    /// `None` (after a line saying why) when this machine cannot mount one.
    fn mount(dir: &Path, mib: u64) -> Option<Self> {
        let image = dir.join("fs.img");
        let mount = dir.join("fs");
        std::fs::create_dir_all(&mount).unwrap();
        let file = std::fs::File::create(&image).unwrap();
        file.set_len(mib << 20).unwrap();
        drop(file);
        let ok = |c: &mut Command| c.output().is_ok_and(|o| o.status.success());
        let made = ok(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&image))
            && ok(Command::new("mount")
                .args(["-o", "loop,errors=remount-ro"])
                .arg(&image)
                .arg(&mount));
        // The state directory is the file system's root (so the daemon's
        // log, beside it, is not on it), and holds nothing of its own.
        let _ = std::fs::remove_dir(mount.join("lost+found"));
        if !made {
            let why = "cannot make and mount an ext4 file system on a loop device (needs root, \
                       mkfs.ext4 and /dev/loop-control)";
            assert!(
                std::env::var_os("SWACTOR_REQUIRE_LOOP").is_none(),
                "SWACTOR_REQUIRE_LOOP is set but this machine {why}"
            );
            eprintln!("skipped: this machine {why}");
            return None;
        }
        Some(Self { image, mount })
    }

    /// The block device's name (`loop3`), as `/sys/fs/ext4/` names it.
    fn device(&self) -> String {
        let o = Command::new("findmnt")
            .args(["-n", "-o", "SOURCE"])
            .arg(&self.mount)
            .output()
            .unwrap();
        let source = String::from_utf8_lossy(&o.stdout).trim().to_owned();
        source.rsplit('/').next().unwrap().to_owned()
    }

    /// Makes the mounted file system read-only from under its users, as the
    /// kernel does when it finds an error: open files stay open, and every
    /// later write fails with EROFS.
    fn break_to_read_only(&self) {
        let knob = format!("/sys/fs/ext4/{}/trigger_fs_error", self.device());
        std::fs::write(&knob, "swactor durable.rs").unwrap_or_else(|e| panic!("{knob}: {e}"));
        let probe = self.mount.join("probe");
        wait_for(
            Duration::from_secs(5),
            "the file system to turn read-only",
            || std::fs::write(&probe, b"x").is_err(),
        );
    }

    /// Fills the file system until a write fails for want of space; returns
    /// the filler, whose removal gives the space back.
    fn fill(&self) -> PathBuf {
        let filler = self.mount.join("filler");
        let mut f = std::fs::File::create(&filler).unwrap();
        let block = vec![0xa5u8; 1 << 16];
        loop {
            match std::io::Write::write_all(&mut f, &block) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(28) => break,
                Err(e) => panic!("filling {}: {e}", filler.display()),
            }
        }
        let _ = f.sync_all();
        // What is left in partial blocks, byte by byte-ish.
        let mut small = vec![0u8; 512];
        while std::io::Write::write_all(&mut f, &small).is_ok() {
            small.truncate(small.len().max(2) / 2);
            if small.is_empty() {
                break;
            }
        }
        assert!(
            std::fs::write(self.mount.join("one-more"), vec![1u8; 8192]).is_err(),
            "the file system is full"
        );
        filler
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        // Whatever still runs from it (a test that failed early) first.
        kill_agents(&self.mount);
        for _ in 0..50 {
            let done = Command::new("umount")
                .arg(&self.mount)
                .output()
                .is_ok_and(|o| o.status.success());
            if done {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = Command::new("umount").arg("-l").arg(&self.mount).output();
        let _ = std::fs::remove_file(&self.image);
    }
}

fn attempt_of(state: &Path, node: &str) -> u64 {
    let snap = status(state).expect("a status");
    snap.nodes
        .iter()
        .find(|n| n.node.to_string() == node)
        .unwrap_or_else(|| panic!("no {node} in {snap:#?}"))
        .attempt
        .0
}

/// The state directory turns read-only under a converged daemon: `replace`
/// and `pause` are refused, naming the journal, rather than answered as done;
/// the daemon stops on the journal it cannot write and leaves its nodes
/// running for the next one to adopt.
#[test]
fn a_read_only_state_directory_refuses_what_it_cannot_record() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(fs) = LoopFs::mount(tmp.path(), 64) else {
        return;
    };
    let state = fs.mount.clone();
    let shape = shape_file(tmp.path(), "two.toml", &workers("ro", 2));
    let mut daemon = Daemon::start(&state, &shape);
    wait_converged(&state, Duration::from_secs(60), |s| {
        s.nodes.iter().filter(|n| n.ready).count() == 2
    });
    let running = agents(&state);
    assert_eq!(running.len(), 2, "{running:?}");

    fs.break_to_read_only();
    let o = cli(&state, &["replace", "worker-0"]);
    let said = format!("{}{}", stdout(&o), stderr(&o));
    assert!(
        !o.status.success(),
        "a replace that cannot be written down is not acknowledged: {said}"
    );
    assert!(
        said.contains("journal"),
        "the refusal names the journal: {said}"
    );
    let o = cli(&state, &["pause"]);
    let said = format!("{}{}", stdout(&o), stderr(&o));
    assert!(!o.status.success(), "nor is a pause: {said}");

    // The daemon stops: acting on what is not on record could double-create.
    let code = daemon.wait_exit(Duration::from_secs(30));
    assert!(
        code.is_some_and(|c| c != 0),
        "the daemon stops with a failure, not {code:?}: {}",
        daemon.last_log()
    );
    assert!(
        daemon.last_log().contains("journal"),
        "its log names the journal: {}",
        daemon.last_log()
    );
    // Its nodes were left running, untouched: stopping is not tearing down.
    assert_eq!(agents(&state), running, "the agents outlive the daemon");
    kill_agents(&state);
}

/// The state directory fills up under a converged daemon. Whatever `replace`
/// and `pause` answer holds after a restart: an acknowledged replace started a
/// new attempt, an acknowledged pause is still in force; a refused one left
/// no trace.
#[test]
fn a_full_state_directory_acknowledges_only_what_it_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(fs) = LoopFs::mount(tmp.path(), 64) else {
        return;
    };
    let state = fs.mount.clone();
    let shape = shape_file(tmp.path(), "two.toml", &workers("full", 2));
    let mut daemon = Daemon::start(&state, &shape);
    wait_converged(&state, Duration::from_secs(60), |s| {
        s.nodes.iter().filter(|n| n.ready).count() == 2
    });
    let before = attempt_of(&state, "worker-0");

    let filler = fs.fill();
    let replaced = cli(&state, &["replace", "worker-0"]);
    let paused = cli(&state, &["pause"]);
    for (what, o) in [("replace", &replaced), ("pause", &paused)] {
        eprintln!(
            "{what} on a full state directory: exit {:?}\n{}{}",
            o.status.code(),
            stdout(o),
            stderr(o)
        );
        let said = format!("{}{}", stdout(o), stderr(o));
        // Refused by a daemon whose journal failed, or by one stopping
        // because of it: never answered as done.
        assert!(
            o.status.success()
                || said.contains("journal")
                || said.contains("cannot reach")
                || said.contains("no daemon is running"),
            "a refusal says why: {said}"
        );
    }

    // Whatever the daemon did next, a kill and a restart with the space
    // back must find every acknowledged request on record.
    daemon.kill9();
    std::fs::remove_file(&filler).unwrap();
    let _daemon = Daemon::spawn(&state, None).unwrap_or_else(|e| panic!("restart: {e:?}"));
    wait_for(
        Duration::from_secs(30),
        "a status after the restart",
        || status(&state).is_some(),
    );
    let snap = status(&state).unwrap();
    if paused.status.success() {
        assert!(snap.paused, "an acknowledged pause holds: {snap:#?}");
    } else {
        assert!(!snap.paused, "a refused pause left no trace: {snap:#?}");
    }
    if replaced.status.success() {
        // Paused or not, the replacement is on record: a new attempt.
        let _ = cli(&state, &["resume"]);
        wait_converged(&state, Duration::from_secs(60), |s| {
            s.nodes
                .iter()
                .any(|n| n.node.to_string() == "worker-0" && n.ready && n.attempt.0 > before)
        });
    } else {
        let _ = cli(&state, &["resume"]);
        let after = wait_converged(&state, Duration::from_secs(60), |s| {
            s.nodes.iter().filter(|n| n.ready).count() == 2
        });
        let w0 = after
            .nodes
            .iter()
            .find(|n| n.node.to_string() == "worker-0");
        assert_eq!(
            w0.map(|n| n.attempt.0),
            Some(before),
            "a refused replace left no trace: {after:#?}"
        );
    }
}
