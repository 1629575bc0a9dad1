//! A run shared by several daemons through etcd (`swactor up SHAPE
//! --etcd URL`): what they share, how each registers, standing by, and the
//! terms in which one of them leads.
//!
//! Every daemon started on the same run and etcd campaigns
//! ([`swactor_engine::etcd::Election`]). The one that wins runs a *term*:
//! the same start as a daemon restarted on its journal (the journal read
//! from etcd, the providers listed, everything adopted), with three
//! differences: its journal commits are fenced on the election key, its
//! host and its provider gate stop at the leadership bound, and the term
//! ends (keeping every node) as soon as the election says it no longer
//! leads. Then it stands by again.
//!
//! The daemons of a run are one daemon to agents and CLIs: they share the
//! iroh keys of both endpoints and the secret join tokens derive from
//! (kept in etcd, written into each state directory), and each registers
//! the addresses it serves on, so an agent or a CLI dials them all and
//! reaches the one that leads.

use super::*;
use crate::journal::EtcdJournal;
use crate::replicas::{HaView, Replicas};
use serde::{Deserialize, Serialize};
use std::sync::OnceLock;
use swactor_engine::LeadBound;
use swactor_engine::etcd::{
    Client, Compare, Election, ElectionConfig, EtcdConfig, Fence, Op, OpResponse, Range, Role, Txn,
};
use tokio::sync::watch;

/// `swactor up --etcd`: where the run's journal and its daemons meet.
#[derive(Clone, Debug)]
pub struct HaOptions {
    /// How to reach etcd.
    pub etcd: EtcdConfig,
    /// The key prefix (empty, or a path such as `/prod`).
    pub prefix: String,
    /// The leader's lease.
    pub lease_ttl: Duration,
}

impl HaOptions {
    /// The options the command line's flags (and etcdctl's environment)
    /// give; `None` when they name no etcd.
    ///
    /// # Errors
    /// The etcd settings are unusable, or the lease is not a number of
    /// seconds from 2 to 600.
    pub fn from_args(
        args: &crate::journal::EtcdArgs,
        prefix: String,
        lease_ttl_s: Option<f64>,
    ) -> Result<Option<Self>> {
        let Some(etcd) = args.config().context("the etcd settings")? else {
            if lease_ttl_s.is_some() || !prefix.is_empty() {
                anyhow::bail!("--lease-ttl and --etcd-prefix need --etcd; nothing was started");
            }
            return Ok(None);
        };
        let lease_ttl = match lease_ttl_s {
            None => DEFAULT_LEASE_TTL,
            Some(s) if s.is_finite() && (2.0..=600.0).contains(&s) => Duration::from_secs_f64(s),
            Some(s) => anyhow::bail!(
                "--lease-ttl {s} is out of range: from 2 to 600 seconds; nothing was started"
            ),
        };
        Ok(Some(Self {
            etcd,
            prefix,
            lease_ttl,
        }))
    }

    /// How the campaign runs for this lease: the margin is a fifth of the
    /// lease (at least 0.5 s, at most 2 s), a standby tries again every
    /// tenth (at most every second).
    fn election(&self, key: String, identity: Vec<u8>) -> ElectionConfig {
        let ttl = self.lease_ttl;
        ElectionConfig {
            key,
            identity,
            ttl,
            margin: (ttl / 5).clamp(Duration::from_millis(500), Duration::from_secs(2)),
            retry: (ttl / 10).min(Duration::from_secs(1)),
        }
    }
}

/// The leader's lease unless `--lease-ttl` says otherwise.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);

/// Where a run's shared keys live: `{prefix}/swactor/ha/{run}`.
fn ha_root(prefix: &str, run: &RunId) -> String {
    format!("{prefix}/swactor/ha/{}", run.as_str())
}

/// What every daemon of a run shares, made by the first and read by the
/// others. Secret: see docs/security.md.
#[derive(Serialize, Deserialize)]
struct Identity {
    /// The key layout.
    format: u32,
    /// The agents' endpoint's iroh secret key, hex.
    swarm_key: String,
    /// The CLI's endpoint's iroh secret key, hex.
    control_key: String,
    /// The secret agents' join tokens derive from, hex.
    token_secret: String,
    /// The deployment every resource of the run carries.
    deployment: String,
}

const IDENTITY_FORMAT: u32 = 1;

