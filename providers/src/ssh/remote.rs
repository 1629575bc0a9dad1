//! What the SSH bootstrap leaves on a host, and the shell commands that
//! manage it. Every remote provider that reaches its machines over SSH uses
//! this layout; commands run in the login user's home directory.
//!
//! ```text
//! ~/.swactor/
//!   claim                          the host's claim: which (run, node, attempt) holds it
//!   bin/swactor-{sha256 prefix}    the agent binary, cached by content
//!   nodes/{run}/{node}-a{attempt}/ one attempt's directory:
//!     run.sh                       starts the agent (its pid, in a session of its own)
//!     agent.credentials            the join token and key (0600; the agent removes it)
//!     agent.pid                    the wrapper's pid, which leads the agent's process group
//!     agent.log                    the agent's output
//!     exit_status                  the agent's exit status, once it exited
//! ```
//!
//! The claim is made with the shell's no-clobber redirection, which creates
//! the file only if it does not exist (`O_EXCL`), so two daemons (or a
//! retried create) never both hold a host. A process belongs to an attempt
//! when it is the pid in `agent.pid` and its working directory is the
//! attempt's directory; nothing else is ever signalled.

use super::quote;
use swactor_provisioning::{NodeTemplate, ResourceKey};

/// The remote root, relative to the login directory.
pub(crate) const ROOT: &str = ".swactor";

/// What the follow command prints last: the agent's exit status, `killed`
/// when the wrapper vanished without writing one, or `gone` when the
/// attempt's directory does not exist.
pub(crate) const EXIT_MARKER: &str = "##swactor-exit ";

/// The first line of a claim file: the key and, for a recorded deployment,
/// ` deployment={id}` after it.
pub(crate) fn claim_line(key: &ResourceKey, deployment: Option<&str>) -> String {
    let mut line = format!(
        "swactor-claim run={} node={} attempt={}",
        key.run_id, key.node, key.attempt.0
    );
    if let Some(d) = deployment {
        line.push_str(" deployment=");
        line.push_str(d);
    }
    line
}

/// The key a claim line names and its deployment, if it is one.
pub(crate) fn parse_claim(line: &str) -> Option<(ResourceKey, Option<String>)> {
    let rest = line.trim().strip_prefix("swactor-claim ")?;
    let mut run = None;
    let mut node = None;
    let mut attempt = None;
    let mut deployment = None;
    for field in rest.split(' ') {
        match field.split_once('=')? {
            ("run", v) => run = Some(v),
            ("node", v) => node = Some(v),
            ("attempt", v) => attempt = v.parse::<u64>().ok(),
            ("deployment", v) if !v.is_empty() => deployment = Some(v.to_owned()),
            _ => return None,
        }
    }
    let key = ResourceKey {
        run_id: swactor_provisioning::RunId::new(run?),
        node: swactor_provisioning::LogicalNodeId::parse(node?)?,
        attempt: swactor_provisioning::NodeAttemptId(attempt?),
    };
    Some((key, deployment))
}

/// `key`'s directory, relative to the login directory.
pub(crate) fn node_dir(key: &ResourceKey) -> String {
    format!("{ROOT}/nodes/{}/{}-{}", key.run_id, key.node, key.attempt)
}

/// Where the agent binary with this content lives, relative to the login directory.
pub(crate) fn binary_path(sha256_hex: &str) -> String {
    format!(
        "{ROOT}/bin/swactor-{}",
        &sha256_hex[..16.min(sha256_hex.len())]
    )
}

/// Claims the host for `key` unless it is claimed already, then prints the
/// claim file (ours, or whoever holds it).
///
/// Exits non-zero, with the reason on stderr, when no claim file exists
/// afterwards (a read-only disk): the host cannot be claimed, which is not
/// the same as being taken. An existing file is never removed here: it may
/// be another daemon's claim between its creation and its write (an empty
/// claim reads as taken).
pub(crate) fn claim(key: &ResourceKey, deployment: Option<&str>) -> String {
    let line = quote(&claim_line(key, deployment));
    format!(
        "mkdir -p {ROOT} || exit 3; \
         err=$( (set -C; printf '%s\\n' {line} > {ROOT}/claim) 2>&1 ); \
         if [ -e {ROOT}/claim ]; then cat {ROOT}/claim; \
         else echo \"cannot write ~/{ROOT}/claim: $err\" >&2; exit 3; fi"
    )
}

