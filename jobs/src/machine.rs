//! What a run does next, decided as data: no clock, no I/O, no actors.
//!
//! [`RunMachine`] is the state machine of one (job, node) run. Its driver
//! (the daemon's run actor) feeds it what happened with
//! [`RunMachine::handle`] and drains what to do with
//! [`RunMachine::poll_action`], in this order:
//!
//! 1. construct it from what the journal says ([`RunMachine::new`]);
//! 2. drain `poll_action` until it returns `None`, performing each action
//!    and handing any event that action produced straight to `handle`;
//! 3. on every later message, `handle` the event and drain again.
//!
//! An [`Action::Record`] MUST be durable in `jobs.redb` before the next
//! action is polled: the actions after it are the effects it licenses
//! (`running` is on record before `Start` is sent, the final state before
//! the agent is told to `Forget`). A driver that cannot record MUST NOT
//! perform any later action.
//!
//! The job-level decisions live here too: how much of a timeout is left
//! ([`timeout_left`]), and how a [`Stop`] turns into a run's outcome.

pub use crate::record::{Change, Outcome, Stop};
use crate::record::{JobState, OutputFile};
use crate::wire::ExitInfo;
use std::collections::VecDeque;
use std::time::Duration;
use swactor_provisioning::LogicalNodeId;

/// How many times in a row a log stream may break while its link stays up
/// before the run is given up as `lost`.
pub const ATTACH_BREAKS_MAX: u32 = 5;

/// What the driver must do; each one describes I/O, none performs it.
#[must_use]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Write this change to the journal, and wait until it is durable.
    Record(Change),
    /// Ask the node which chunks it lacks and send them; answer
    /// [`Event::Shipped`] or [`Event::ShipFailed`].
    Ship,
    /// Send the start request; answer [`Event::Started`],
    /// [`Event::StartRefused`] or [`Event::StartLost`].
    Start,
    /// Ask for the log from what the daemon already has on; its pieces and
    /// end arrive later as [`Event::Log`], [`Event::Exit`] and the like, or
    /// [`Event::AttachBroke`].
    Attach,
    /// Ask the agent to kill the run's process group; answer
    /// [`Event::CancelFailed`] if the request did not get through.
    Cancel,
    /// Fetch the run's output files; answer [`Event::Collected`] or
    /// [`Event::CollectFailed`].
    Collect,
    /// Start the reattach wait, unless it already runs; when it ends,
    /// answer [`Event::ReattachExpired`].
    ArmReattach,
    /// Stop the reattach wait.
    DisarmReattach,
    /// Look once whether the link is up ([`Event::LinkUp`]) or the cluster
    /// has moved on from this attempt ([`Event::Superseded`]).
    CheckLink,
    /// Tell the agent it may drop everything it keeps of the run.
    Forget,
    /// The run is over: the driver stops.
    Done,
}

/// Something that happened to a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The node has the workspace.
    Shipped {
        /// Bytes sent.
        bytes: u64,
        /// Chunks sent.
        chunks: u64,
    },
    /// The workspace could not be shipped; `lost` when the node went away.
    ShipFailed {
        /// Why.
        error: String,
        /// Whether the node went away (else the transfer itself failed).
        lost: bool,
    },
    /// The agent started the command.
    Started,
    /// The agent refused to start it (e.g. a bad workspace).
    StartRefused(String),
    /// The link broke while the start request was on its way.
    StartLost(String),
    /// A piece of log arrived.
    Log,
    /// The command ended.
    Exit(ExitInfo),
    /// The agent has no record of the run.
    Unknown,
    /// The run's process died with an earlier agent of the attempt.
    Died(String),
    /// The agent refused to attach (it serves another attempt).
    Refused(String),
    /// The log stream ended or broke before the exit.
    AttachBroke(String),
    /// A cancel request did not get through.
    CancelFailed,
    /// The attempt's link is up.
    LinkUp,
    /// The cluster has moved on from the attempt; the text says how.
    Superseded(String),
    /// The reattach wait ended without the link coming back.
    ReattachExpired,
    /// The outputs were collected and verified.
    Collected(Vec<OutputFile>),
    /// The outputs could not be collected.
    CollectFailed(String),
    /// The job was stopped.
    Stop(Stop),
}

