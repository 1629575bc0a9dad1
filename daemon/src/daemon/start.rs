//! Before anything starts: the addresses, the checks of the user's input,
//! the start decision for (journal, shape), and the shape offered at start.

use super::*;

/// The addresses to listen on and to advertise to agents. Addresses given
/// now win; without any, those of the last daemon of this state directory,
/// so agents on other machines can still reach it.
pub(super) fn network(opts: &UpOptions) -> Result<(IpAddr, Option<IpAddr>)> {
    let (listen, advertise) = match (opts.listen, opts.advertise) {
        (None, None) => match StateDir::saved_network(&opts.state_dir) {
            Some((listen, advertise)) => {
                if !listen.is_loopback() || advertise.is_some() {
                    eprintln!(
                        "swactor: listening on {listen}{}, as the last daemon of this state \
                         directory did (--listen and --advertise change it)",
                        advertise
                            .map(|ip| format!(" for agents dialing {ip}"))
                            .unwrap_or_default()
                    );
                }
                (listen, advertise)
            }
            None => {
                let saved = opts.state_dir.join(crate::state::NETWORK_FILE);
                if saved.exists() {
                    eprintln!(
                        "swactor: warning: cannot read the saved addresses in {}; listening \
                         on 127.0.0.1 (--listen and --advertise name others)",
                        saved.display()
                    );
                }
                (IpAddr::V4(Ipv4Addr::LOCALHOST), None)
            }
        },
        (listen, advertise) => (listen.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)), advertise),
    };
    if listen.is_unspecified() && advertise.is_none() {
        anyhow::bail!(
            "listening on {listen} (every interface), the daemon cannot tell remote agents \
             which address to dial: name it with --advertise IP; nothing was started"
        );
    }
    Ok((listen, advertise))
}

/// What `up` checks before it makes or touches anything: the telemetry
/// settings, the shape file, the start decision for a fresh directory, the
/// traces of a lost journal, the agent binary, the Vast.ai key, and (on a
/// fresh directory) the user's go-ahead.
pub(super) struct Preflight {
    pub(super) ndjson: NdjsonConfig,
    pub(super) file: Option<ShapeFile>,
    pub(super) checked: Option<swactor_provisioning::ClusterShape>,
    /// No journal yet: the whole shape is new.
    pub(super) fresh: bool,
    pub(super) traces: swactor_provisioning::Traces,
    pub(super) agent_binary: AgentBinary,
    pub(super) keep_agent_binary: Option<PathBuf>,
    pub(super) vast_key: Option<ApiKey>,
}