/// Prints the claim file, or nothing when the host is free.
pub(crate) fn read_claim() -> String {
    format!("cat {ROOT}/claim 2>/dev/null; true")
}

/// Frees the host if `key` of `deployment` holds it (and only then).
pub(crate) fn release(key: &ResourceKey, deployment: Option<&str>) -> String {
    let line = quote(&claim_line(key, deployment));
    format!(
        "if [ \"$(head -n 1 {ROOT}/claim 2>/dev/null)\" = {line} ]; then rm -f {ROOT}/claim; fi"
    )
}

/// What [`unless_claimed_by_another`] prints instead of running its command.
pub(crate) const FOREIGN_MARKER: &str = "##swactor-foreign";

/// Runs `command` unless the host's claim names another key or deployment
/// than `key`'s in `deployment` (then it prints [`FOREIGN_MARKER`] and
/// does nothing): an attempt's directory on a host another deployment
/// holds may be that deployment's node of the same key.
pub(crate) fn unless_claimed_by_another(
    key: &ResourceKey,
    deployment: Option<&str>,
    command: &str,
) -> String {
    let line = quote(&claim_line(key, deployment));
    format!(
        "c=$(head -n 1 {ROOT}/claim 2>/dev/null); \
         if [ -n \"$c\" ] && [ \"$c\" != {line} ]; then echo '{FOREIGN_MARKER}'; exit 0; fi; \
         {command}"
    )
}

/// Prints `ok` when the file at `path` has this sha256, after making its directory.
pub(crate) fn binary_matches(path: &str, sha256_hex: &str) -> String {
    let path = quote(path);
    format!(
        "mkdir -p {ROOT}/bin && [ \"$(sha256sum {path} 2>/dev/null | cut -d' ' -f1)\" = {sha} ] && echo ok; true",
        sha = quote(sha256_hex)
    )
}

/// Shell functions the commands below use: `alive PID` (a process that
/// runs, a zombie being dead already) and `group_alive PGID` (any such
/// process in the group). Signals alone cannot tell: `kill -0` succeeds on
/// a zombie until its parent reaps it.
const LIVENESS: &str = "alive() { st=$(sed 's/.*) //' /proc/$1/stat 2>/dev/null | cut -d' ' -f1); \
     [ -n \"$st\" ] && [ \"$st\" != Z ]; }; \
     group_alive() { for f in /proc/[0-9]*/stat; do \
     s=$(sed 's/.*) //' \"$f\" 2>/dev/null) || continue; set -- $s; \
     [ \"$1\" != Z ] && [ \"$3\" = \"$g\" ] && return 0; done; return 1; }";

/// A shell snippet that sets `pid` to the attempt's live agent (the wrapper
/// named in `agent.pid`, running in the attempt's directory), or empty.
/// `dir` is a shell word (quoted, or a variable in double quotes).
fn live_agent_pid(dir: &str) -> String {
    format!(
        "{LIVENESS}; pid=$(cat {dir}/agent.pid 2>/dev/null); \
         want=$(cd {dir} 2>/dev/null && pwd -P); \
         if [ -z \"$pid\" ] || [ -z \"$want\" ] || ! alive \"$pid\" \
            || [ \"$(readlink /proc/$pid/cwd 2>/dev/null)\" != \"$want\" ]; then pid=; fi"
    )
}

/// Prints the pid of the attempt's live agent, or nothing.
pub(crate) fn agent_pid(dir: &str) -> String {
    format!("{}; echo $pid", live_agent_pid(&quote(dir)))
}

