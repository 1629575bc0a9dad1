//! Agents' leases in the simulated world, and what a daemon that comes back owes them.
//!
//! Every agent the host welcomes holds its node on a lease: the welcome
//! names the lease and is its first renewal, and the daemon renews it at the
//! period the host's [`Liveness`] gives, for as long as it hears the agent.
//! The world plays both sides. As the daemon, it renews the lease of every
//! agent a listening host is linked to (not during a host pause, not while
//! no host runs, not for an agent cut off or away). As the agent, it counts
//! from the last renewal and, a whole lease later, ends the node: its
//! machine disappears from the provider, as a Vast.ai instance its agent
//! destroys would (the world deletes it out of band). Process and container
//! providers, where the lease outlives its agent, are not modelled.
//!
//! [`AgentLeases`] keeps that ledger and judges three guarantees of issue 32:
//!
//! - [`Invariant::LeaseEndOnlyWhenUnrenewed`]: an agent is welcomed with its
//!   group's `orphan_after_s` and a renewal period shorter than it, and a
//!   lease lapses only after a whole lease without renewal in which no
//!   listening host held a link to the agent for a renewal period;
//! - [`Invariant::BackWithinWindowCreatesNothing`] and
//!   [`Invariant::LapsedSlotsMadeOnceMore`]: a host restarted with every
//!   fault quiet is held, slot by slot, to adopting each node whose agent is
//!   still alive and making nothing new for it, and to making each node
//!   whose lease lapsed exactly once more.
//!
//! # What a restarted host owes
//!
//! When a host goes (killed, or stopped keeping its nodes) with no fault
//! armed that could touch a running node (a delivery fault, a refused call,
//! a scripted bootstrap failure or loss of the next session), every slot
//! whose node is ready, Active, of its slot's desired template, with no
//! operation pending or in flight and its agent linked and alive, is
//! *kept*. Until the next input that could change that (anything but time
//! passing, ticks, host pauses, lost timers, resubmitted or invalid shapes)
//! and through the fair tail, for every kept slot whose template its new
//! host still wants:
//!
//! - while its agent is alive, the new host adopts that very attempt (once
//!   adopted, the slot's node is that attempt, Active), creates no lease for
//!   another attempt of it, re-issues no create for it when its listing
//!   showed its lease, and neither cancels, destroys nor collects it;
//! - once its lease has lapsed, the provider makes one machine for the slot
//!   (of whichever attempt): a second is a violation, and by the end of
//!   the fair tail exactly one was made.
//!
//! With the default lease (an hour) nothing lapses in a generated trace
//! (the longest runs a few minutes of virtual time), so the default battery
//! runs exactly as it did before leases were modelled; the lease battery
//! gives its groups a short `orphan_after_s` instead.

use crate::oracle::Invariant;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use swactor_provisioning::{
    CollectRequest, EffectRequest, Intent, Listed, Liveness, LogicalNodeId, NodeAttemptId,
    NodeTemplate, Pass, ResourceKey, Timestamp, same_template,
};

/// How the world's daemon renews leases.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Renewals {
    /// At the period the host's [`Liveness`] gives (the honest daemon).
    #[default]
    AsTold,
    /// Every `ms`, whatever the host said: a broken daemon, set only to
    /// prove that the oracle notices (`u64::MAX`: it never renews).
    Every {
        /// The period.
        ms: u64,
    },
}

/// What the lease ledger saw over a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LeaseStats {
    /// Renewals the world's daemon sent (welcomes not counted).
    pub renewals: u64,
    /// Leases that lapsed: nodes their agents ended.
    pub lapses: u64,
    /// Host restarts after which at least one slot was held to its
    /// guarantees (every fault quiet, its node ready and its agent linked).
    pub comebacks: u64,
    /// Slots held to "adopted, nothing new" that their new host adopted
    /// while their agent was alive.
    pub kept_adopted: u64,
    /// Slots held to "made once more" whose lease lapsed.
    pub kept_lapsed: u64,
}

/// One agent's hold on its node.
#[derive(Clone, Debug)]
struct Agent {
    /// The lease and the renewal period its last welcome named.
    lease_ms: u64,
    renew_every_ms: u64,
    /// The last renewal it received (a welcome is one).
    renewed: Timestamp,
    /// Since when a listening host has been linked to it without a break,
    /// counted from its last renewal at the earliest.
    linked_since: Option<Timestamp>,
    /// The longest such stretch since its last renewal that has ended.
    linked_longest_ms: u64,
}