/// Where a run is, as its driver sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    /// `shipping` is on record; chunks are on their way.
    Shipping,
    /// `running` is on record; the start request is on its way.
    Starting,
    /// Following the log on a live link.
    Attached,
    /// The link is gone; waiting for it to come back.
    Away,
    /// The command exited like this; its outputs are being collected.
    Collecting(ExitInfo),
    /// The final state is decided.
    Finished,
}

/// The facts about a run that its decisions depend on.
#[derive(Clone, Debug)]
pub struct RunFacts {
    /// The node.
    pub node: LogicalNodeId,
    /// The attempt of the node the run is for.
    pub attempt: u64,
    /// Whether the job declared outputs to collect.
    pub wants_outputs: bool,
    /// How long a run waits for its link to come back.
    pub reattach_wait: Duration,
}

/// The state machine of one run; see the module doc for how to drive it.
#[derive(Debug)]
pub struct RunMachine {
    facts: RunFacts,
    phase: Phase,
    stop: Option<Stop>,
    /// Whether a cancel request got through (or is on its way).
    cancel_sent: bool,
    /// Log streams that broke in a row without delivering anything.
    breaks: u32,
    actions: VecDeque<Action>,
}

impl RunMachine {
    /// A run whose record says `recorded`; `has_workspace` when this daemon
    /// accepted the job and holds its workspace (a resumed job does not).
    pub fn new(facts: RunFacts, recorded: JobState, has_workspace: bool) -> Self {
        let mut m = Self {
            facts,
            phase: Phase::Finished,
            stop: None,
            cancel_sent: false,
            breaks: 0,
            actions: VecDeque::new(),
        };
        match recorded {
            JobState::Queued | JobState::Shipping if has_workspace => {
                m.phase = Phase::Shipping;
                m.act(Action::Record(Change::Shipping));
                m.act(Action::Ship);
            }
            JobState::Queued | JobState::Shipping => m.finish(Outcome::fail(
                JobState::Failed,
                "the daemon stopped before the run started; nothing ran",
            )),
            JobState::Running => {
                m.phase = Phase::Attached;
                m.act(Action::Attach);
            }
            // Nothing to do; a driver is not started for a finished run.
            JobState::Succeeded | JobState::Failed | JobState::Cancelled | JobState::Lost => {
                m.act(Action::Done);
            }
        }
        m
    }

    /// The next thing to do, oldest first; `None` when nothing is left.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Whether the run's final state is decided.
    #[cfg(test)]
    pub fn is_finished(&self) -> bool {
        self.phase == Phase::Finished
    }

    fn act(&mut self, action: Action) {
        // After `Done` the driver stops; nothing queued after it would run.
        debug_assert!(
            !matches!(self.actions.back(), Some(Action::Done)),
            "nothing is queued after Done"
        );
        self.actions.push_back(action);
    }

    fn finish(&mut self, outcome: Outcome) {
        debug_assert!(
            !self
                .actions
                .iter()
                .any(|a| matches!(a, Action::Record(Change::Finished(_)))),
            "a run's final state is recorded once"
        );
        debug_assert!(
            outcome.state.is_final(),
            "a run finishes in a final state, not {:?}",
            outcome.state
        );
        self.phase = Phase::Finished;
        self.act(Action::Record(Change::Finished(outcome)));
        self.act(Action::Forget);
        self.act(Action::Done);
    }

    fn attach(&mut self) {
        self.phase = Phase::Attached;
        if self.stop.is_some() && !self.cancel_sent {
            self.cancel_sent = true;
            self.act(Action::Cancel);
        }
        self.act(Action::Attach);
    }