impl Preflight {
    /// `ha_fresh`: in a term of a run shared through etcd, whether its
    /// journal there is empty (the state directory's files then say
    /// nothing of the run).
    pub(super) async fn check(
        opts: &UpOptions,
        more_providers: &[&'static str],
        ha_fresh: Option<bool>,
    ) -> Result<Self> {
        let ndjson = ndjson_config()?;
        if let Some(kind) = more_providers
            .iter()
            .find(|k| crate::shapefile::SUPPORTED_PROVIDERS.contains(k))
        {
            anyhow::bail!(
                "an embedded provider is of kind {kind:?}, which a built-in provider already is"
            );
        }
        let mut file = opts.shape.as_deref().map(ShapeFile::load).transpose()?;
        if let Some(f) = &mut file {
            f.allow_providers(more_providers);
        }
        let checked = file.as_ref().map(|f| f.check(1)).transpose()?;
        // A fresh state directory: the whole shape is new, and whether to go
        // ahead is settled before the directory is even made.
        let fresh = ha_fresh.unwrap_or_else(|| !opts.state_dir.join("journal.redb").exists());
        if fresh {
            // The core's start decision without a journal, asked before
            // anything is made: a mistyped --state-dir is left as it was (or
            // absent). With a journal, it is asked once the journal is read.
            let shape_run = file.as_ref().map(ShapeFile::run_id);
            if let Err(refusal) = swactor_provisioning::decide_start(None, shape_run.as_ref()) {
                return Err(start_refused(&refusal, &opts.state_dir));
            }
        }
        if !fresh && let Some(choice) = opts.unrecorded {
            anyhow::bail!(
                "{} has a journal: --{} is only for a state directory whose journal was lost; \
                 nothing was started",
                opts.state_dir.display(),
                match choice {
                    Unrecorded::Adopt => "adopt",
                    Unrecorded::Fresh => "fresh",
                }
            );
        }
        // Traces of an earlier run in a directory with no journal: its journal
        // was lost. Refused here already when the files say so; the provider's
        // listing is looked at once the providers are made.
        let traces = swactor_provisioning::Traces {
            files: if fresh && ha_fresh.is_none() {
                run_traces(&opts.state_dir)
            } else {
                Vec::new()
            },
            listed: Vec::new(),
        };
        if fresh {
            swactor_provisioning::without_journal(traces.clone(), opts.unrecorded)?;
        }
        let (agent_binary, keep_agent_binary) =
            choose_agent_binary(&opts.state_dir, opts.agent_binary.as_deref())?;
        // A shape that rents Vast.ai machines needs the key before anything else.
        let vast_key = vast_key(file.as_ref())?;
        if let Some(shape) = checked.as_ref().filter(|_| fresh) {
            confirm_start(None, shape, opts.yes).await?;
        }
        Ok(Self {
            ndjson,
            file,
            checked,
            fresh,
            traces,
            agent_binary,
            keep_agent_binary,
            vast_key,
        })
    }
}

/// The secret agents' join tokens are made from; warns when it had to be
/// made anew for a journal that holds nodes (their agents cannot rejoin).
pub(super) fn token_secret(state: &StateDir, resume: Option<&JournalImage>) -> Result<[u8; 32]> {
    let secret_existed = state.root().join("token.secret").exists();
    let secret = state.token_secret()?;
    if !secret_existed && resume.is_some_and(|j| !j.slots.is_empty()) {
        eprintln!(
            "swactor: warning: {} was missing; a new secret was made. The agents of the \
             nodes on record hold credentials from the old one and cannot rejoin: their \
             nodes will be replaced once their rejoin window ends",
            state.root().join("token.secret").display()
        );
    }
    Ok(secret)
}

/// A new journal for a run whose resources the provider still lists is
/// refused unless told what to do with them (`--adopt`, `--fresh`).
pub(super) async fn check_unrecorded(
    provider: &Providers,
    run_id: &RunId,
    mut traces: swactor_provisioning::Traces,
) -> Result<()> {
    match provider.list(run_id).await {
        Ok(listed) => {
            traces.listed = listed.into_keys().collect();
            swactor_provisioning::without_journal(traces, None)?;
            // Another deployment's resources of the same run: another
            // daemon's, or those of a state directory that was lost.
            // Left alone, and said.
            let foreign = provider.foreign();
            if !foreign.is_empty() {
                eprintln!(
                    "swactor: warning: {}",
                    crate::words::foreign_resources(run_id, &foreign)
                );
            }
        }
        // A provider that does not answer now (an engine that is down)
        // is the nodes' problem, said per node once they are made; a
        // new run still starts. The state directory held no trace of
        // an earlier run, or the start was refused above.
        Err(e) => eprintln!(
            "swactor: warning: could not check what the provider holds for run {run_id} \
             ({}); starting it as a new run",
            crate::words::cut_long_words(&e.to_string())
        ),
    }
    Ok(())
}

/// What a start does with the journal and the shape it was given.
pub(super) struct Start {
    pub(super) run_id: RunId,
    pub(super) what: StartWhat,
    /// One line saying so.
    pub(super) note: String,
}

pub(super) enum StartWhat {
    /// Offer the shape file (as the next generation, on a journal).
    Apply(ShapeFile),
    /// Resume the journal's shape.
    Resume,
    /// The last daemon was tearing down when it stopped: finish that.
    FinishTeardown,
}

impl Start {
    /// What `swactor up [SHAPE]` means for this state directory, as
    /// [`swactor_provisioning::decide_start`] decides it, in words.
    ///
    /// # Errors
    /// A shape of another run than the journal's, or nothing to resume.
    pub(super) fn decide(
        journal: Option<&JournalImage>,
        file: Option<&ShapeFile>,
        dir: &Path,
    ) -> Result<Self> {
        let shape_run = file.map(ShapeFile::run_id);
        let decision = swactor_provisioning::decide_start(journal, shape_run.as_ref())
            .map_err(|refusal| start_refused(&refusal, dir))?;
        let run_id = decision.run_id().clone();
        let paused_note = |paused: bool| {
            if paused {
                "; it is paused: nothing new is dispatched until `swactor resume`"
            } else {
                ""
            }
        };
        // The core applies a shape only when it was given one.
        let apply = || {
            file.cloned()
                .map(StartWhat::Apply)
                .context("the start decision applies a shape, but none was given")
        };
        let (what, note) = match decision {
            StartDecision::New { run_id } => (
                apply()?,
                format!("starting run {run_id} from {}", dir.display()),
            ),
            StartDecision::Offer {
                run_id,
                generation,
                paused,
            } => (
                apply()?,
                format!(
                    "resuming run {run_id} at generation {} from its journal; \
                     the shape is offered as the next generation{}",
                    generation.0,
                    paused_note(paused)
                ),
            ),
            StartDecision::FinishTeardown { run_id } => (
                StartWhat::FinishTeardown,
                format!(
                    "the last daemon of run {run_id} was tearing its cluster down when it \
                     stopped; finishing the teardown"
                ),
            ),
            StartDecision::Resume {
                run_id,
                generation,
                desired,
                paused,
            } => (
                StartWhat::Resume,
                format!(
                    "resuming run {run_id} at generation {} ({desired} node(s)) from its \
                     journal{}",
                    generation.0,
                    paused_note(paused)
                ),
            ),
        };
        Ok(Self { run_id, what, note })
    }
}

/// Says why a start was refused, naming the state directory `dir`.
pub(super) fn start_refused(refusal: &StartRefusal, dir: &Path) -> anyhow::Error {
    match refusal {
        StartRefusal::NoJournal => anyhow::anyhow!(
            "there is nothing to resume in {}: no daemon has run here yet. Give a shape, e.g. \
             `swactor up examples/local.toml`",
            dir.display()
        ),
        StartRefusal::OtherRun { journal, shape } => {
            let theirs = crate::words::cut(shape.as_str());
            anyhow::anyhow!(
                "{} belongs to run {journal:?}, and the shape is for run {theirs:?}; a \
                 state directory's run never changes. Use another --state-dir for run \
                 {theirs:?}; nothing was started",
                dir.display(),
            )
        }
        StartRefusal::TornDown { run_id, generation } => anyhow::anyhow!(
            "there is nothing to resume in {}: run {run_id} has no nodes (its cluster was \
             torn down at generation {}). Give a shape to start it again",
            dir.display(),
            generation.0
        ),
    }
}

/// Longest a start waits for the earlier nodes' adoption before it offers
/// its shape.
pub(super) const ADOPTION_WAIT_MAX: Duration = Duration::from_secs(30);

/// `up SHAPE`: once the earlier daemon's nodes are adopted, applies the
/// shape (its plan was shown before the daemon started), with the same rules
/// as `apply`.
pub(super) async fn offer_on_start(
    cluster: &ClusterHandle,
    run_id: &RunId,
    journal: &crate::journal::JournalHealth,
    file: &ShapeFile,
) -> Result<()> {
    // A provider that cannot list for this long does not hold the shape
    // back for ever: the host judges it against what it knows then.
    match tokio::time::timeout(ADOPTION_WAIT_MAX, cluster.adopted()).await {
        Ok(adopted) => adopted?,
        Err(_) => tracing::warn!(
            "the earlier nodes were not adopted within {} s; offering the shape anyway",
            ADOPTION_WAIT_MAX.as_secs()
        ),
    }
    match apply_file(cluster, run_id, journal, file).await {
        Ok((generation, true)) => eprintln!("swactor: applied generation {generation}"),
        Ok((generation, false)) => {
            eprintln!("swactor: the shape is generation {generation} already; nothing to change")
        }
        Err(e) => anyhow::bail!("the shape was refused: {e}"),
    }
    if let Ok(shape) = file.to_shape(1) {
        use swactor_provisioning::lifetime::Which;
        let said = |which| crate::words::lifetime_setting(&shape.lifetime, which);
        if shape.lifetime.max_lifetime_s > 0 {
            eprintln!(
                "swactor: {}: the run tears itself down that long from now",
                said(Which::MaxLifetime)
            );
        }
        if shape.lifetime.idle_teardown_s > 0 {
            eprintln!(
                "swactor: {}: the run tears itself down once no job has run for that long",
                said(Which::IdleTeardown)
            );
        }
    }
    Ok(())
}

/// Shows what `shape` changes on the cluster the journal `image` records
/// (none: a fresh state directory) and asks when it destroys, replaces or
/// creates many nodes, unless `yes`. Runs before the daemon starts anything,
/// so a shape the daemon would refuse on capacity is refused here, with the
/// same check and the same words, and nothing starts.
///
/// # Errors
/// The shape grows past its own `capacity` or what the providers can hold,
/// or the change was not confirmed.
pub(super) async fn confirm_start(
    image: Option<&JournalImage>,
    shape: &swactor_provisioning::ClusterShape,
    yes: bool,
) -> Result<()> {
    let current = image.and_then(|i| i.meta.shape.as_ref());
    let capacities = crate::shapefile::offline_capacities();
    if let Some(refused) = crate::shapefile::capacity_refusal(shape, current, &capacities) {
        anyhow::bail!("{refused}");
    }
    let diff = crate::guard::diff_from_journal(image, shape);
    eprintln!("swactor: {}", crate::guard::summary(&diff));
    if crate::guard::reason_to_ask(&diff).is_some() {
        let shown = crate::guard::examples(&diff, crate::guard::CHANGES_SHOWN);
        for line in crate::guard::listing(&shown, crate::guard::changed(&diff)) {
            eprintln!("{line}");
        }
    }
    crate::guard::ask(&diff, yes).await
}

/// The agent binary remote machines and containers run: the one given now
/// (returned again, absolute, to be kept for the next daemon), else the one
/// the last daemon of this state directory was given (as `--listen` is
/// kept), else the one [`AgentBinary::find`] finds.
///
/// # Errors
/// A binary given now that cannot be read.
pub(super) fn choose_agent_binary(
    state_dir: &Path,
    given: Option<&Path>,
) -> Result<(AgentBinary, Option<PathBuf>)> {
    if let Some(path) = given {
        let binary = AgentBinary::find(Some(path))?;
        let absolute = std::path::absolute(path)
            .with_context(|| format!("cannot tell where {} is", path.display()))?;
        return Ok((binary, Some(absolute)));
    }
    let Some(saved) = StateDir::saved_agent_binary(state_dir) else {
        return Ok((AgentBinary::find(None)?, None));
    };
    if saved.is_file() {
        eprintln!(
            "swactor: remote machines and containers run the agent binary {}, as the last \
             daemon of this state directory was told (--agent-binary names another)",
            saved.display()
        );
        return Ok((AgentBinary::find(Some(&saved))?, None));
    }
    let found = AgentBinary::find(None)?;
    eprintln!(
        "swactor: warning: the agent binary the last daemon of this state directory was \
         given, {}, is gone; remote machines and containers run {} ({}) instead \
         (--agent-binary names one)",
        saved.display(),
        found.path.display(),
        found.found
    );
    Ok((found, None))
}

/// What in a state directory without a journal says a run was here: files
/// only a daemon or its nodes leave, for people.
pub(super) fn run_traces(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for file in [
        "token.secret",
        crate::state::DEPLOYMENT_FILE,
        "telemetry.ndjson",
        "jobs.redb",
        "daemon.ticket",
    ] {
        if dir.join(file).exists() {
            found.push(file.to_owned());
        }
    }
    for sub in ["nodes", "logs", "jobs"] {
        let entries = std::fs::read_dir(dir.join(sub)).map_or(0, Iterator::count);
        if entries > 0 {
            found.push(format!("{sub}/ ({entries} entries)"));
        }
    }
    found
}
