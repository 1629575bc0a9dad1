//! The agent's line protocol, defined once for the provider and the agent.

use swactor_provisioning::{BootstrapEvent, BootstrapStage};

/// Every protocol line starts with this marker; any other line is free-form log output.
pub const AGENT_LINE_PREFIX: &str = "@swactor ";

/// Parses one line of agent output; `None` for anything that is not exactly a
/// protocol line (those are ordinary log output).
///
/// The lines, one per event, with single spaces:
///
/// ```text
/// @swactor stage ssh-connect|boot-check|swactor-start|join|converged
/// @swactor joined
/// @swactor failed ssh-connect-failed|boot-check-failed|swactor-start-failed|join-failed|agent-lost <reason…>
/// ```
///
/// The reason runs to the end of the line and may be empty (then the stage
/// may end the line). A trailing `\r` is ignored. There is deliberately no line
/// for [`BootstrapEvent::Closed`]: a closed stream makes the reconciler forget
/// the session, and only the provider knows whether the process is gone.
pub fn parse_agent_line(line: &str) -> Option<BootstrapEvent> {
    let line = line.strip_suffix('\r').unwrap_or(line);
    let rest = line.strip_prefix(AGENT_LINE_PREFIX)?;
    let (verb, args) = match rest.split_once(' ') {
        Some((verb, args)) => (verb, Some(args)),
        None => (rest, None),
    };
    match (verb, args) {
        ("stage", Some(name)) => progress_stage(name).map(BootstrapEvent::Stage),
        ("joined", None) => Some(BootstrapEvent::SwactorJoined),
        ("failed", Some(args)) => {
            let (name, reason) = args.split_once(' ').unwrap_or((args, ""));
            let stage = failure_stage(name)?;
            Some(BootstrapEvent::Failed {
                stage,
                reason: reason.to_owned(),
            })
        }
        _ => None,
    }
}

/// The protocol line for `event` (without a newline), as an agent writes it.
///
/// [`parse_agent_line`] reads every line this writes back to an equal event,
/// with these exceptions, since the protocol cannot say more:
/// - a failure stage sent as [`BootstrapEvent::Stage`] is written as a
///   `failed` line with an empty reason;
/// - a progress stage inside [`BootstrapEvent::Failed`] is written as that
///   stage's failure (`converged` as `agent-lost`);
/// - line breaks in a reason become spaces;
/// - [`BootstrapEvent::Closed`] is written as `@swactor closed`, which the
///   parser refuses (see there why).
pub fn format_agent_line(event: &BootstrapEvent) -> String {
    match event {
        BootstrapEvent::Stage(stage) if !stage.is_failure() => {
            format!("{AGENT_LINE_PREFIX}stage {}", stage_name(*stage))
        }
        BootstrapEvent::Stage(stage) => format!("{AGENT_LINE_PREFIX}failed {}", stage_name(*stage)),
        BootstrapEvent::SwactorJoined => format!("{AGENT_LINE_PREFIX}joined"),
        BootstrapEvent::Closed => format!("{AGENT_LINE_PREFIX}closed"),
        BootstrapEvent::Failed { stage, reason } => {
            let name = stage_name(failure_of(*stage));
            if reason.is_empty() {
                format!("{AGENT_LINE_PREFIX}failed {name}")
            } else {
                let reason = reason.replace(['\r', '\n'], " ");
                format!("{AGENT_LINE_PREFIX}failed {name} {reason}")
            }
        }
    }
}

/// The protocol's name for a stage.
fn stage_name(stage: BootstrapStage) -> &'static str {
    match stage {
        BootstrapStage::SshConnect => "ssh-connect",
        BootstrapStage::BootCheck => "boot-check",
        BootstrapStage::SwactorStart => "swactor-start",
        BootstrapStage::Join => "join",
        BootstrapStage::Converged => "converged",
        BootstrapStage::SshConnectFailed => "ssh-connect-failed",
        BootstrapStage::BootCheckFailed => "boot-check-failed",
        BootstrapStage::SwactorStartFailed => "swactor-start-failed",
        BootstrapStage::JoinFailed => "join-failed",
        BootstrapStage::AgentLost => "agent-lost",
    }
}