impl Agent {
    /// Lets time pass from `from` to `to`, during which a listening host was
    /// linked to the agent throughout (`linked`) or not at all, and the
    /// daemon renews every `period_ms` while linked. Returns the renewals
    /// sent, and when the lease lapsed if it did by `to`.
    fn pass(
        &mut self,
        from: Timestamp,
        to: Timestamp,
        linked: bool,
        period_ms: u64,
    ) -> (u64, Option<Timestamp>) {
        if linked {
            self.linked_since.get_or_insert(from);
        } else if let Some(since) = self.linked_since.take() {
            self.linked_longest_ms = self.linked_longest_ms.max(from.saturating_since(since));
        }
        if self.lease_ms == 0 {
            // No lease: nothing to renew, nothing lapses.
            return (0, None);
        }
        let mut renewals = 0;
        loop {
            let lapse = self.renewed.saturating_add_ms(self.lease_ms);
            // The daemon renews at the first heartbeat it hears once a
            // period has passed (at once after a pause, if one is due).
            let next = (linked && period_ms > 0)
                .then(|| self.renewed.saturating_add_ms(period_ms).max(from));
            match next {
                Some(r) if r <= to && r <= lapse => {
                    // Renewals in time never let the lease lapse in
                    // between, so a long stretch is skipped at once.
                    let more = if period_ms < self.lease_ms {
                        (to.0 - r.0) / period_ms
                    } else {
                        0
                    };
                    self.renewed = Timestamp(r.0 + more * period_ms);
                    renewals += more + 1;
                    self.linked_since = Some(self.renewed);
                    self.linked_longest_ms = 0;
                }
                _ => return (renewals, (lapse <= to).then_some(lapse)),
            }
        }
    }

    /// The longest stretch since its last renewal, up to `at`, in which a
    /// listening host was linked to it.
    fn linked_ms(&self, at: Timestamp) -> u64 {
        let open = self.linked_since.map_or(0, |s| at.saturating_since(s));
        self.linked_longest_ms.max(open)
    }
}

/// A lease that lapsed: its agent ends its node.
#[derive(Clone, Debug)]
pub(crate) struct Lapse {
    /// Whose.
    pub key: ResourceKey,
    /// When.
    pub at: Timestamp,
    /// What the violation of [`Invariant::LeaseEndOnlyWhenUnrenewed`] is, if any.
    pub wrong: Option<String>,
}

/// A slot a restarted host is held to (see [`Comeback`]).
#[derive(Clone, Debug)]
struct Kept {
    /// The attempt whose node was ready, its agent linked, when the host went.
    attempt: NodeAttemptId,
    /// The template its slot wanted then.
    template: Arc<NodeTemplate>,
    /// When its lease lapsed, if it did.
    lapsed: Option<Timestamp>,
    /// Whether a second machine made for the slot since was reported.
    flagged: bool,
}

/// What a restarted host owes the slots it found running (see the module
/// docs, "What a restarted host owes").
#[derive(Clone, Debug)]
struct Comeback {
    slots: BTreeMap<LogicalNodeId, Kept>,
    /// Keys the new host's latest listing showed with a lease.
    listed: BTreeSet<ResourceKey>,
    /// Whether the new host's adoption was judged.
    adoption_judged: bool,
}

/// A broken guarantee, for the world to report.
pub(crate) type Wrong = (Invariant, LogicalNodeId, String);

/// The world's ledger of agents' leases. See the module docs.
#[derive(Clone, Debug, Default)]
pub struct AgentLeases {
    renewals: Renewals,
    agents: BTreeMap<(LogicalNodeId, NodeAttemptId), Agent>,
    ended: BTreeSet<(LogicalNodeId, NodeAttemptId)>,
    comeback: Option<Comeback>,
    stats: LeaseStats,
}

impl AgentLeases {
    /// An empty ledger whose daemon renews as `renewals` says.
    pub(crate) fn new(renewals: Renewals) -> Self {
        Self {
            renewals,
            ..Self::default()
        }
    }

    /// What the ledger saw so far.
    pub fn stats(&self) -> LeaseStats {
        self.stats
    }

    /// Whether the agent of `key` ended its node because its lease lapsed.
    pub fn ended(&self, key: &ResourceKey) -> bool {
        self.ended.contains(&(key.node, key.attempt))
    }

