//! Embedding a cluster in an application's own actor tree.
//!
//! ```text
//!   App (the application's root actor)
//!    ├── ClusterSupervisor ── DriverActor (+ executors, observers)   restarted from the journal
//!    └── Operator (a sibling) ── holds a ClusterRef, applies shapes
//! ```
//!
//! The app spawns the cluster linked to itself, hands a typed [`ClusterRef`]
//! (public messages only) to a sibling actor that applies shapes, and serves
//! the cluster's telemetry on an iroh endpoint; [`run`] subscribes to it over
//! loopback and waits for each generation to converge.
//!
//! Run it: `cargo run -p swactor-actors --example cluster`.

// An application, not the policy crate: it owns its runtime, clock and endpoint.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::sync::Arc;
use std::time::Duration;
use swactor_actors::{
    Cluster, ClusterConfig, ClusterEvent, ClusterHandle, ClusterMsg, ClusterRef, ClusterSnapshot,
    MemoryJournal, SupervisorArgs,
};
use swactor_engine::iroh::SecretKey;
use swactor_engine::net::{
    ALPN_TELEMETRY, Allowlist, GuardedRouterBuilder, NetConfig, bind_endpoint,
};
use swactor_engine::ractor::{
    Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent, call,
};
use swactor_engine::telemetry::{TelemetryConfig, TelemetryFrame, TelemetryPublisher, subscribe};
use swactor_engine::{Clock, RestartPolicy};
use swactor_providers::fake::{FakeConfig, FakeProvider};
use swactor_provisioning::{ClusterShape, Generation, GroupShape, ProviderShape, RunId, SwarmJoin};

/// The sibling that changes the cluster: it only knows the public surface.
struct Operator;

/// Apply `count` nodes as generation `generation`; the reply is the generation accepted.
struct Scale(u64, u32, RpcReplyPort<Result<Generation, String>>);

impl Actor for Operator {
    type Msg = Scale;
    type State = ClusterRef;
    type Arguments = ClusterRef;

    async fn pre_start(
        &self,
        _: ActorRef<Scale>,
        cluster: ClusterRef,
    ) -> Result<ClusterRef, ActorProcessingErr> {
        Ok(cluster)
    }

    async fn handle(
        &self,
        _: ActorRef<Scale>,
        Scale(generation, count, reply): Scale,
        cluster: &mut ClusterRef,
    ) -> Result<(), ActorProcessingErr> {
        let (tx, rx) = swactor_engine::ractor::concurrency::oneshot();
        cluster.send_message(ClusterMsg::Apply(shape(generation, count), tx.into()))?;
        let applied = match rx.await {
            Ok(Ok(update)) => Ok(update.generation()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("the cluster is gone".to_owned()),
        };
        let _ = reply.send(applied);
        Ok(())
    }
}

/// The application's root actor: it owns the cluster and the operator.
struct App;

/// What the app hands out once it is up.
struct AppReady {
    cluster: ClusterHandle,
    operator: ActorRef<Scale>,
}

impl Actor for App {
    type Msg = ();
    type State = ();
    type Arguments = (SupervisorArgs, tokio::sync::oneshot::Sender<AppReady>);

    async fn pre_start(
        &self,
        myself: ActorRef<()>,
        (args, ready): Self::Arguments,
    ) -> Result<(), ActorProcessingErr> {
        // The cluster is the app's child: if its supervisor gives up, the app hears of it.
        let cluster = Cluster::supervised(args, Some(myself.get_cell())).await?;
        let (operator, _) =
            Actor::spawn_linked(None, Operator, cluster.cluster_ref(), myself.get_cell()).await?;
        let _ = ready.send(AppReady { cluster, operator });
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _: ActorRef<()>,
        evt: SupervisionEvent,
        _: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        // A real application decides here what a stopped cluster means to it.
        if let SupervisionEvent::ActorFailed(_, e) = evt {
            eprintln!("app: a child failed: {e}");
        }
        Ok(())
    }
}

fn shape(generation: u64, count: u32) -> ClusterShape {
    ClusterShape {
        run_id: RunId::new("embedded"),
        generation: Generation(generation),
        groups: vec![GroupShape {
            id: "worker".to_owned(),
            run_id: None,
            count,
            provider: ProviderShape {
                kind: "fake".to_owned(),
                params: Default::default(),
                placement: Default::default(),
            },
            boot: Default::default(),
            role: "worker".to_owned(),
            join: SwarmJoin::default(),
            limits: Default::default(),
            policy: Default::default(),
        }],
        capacity: None,
        budget: None,
        lifetime: Default::default(),
    }
}

/// Starts the app, applies two generations through the operator, and
/// returns the generations a loopback telemetry subscriber saw converge.
///
/// # Errors
/// Anything that stops the example; it says what.
pub(crate) async fn run() -> Result<Vec<(u64, usize)>, Box<dyn std::error::Error>> {
    let empty = ClusterSnapshot::empty("embedded");
    let publisher: TelemetryPublisher<ClusterSnapshot, ClusterEvent> =
        TelemetryPublisher::new(TelemetryConfig::default(), &empty)?;
    let viewer = SecretKey::generate();
    let server = bind_endpoint(&NetConfig::default(), SecretKey::generate()).await?;
    let router = GuardedRouterBuilder::new(server.clone())
        .serve(
            ALPN_TELEMETRY,
            Allowlist::only([viewer.public()]),
            publisher.handler(),
        )
        .spawn();

    let mut config = ClusterConfig::new(RunId::new("embedded"));
    // The fake provider has no swarm: its stream's join report is the join.
    config.stream_joins = true;
    let provider = FakeProvider::new(
        FakeConfig {
            latency: Duration::from_millis(5),
            ..FakeConfig::default()
        },
        Clock::new(),
    );
    let args = SupervisorArgs {
        config,
        provider: Arc::new(provider),
        publisher: Some(Arc::new(publisher)),
        journal: Arc::new(MemoryJournal::new(RunId::new("embedded"))),
        restarts: RestartPolicy::default(),
        on_exit: None,
    };
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let (app, app_done) = Actor::spawn(None, App, (args, ready_tx)).await?;
    let AppReady { cluster, operator } = ready_rx.await?;

    let client = bind_endpoint(&NetConfig::default(), viewer).await?;
    let mut sub = subscribe::<ClusterSnapshot, ClusterEvent>(
        &client,
        server.addr(),
        Duration::from_secs(10),
        1 << 24,
    )
    .await?;
    let mut converged = Vec::new();
    for (generation, count) in [(1, 3), (2, 5)] {
        let applied = call!(operator, |reply| Scale(generation, count, reply))?;
        println!("operator: generation {} applied", applied?.0);
        loop {
            let frame = tokio::time::timeout(Duration::from_secs(60), sub.next()).await??;
            match frame {
                Some(TelemetryFrame::Event {
                    event:
                        ClusterEvent::Converged {
                            generation: g,
                            nodes,
                        },
                    ..
                }) => {
                    println!(
                        "telemetry: generation {} converged with {nodes} node(s)",
                        g.0
                    );
                    if g.0 == generation {
                        converged.push((g.0, nodes));
                        break;
                    }
                }
                Some(_) => {}
                None => return Err("the telemetry stream ended".into()),
            }
        }
    }
    cluster
        .shutdown(swactor_actors::ShutdownMode::Teardown)
        .await?;
    app.stop(None);
    app_done.await?;
    router.shutdown().await?;
    client.close().await;
    Ok(converged)
}

#[tokio::main]
#[allow(dead_code)] // Also compiled into a test, which calls `run` itself.
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let converged = run().await?;
    println!("done: {converged:?}");
    Ok(())
}
