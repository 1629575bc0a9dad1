//! The repository's scripts, run against a stand-in `cargo` in a copy of
//! the repository: what they build is not built here, only where they look.

use std::path::Path;
use std::process::Command;

/// A `cargo` that builds nothing: `metadata` names the target directory as
/// cargo does ($CARGO_TARGET_DIR, relative to where it runs, else
/// ./target), `build` leaves a file where cargo would leave the binary.
const FAKE_CARGO: &str = r#"#!/bin/sh
t=${CARGO_TARGET_DIR:-$PWD/target}
case "$t" in /*) ;; *) t=$PWD/$t ;; esac
case "$1" in
metadata) printf '{"packages":[],"target_directory":"%s","version":1}\n' "$t" ;;
build)
    profile=debug; host=
    while [ $# -gt 0 ]; do
        case "$1" in --release) profile=release ;; --target) shift; host=$1 ;; esac
        shift
    done
    mkdir -p "$t/$host/$profile" && echo "not an agent" > "$t/$host/$profile/swactor" ;;
*) echo "fake cargo: $*" >&2; exit 2 ;;
esac
"#;

/// Runs the copied `scripts/build-static-agent.sh --debug` from `cwd` with
/// `target_dir` as CARGO_TARGET_DIR (unset when `None`).
fn build_static_agent(repo: &Path, cwd: &Path, target_dir: Option<&str>) -> std::process::Output {
    let bin = repo.join("fake-bin");
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let mut cmd = Command::new("bash");
    cmd.arg(repo.join("scripts/build-static-agent.sh"))
        .arg("--debug")
        .current_dir(cwd)
        .env("PATH", path)
        .env_remove("CARGO_TARGET_DIR");
    if let Some(t) = target_dir {
        cmd.env("CARGO_TARGET_DIR", t);
    }
    cmd.output().unwrap()
}

#[test]
fn build_static_agent_leaves_the_agent_in_cargo_s_target_directory_set_or_not() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("repo");
    std::fs::create_dir_all(repo.join("scripts")).unwrap();
    std::fs::create_dir_all(repo.join("fake-bin")).unwrap();
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../scripts/build-static-agent.sh"
    );
    std::fs::copy(script, repo.join("scripts/build-static-agent.sh")).unwrap();
    let cargo = repo.join("fake-bin/cargo");
    std::fs::write(&cargo, FAKE_CARGO).unwrap();
    std::fs::set_permissions(&cargo, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let elsewhere = tmp.path().join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    let absolute = tmp.path().join("absolute");
    let cases = [
        (
            Some(absolute.to_str().unwrap().to_owned()),
            absolute.join("debug/swactor-agent"),
        ),
        // Relative: to where the script was run, as it is for cargo.
        (
            Some("relative".to_owned()),
            elsewhere.join("relative/debug/swactor-agent"),
        ),
        (None, repo.join("target/debug/swactor-agent")),
    ];
    for (target_dir, expected) in cases {
        let o = build_static_agent(&repo, &elsewhere, target_dir.as_deref());
        let said = format!(
            "CARGO_TARGET_DIR={target_dir:?}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(o.status.success(), "{said}");
        assert_eq!(
            std::fs::read_to_string(&expected).ok().as_deref(),
            Some("not an agent\n"),
            "{} was not made; {said}",
            expected.display()
        );
        assert!(
            String::from_utf8_lossy(&o.stdout).starts_with(&expected.display().to_string()),
            "{said}"
        );
    }
}