/// One daemon of the run, as it registers itself (on its election lease,
/// so the record goes when the daemon does).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct ReplicaRecord {
    /// How people know it: `host (pid N)`.
    pub(super) name: String,
    /// Where its agents' endpoint listens when it leads.
    pub(super) swarm: SocketAddr,
    /// Where its CLI endpoint listens when it leads.
    pub(super) control: SocketAddr,
    /// Its state directory's CLI key, which whichever daemon leads lets in.
    pub(super) cli_key: String,
}

/// What a daemon knows of its run's other daemons, as it changes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Peers {
    /// Every daemon registered now (alive), this one included, in key order.
    pub(super) all: Vec<ReplicaRecord>,
    /// Every daemon that ever registered, alive or not: a replica that was
    /// killed and comes back on the same addresses (its state directory
    /// keeps its ports) is reachable at them, so agents are told of it
    /// even while it is down. At most [`PEERS_MAX`].
    pub(super) known: Vec<ReplicaRecord>,
}

impl Peers {
    /// This daemon's address first, then every other daemon's, alive
    /// first, each once, at most [`PEERS_MAX`].
    fn addresses(
        &self,
        me: &ReplicaRecord,
        of: impl Fn(&ReplicaRecord) -> SocketAddr,
    ) -> Vec<SocketAddr> {
        let mut addrs = vec![of(me)];
        for a in self.all.iter().chain(&self.known).map(of) {
            if !addrs.contains(&a) && addrs.len() < PEERS_MAX {
                addrs.push(a);
            }
        }
        addrs
    }

    fn swarm(&self, me: &ReplicaRecord) -> Vec<SocketAddr> {
        self.addresses(me, |r| r.swarm)
    }

    fn control(&self, me: &ReplicaRecord) -> Vec<SocketAddr> {
        self.addresses(me, |r| r.control)
    }
}

/// A ticket naming `id` at every one of `addrs`.
fn ticket_at(id: swactor_engine::iroh::EndpointId, addrs: &[SocketAddr]) -> EndpointTicket {
    let mut addr = swactor_engine::iroh::EndpointAddr::new(id);
    for a in addrs {
        addr = addr.with_ip_addr(*a);
    }
    EndpointTicket::new(addr)
}

/// What a term of leadership is given by the loop that campaigns, and
/// what `run` needs of it.
pub(super) struct Term {
    pub(super) journal: EtcdJournal,
    pub(super) resume: Option<JournalImage>,
    pub(super) lead: LeadBound,
    /// True once this term's leadership is lost.
    pub(super) lost: watch::Receiver<bool>,
    /// The agents' addresses of every daemon of the run.
    pub(super) replicas: Replicas,
    pub(super) view: HaView,
    pub(super) peers: watch::Receiver<Peers>,
    pub(super) me: ReplicaRecord,
    /// The cluster, once started, told when the bound moves.
    pub(super) cluster: Arc<OnceLock<ClusterHandle>>,
    /// Provider calls let through and refused by this term's gate.
    pub(super) gate: Arc<OnceLock<Arc<swactor_providers::gate::GateCounts>>>,
    /// The ticket agents made now are started with: every daemon of the
    /// run, kept up to date as they register.
    pub(super) ticket: swactor_providers::DaemonTicket,
}

/// How long a daemon about to lead waits for a port it gave the run's
/// other daemons while the port is taken (by its own endpoint of a term
/// just ended, still closing, say).
pub(super) const PORT_PATIENCE: Duration = Duration::from_secs(3);

/// Why a term ended before it began: a port this daemon gave the run's
/// other daemons (and that their tickets name) stayed taken, so it bound
/// another. Agents and CLIs could not find it there: it stands by again
/// and gives the others the ports it has now.
#[derive(Debug)]
pub(super) struct PortsMoved {
    /// Which port: "agents'" or "control".
    what: &'static str,
    given: SocketAddr,
    bound: Option<u16>,
}

impl std::fmt::Display for PortsMoved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the {} port this daemon gave the run's other daemons ({}) stayed taken for {} s",
            self.what,
            self.given,
            PORT_PATIENCE.as_secs()
        )?;
        match self.bound {
            Some(port) => write!(f, "; it bound {port} instead"),
            None => Ok(()),
        }
    }
}

impl std::error::Error for PortsMoved {}

fn check_port(
    what: &'static str,
    given: SocketAddr,
    ep: &swactor_engine::iroh::Endpoint,
) -> Result<(), PortsMoved> {
    let bound = serve::bound_port(ep);
    if bound == Some(given.port()) {
        Ok(())
    } else {
        Err(PortsMoved { what, given, bound })
    }
}