    /// Folds in what happened; the actions it calls for are queued. A stop
    /// and a failed cancel count in every phase; anything else is read by
    /// the phase the run is in, and one out of place (a link that came up
    /// while attached, a timer that fired after the link came back) does
    /// nothing.
    pub fn handle(&mut self, event: Event) {
        match (self.phase.clone(), event) {
            (Phase::Finished, _) => {}
            (_, Event::Stop(why)) => self.on_stop(why),
            (_, Event::CancelFailed) => self.cancel_sent = false,
            (Phase::Shipping, event) => self.while_shipping(event),
            (Phase::Starting, event) => self.while_starting(event),
            (Phase::Attached, event) => self.while_attached(event),
            (Phase::Away, event) => self.while_away(event),
            (Phase::Collecting(exit), event) => self.while_collecting(exit, event),
        }
    }

    fn on_stop(&mut self, why: Stop) {
        if self.stop.is_some() {
            return;
        }
        self.stop = Some(why.clone());
        match self.phase {
            // Nothing started yet: nothing to kill.
            Phase::Shipping => self.finish(why.outcome("before it started")),
            Phase::Attached => {
                self.cancel_sent = true;
                self.act(Action::Cancel);
            }
            // Sent once the start is answered or the link is back; a
            // command that already exited is collected as it ended.
            Phase::Starting | Phase::Away | Phase::Collecting(_) | Phase::Finished => {}
        }
    }

    fn while_shipping(&mut self, event: Event) {
        match event {
            Event::Shipped { bytes, chunks } => {
                self.act(Action::Record(Change::Shipped { bytes, chunks }));
                self.phase = Phase::Starting;
                self.act(Action::Record(Change::Running));
                self.act(Action::Start);
            }
            Event::ShipFailed { error, lost } => {
                let state = if lost {
                    JobState::Lost
                } else {
                    JobState::Failed
                };
                self.finish(Outcome::fail(state, error));
            }
            _ => {}
        }
    }

    fn while_starting(&mut self, event: Event) {
        match event {
            Event::Started => self.attach(),
            Event::StartRefused(e) => self.finish(Outcome {
                state: JobState::Failed,
                exit_code: Some(127),
                error: Some(e),
                collected: Vec::new(),
                node_lost: false,
            }),
            Event::StartLost(e) => self.finish(Outcome::fail(JobState::Lost, e)),
            _ => {}
        }
    }

    fn while_attached(&mut self, event: Event) {
        let node = self.facts.node;
        match event {
            Event::Log => self.breaks = 0,
            Event::Exit(exit) => match self.stop.clone() {
                Some(why) => {
                    let mut outcome = why.outcome("while it ran");
                    // A cancelled run shows how it was killed.
                    if why == Stop::Cancelled {
                        outcome.exit_code = Some(exit.shell_code());
                    }
                    self.finish(outcome);
                }
                None if self.facts.wants_outputs => {
                    self.phase = Phase::Collecting(exit);
                    self.act(Action::Collect);
                }
                None => self.finish(Outcome::exited(exit, Vec::new())),
            },
            Event::Unknown => self.finish(Outcome::fail(
                JobState::Failed,
                format!(
                    "{node} has no record of this run: the daemon stopped before the run \
                     started, so nothing ran"
                ),
            )),
            Event::Died(e) | Event::Refused(e) => {
                self.finish(Outcome::fail(JobState::Lost, e));
            }
            Event::AttachBroke(e) => {
                self.breaks += 1;
                if self.breaks >= ATTACH_BREAKS_MAX {
                    self.finish(Outcome::fail(
                        JobState::Lost,
                        format!(
                            "the log stream from {node} broke {} times in a row: {e}",
                            self.breaks
                        ),
                    ));
                } else {
                    self.phase = Phase::Away;
                    self.act(Action::ArmReattach);
                    self.act(Action::CheckLink);
                }
            }
            _ => {}
        }
    }