/// Stops the attempt's agent and everything it started (its process
/// group): SIGTERM (and SIGCONT, for a stopped one), then SIGKILL after
/// `grace_s`. Prints `stopped` once the group is gone, `none` when no agent
/// of the attempt runs, `stuck` when the group outlived SIGKILL.
pub(crate) fn stop_agent(dir: &str, grace_s: u64) -> String {
    let polls = grace_s * 10;
    // `kill -SIG -PGID` (no `--`: dash's kill takes none) signals the group.
    format!(
        "{live}; if [ -z \"$pid\" ]; then echo none; exit 0; fi; g=$pid; \
         kill -TERM -$g 2>/dev/null; kill -CONT -$g 2>/dev/null; \
         i=0; while group_alive && [ $i -lt {polls} ]; do sleep 0.1; i=$((i+1)); done; \
         if group_alive; then kill -KILL -$g 2>/dev/null; sleep 0.5; fi; \
         if group_alive; then echo stuck; else echo stopped; fi",
        live = live_agent_pid(&quote(dir))
    )
}

/// Removes the cached agent binaries, then whatever directories are left
/// empty (a claim or another run's nodes keep `~/.swactor`).
pub(crate) fn purge() -> String {
    format!(
        "rm -rf {ROOT}/bin && for d in {ROOT}/nodes/*; do rmdir \"$d\" 2>/dev/null; done; \
         rmdir {ROOT}/nodes {ROOT} 2>/dev/null; true"
    )
}

/// Removes the attempt's directory.
pub(crate) fn remove_dir(dir: &str) -> String {
    format!("rm -rf {}", quote(dir))
}

/// Writes the attempt's credentials (from stdin) with only the owner able
/// to read them, making the directory (0700) first.
pub(crate) fn write_credentials(dir: &str) -> String {
    let dir = quote(dir);
    format!(
        "umask 077 && mkdir -p {dir} && cat > {dir}/agent.credentials.tmp && mv {dir}/agent.credentials.tmp {dir}/agent.credentials"
    )
}

/// The wrapper script that runs the agent of `key` from `binary` (a path
/// relative to the login directory), with the group's `env` and the host's
/// `labels`, space-separated, in `SWACTOR_HOST_LABELS`.
use crate::ORPHANED_EXIT as ORPHANED_STATUS;

/// The attempt's `run.sh`: starts the agent, records its pid and, once it
/// exits, its status. An agent that ended its node for a lapsed lease
/// ([`crate::ORPHANED_EXIT`]) had no daemon to clean up after it: the wrapper
/// then releases the host's claim, if this attempt (of `deployment`) holds
/// it, and removes the attempt's directory, so a later daemon finds the
/// host free and nothing left of the node. `extra` are more agent
/// arguments, from the provider (the vast provider's way for the agent to
/// end its own instance).
pub(crate) fn wrapper(
    key: &ResourceKey,
    binary: &str,
    daemon_ticket: &str,
    template: &NodeTemplate,
    (labels, deployment, extra): (&[String], Option<&str>, &[String]),
) -> String {
    let mut argv: Vec<String> = vec![
        "agent".into(),
        "--run".into(),
        key.run_id.to_string(),
        "--node".into(),
        key.node.to_string(),
        "--attempt".into(),
        key.attempt.0.to_string(),
        "--daemon".into(),
        daemon_ticket.to_owned(),
    ];
    // `--boot-check=ARG` keeps an argument that starts with `-` a value.
    for check in &template.boot.boot_check {
        argv.push(format!("--boot-check={check}"));
    }
    argv.push(format!(
        "--boot-timeout-s={}",
        template.limits.boot_timeout_s
    ));
    argv.extend(extra.iter().cloned());
    let args: Vec<String> = argv.iter().map(|a| quote(a)).collect();
    let mut env: Vec<String> = template
        .boot
        .env
        .iter()
        .map(|(k, v)| quote(&format!("{k}={v}")))
        .collect();
    if !labels.is_empty() {
        env.push(quote(&format!("SWACTOR_HOST_LABELS={}", labels.join(" "))));
    }
    let env = if env.is_empty() {
        String::new()
    } else {
        format!("env {} ", env.join(" "))
    };
    format!(
        "#!/bin/sh\n\
         # The swactor agent of {key}, started by the daemon over SSH.\n\
         cd \"$(dirname \"$0\")\" || exit 1\n\
         echo $$ > agent.pid.tmp && mv agent.pid.tmp agent.pid\n\
         {env}\"$HOME\"/{binary} {args} --credentials \"$PWD/agent.credentials\" --dir \"$PWD\" >> agent.log 2>&1 < /dev/null\n\
         s=$?\n\
         if [ $s -eq {ORPHANED_STATUS} ]; then\n\
         \x20 # The node ended itself: its daemon renewed nothing for a whole lease.\n\
         \x20 cd \"$HOME\" && {release}; rm -rf {dir}\n\
         \x20 exit $s\n\
         fi\n\
         echo $s > exit_status\n",
        binary = quote(binary),
        args = args.join(" "),
        release = release(key, deployment),
        dir = quote(&node_dir(key)),
    )
}