impl Term {
    /// Fails with [`PortsMoved`] unless `control` is bound on the port
    /// this daemon's record gives.
    pub(super) fn check_control_port(
        &self,
        control: &swactor_engine::iroh::Endpoint,
    ) -> Result<(), PortsMoved> {
        check_port("control", self.me.control, control)
    }

    /// [`Term::check_control_port`] for the agents' endpoint.
    pub(super) fn check_swarm_port(
        &self,
        swarm: &swactor_engine::iroh::Endpoint,
    ) -> Result<(), PortsMoved> {
        check_port("agents'", self.me.swarm, swarm)
    }

    /// The agents' ticket: the shared key, at every daemon's address.
    pub(super) fn agent_ticket(&self, id: swactor_engine::iroh::EndpointId) -> EndpointTicket {
        ticket_at(id, &self.peers.borrow().swarm(&self.me))
    }

    /// The CLI's ticket: the shared control key, at every daemon's address.
    pub(super) fn cli_ticket(&self, id: swactor_engine::iroh::EndpointId) -> EndpointTicket {
        ticket_at(id, &self.peers.borrow().control(&self.me))
    }

    /// Lets in the CLI keys of every daemon of the run, as they register.
    pub(super) fn admit_clis(&self, allowed: Allowlist) -> AbortOnDrop {
        let mut peers = self.peers.clone();
        AbortOnDrop(tokio::spawn(async move {
            loop {
                let keys: Vec<String> = peers
                    .borrow_and_update()
                    .all
                    .iter()
                    .map(|r| r.cli_key.clone())
                    .collect();
                for key in keys {
                    if let Ok(id) = key.parse::<swactor_engine::iroh::EndpointId>() {
                        allowed.allow(id);
                    }
                }
                if peers.changed().await.is_err() {
                    return;
                }
            }
        }))
    }
}