    fn while_away(&mut self, event: Event) {
        match event {
            Event::LinkUp => {
                self.act(Action::DisarmReattach);
                self.attach();
            }
            // The cluster replaced the node: the one loss a gang with
            // retries left restarts on.
            Event::Superseded(why) => {
                self.finish(Outcome::node_lost(format!("{why} while the run ran")));
            }
            Event::ReattachExpired => self.finish(Outcome::fail(
                JobState::Lost,
                format!(
                    "the agent of {} attempt {} did not come back within {} s",
                    self.facts.node,
                    self.facts.attempt,
                    self.facts.reattach_wait.as_secs()
                ),
            )),
            _ => {}
        }
    }

    fn while_collecting(&mut self, exit: ExitInfo, event: Event) {
        match event {
            Event::Collected(files) => self.finish(Outcome::exited(exit, files)),
            Event::CollectFailed(e) => self.finish(Outcome {
                state: JobState::Failed,
                exit_code: Some(exit.shell_code()),
                error: Some(e),
                collected: Vec::new(),
                node_lost: false,
            }),
            _ => {}
        }
    }
}

/// How much of a job's `timeout_s` is left at `now_unix_ms` for a job
/// accepted at `created_unix_ms`: the time already used counts, including
/// time the daemon was down. `None` without a timeout.
pub fn timeout_left(
    timeout_s: Option<f64>,
    created_unix_ms: u64,
    now_unix_ms: u64,
) -> Option<Duration> {
    let total = Duration::from_secs_f64(timeout_s?.clamp(0.001, 1e9));
    let used = Duration::from_millis(now_unix_ms.saturating_sub(created_unix_ms));
    Some(total.saturating_sub(used))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn facts(wants_outputs: bool) -> RunFacts {
        RunFacts {
            node: LogicalNodeId::parse("worker-0").unwrap(),
            attempt: 3,
            wants_outputs,
            reattach_wait: Duration::from_secs(15),
        }
    }

    fn drain(m: &mut RunMachine) -> Vec<Action> {
        std::iter::from_fn(|| m.poll_action()).collect()
    }

    fn exit(code: i32) -> ExitInfo {
        ExitInfo {
            code: Some(code),
            signal: None,
        }
    }

    fn finished(actions: &[Action]) -> Option<&Outcome> {
        actions.iter().find_map(|a| match a {
            Action::Record(Change::Finished(o)) => Some(o),
            _ => None,
        })
    }

    #[test]
    fn a_fresh_run_records_each_state_before_the_request_it_licenses() {
        let mut m = RunMachine::new(facts(true), JobState::Queued, true);
        assert_eq!(
            drain(&mut m),
            [Action::Record(Change::Shipping), Action::Ship]
        );
        m.handle(Event::Shipped {
            bytes: 6,
            chunks: 1,
        });
        assert_eq!(
            drain(&mut m),
            [
                Action::Record(Change::Shipped {
                    bytes: 6,
                    chunks: 1
                }),
                Action::Record(Change::Running),
                Action::Start
            ]
        );
        m.handle(Event::Started);
        assert_eq!(drain(&mut m), [Action::Attach]);
        m.handle(Event::Log);
        m.handle(Event::Exit(exit(0)));
        assert_eq!(drain(&mut m), [Action::Collect]);
        m.handle(Event::Collected(Vec::new()));
        let actions = drain(&mut m);
        assert_eq!(finished(&actions).unwrap().state, JobState::Succeeded);
        assert_eq!(&actions[1..], [Action::Forget, Action::Done]);
        assert!(m.is_finished());
    }

    #[test]
    fn a_resumed_run_that_never_started_fails_without_sending_anything() {
        for recorded in [JobState::Queued, JobState::Shipping] {
            let mut m = RunMachine::new(facts(false), recorded, false);
            let actions = drain(&mut m);
            let o = finished(&actions).unwrap();
            assert_eq!(o.state, JobState::Failed);
            assert!(o.error.as_deref().unwrap().contains("nothing ran"));
            assert!(!actions.contains(&Action::Ship) && !actions.contains(&Action::Start));
        }
        // A run recorded as running is followed again.
        let mut m = RunMachine::new(facts(false), JobState::Running, false);
        assert_eq!(drain(&mut m), [Action::Attach]);
        m.handle(Event::Unknown);
        let actions = drain(&mut m);
        assert!(
            finished(&actions)
                .unwrap()
                .error
                .as_deref()
                .unwrap()
                .contains("no record of this run")
        );
    }

    #[test]
    fn a_timed_out_run_fails_with_124_and_a_cancelled_one_keeps_its_signal() {
        let mut m = RunMachine::new(facts(true), JobState::Running, false);
        let _ = drain(&mut m);
        m.handle(Event::Stop(Stop::TimedOut(
            "timed out after 1 s".to_owned(),
        )));
        assert_eq!(drain(&mut m), [Action::Cancel]);
        // A second stop changes nothing.
        m.handle(Event::Stop(Stop::Cancelled));
        assert_eq!(drain(&mut m), []);
        m.handle(Event::Exit(ExitInfo {
            code: None,
            signal: Some(9),
        }));
        let actions = drain(&mut m);
        let o = finished(&actions).unwrap();
        assert_eq!((o.state, o.exit_code), (JobState::Failed, Some(124)));
        assert_eq!(o.error.as_deref(), Some("timed out after 1 s"));
        assert!(!actions.contains(&Action::Collect));

        let mut m = RunMachine::new(facts(false), JobState::Running, false);
        let _ = drain(&mut m);
        m.handle(Event::Stop(Stop::Cancelled));
        let _ = drain(&mut m);
        m.handle(Event::Exit(ExitInfo {
            code: None,
            signal: Some(9),
        }));
        let o = finished(&drain(&mut m)).cloned().unwrap();
        assert_eq!((o.state, o.exit_code), (JobState::Cancelled, Some(137)));
    }

    #[test]
    fn a_stop_while_shipping_ends_the_run_before_anything_starts() {
        let mut m = RunMachine::new(facts(false), JobState::Queued, true);
        let _ = drain(&mut m);
        m.handle(Event::Stop(Stop::Cancelled));
        let actions = drain(&mut m);
        assert_eq!(finished(&actions).unwrap().state, JobState::Cancelled);
        // The transfer's answer, arriving late, starts nothing.
        m.handle(Event::Shipped {
            bytes: 1,
            chunks: 1,
        });
        assert_eq!(drain(&mut m), []);
    }

    #[test]
    fn a_stop_while_the_link_is_away_is_sent_once_it_is_back() {
        let mut m = RunMachine::new(facts(false), JobState::Running, false);
        let _ = drain(&mut m);
        m.handle(Event::AttachBroke("reset".to_owned()));
        assert_eq!(drain(&mut m), [Action::ArmReattach, Action::CheckLink]);
        m.handle(Event::Stop(Stop::Cancelled));
        assert_eq!(drain(&mut m), []);
        m.handle(Event::LinkUp);
        assert_eq!(
            drain(&mut m),
            [Action::DisarmReattach, Action::Cancel, Action::Attach]
        );
        // A cancel that did not get through is sent again after the next break.
        m.handle(Event::CancelFailed);
        m.handle(Event::AttachBroke("reset".to_owned()));
        let _ = drain(&mut m);
        m.handle(Event::LinkUp);
        assert_eq!(
            drain(&mut m),
            [Action::DisarmReattach, Action::Cancel, Action::Attach]
        );
    }

    #[test]
    fn a_run_whose_link_stays_away_is_lost_when_the_wait_ends_or_its_node_moves_on() {
        let mut m = RunMachine::new(facts(false), JobState::Running, false);
        let _ = drain(&mut m);
        // A wait that ends while the run is attached again means nothing.
        m.handle(Event::ReattachExpired);
        assert_eq!(drain(&mut m), []);
        m.handle(Event::AttachBroke("reset".to_owned()));
        let _ = drain(&mut m);
        m.handle(Event::ReattachExpired);
        let o = finished(&drain(&mut m)).cloned().unwrap();
        assert_eq!(o.state, JobState::Lost);
        assert_eq!(
            o.error.as_deref(),
            Some("the agent of worker-0 attempt 3 did not come back within 15 s")
        );

        let mut m = RunMachine::new(facts(false), JobState::Running, false);
        let _ = drain(&mut m);
        m.handle(Event::AttachBroke("reset".to_owned()));
        let _ = drain(&mut m);
        m.handle(Event::Superseded(
            "worker-0 attempt 3 was replaced by attempt 4".to_owned(),
        ));
        let o = finished(&drain(&mut m)).cloned().unwrap();
        assert_eq!(o.state, JobState::Lost);
    }

    #[test]
    fn a_stream_that_keeps_breaking_on_a_live_link_is_given_up() {
        let mut m = RunMachine::new(facts(false), JobState::Running, false);
        let _ = drain(&mut m);
        for _ in 1..ATTACH_BREAKS_MAX {
            m.handle(Event::AttachBroke("reset".to_owned()));
            m.handle(Event::LinkUp);
            let actions = drain(&mut m);
            assert!(finished(&actions).is_none());
        }
        m.handle(Event::AttachBroke("reset".to_owned()));
        let o = finished(&drain(&mut m)).cloned().unwrap();
        assert_eq!(o.state, JobState::Lost);
        assert!(o.error.unwrap().contains("broke 5 times in a row"));
        // Progress resets the count.
        let mut m = RunMachine::new(facts(false), JobState::Running, false);
        let _ = drain(&mut m);
        for _ in 0..3 * ATTACH_BREAKS_MAX {
            m.handle(Event::Log);
            m.handle(Event::AttachBroke("reset".to_owned()));
            m.handle(Event::LinkUp);
        }
        assert!(!m.is_finished());
    }

    #[test]
    fn an_exit_code_a_refused_start_and_failed_outputs_decide_the_outcome() {
        let mut m = RunMachine::new(facts(false), JobState::Running, false);
        let _ = drain(&mut m);
        m.handle(Event::Exit(exit(3)));
        let o = finished(&drain(&mut m)).cloned().unwrap();
        assert_eq!(
            (o.state, o.exit_code, o.error.as_deref()),
            (JobState::Failed, Some(3), Some("exited with code 3"))
        );
        // Killed: the exit code is the shell's, the words say it was a signal.
        let mut m = RunMachine::new(facts(false), JobState::Running, false);
        let _ = drain(&mut m);
        m.handle(Event::Exit(ExitInfo {
            code: None,
            signal: Some(15),
        }));
        let o = finished(&drain(&mut m)).cloned().unwrap();
        assert_eq!(
            (o.state, o.exit_code, o.error.as_deref()),
            (
                JobState::Failed,
                Some(143),
                Some("killed by signal 15 (SIGTERM)")
            )
        );

        let mut m = RunMachine::new(facts(false), JobState::Queued, true);
        m.handle(Event::Shipped {
            bytes: 0,
            chunks: 0,
        });
        m.handle(Event::StartRefused("cannot run".to_owned()));
        let o = finished(&drain(&mut m)).cloned().unwrap();
        assert_eq!((o.state, o.exit_code), (JobState::Failed, Some(127)));

        let mut m = RunMachine::new(facts(true), JobState::Running, false);
        m.handle(Event::Exit(exit(0)));
        m.handle(Event::CollectFailed("output x rejected".to_owned()));
        let o = finished(&drain(&mut m)).cloned().unwrap();
        assert_eq!((o.state, o.exit_code), (JobState::Failed, Some(0)));
    }

    #[test]
    fn timeout_left_counts_the_time_already_used() {
        assert_eq!(timeout_left(None, 0, 5000), None);
        assert_eq!(
            timeout_left(Some(12.0), 1_000, 5_000),
            Some(Duration::from_secs(8))
        );
        // Used up while the daemon was down: fires at once.
        assert_eq!(timeout_left(Some(1.0), 1_000, 90_000), Some(Duration::ZERO));
        // A clock that went back counts nothing as used.
        assert_eq!(
            timeout_left(Some(2.0), 9_000, 1_000),
            Some(Duration::from_secs(2))
        );
    }

    fn any_event() -> impl Strategy<Value = Event> {
        prop_oneof![
            (0u64..10, 0u64..3).prop_map(|(bytes, chunks)| Event::Shipped { bytes, chunks }),
            any::<bool>().prop_map(|lost| Event::ShipFailed {
                error: "e".to_owned(),
                lost
            }),
            Just(Event::Started),
            Just(Event::StartRefused("e".to_owned())),
            Just(Event::StartLost("e".to_owned())),
            Just(Event::Log),
            (0i32..3).prop_map(|c| Event::Exit(ExitInfo {
                code: Some(c),
                signal: None
            })),
            Just(Event::Unknown),
            Just(Event::Died("e".to_owned())),
            Just(Event::Refused("e".to_owned())),
            Just(Event::AttachBroke("e".to_owned())),
            Just(Event::CancelFailed),
            Just(Event::LinkUp),
            Just(Event::Superseded("e".to_owned())),
            Just(Event::ReattachExpired),
            Just(Event::Collected(Vec::new())),
            Just(Event::CollectFailed("e".to_owned())),
            Just(Event::Stop(Stop::Cancelled)),
            Just(Event::Stop(Stop::TimedOut("t".to_owned()))),
        ]
    }

    fn any_start() -> impl Strategy<Value = (JobState, bool, bool)> {
        (
            prop_oneof![
                Just(JobState::Queued),
                Just(JobState::Shipping),
                Just(JobState::Running)
            ],
            any::<bool>(),
            any::<bool>(),
        )
    }

    proptest! {
        /// Whatever happens, in whatever order: every effect comes after
        /// the record that licenses it, a run is finished (recorded) exactly
        /// once, and nothing follows `Done`.
        #[test]
        fn every_effect_follows_the_record_that_licenses_it(
            (recorded, has_workspace, wants_outputs) in any_start(),
            events in proptest::collection::vec(any_event(), 0..40),
        ) {
            let mut m = RunMachine::new(facts(wants_outputs), recorded, has_workspace);
            let mut all = drain(&mut m);
            for e in events {
                m.handle(e);
                all.extend(drain(&mut m));
            }
            let position = |want: &dyn Fn(&Action) -> bool| all.iter().position(want);
            let running = position(&|a| *a == Action::Record(Change::Running));
            let shipping = position(&|a| *a == Action::Record(Change::Shipping));
            let finished = position(&|a| matches!(a, Action::Record(Change::Finished(_))));
            for (i, a) in all.iter().enumerate() {
                match a {
                    Action::Start => prop_assert!(running.is_some_and(|r| r < i)),
                    Action::Ship => prop_assert!(shipping.is_some_and(|s| s < i)),
                    Action::Forget => prop_assert!(finished.is_some_and(|f| f < i)),
                    // A fresh run only runs what this daemon shipped.
                    Action::Record(Change::Running) => {
                        prop_assert!(has_workspace && recorded != JobState::Running);
                    }
                    _ => {}
                }
                if let Some(f) = finished {
                    // After the final record: only Forget and Done.
                    prop_assert!(i <= f || matches!(a, Action::Forget | Action::Done));
                }
            }
            let records = all
                .iter()
                .filter(|a| matches!(a, Action::Record(Change::Finished(_))))
                .count();
            prop_assert!(records <= 1);
            prop_assert_eq!(records == 1, m.is_finished());
            if let Some(done) = position(&|a| *a == Action::Done) {
                prop_assert_eq!(done, all.len() - 1);
            }
        }
    }
}
