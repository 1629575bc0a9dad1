//! The providers a daemon runs with, made for its run, and the watches over
//! what its rentals cost and how long it may live.

use super::*;

/// The providers a daemon runs with, made for this run.
pub(super) struct MadeProviders {
    /// All of them, each timed and counted for /metrics.
    pub(super) provider: Arc<Providers>,
    /// The `ssh` provider itself, for `down --purge`.
    pub(super) ssh: SshHostsProvider,
    /// The Vast.ai provider, when there is a key.
    pub(super) vast: Option<VastProvider>,
    /// How long a restarted daemon waits out the providers' listing lag.
    pub(super) visibility_window: Duration,
    /// The most nodes the run holds now or may ask for at start.
    pub(super) fleet: usize,
}

pub(super) async fn make_providers(
    state: &StateDir,
    agents: &Agents<'_>,
    resume: Option<&JournalImage>,
    (file, vast_key): (Option<&ShapeFile>, Option<ApiKey>),
    (metrics, embedded): (&Arc<crate::metrics::Metrics>, Vec<EmbeddedProvider>),
) -> Result<MadeProviders> {
    let process = ProcessProvider::new(ProcessConfig {
        agent_program: std::env::current_exe().context("cannot find the swactor executable")?,
        agent_args: vec!["agent".to_owned()],
        daemon_ticket: agents.ticket.clone(),
        token_secret: agents.secret,
        ..ProcessConfig::new(state.root().to_path_buf())
    })
    .context("cannot start the process provider")?;
    let ssh = ssh_provider(state, agents, resume, file)?;
    let docker = docker_provider(agents, resume, file)?;
    // The most nodes the run holds now or may ask for at start: every one
    // of their agents may have to reconnect at once after this start.
    let fleet = fleet_size(resume, file)?;
    // Every provider call is timed and its failures counted for /metrics.
    let metered = |p: Arc<dyn Provider>| crate::http::Metered::wrap(p, metrics.clone());
    let mut providers: Vec<Arc<dyn Provider>> = vec![
        metered(Arc::new(process)),
        metered(Arc::new(ssh.clone())),
        metered(Arc::new(docker)),
    ];
    let joining = Joining {
        ticket: agents.ticket.get(),
        token_secret: agents.secret,
        deployment: agents.deployment.map(str::to_owned),
        state_dir: state.root().to_path_buf(),
    };
    for p in embedded {
        let kind = p.kind;
        let made = (p.make)(&joining)
            .with_context(|| format!("cannot start the embedded {kind:?} provider"))?;
        anyhow::ensure!(
            made.kind() == kind,
            "the embedded provider declared as {kind:?} says it is {:?}",
            made.kind()
        );
        providers.push(metered(made));
    }
    let vast = vast_provider(vast_key, state, agents, resume, file).await?;
    // A restarted daemon waits out the listing lag of the providers its
    // shapes use: a Vast.ai key in the environment must not slow down the
    // restart of a shape that rents nothing.
    let mut visibility_window = Providers::new(providers.clone()).listing_lag();
    if let Some((vast, used)) = &vast {
        providers.push(metered(Arc::new(vast.clone())));
        if *used {
            visibility_window = visibility_window.max(vast.listing_lag());
        }
    }
    Ok(MadeProviders {
        provider: Arc::new(Providers::new(providers)),
        ssh,
        vast: vast.map(|(v, _)| v),
        visibility_window,
        fleet,
    })
}

/// What the remote providers hand their agents, and the deployment their
/// resources carry.
pub(super) struct Agents<'a> {
    pub(super) binary: &'a AgentBinary,
    /// What agents are started with; in a term of a shared run it follows
    /// the run's daemons.
    pub(super) ticket: &'a swactor_providers::DaemonTicket,
    pub(super) secret: [u8; 32],
    pub(super) deployment: Option<&'a str>,
}