/// Starts the wrapper in `dir` in a session of its own (it outlives the SSH
/// connection) and prints its pid once it has recorded it.
pub(crate) fn launch(dir: &str) -> String {
    let dir = quote(dir);
    format!(
        "cd {dir} && rm -f agent.pid exit_status && chmod 700 run.sh && \
         (setsid ./run.sh > /dev/null 2>&1 < /dev/null &) && \
         i=0; while [ ! -s agent.pid ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done; cat agent.pid"
    )
}

/// Streams the attempt's log from its start, then prints [`EXIT_MARKER`]
/// with the agent's exit status once the wrapper has gone (or the
/// directory was removed). Every few seconds it prints [`ALIVE_MARKER`], so
/// that once nobody reads any more (the connection dropped) the write fails
/// and the follower ends instead of outliving its reader.
pub(crate) fn follow(dir: &str) -> String {
    let dir = quote(dir);
    format!(
        "{LIVENESS}; cd {dir} 2>/dev/null || {{ echo '{EXIT_MARKER}gone'; exit 0; }}; \
         tail -n +1 -F agent.log 2>/dev/null & t=$!; \
         trap 'kill $t 2>/dev/null' EXIT HUP PIPE TERM; \
         i=0; while [ ! -f exit_status ] && [ -f run.sh ]; do \
           pid=$(cat agent.pid 2>/dev/null); \
           if [ -n \"$pid\" ] && ! alive \"$pid\"; then break; fi; \
           sleep 0.3; i=$((i+1)); \
           if [ $i -ge 10 ]; then i=0; echo '{ALIVE_MARKER}' || exit 0; fi; \
         done; sleep 0.5; kill $t 2>/dev/null; \
         echo \"{EXIT_MARKER}$(cat exit_status 2>/dev/null || echo killed)\""
    )
}

/// A line [`follow`] prints now and then to notice a reader that is gone.
pub(crate) const ALIVE_MARKER: &str = "##swactor-alive";

/// What [`read_log`] prints before the log, so that whatever the login
/// shell prints first (a greeting) is told from it.
pub(crate) const LOG_START_MARKER: &str = "##swactor-log";