    /// Whether the agent of `key` holds a lease and has not ended its node.
    pub fn alive(&self, key: &ResourceKey) -> bool {
        self.agents.contains_key(&(key.node, key.attempt))
    }

    /// When the earliest lease lapses unless renewed before.
    pub(crate) fn next_lapse(&self) -> Option<Timestamp> {
        self.agents
            .values()
            .filter(|a| a.lease_ms > 0)
            .map(|a| a.renewed.saturating_add_ms(a.lease_ms))
            .min()
    }

    /// The host welcomed the agent of `key` at `now` on `liveness`: the
    /// welcome is a renewal, on the terms it names. `window_s` is the
    /// `orphan_after_s` the world's shapes give its group.
    pub(crate) fn welcomed(
        &mut self,
        key: &ResourceKey,
        liveness: &Liveness,
        window_s: u32,
        now: Timestamp,
    ) -> Option<String> {
        self.agents.insert(
            (key.node, key.attempt),
            Agent {
                lease_ms: liveness.lease_ms,
                renew_every_ms: liveness.renew_every_ms,
                renewed: now,
                linked_since: Some(now),
                linked_longest_ms: 0,
            },
        );
        let want_ms = u64::from(window_s) * 1_000;
        let renews = liveness.lease_ms == 0 || liveness.renew_every_ms < liveness.lease_ms;
        (liveness.lease_ms != want_ms || !renews).then(|| {
            format!(
                "{key} was welcomed with a lease of {} ms renewed every {} ms; its group's \
                 orphan_after_s asks for {want_ms} ms, renewed more often than that",
                liveness.lease_ms, liveness.renew_every_ms
            )
        })
    }

    /// Lets time pass from `from` to `to`: a listening host renews every
    /// agent it is linked to (as `linked` says at `from`); an agent whose
    /// machine is gone or stopped (not `running`) is dropped. Returns the
    /// leases that lapsed by `to`, in the order they lapsed; their agents
    /// are gone.
    pub(crate) fn advance(
        &mut self,
        from: Timestamp,
        to: Timestamp,
        listening: bool,
        linked: impl Fn(&ResourceKey) -> bool,
        running: impl Fn(&ResourceKey) -> bool,
    ) -> Vec<Lapse> {
        let mut lapses = Vec::new();
        let override_ms = match self.renewals {
            Renewals::AsTold => None,
            Renewals::Every { ms } => Some(ms),
        };
        let run = swactor_provisioning::RunId::new(crate::world::RUN);
        let mut gone = Vec::new();
        for (&(node, attempt), agent) in &mut self.agents {
            let key = ResourceKey {
                run_id: run.clone(),
                node,
                attempt,
            };
            if !running(&key) {
                gone.push((node, attempt));
                continue;
            }
            let period = override_ms.unwrap_or(agent.renew_every_ms);
            let (renewals, lapsed) = agent.pass(from, to, listening && linked(&key), period);
            self.stats.renewals += renewals;
            if let Some(at) = lapsed {
                gone.push((node, attempt));
                let wrong = judge_lapse(&key, agent, at);
                lapses.push(Lapse { key, at, wrong });
            }
        }
        for id in gone {
            self.agents.remove(&id);
        }
        for l in &lapses {
            self.ended.insert((l.key.node, l.key.attempt));
            self.stats.lapses += 1;
            self.lapsed(&l.key, l.at);
        }
        lapses.sort_by_key(|l| l.at);
        lapses
    }

    /// Any input but these may touch a kept slot: the comeback's
    /// guarantees end with it.
    pub(crate) fn input(&mut self, quiet: bool) {
        if !quiet {
            self.comeback = None;
        }
    }

    /// The host goes with every fault that could touch a running node
    /// quiet (`quiet`); `keep` are the slots whose node is ready, Active,
    /// of its desired template (given), idle, and whose agent is linked.
    pub(crate) fn host_going(&mut self, quiet: bool, keep: Vec<(ResourceKey, Arc<NodeTemplate>)>) {
        let slots: BTreeMap<LogicalNodeId, Kept> = keep
            .into_iter()
            .filter(|(key, _)| quiet && self.alive(key))
            .map(|(key, template)| {
                let kept = Kept {
                    attempt: key.attempt,
                    template,
                    lapsed: None,
                    flagged: false,
                };
                (key.node, kept)
            })
            .collect();
        if !slots.is_empty() {
            self.stats.comebacks += 1;
        }
        self.comeback = (!slots.is_empty()).then_some(Comeback {
            slots,
            listed: BTreeSet::new(),
            adoption_judged: false,
        });
    }