/// The `ssh` provider, told of every host the journal's and the file's
/// shapes list (so a listing at start asks them before any create).
pub(super) fn ssh_provider(
    state: &StateDir,
    agents: &Agents<'_>,
    resume: Option<&JournalImage>,
    file: Option<&ShapeFile>,
) -> Result<SshHostsProvider> {
    let binary = agents.binary;
    let mut config = SshHostsConfig::new(state.root(), binary.path.clone());
    config.daemon_ticket = agents.ticket.clone();
    config.token_secret = agents.secret;
    config.deployment = agents.deployment.map(str::to_owned);
    let ssh = SshHostsProvider::new(config).context("cannot start the ssh provider")?;
    let shapes = resume
        .and_then(|j| j.meta.shape.clone())
        .into_iter()
        .chain(file.map(|f| f.to_shape(1)).transpose()?);
    let mut remote = false;
    for shape in shapes {
        let Ok(desired) = shape.validate() else {
            continue;
        };
        for g in desired
            .groups
            .iter()
            .filter(|g| g.template.provider.kind == "ssh")
        {
            remote = true;
            ssh.learn_template(&g.template);
        }
    }
    if remote && let Some(warning) = binary.warning() {
        eprintln!("swactor: warning: {warning}");
    }
    Ok(ssh)
}

/// The kinds of the groups of the journal's and the file's shapes.
pub(super) fn kinds_in_use(
    resume: Option<&JournalImage>,
    file: Option<&ShapeFile>,
) -> Result<Vec<String>> {
    let shapes = resume
        .and_then(|j| j.meta.shape.clone())
        .into_iter()
        .chain(file.map(|f| f.to_shape(1)).transpose()?);
    Ok(shapes
        .flat_map(|s| s.groups.into_iter().map(|g| g.provider.kind))
        .collect())
}

/// The `docker` provider. It reaches the engine only once a `docker` group
/// needs it, so a daemon on a machine without Docker runs other groups.
pub(super) fn docker_provider(
    agents: &Agents<'_>,
    resume: Option<&JournalImage>,
    file: Option<&ShapeFile>,
) -> Result<DockerOnDemand> {
    let config = DockerConfig {
        daemon_ticket: agents.ticket.clone(),
        token_secret: agents.secret,
        deployment: agents.deployment.map(str::to_owned),
        ..DockerConfig::new(agents.binary.path.clone())
    };
    let docker = DockerOnDemand::new(config).context("cannot set up the docker provider")?;
    if kinds_in_use(resume, file)?.iter().any(|k| k == "docker") {
        docker.mark_in_use();
        let binary = agents.binary;
        if !binary.static_linked {
            eprintln!(
                "swactor: warning: the agent binary {} ({}) is dynamically linked, and a \
                 container runs only a static one: docker nodes will fail until one is given. \
                 Build it with scripts/build-static-agent.sh, or name one with --agent-binary",
                binary.path.display(),
                binary.found
            );
        }
    }
    Ok(docker)
}

/// Whether a shape rents Vast.ai machines: the group that does, if any.
pub(super) fn vast_group(shape: &swactor_provisioning::ClusterShape) -> Option<String> {
    shape
        .groups
        .iter()
        .find(|g| g.provider.kind == "vast")
        .map(|g| g.id.clone())
}

/// The Vast.ai API key (`VAST_API_KEY`, else the official client's key
/// file), when there is one. A shape file that rents Vast.ai machines
/// without one is refused here, before anything is started or rented (a
/// resumed shape is checked by [`vast_provider`], also before anything runs).
pub(super) fn vast_key(file: Option<&ShapeFile>) -> Result<Option<ApiKey>> {
    match ApiKey::from_env() {
        Ok(key) => Ok(Some(key)),
        Err(e) => match file
            .map(|f| f.to_shape(1))
            .transpose()?
            .and_then(|s| vast_group(&s))
        {
            Some(group) => anyhow::bail!(
                "group {group:?} rents Vast.ai machines, but {e}; nothing was started or rented"
            ),
            None => Ok(None),
        },
    }
}