/// Runs the daemon as one of the run's replicas: stands by until it
/// leads, leads until it stops leading, and again, until it is told to
/// stop. Returns the process exit code.
///
/// # Errors
/// Bad input, etcd unreachable at start, or a failure to start.
pub(super) async fn up(mut opts: UpOptions, ha: HaOptions) -> Result<i32> {
    let endpoints = ha.etcd.endpoints.join(",");
    let Some(shape_path) = opts.shape.clone() else {
        anyhow::bail!(
            "with --etcd, give the run's shape file: its run names the journal in etcd (start \
             each standby with the same file); nothing was started"
        );
    };
    let file = ShapeFile::load(&shape_path)?;
    if let Some(why) = local_group(&file) {
        anyhow::bail!("{why}; nothing was started");
    }
    let run_id = file.run_id();
    let client = Client::new(ha.etcd.clone())
        .with_context(|| format!("cannot use etcd at {endpoints}; nothing was started"))?;
    // etcd must answer now: a daemon that cannot read the journal starts
    // nothing. The journal's checks (another run's, another format) too.
    let (_, journal) = EtcdJournal::open(client.clone(), &ha.prefix, &run_id)
        .await
        .with_context(|| {
            format!(
                "cannot read run {run_id}'s journal in etcd at {endpoints}; nothing was started"
            )
        })?;
    let (listen, advertise) = network(&opts)?;
    let state = StateDir::create(opts.state_dir.clone())?;
    // The CLI sends SIGHUP to the pid in the lock when the daemon refuses
    // its key (a standby's key is let in by the leader a moment after the
    // standby registers): caught for the whole process, or it would end a
    // standby. A term reloads the ticket and the key on it as any daemon.
    let mut hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .context("cannot catch SIGHUP")?;
    let _hangups = AbortOnDrop(tokio::spawn(async move {
        while hangups.recv().await.is_some() {}
    }));
    let lock = state.lock()?;
    let root = ha_root(&ha.prefix, &run_id);
    let identity = shared_identity(&client, &root, &state, journal.as_ref()).await?;
    let record = |state: &StateDir| -> Result<ReplicaRecord> {
        Ok(ReplicaRecord {
            name: format!("{} (pid {})", host_name(), std::process::id()),
            swarm: SocketAddr::new(
                advertise.unwrap_or(listen),
                reserve_port(state, listen, Port::Swarm)?,
            ),
            // Dialed from the other replicas' machines too: the advertised
            // address when there is one, as for agents.
            control: SocketAddr::new(
                advertise.unwrap_or(listen),
                reserve_port(state, listen, Port::Control)?,
            ),
            cli_key: state.cli_key()?.public().to_string(),
        })
    };
    let candidacy = |me: &ReplicaRecord| -> Result<ElectionConfig> {
        Ok(ha.election(
            format!("{root}/leader"),
            serde_json::to_vec(me).context("encoding this daemon's record")?,
        ))
    };
    let mut me = record(&state)?;
    let mut election_config = candidacy(&me)?;
    let mut election = Election::start(client.clone(), election_config.clone());
    let (peers_tx, peers) = watch::channel(Peers::default());
    let _following = AbortOnDrop(tokio::spawn(follow_peers(
        client.clone(),
        root.clone(),
        peers_tx,
    )));
    let mut registered = re_register(&client, &root, &me, &election);
    eprintln!(
        "swactor: run {run_id} keeps its journal in etcd at {endpoints}; this daemon is \
         {} (lease {} s)",
        me.name,
        ha.lease_ttl.as_secs_f64()
    );
    let mut terms = 0u64;
    let mut quick_failures = 0u32;
    let code = loop {
        let mut role = election.role();
        let waited = std::time::Instant::now();
        let fence = tokio::select! {
            fence = stand_by(&mut role, &state, &peers, &me, &identity) => fence,
            () = shutdown_signal() => break 0,
        };
        let (journal, resume) = match EtcdJournal::open(client.clone(), &ha.prefix, &run_id).await {
            Ok(read) => read,
            Err(e) => {
                eprintln!("swactor: cannot read the journal to lead: {e:#}; standing by");
                (election, registered) =
                    campaign_again(election, &client, &election_config, (&root, &me)).await;
                continue;
            }
        };
        // A run torn down (by `swactor down` on the leader) is not started
        // again by its standbys.
        if let Some(image) = &resume
            && image.meta.shape.is_some()
            && matches!(
                swactor_provisioning::decide_start(Some(image), None),
                Err(StartRefusal::TornDown { .. })
            )
        {
            eprintln!("swactor: run {run_id} was torn down; nothing to lead, this daemon stops");
            break 0;
        }
        journal.set_fence(Some(fence.clone()));
        terms += 1;
        eprintln!(
            "swactor: leading run {run_id} (term {terms}; stood by {:.1} s)",
            waited.elapsed().as_secs_f64()
        );
        let term = start_term(
            &election,
            fence,
            (journal, resume),
            (&peers, &me, identity.swarm),
            &ha,
            terms,
        );
        let started = std::time::Instant::now();
        let gate = term.gate.clone();
        let journal = term.journal.clone();
        let outcome = run(&mut opts, Some(term)).await;
        let counts = gate
            .get()
            .map(|c| (c.passed(), c.refused()))
            .unwrap_or_default();
        let commits = journal.commits_sent();
        match outcome {
            Ok(LOST_LEAD) => {
                eprintln!(
                    "swactor: no longer leading run {run_id} (after {:.1} s; {} provider calls \
                     made, {} refused at the bound, {commits} journal commits sent); every node \
                     was left running, standing by",
                    started.elapsed().as_secs_f64(),
                    counts.0,
                    counts.1
                );
                quick_failures = 0;
            }
            Ok(GAVE_UP) => {
                quick_failures += 1;
                if quick_failures > 3 {
                    break 3;
                }
                eprintln!("swactor: stepping down so the journal is read again; standing by");
                (election, registered) =
                    campaign_again(election, &client, &election_config, (&root, &me)).await;
            }
            Ok(code) => break code,
            Err(e) if e.downcast_ref::<PortsMoved>().is_some() => {
                // The ports it bound instead are saved: the record gives
                // them, so the others' tickets name them before it leads.
                quick_failures += 1;
                let next = record(&state).and_then(|me| Ok((candidacy(&me)?, me)));
                let (config, moved) = match next {
                    Ok(next) if quick_failures <= 3 => next,
                    failed => {
                        election.step_down().await;
                        drop(lock);
                        return Err(failed.err().unwrap_or(e));
                    }
                };
                eprintln!(
                    "swactor: no longer leading run {run_id}: {e:#}; nothing was started, \
                     standing by on {} (agents) and {} (control)",
                    moved.swarm, moved.control
                );
                (me, election_config) = (moved, config);
                (election, registered) =
                    campaign_again(election, &client, &election_config, (&root, &me)).await;
            }
            Err(e) => {
                election.step_down().await;
                drop(lock);
                return Err(e);
            }
        }
    };
    drop(registered);
    // Stepping down revokes the lease: a standby leads at once, and this
    // daemon's record goes with it.
    election.step_down().await;
    state.remove_ticket();
    drop(lock);
    Ok(code)
}