/// Prints [`LOG_START_MARKER`], then the attempt's log and [`EXIT_MARKER`]
/// (`shown` when not following, else as [`follow`] ends it); only
/// `{EXIT_MARKER}gone` when the attempt's directory does not exist.
pub(crate) fn read_log(dir: &str, follow_it: bool) -> String {
    let start = format!("printf '%s\\n' '{LOG_START_MARKER}'");
    if follow_it {
        return format!("{start}; {}", follow(dir));
    }
    let dir = quote(dir);
    // The log's last line may lack its end of line: the marker then starts a line of its own.
    format!(
        "{start}; cd {dir} 2>/dev/null || {{ echo '{EXIT_MARKER}gone'; exit 0; }}; \
         cat agent.log 2>/dev/null; \
         [ -z \"$(tail -c 1 agent.log 2>/dev/null)\" ] || echo; echo '{EXIT_MARKER}shown'"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use swactor_provisioning::{LogicalNodeId, NodeAttemptId, RunId};

    fn key() -> ResourceKey {
        ResourceKey {
            run_id: RunId::new("r1"),
            node: LogicalNodeId::parse("gpu-3").unwrap(),
            attempt: NodeAttemptId(12),
        }
    }

    #[test]
    fn a_claim_line_names_its_key_and_nothing_else_parses() {
        assert_eq!(parse_claim(&claim_line(&key(), None)), Some((key(), None)));
        assert_eq!(
            parse_claim(&format!("{}\n", claim_line(&key(), None))),
            Some((key(), None))
        );
        let deployed = claim_line(&key(), Some("0a1b2c3d"));
        assert_eq!(
            deployed,
            "swactor-claim run=r1 node=gpu-3 attempt=12 deployment=0a1b2c3d"
        );
        assert_eq!(
            parse_claim(&deployed),
            Some((key(), Some("0a1b2c3d".to_owned())))
        );
        assert_eq!(parse_claim("swactor-claim run=r1 node=gpu-3"), None);
        assert_eq!(
            parse_claim("swactor-claim run=r1 node=gpu-3 attempt=x"),
            None
        );
        assert_eq!(parse_claim("somebody else's file"), None);
        assert_eq!(node_dir(&key()), ".swactor/nodes/r1/gpu-3-a12");
        assert_eq!(
            binary_path("0123456789abcdef0123"),
            ".swactor/bin/swactor-0123456789abcdef"
        );
    }

    fn template() -> NodeTemplate {
        NodeTemplate {
            provider: swactor_provisioning::ProviderShape {
                kind: "ssh".to_owned(),
                params: Default::default(),
                placement: Default::default(),
            },
            boot: swactor_provisioning::BootParams::default(),
            role: "worker".to_owned(),
            join: swactor_provisioning::SwarmJoin::default(),
            limits: Default::default(),
        }
    }

    /// Runs `key`'s wrapper in a home of its own, with an "agent" that
    /// exits with `status`, the host claimed by `claim`; returns the home.
    fn run_wrapper(status: i32, claim: &str) -> tempfile::TempDir {
        let home = tempfile::tempdir().unwrap();
        let dir = home.path().join(node_dir(&key()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(home.path().join(ROOT).join("claim"), format!("{claim}\n")).unwrap();
        let agent = home.path().join("agent.sh");
        std::fs::write(&agent, format!("#!/bin/sh\nexit {status}\n")).unwrap();
        let run = dir.join("run.sh");
        let script = wrapper(
            &key(),
            "agent.sh",
            "ticket",
            &template(),
            (&[], Some("0a1b2c3d"), &[]),
        );
        std::fs::write(&run, script).unwrap();
        for f in [&agent, &run] {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let out = std::process::Command::new("sh")
            .arg(&run)
            .env("HOME", home.path())
            .current_dir(home.path())
            .output()
            .unwrap();
        // The wrapper passes an ended node's status on; otherwise it ends
        // well once the status is written.
        let expected = if status == crate::ORPHANED_EXIT {
            status
        } else {
            0
        };
        assert_eq!(out.status.code(), Some(expected), "{out:?}");
        home
    }

    #[test]
    fn an_agent_that_ended_its_node_leaves_its_host_free_and_nothing_behind() {
        let ours = claim_line(&key(), Some("0a1b2c3d"));
        let home = run_wrapper(crate::ORPHANED_EXIT, &ours);
        assert!(
            !home.path().join(ROOT).join("claim").exists(),
            "the claim is released"
        );
        assert!(
            !home.path().join(node_dir(&key())).exists(),
            "the attempt's directory is gone"
        );
        // A claim another deployment holds is left alone, even then.
        let theirs = claim_line(&key(), Some("ffffffff"));
        let home = run_wrapper(crate::ORPHANED_EXIT, &theirs);
        let claim = std::fs::read_to_string(home.path().join(ROOT).join("claim")).unwrap();
        assert_eq!(claim.trim(), theirs);
        assert!(!home.path().join(node_dir(&key())).exists());
    }

    #[test]
    fn an_agent_that_exits_otherwise_leaves_its_status_for_the_daemon() {
        let ours = claim_line(&key(), Some("0a1b2c3d"));
        let home = run_wrapper(1, &ours);
        let dir = home.path().join(node_dir(&key()));
        assert_eq!(
            std::fs::read_to_string(dir.join("exit_status"))
                .unwrap()
                .trim(),
            "1"
        );
        assert!(
            home.path().join(ROOT).join("claim").exists(),
            "the daemon releases it"
        );
    }
}