/// The `vast` provider, when an API key was found, and whether a shape (on
/// record or in the file) uses it; its access is checked (one listing) when
/// one does, so that a refused key is reported before anything is rented.
///
/// Besides `VAST_URL`, three variables tune it (tests point them at a mock):
/// `SWACTOR_VAST_PACING=none` drops the client-side pacing of requests,
/// `SWACTOR_VAST_LISTING_LAG_S` and `SWACTOR_VAST_REQUEST_TIMEOUT_S`.
pub(super) async fn vast_provider(
    key: Option<ApiKey>,
    state: &StateDir,
    agents: &Agents<'_>,
    resume: Option<&JournalImage>,
    file: Option<&ShapeFile>,
) -> Result<Option<(VastProvider, bool)>> {
    let used = resume
        .and_then(|j| j.meta.shape.clone())
        .into_iter()
        .chain(file.map(|f| f.to_shape(1)).transpose()?)
        .find_map(|s| vast_group(&s));
    let Some(key) = key else {
        if let Some(group) = used {
            anyhow::bail!(
                "group {group:?} of the run on record rents Vast.ai machines, but there is no \
                 Vast.ai API key (set VAST_API_KEY or write ~/.vast_api_key); nothing was started"
            );
        }
        return Ok(None);
    };
    let url = std::env::var("VAST_URL")
        .ok()
        .filter(|u| !u.trim().is_empty())
        .unwrap_or_else(|| swactor_providers::vast::DEFAULT_URL.to_owned());
    let binary = agents.binary;
    let mut config = VastConfig::new(state.root(), binary.path.clone(), url, key);
    config.daemon_ticket = agents.ticket.clone();
    config.token_secret = agents.secret;
    config.deployment = agents.deployment.map(str::to_owned);
    if std::env::var("SWACTOR_VAST_PACING").is_ok_and(|v| v.trim() == "none") {
        config.pacing = Pacing::none();
    }
    if let Some(lag) = env_seconds("SWACTOR_VAST_LISTING_LAG_S")? {
        config.listing_lag = lag;
    }
    if let Some(t) = env_seconds("SWACTOR_VAST_REQUEST_TIMEOUT_S")? {
        config.request_timeout = t.max(Duration::from_millis(100));
    }
    let vast = match VastProvider::new(config) {
        Ok(v) => v,
        Err(e) if used.is_none() => {
            // Not needed by any shape yet: the daemon runs without it.
            eprintln!("swactor: warning: the vast provider is off: {e}");
            return Ok(None);
        }
        Err(e) => anyhow::bail!("cannot start the vast provider: {e}; nothing was started"),
    };
    if used.is_some() {
        check_vast_access(&vast).await?;
        if let Some(warning) = binary.warning() {
            eprintln!("swactor: warning: {warning}");
        }
    }
    Ok(Some((vast, used.is_some())))
}

/// Checks the vast key before anything is rented. A service that cannot be
/// read just now (rate limits, errors, answers cut off) is asked again with
/// a growing wait, each wait said, for up to `SWACTOR_VAST_ACCESS_WAIT_S`
/// (default 600 s); a refused key stops the daemon at once.
pub(super) async fn check_vast_access(vast: &VastProvider) -> Result<()> {
    use swactor_providers::vast::AccessError;
    let patience = env_seconds("SWACTOR_VAST_ACCESS_WAIT_S")?.unwrap_or(Duration::from_secs(600));
    let started = std::time::Instant::now();
    let mut wait = Duration::from_secs(1);
    let stop = |e: &AccessError| {
        anyhow::anyhow!(
            "{e}; nothing new was rented (instances rented before are left running, \
             and the next `swactor up` adopts them)"
        )
    };
    loop {
        match vast.check_access().await {
            Ok(()) => return Ok(()),
            Err(e @ AccessError::Unavailable(_)) if started.elapsed() + wait <= patience => {
                eprintln!(
                    "swactor: {e}; asking again in {} s (nothing is rented before it answers; \
                     giving up after {} s in all)",
                    wait.as_secs(),
                    patience.as_secs()
                );
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(30));
            }
            Err(e) => return Err(stop(&e)),
        }
    }
}

/// How often the run's spend is held against its budget: with the lead
/// the verdict keeps ([`swactor_provisioning::budget::LEAD_MS`]), a run is
/// acted on before it overspends by more than this much of its rate.
pub(super) const BUDGET_CHECK: Duration = Duration::from_secs(5);