/// `run` returns this when the term's leadership was lost (internal).
pub(super) const LOST_LEAD: i32 = -100;
/// `run` returns this when the cluster actor gave up (internal, in a term).
pub(super) const GAVE_UP: i32 = -101;

/// Steps down from `election` and campaigns again with `config`,
/// registering `me` for it; pauses a second before the next try.
async fn campaign_again(
    election: Election,
    client: &Client,
    config: &ElectionConfig,
    (root, me): (&str, &ReplicaRecord),
) -> (Election, AbortOnDrop) {
    election.step_down().await;
    let election = Election::start(client.clone(), config.clone());
    let registered = re_register(client, root, me, &election);
    tokio::time::sleep(Duration::from_secs(1)).await;
    (election, registered)
}

fn re_register(
    client: &Client,
    root: &str,
    me: &ReplicaRecord,
    election: &Election,
) -> AbortOnDrop {
    AbortOnDrop(tokio::spawn(register(
        client.clone(),
        (
            format!("{root}/replicas/{}", me.cli_key),
            format!("{root}/known/{}", me.cli_key),
        ),
        me.clone(),
        election.lease(),
    )))
}

/// Starts a term: the bound, the watch that ends it, what status shows.
#[allow(clippy::too_many_arguments)]
fn start_term(
    election: &Election,
    fence: Fence,
    (journal, resume): (EtcdJournal, Option<JournalImage>),
    (peers, me, swarm): (
        &watch::Receiver<Peers>,
        &ReplicaRecord,
        swactor_engine::iroh::EndpointId,
    ),
    ha: &HaOptions,
    terms: u64,
) -> Term {
    let ticket = swactor_providers::DaemonTicket::new(
        ticket_at(swarm, &peers.borrow().swarm(me)).to_string(),
    );
    let lead = LeadBound::new();
    let (lost_tx, lost) = watch::channel(false);
    let view = HaView::default();
    let cluster: Arc<OnceLock<ClusterHandle>> = Arc::default();
    let gate: Arc<OnceLock<Arc<swactor_providers::gate::GateCounts>>> = Arc::default();
    let (replicas_tx, replicas_rx) = watch::channel(peers.borrow().swarm(me));
    let role = election.role();
    let since_wall_ms = wall_ms();
    let margin = ha.election(String::new(), Vec::new()).margin;
    let follow = Following {
        role,
        fence,
        lead: lead.clone(),
        lost: lost_tx,
        view: view.clone(),
        cluster: cluster.clone(),
        peers: peers.clone(),
        me: me.clone(),
        replicas: replicas_tx,
        ticket: (ticket.clone(), swarm),
        journal: journal.clone(),
        gate: gate.clone(),
        status: swactor_actors::HaStatus {
            leader: me.name.clone(),
            leading_since_wall_ms: since_wall_ms,
            standbys: Vec::new(),
            lease_ttl_ms: millis(ha.lease_ttl),
            margin_ms: millis(margin),
            renewed_ms_ago: 0,
            etcd: ha.etcd.endpoints.join(","),
            terms,
            ..Default::default()
        },
        ttl: ha.lease_ttl,
        margin,
    };
    follow.update();
    tokio::spawn(follow.run());
    Term {
        journal,
        resume,
        lead,
        lost,
        replicas: Replicas::new(replicas_rx),
        view,
        peers: peers.clone(),
        me: me.clone(),
        cluster,
        gate,
        ticket,
    }
}

/// A term's follower of the election: moves the bound, pokes the cluster,
/// keeps the status, and says when the term is over. Ends with the term.
struct Following {
    role: watch::Receiver<Role>,
    fence: Fence,
    lead: LeadBound,
    lost: watch::Sender<bool>,
    view: HaView,
    cluster: Arc<OnceLock<ClusterHandle>>,
    peers: watch::Receiver<Peers>,
    me: ReplicaRecord,
    replicas: watch::Sender<Vec<SocketAddr>>,
    /// The agents' ticket, and the identity it names.
    ticket: (
        swactor_providers::DaemonTicket,
        swactor_engine::iroh::EndpointId,
    ),
    journal: EtcdJournal,
    gate: Arc<OnceLock<Arc<swactor_providers::gate::GateCounts>>>,
    status: swactor_actors::HaStatus,
    ttl: Duration,
    margin: Duration,
}