/// The failure stage that ends `stage`; failure stages map to themselves.
fn failure_of(stage: BootstrapStage) -> BootstrapStage {
    match stage {
        BootstrapStage::SshConnect => BootstrapStage::SshConnectFailed,
        BootstrapStage::BootCheck => BootstrapStage::BootCheckFailed,
        BootstrapStage::SwactorStart => BootstrapStage::SwactorStartFailed,
        BootstrapStage::Join => BootstrapStage::JoinFailed,
        BootstrapStage::Converged => BootstrapStage::AgentLost,
        failure => failure,
    }
}

const PROGRESS_STAGES: [BootstrapStage; 5] = [
    BootstrapStage::SshConnect,
    BootstrapStage::BootCheck,
    BootstrapStage::SwactorStart,
    BootstrapStage::Join,
    BootstrapStage::Converged,
];

const FAILURE_STAGES: [BootstrapStage; 5] = [
    BootstrapStage::SshConnectFailed,
    BootstrapStage::BootCheckFailed,
    BootstrapStage::SwactorStartFailed,
    BootstrapStage::JoinFailed,
    BootstrapStage::AgentLost,
];

fn progress_stage(name: &str) -> Option<BootstrapStage> {
    PROGRESS_STAGES.into_iter().find(|s| stage_name(*s) == name)
}

fn failure_stage(name: &str) -> Option<BootstrapStage> {
    FAILURE_STAGES.into_iter().find(|s| stage_name(*s) == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_progress_and_failure_event_round_trips_through_a_line() {
        let mut events: Vec<_> = PROGRESS_STAGES
            .into_iter()
            .map(BootstrapEvent::Stage)
            .collect();
        events.push(BootstrapEvent::SwactorJoined);
        for stage in FAILURE_STAGES {
            for reason in ["", "exit status 3: no gpu"] {
                events.push(BootstrapEvent::Failed {
                    stage,
                    reason: reason.to_owned(),
                });
            }
        }
        for event in events {
            let line = format_agent_line(&event);
            assert_eq!(parse_agent_line(&line), Some(event), "{line}");
        }
    }

    #[test]
    fn the_documented_lines_parse_to_their_events() {
        assert_eq!(
            parse_agent_line("@swactor stage boot-check"),
            Some(BootstrapEvent::Stage(BootstrapStage::BootCheck))
        );
        assert_eq!(
            parse_agent_line("@swactor joined\r"),
            Some(BootstrapEvent::SwactorJoined)
        );
        assert_eq!(
            parse_agent_line("@swactor failed join-failed peer refused: bad token"),
            Some(BootstrapEvent::Failed {
                stage: BootstrapStage::JoinFailed,
                reason: "peer refused: bad token".to_owned(),
            })
        );
    }

    #[test]
    fn anything_but_an_exact_protocol_line_is_plain_output() {
        for line in [
            "",
            "starting up",
            "@swactor",
            "@swactor ",
            " @swactor joined",
            "@swactor  joined",
            "@swactor joined now",
            "@swactor stage",
            "@swactor stage booting",
            "@swactor stage join-failed",
            "@swactor failed",
            "@swactor failed boot-check broken",
            "@swactor closed",
            "@SWACTOR joined",
        ] {
            assert_eq!(parse_agent_line(line), None, "{line:?}");
        }
    }

    #[test]
    fn lossy_events_format_to_lines_that_keep_their_meaning() {
        let stage_failure = format_agent_line(&BootstrapEvent::Stage(BootstrapStage::JoinFailed));
        assert_eq!(
            parse_agent_line(&stage_failure),
            Some(BootstrapEvent::Failed {
                stage: BootstrapStage::JoinFailed,
                reason: String::new(),
            })
        );
        let multiline = format_agent_line(&BootstrapEvent::Failed {
            stage: BootstrapStage::BootCheck,
            reason: "line one\nline two".to_owned(),
        });
        assert_eq!(
            multiline,
            "@swactor failed boot-check-failed line one line two"
        );
        assert_eq!(
            parse_agent_line(&format_agent_line(&BootstrapEvent::Closed)),
            None
        );
    }
}
