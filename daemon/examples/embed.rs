//! Embedding the whole daemon in another program, through the public API.
//!
//! ```text
//!   embed                  this program: runs swactor_daemon::daemon::up on a
//!    │                     state directory of its own, with a two-node shape
//!    ├── embed agent …     node worker-0: the built-in process provider starts
//!    │                     this same executable as the node's agent
//!    └── embed agent …     node own-0: so does the provider this program
//!                          brings, of its own kind ("own")
//! ```
//!
//! The daemon leases two local agent processes, each joins it over iroh with
//! its attempt-bound key, the journal records the run in the state
//! directory, and once the cluster is converged the daemon tears it down and
//! returns. The program then opens the journal the daemon left and shows
//! what it recorded, and what its own provider was asked to do.
//!
//! The program's provider ([`Own`]) shows what an embedder's provider gets:
//! it is made once the daemon knows what agents need to join it (the
//! [`Joining`] it is given), and groups name it by its kind as they name
//! the built-in ones. It keeps its nodes under a directory of its own, by
//! running a process provider there under names of its own.
//!
//! The local process provider starts the daemon's own executable as each
//! node's agent, so an embedding program answers the two entry points the
//! `swactor` binary does: `agent …` and `job-exec …`.
//!
//! Run it: `cargo run -p swactor-daemon --example embed [STATE_DIR]`.

// An application, not a policy crate: it owns its runtime.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use clap::Parser;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use swactor_daemon::agent::AgentOptions;
use swactor_daemon::daemon::{EmbeddedProvider, Joining, UpOptions, up};
use swactor_daemon::journal::DaemonJournal;
use swactor_providers::process::{ProcessConfig, ProcessProvider};
use swactor_providers::{
    BootstrapSession, Inventory, LeaseGrant, Provider, ProviderError, Release, async_trait,
};
use swactor_provisioning::{LeaseId, NodeEndpoint, NodeTemplate, ResourceKey, RunId, SessionId};

/// What the provider starts this program as, on each node.
#[derive(Debug, Parser)]
enum NodeSide {
    /// The node agent.
    Agent(AgentOptions),
}

const SHAPE: &str = r#"
run = "embedded"

[[group]]
id = "worker"
count = 1
provider = "process"
boot_check = ["true"]

[[group]]
id = "own"
count = 1
provider = "own"
boot_check = ["true"]
"#;

/// This program's own provider, of kind `own`: a process provider of its
/// own, under `{state}/own`, whose leases and sessions carry an `own:`
/// prefix so that nobody takes them for the built-in provider's.
struct Own {
    inner: ProcessProvider,
    /// Leases it made and destroyed, for the program to show.
    made: Arc<AtomicUsize>,
    destroyed: Arc<AtomicUsize>,
}

const PREFIX: &str = "own:";

fn outer_lease(l: LeaseId) -> LeaseId {
    LeaseId::from(format!("{PREFIX}{}", l.0))
}

fn inner_lease(l: &LeaseId) -> LeaseId {
    LeaseId::from(l.0.strip_prefix(PREFIX).unwrap_or(&l.0).to_owned())
}

fn outer_session(s: SessionId) -> SessionId {
    SessionId::from(format!("{PREFIX}{}", s.0))
}

fn inner_session(s: &SessionId) -> SessionId {
    SessionId::from(s.0.strip_prefix(PREFIX).unwrap_or(&s.0).to_owned())
}