    /// A new host started; `as_before` is false when it starts on another
    /// shape than the journal's, or to finish a teardown.
    pub(crate) fn host_started(&mut self, as_before: bool) {
        if !as_before {
            self.comeback = None;
        }
    }

    /// The new host was shown `listed`.
    pub(crate) fn listed(&mut self, listed: &[Listed]) {
        if let Some(c) = &mut self.comeback {
            c.listed = listed
                .iter()
                .filter(|l| l.lease.is_some())
                .map(|l| l.key.clone())
                .collect();
        }
    }

    fn lapsed(&mut self, key: &ResourceKey, at: Timestamp) {
        let Some(c) = &mut self.comeback else {
            return;
        };
        if let Some(k) = c.slots.get_mut(&key.node)
            && k.attempt == key.attempt
            && k.lapsed.is_none()
        {
            k.lapsed = Some(at);
            self.stats.kept_lapsed += 1;
        }
    }

    /// The kept slots whose template `wanted` (the new host's desired
    /// template of a slot) still names, with whether their agent is alive.
    fn held<'a>(
        &'a self,
        wanted: &'a dyn Fn(&LogicalNodeId) -> Option<Arc<NodeTemplate>>,
    ) -> impl Iterator<Item = (&'a LogicalNodeId, &'a Kept, bool)> + 'a {
        self.comeback.iter().flat_map(move |c| {
            c.slots.iter().filter_map(move |(node, k)| {
                let still = wanted(node).is_some_and(|t| same_template(&t, &k.template));
                let alive = self.agents.contains_key(&(*node, k.attempt));
                still.then_some((node, k, alive))
            })
        })
    }

    /// The new host adopted (`adopted_as` gives the attempt and intent of a
    /// slot's node, if it holds one): every kept slot whose agent is alive
    /// must hold that very attempt, Active. Judged once per comeback.
    pub(crate) fn judge_adoption(
        &mut self,
        wanted: &dyn Fn(&LogicalNodeId) -> Option<Arc<NodeTemplate>>,
        adopted_as: &dyn Fn(&LogicalNodeId) -> Option<(NodeAttemptId, Intent)>,
    ) -> Vec<Wrong> {
        if self.comeback.as_ref().is_none_or(|c| c.adoption_judged) {
            return Vec::new();
        }
        let mut wrong = Vec::new();
        let mut adopted = 0;
        for (node, k, alive) in self.held(wanted) {
            if !alive {
                continue;
            }
            match adopted_as(node) {
                Some((a, Intent::Active)) if a == k.attempt => adopted += 1,
                other => wrong.push((
                    Invariant::BackWithinWindowCreatesNothing,
                    *node,
                    format!(
                        "the restarted host holds {other:?} for {node}, whose agent of {} is alive \
                         and was linked when the last host went: it must adopt that attempt",
                        k.attempt
                    ),
                )),
            }
        }
        self.stats.kept_adopted += adopted;
        if let Some(c) = &mut self.comeback {
            c.adoption_judged = true;
        }
        wrong
    }

    /// A pass of the new host: no create for a slot whose agent is alive,
    /// and nothing taken down of it.
    pub(crate) fn judge_pass(
        &self,
        pass: &Pass,
        wanted: &dyn Fn(&LogicalNodeId) -> Option<Arc<NodeTemplate>>,
    ) -> Vec<Wrong> {
        let mut wrong = Vec::new();
        let held: BTreeMap<LogicalNodeId, (NodeAttemptId, Option<Timestamp>, bool)> = self
            .held(wanted)
            .map(|(n, k, alive)| (*n, (k.attempt, k.lapsed, alive)))
            .collect();
        let listed = self.comeback.as_ref().map(|c| &c.listed);
        for d in &pass.dispatches {
            let Some(&(kept, lapsed, alive)) = held.get(&d.key.node) else {
                continue;
            };
            let (node, attempt) = (d.key.node, d.key.attempt);
            let create = matches!(d.request, EffectRequest::CreateLease { .. });
            let down = matches!(
                d.request,
                EffectRequest::CancelBootstrap { .. } | EffectRequest::DestroyLease { .. }
            );
            if !alive || lapsed.is_some() {
                continue;
            }
            let again = create && attempt == kept && listed.is_some_and(|l| l.contains(&d.key));
            if (create && attempt != kept) || again || (down && attempt == kept) {
                wrong.push((
                    Invariant::BackWithinWindowCreatesNothing,
                    node,
                    format!(
                        "the restarted host dispatched {:?} for {}/{attempt} while the agent of \
                         {kept}, linked when the last host went, is alive{}",
                        d.request.kind(),
                        node,
                        if again {
                            " and its lease was listed"
                        } else {
                            ""
                        }
                    ),
                ));
            }
        }
        wrong
    }

    /// After any step: the provider made at most one machine for each
    /// lapsed kept slot since its lease lapsed (`made` lists the attempts
    /// of the machines made for a slot since an instant).
    pub(crate) fn judge_made(
        &mut self,
        wanted: &dyn Fn(&LogicalNodeId) -> Option<Arc<NodeTemplate>>,
        made: &dyn Fn(&LogicalNodeId, Timestamp) -> Vec<NodeAttemptId>,
    ) -> Vec<Wrong> {
        let lapsed: Vec<(LogicalNodeId, NodeAttemptId, Timestamp)> = self
            .held(wanted)
            .filter(|(_, k, _)| !k.flagged)
            .filter_map(|(node, k, _)| Some((*node, k.attempt, k.lapsed?)))
            .collect();
        let mut wrong = Vec::new();
        for (node, attempt, at) in lapsed {
            let machines = made(&node, at);
            if machines.len() < 2 {
                continue;
            }
            if let Some(k) = self.comeback.as_mut().and_then(|c| c.slots.get_mut(&node)) {
                k.flagged = true;
            }
            wrong.push((
                Invariant::LapsedSlotsMadeOnceMore,
                node,
                format!(
                    "the lease of {node}/{attempt} lapsed at {at}; since then the provider made \
                     machines of attempts {machines:?} for the slot, where one was owed"
                ),
            ));
        }
        wrong
    }

    /// The new host collects `request`: never a kept attempt whose agent is alive.
    pub(crate) fn judge_collect(&self, request: &CollectRequest) -> Option<Wrong> {
        let k = self.comeback.as_ref()?.slots.get(&request.key.node)?;
        let alive = self.alive(&request.key);
        (k.attempt == request.key.attempt && alive && k.lapsed.is_none()).then(|| {
            (
                Invariant::BackWithinWindowCreatesNothing,
                request.key.node,
                format!(
                    "the restarted host collects {} as an orphan while its agent is alive",
                    request.key
                ),
            )
        })
    }

    /// The end of the fair tail: the provider made exactly one machine for
    /// each lapsed kept slot still wanted.
    pub(crate) fn judge_end(
        &self,
        wanted: &dyn Fn(&LogicalNodeId) -> Option<Arc<NodeTemplate>>,
        made: &dyn Fn(&LogicalNodeId, Timestamp) -> Vec<NodeAttemptId>,
    ) -> Vec<Wrong> {
        self.held(wanted)
            .filter_map(|(node, k, _)| {
                let at = k.lapsed?;
                let machines = made(node, at);
                (machines.len() != 1).then(|| {
                    (
                        Invariant::LapsedSlotsMadeOnceMore,
                        *node,
                        format!(
                            "the lease of {node}/{} lapsed at {at}; by the end the provider had \
                             made machines of attempts {machines:?} for the slot, where exactly \
                             one was owed",
                            k.attempt
                        ),
                    )
                })
            })
            .collect()
    }
}

/// Whether `agent`'s lease may lapse at `at`: a whole lease after its
/// last renewal, and with no stretch since then in which a listening host
/// was linked to it for as long as a renewal period (or the lease, if the
/// period is not shorter).
fn judge_lapse(key: &ResourceKey, agent: &Agent, at: Timestamp) -> Option<String> {
    let unrenewed = at.saturating_since(agent.renewed);
    if unrenewed < agent.lease_ms {
        return Some(format!(
            "{key} ended its node at {at}, {unrenewed} ms after its last renewal at {}: its \
             lease is {} ms",
            agent.renewed, agent.lease_ms
        ));
    }
    let linked = agent.linked_ms(at);
    let due = agent.renew_every_ms.min(agent.lease_ms);
    (linked >= due).then(|| {
        format!(
            "{key} ended its node at {at}, its lease of {} ms unrenewed since {}, though a \
             listening host was linked to it for {linked} ms of that (renewals due every {} ms)",
            agent.lease_ms, agent.renewed, agent.renew_every_ms
        )
    })
}