impl Following {
    /// Reads the role and the peers once; false once the term is over.
    fn update(&self) -> bool {
        let role = self.role.borrow().clone();
        let held = match role {
            Role::Leading { until, fence } if fence == self.fence => Some(until),
            _ => None,
        };
        self.lead.set(held.map(EngineInstant::from));
        if let Some(cluster) = self.cluster.get() {
            cluster.leadership_changed();
        }
        let peers = self.peers.borrow().clone();
        let swarm = peers.swarm(&self.me);
        self.replicas.send_if_modified(|addrs| {
            let changed = *addrs != swarm;
            addrs.clone_from(&swarm);
            changed
        });
        // Agents made from now on are told of every daemon known now.
        self.ticket
            .0
            .set(ticket_at(self.ticket.1, &swarm).to_string());
        let mut status = self.status.clone();
        status.standbys = peers
            .all
            .iter()
            .filter(|r| r.cli_key != self.me.cli_key)
            .map(|r| r.name.clone())
            .collect();
        if let Some(gate) = self.gate.get() {
            status.provider_calls = gate.passed();
            status.provider_calls_refused = gate.refused();
        }
        status.journal_commits = self.journal.commits_sent();
        status.renewed_ms_ago = held.map_or(u64::MAX, |until| {
            // The bound is the renewal's send time + ttl − margin.
            let renewed = until.checked_sub(self.ttl.saturating_sub(self.margin));
            renewed.map_or(0, |at| millis(at.elapsed()))
        });
        self.view.set(Some(status));
        // Past the bound by the margin, the lease may have ended in etcd
        // and another daemon may lead: one that still held the agents'
        // links (cut off from etcd, not from them) would keep them from
        // the new leader, which would replace their nodes. The term ends.
        let over = held.is_none_or(|until| tokio::time::Instant::now() >= until + self.margin);
        if over {
            self.lost.send_replace(true);
        }
        !over
    }

    async fn run(mut self) {
        loop {
            tokio::select! {
                changed = self.role.changed() => if changed.is_err() {
                    self.lost.send_replace(true);
                    return;
                },
                changed = self.peers.changed() => if changed.is_err() {
                    return;
                },
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
                () = self.lost.closed() => return,
            }
            if !self.update() {
                return;
            }
        }
    }
}

/// Stands by until this daemon leads; returns its fence. Keeps the CLI
/// ticket in the state directory naming every daemon of the run, and says
/// who leads when that changes.
async fn stand_by(
    role: &mut watch::Receiver<Role>,
    state: &StateDir,
    peers: &watch::Receiver<Peers>,
    me: &ReplicaRecord,
    identity: &SharedKeys,
) -> Fence {
    let mut said: Option<Option<String>> = None;
    let mut peers = peers.clone();
    loop {
        let now = role.borrow_and_update().clone();
        match now {
            Role::Leading { until, fence } if until > tokio::time::Instant::now() => return fence,
            Role::Leading { .. } => {}
            Role::Standby { leader, error } => {
                let leader = leader
                    .and_then(|l| serde_json::from_slice::<ReplicaRecord>(&l).ok())
                    .map(|r| r.name);
                if said.as_ref() != Some(&leader) {
                    match (&leader, error) {
                        (Some(name), _) => eprintln!("swactor: standing by; {name} leads"),
                        (None, Some(e)) => {
                            eprintln!("swactor: standing by; etcd does not answer ({e})");
                        }
                        (None, None) => eprintln!("swactor: standing by"),
                    }
                    said = Some(leader);
                }
            }
        }
        // The CLI of this state directory reaches whichever daemon leads.
        let ticket = ticket_at(identity.control, &peers.borrow_and_update().control(me));
        if let Err(e) = state.write_ticket(&ticket) {
            tracing::warn!(%e, "cannot write the ticket");
        }
        tokio::select! {
            _ = role.changed() => {}
            _ = peers.changed() => {}
        }
    }
}

/// The public halves of the shared keys.
struct SharedKeys {
    swarm: swactor_engine::iroh::EndpointId,
    control: swactor_engine::iroh::EndpointId,
}