#[async_trait]
impl Provider for Own {
    fn kind(&self) -> &'static str {
        "own"
    }

    async fn create_lease(
        &self,
        key: &ResourceKey,
        template: &NodeTemplate,
    ) -> Result<LeaseGrant, ProviderError> {
        let grant = self.inner.create_lease(key, template).await?;
        self.made.fetch_add(1, Ordering::Relaxed);
        Ok(LeaseGrant {
            lease: outer_lease(grant.lease),
            endpoint: grant.endpoint,
        })
    }

    async fn lookup_endpoint(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<NodeEndpoint, ProviderError> {
        self.inner.lookup_endpoint(key, &inner_lease(lease)).await
    }

    async fn start_bootstrap(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        endpoint: &NodeEndpoint,
        template: &NodeTemplate,
    ) -> Result<BootstrapSession, ProviderError> {
        let s = self
            .inner
            .start_bootstrap(key, &inner_lease(lease), endpoint, template)
            .await?;
        Ok(BootstrapSession {
            session: outer_session(s.session),
            events: s.events,
        })
    }

    async fn cancel_bootstrap(
        &self,
        key: &ResourceKey,
        session: &SessionId,
    ) -> Result<Release, ProviderError> {
        self.inner
            .cancel_bootstrap(key, &inner_session(session))
            .await
    }

    async fn destroy_lease(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<Release, ProviderError> {
        let released = self.inner.destroy_lease(key, &inner_lease(lease)).await?;
        self.destroyed.fetch_add(1, Ordering::Relaxed);
        Ok(released)
    }

    async fn list(&self, run_id: &RunId) -> Result<Inventory, ProviderError> {
        let mut listed = self.inner.list(run_id).await?;
        for owned in listed.values_mut() {
            owned.lease = owned.lease.take().map(outer_lease);
            owned.session = owned.session.take().map(outer_session);
        }
        Ok(listed)
    }

    fn owns_lease(&self, lease: &LeaseId) -> bool {
        lease.0.starts_with(PREFIX)
    }

    fn owns_session(&self, session: &SessionId) -> bool {
        session.0.starts_with(PREFIX)
    }
}

/// The `own` provider, made from what the daemon says agents need.
fn own_provider(made: Arc<AtomicUsize>, destroyed: Arc<AtomicUsize>) -> EmbeddedProvider {
    EmbeddedProvider {
        kind: "own",
        make: Box::new(move |joining: &Joining| {
            let root = joining.state_dir.join("own");
            std::fs::create_dir_all(&root)?;
            let inner = ProcessProvider::new(ProcessConfig {
                agent_program: std::env::current_exe()?,
                agent_args: vec!["agent".to_owned()],
                daemon_ticket: joining.ticket.clone().into(),
                token_secret: joining.token_secret,
                ..ProcessConfig::new(root)
            })?;
            Ok(Arc::new(Own {
                inner,
                made,
                destroyed,
            }) as Arc<dyn Provider>)
        }),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // How an agent starts a job's command; it must come first (no runtime).
    if let Some(code) = swactor_daemon::jobs::agent::exec_if_asked(&args) {
        std::process::exit(code);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    if args.get(1).map(String::as_str) == Some("agent") {
        let NodeSide::Agent(opts) = NodeSide::parse();
        let code = runtime.block_on(swactor_daemon::agent::run(opts));
        std::process::exit(code.unwrap_or_else(|e| {
            eprintln!("agent: {e:#}");
            1
        }));
    }
    let code = runtime.block_on(embed(args.get(1).map(PathBuf::from)));
    std::process::exit(code.unwrap_or_else(|e| {
        eprintln!("embed: {e:#}");
        1
    }));
}

async fn embed(state_dir: Option<PathBuf>) -> anyhow::Result<i32> {
    let temp = tempfile::tempdir()?;
    let state_dir = state_dir.unwrap_or_else(|| temp.path().join("state"));
    let shape = temp.path().join("shape.toml");
    std::fs::write(&shape, SHAPE)?;
    println!(
        "embed: converging on two local nodes in {}",
        state_dir.display()
    );
    let (made, destroyed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let code = up(UpOptions {
        shape: Some(shape),
        state_dir: state_dir.clone(),
        until_converged: true,
        timeout: Duration::from_secs(120),
        keep: false,
        yes: true,
        listen: None,
        advertise: None,
        agent_binary: None,
        http: None,
        unrecorded: None,
        providers: vec![own_provider(made.clone(), destroyed.clone())],
        ha: None,
        flight_max_bytes: swactor_daemon::daemon::FLIGHT_MAX_BYTES_DEFAULT,
    })
    .await?;
    println!("embed: the daemon returned {code}");
    println!(
        "embed: the own provider made {} lease(s) and destroyed {}",
        made.load(Ordering::Relaxed),
        destroyed.load(Ordering::Relaxed)
    );
    // What the daemon persisted: the run, the shape it accepted and the
    // attempts it reserved, read back from the journal file it left.
    let (_journal, image) = DaemonJournal::open(&state_dir.join("journal.redb"))?;
    let Some(image) = image else {
        anyhow::bail!("the daemon left an empty journal");
    };
    let meta = &image.meta;
    println!(
        "embed: journal: run {}, {} attempt(s) reserved, {} slot record(s), shape generation {}",
        meta.run_id,
        meta.attempts_reserved,
        image.slots.len(),
        meta.shape
            .as_ref()
            .map_or_else(|| "none".to_owned(), |s| s.generation.to_string()),
    );
    Ok(code)
}