/// Holds what the run's rented machines cost against its budget every
/// [`BUDGET_CHECK`], as [`swactor_provisioning::budget::verdict`] decides:
/// says so as the end nears, and at the budget tears the run down (as
/// `swactor down` does) or pauses it, whichever its shape says. A paused
/// run that is resumed while still over its budget is paused again; raise
/// `budget_usd` with `apply` to go on.
pub(super) async fn watch_budget(
    cluster: swactor_actors::ClusterHandle,
    vast: VastProvider,
    run_id: RunId,
    down: mpsc::Sender<DownRequest>,
) {
    use swactor_provisioning::budget::{OnBudget, Verdict, verdict, warning_due};
    let mut warned = None;
    let mut torn_down = false;
    loop {
        tokio::time::sleep(BUDGET_CHECK).await;
        let mut spend = vast.spend(&run_id);
        // The journal keeps it, and what it keeps is a floor: a provider
        // that lost its records does not make the run cheaper.
        let Ok(held) = cluster.record_spent(spend.spent_micros).await else {
            return;
        };
        spend.spent_micros = held.spent_micros;
        let Some(budget) = held.budget else {
            warned = None;
            continue;
        };
        let line = crate::words::budget_line(Some(&budget), Some(&spend)).unwrap_or_default();
        match verdict(&budget, spend) {
            Verdict::Within { left_ms } => {
                let due;
                (warned, due) = warning_due(left_ms, warned);
                if due {
                    eprintln!("swactor: {line}");
                }
            }
            Verdict::Reached => match budget.on_reached {
                OnBudget::Down if !torn_down => {
                    torn_down = true;
                    eprintln!("swactor: {line}; tearing the run down");
                    let (reply, _) = oneshot::channel();
                    let _ = down.send((false, false, reply)).await;
                }
                OnBudget::Pause if !held.paused && !held.shutting_down => {
                    eprintln!("swactor: {line}; pausing the run (raise budget_usd to go on)");
                    if let Err(e) = cluster.pause().await {
                        eprintln!("swactor: could not pause the run at its budget: {e}");
                    }
                }
                _ => {}
            },
        }
    }
}

/// How often the run's lifetimes are checked: a run is torn down within
/// this of its deadline.
pub(super) const LIFETIME_CHECK: Duration = Duration::from_secs(1);

/// Checks the run's lifetimes (`max_lifetime_s`, `idle_teardown_s`) every
/// [`LIFETIME_CHECK`] against the wall clock and whether a job runs, as
/// [`swactor_provisioning::lifetime::verdict`] decides in the cluster's
/// host (which journals what the deadlines count from): says so as the end
/// nears, and at a deadline tears the run down as `swactor down` does.
///
/// The first check waits until the start's own shape has been offered
/// (`started`): `up SHAPE` on a run past its deadline extends it rather
/// than tearing it down.
pub(super) async fn watch_lifetime(
    cluster: swactor_actors::ClusterHandle,
    jobs: crate::jobs::service::JobService,
    mut started: tokio::sync::watch::Receiver<bool>,
    down: mpsc::Sender<DownRequest>,
) {
    use swactor_provisioning::budget::warning_due;
    use swactor_provisioning::lifetime::Verdict;
    if started.wait_for(|s| *s).await.is_err() {
        return;
    }
    let mut warned = None;
    loop {
        let wall_ms = crate::jobs::service::unix_now_ms();
        let Ok(view) = cluster.check_lifetime(wall_ms, jobs.any_running()).await else {
            return;
        };
        match view.status {
            _ if view.shutting_down => return,
            Some(status) => match status.verdict {
                Verdict::Reached(which) => {
                    eprintln!(
                        "swactor: {} reached; tearing the run down",
                        crate::words::lifetime_setting(&status.lifetime, which)
                    );
                    let (reply, _) = oneshot::channel();
                    let _ = down.send((false, false, reply)).await;
                    return;
                }
                Verdict::Within { left_ms, .. } => {
                    let due;
                    (warned, due) = warning_due(Some(left_ms), warned);
                    if due {
                        eprintln!("swactor: {}", crate::words::lifetime_line(&status));
                    }
                }
                Verdict::Unbounded => warned = None,
            },
            None => warned = None,
        }
        tokio::time::sleep(LIFETIME_CHECK).await;
    }
}

/// The most nodes of the journal's shape and of the shape given.
pub(super) fn fleet_size(resume: Option<&JournalImage>, file: Option<&ShapeFile>) -> Result<usize> {
    let shapes = resume
        .and_then(|j| j.meta.shape.clone())
        .into_iter()
        .chain(file.map(|f| f.to_shape(1)).transpose()?);
    Ok(shapes
        .map(|s| s.groups.iter().map(|g| g.count as usize).sum::<usize>())
        .max()
        .unwrap_or(0))
}