/// Reads the run's shared identity from etcd, making it when this is the
/// first daemon of the run, and writes it into the state directory, where
/// the daemon reads its keys, its token secret and its deployment from.
async fn shared_identity(
    client: &Client,
    root: &str,
    state: &StateDir,
    journal: Option<&JournalImage>,
) -> Result<SharedKeys> {
    let key = format!("{root}/identity");
    let made = Identity {
        format: IDENTITY_FORMAT,
        swarm_key: hex(&swactor_engine::iroh::SecretKey::generate().to_bytes()),
        control_key: hex(&swactor_engine::iroh::SecretKey::generate().to_bytes()),
        token_secret: hex(&random_bytes::<32>()?),
        deployment: journal
            .and_then(|j| j.meta.deployment.clone())
            .unwrap_or_else(|| hex(&random_bytes::<4>().unwrap_or([0; 4]))),
    };
    let answer = client
        .txn(&Txn {
            compare: vec![Compare::created_at(key.clone(), 0)],
            success: vec![Op::Put {
                key: key.clone().into_bytes(),
                value: serde_json::to_vec(&made).context("encoding the run's identity")?,
                lease: 0,
            }],
            failure: vec![Op::Get(Range::key(key.clone()))],
        })
        .await
        .with_context(|| format!("cannot read or make the run's identity at {key} in etcd"))?;
    let identity = if answer.succeeded {
        made
    } else {
        let value = answer
            .responses
            .into_iter()
            .find_map(|r| match r {
                OpResponse::Get(page) => page.kvs.into_iter().next().map(|kv| kv.value),
                _ => None,
            })
            .with_context(|| format!("the run's identity at {key} vanished while read"))?;
        let identity: Identity = serde_json::from_slice(&value)
            .with_context(|| format!("{key} in etcd is not a run identity this build reads"))?;
        if identity.format != IDENTITY_FORMAT {
            anyhow::bail!(
                "{key} in etcd has format {}, this build reads {IDENTITY_FORMAT}; nothing was \
                 started",
                identity.format
            );
        }
        identity
    };
    let swarm = parse_key(&identity.swarm_key, &key)?;
    let control = parse_key(&identity.control_key, &key)?;
    let secret: [u8; 32] = unhex(&identity.token_secret)
        .and_then(|b| b.try_into().ok())
        .with_context(|| format!("{key} in etcd holds a damaged token secret"))?;
    swactor_providers::check_deployment(&identity.deployment)
        .map_err(|e| anyhow::anyhow!("{key} in etcd: {e}"))?;
    let root_dir = state.root();
    let previous = state.daemon_key().ok().map(|k| k.public());
    if previous.is_some_and(|p| p != swarm.public()) && root_dir.join("journal.redb").exists() {
        eprintln!(
            "swactor: warning: {} held a daemon of its own (journal.redb); its keys are \
             replaced by the run's shared ones",
            root_dir.display()
        );
    }
    let key_text = |k: &swactor_engine::iroh::SecretKey| format!("{}\n", hex(&k.to_bytes()));
    crate::state::write_atomic(
        &root_dir.join("daemon.key"),
        key_text(&swarm).as_bytes(),
        0o600,
    )?;
    crate::state::write_atomic(
        &root_dir.join("control.key"),
        key_text(&control).as_bytes(),
        0o600,
    )?;
    crate::state::write_atomic(&root_dir.join("token.secret"), &secret, 0o600)?;
    crate::state::write_atomic(
        &root_dir.join(crate::state::DEPLOYMENT_FILE),
        format!("{}\n", identity.deployment).as_bytes(),
        0o600,
    )?;
    Ok(SharedKeys {
        swarm: swarm.public(),
        control: control.public(),
    })
}

fn parse_key(text: &str, key: &str) -> Result<swactor_engine::iroh::SecretKey> {
    let bytes: [u8; 32] = unhex(text)
        .and_then(|b| b.try_into().ok())
        .with_context(|| format!("{key} in etcd holds a damaged key"))?;
    Ok(swactor_engine::iroh::SecretKey::from_bytes(&bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut bytes = [0u8; N];
    let mut urandom = std::fs::File::open("/dev/urandom").context("open /dev/urandom")?;
    std::io::Read::read_exact(&mut urandom, &mut bytes).context("read /dev/urandom")?;
    Ok(bytes)
}

#[derive(Clone, Copy)]
enum Port {
    Swarm,
    Control,
}

/// The port this daemon serves on when it leads: the one it used last,
/// else one the system has free now, kept for next time. A standby gives
/// it to the others (and to agents) before it binds it.
fn reserve_port(state: &StateDir, listen: IpAddr, which: Port) -> Result<u16> {
    let saved = match which {
        Port::Swarm => state.saved_port(),
        Port::Control => state.saved_control_port(),
    };
    if let Some(port) = saved {
        return Ok(port);
    }
    let socket = std::net::UdpSocket::bind(SocketAddr::new(listen, 0))
        .with_context(|| format!("cannot find a free port on {listen}"))?;
    let port = socket.local_addr()?.port();
    drop(socket);
    match which {
        Port::Swarm => state.save_port(port)?,
        Port::Control => state.save_control_port(port)?,
    }
    Ok(port)
}

/// Keeps this daemon's record under `key`, attached to its election lease
/// (written again whenever the lease changes), and once under `known`,
/// without a lease.
async fn register(
    client: Client,
    (key, known): (String, String),
    me: ReplicaRecord,
    mut lease: watch::Receiver<Option<i64>>,
) {
    let Ok(value) = serde_json::to_vec(&me) else {
        return;
    };
    while let Err(e) = client.put(&known, &value, None).await {
        tracing::debug!(%e, "cannot record this daemon's addresses yet");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    loop {
        let id = *lease.borrow_and_update();
        if let Some(id) = id {
            // Retried until it lands or the lease changes.
            loop {
                match client.put(&key, &value, Some(id)).await {
                    Ok(_) => break,
                    Err(e) => {
                        tracing::debug!(%e, "cannot register this daemon yet");
                        tokio::select! {
                            () = tokio::time::sleep(Duration::from_secs(1)) => {}
                            _ = lease.changed() => break,
                        }
                    }
                }
            }
        }
        if lease.changed().await.is_err() {
            return;
        }
    }
}

/// Reads the run's registered daemons (alive and ever) every second.
async fn follow_peers(client: Client, root: String, peers: watch::Sender<Peers>) {
    let read = |prefix: String| {
        let client = client.clone();
        async move {
            let page = client.range(&Range::prefix(prefix)).await.ok()?;
            Some(
                page.kvs
                    .iter()
                    .filter_map(|kv| serde_json::from_slice(&kv.value).ok())
                    .take(PEERS_MAX)
                    .collect::<Vec<ReplicaRecord>>(),
            )
        }
    };
    loop {
        if let (Some(all), Some(known)) = (
            read(format!("{root}/replicas/")).await,
            read(format!("{root}/known/")).await,
        ) {
            let now = Peers { all, known };
            peers.send_if_modified(|p| {
                let changed = *p != now;
                *p = now;
                changed
            });
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Most daemons of one run looked at.
const PEERS_MAX: usize = 16;

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, millis)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Why `file` cannot run with standbys, if it cannot: a group of local
/// processes is seen by the daemon of its machine alone, so the next
/// leader would not find its nodes, and would make them again.
pub(crate) fn local_group(file: &ShapeFile) -> Option<String> {
    file.groups
        .iter()
        .find(|g| g.provider == "process")
        .map(|group| {
            format!(
                "group {:?} runs its nodes as processes of this machine, which a daemon on \
             another machine cannot see or adopt; a run with standbys (--etcd) needs \
             providers every daemon reaches (docker on a shared engine, ssh hosts, vast)",
                group.id
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_refuses_damage() {
        let bytes = [0u8, 1, 0xab, 0xff];
        assert_eq!(unhex(&hex(&bytes)).unwrap(), bytes);
        assert!(unhex("abc").is_none());
        assert!(unhex("zz").is_none());
    }

    #[test]
    fn a_ticket_names_every_replica_and_this_one_first() {
        let record = |port: u16| ReplicaRecord {
            name: format!("r{port}"),
            swarm: SocketAddr::from(([127, 0, 0, 1], port)),
            control: SocketAddr::from(([127, 0, 0, 1], port + 1)),
            cli_key: format!("k{port}"),
        };
        let me = record(4000);
        let peers = Peers {
            all: vec![record(3000), record(4000)],
            known: vec![record(2000), record(3000)],
        };
        let at = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
        // This daemon first, the live ones, then one known but down.
        assert_eq!(peers.swarm(&me), vec![me.swarm, at(3000), at(2000)]);
        assert_eq!(peers.control(&me)[0], me.control);
        let id = swactor_engine::iroh::SecretKey::generate().public();
        let ticket = ticket_at(id, &peers.swarm(&me));
        assert_eq!(ticket.addr().ip_addrs().count(), 3);
    }

    #[test]
    fn the_lease_options_are_bounded() {
        let args = crate::journal::EtcdArgs {
            etcd: Some("http://127.0.0.1:2379".to_owned()),
            ..Default::default()
        };
        let ha = HaOptions::from_args(&args, String::new(), Some(3.0))
            .unwrap()
            .unwrap();
        let election = ha.election("k".to_owned(), Vec::new());
        assert_eq!(election.margin, Duration::from_millis(600));
        assert_eq!(election.retry, Duration::from_millis(300));
        assert!(HaOptions::from_args(&args, String::new(), Some(1.0)).is_err());
        let none = crate::journal::EtcdArgs::default();
        assert!(HaOptions::from_args(&none, "/p".to_owned(), None).is_err());
    }
}
