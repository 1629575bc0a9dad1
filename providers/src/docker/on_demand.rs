//! A [`DockerProvider`] that reaches the engine only when a node needs it.
//!
//! A daemon drives every provider kind it knows, but most runs never use
//! Docker, and a machine without an engine must still run them. This wrapper
//! connects on the first call that concerns a container and again after a
//! failed connect, so an engine that was down when the daemon started is
//! used once it answers. Until a `docker` group has been seen (in a shape the
//! daemon was given, or in a create), its listing is empty without asking the
//! engine: there is nothing of the run's to find there.

use super::{DockerConfig, DockerError, DockerProvider};
use crate::Release;
use crate::{
    AgentLogSource, BootstrapSession, FaultKind, Inventory, LeaseGrant, Provider, ProviderError,
    async_trait,
};
use std::sync::atomic::{AtomicBool, Ordering};
use swactor_provisioning::{LeaseId, NodeEndpoint, NodeTemplate, ResourceKey, RunId, SessionId};

/// The `docker` provider, connected on demand. See the module docs.
#[derive(Debug)]
pub struct DockerOnDemand {
    config: DockerConfig,
    connected: tokio::sync::Mutex<Option<DockerProvider>>,
    /// A copy of the connected provider for the calls that may not wait.
    ready: std::sync::OnceLock<DockerProvider>,
    in_use: AtomicBool,
}

impl DockerOnDemand {
    /// A provider that will connect with `config`.
    ///
    /// # Errors
    /// An invalid `config` (checked now, so a bad setting is not found only
    /// when the first node needs it).
    pub fn new(config: DockerConfig) -> Result<Self, DockerError> {
        config.validate()?;
        Ok(Self {
            config,
            connected: tokio::sync::Mutex::new(None),
            ready: std::sync::OnceLock::new(),
            in_use: AtomicBool::new(false),
        })
    }

    /// Says the run has (or had) `docker` groups, so listings must ask the engine.
    pub fn mark_in_use(&self) {
        self.in_use.store(true, Ordering::SeqCst);
    }

    /// The connected provider, connecting first if need be.
    async fn get(&self) -> Result<DockerProvider, ProviderError> {
        self.mark_in_use();
        let mut connected = self.connected.lock().await;
        if let Some(p) = connected.as_ref() {
            return Ok(p.clone());
        }
        let provider = DockerProvider::connect(self.config.clone())
            .await
            .map_err(|e| {
                ProviderError::definite(FaultKind::Unreachable, swactor_engine::error_chain(&e))
            })?;
        let _ = self.ready.set(provider.clone());
        *connected = Some(provider.clone());
        Ok(provider)
    }
}

#[async_trait]
impl Provider for DockerOnDemand {
    fn kind(&self) -> &'static str {
        "docker"
    }

    async fn create_lease(
        &self,
        key: &ResourceKey,
        template: &NodeTemplate,
    ) -> Result<LeaseGrant, ProviderError> {
        self.get().await?.create_lease(key, template).await
    }

    async fn lookup_endpoint(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<NodeEndpoint, ProviderError> {
        self.get().await?.lookup_endpoint(key, lease).await
    }

    async fn start_bootstrap(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        endpoint: &NodeEndpoint,
        template: &NodeTemplate,
    ) -> Result<BootstrapSession, ProviderError> {
        self.get()
            .await?
            .start_bootstrap(key, lease, endpoint, template)
            .await
    }

    async fn cancel_bootstrap(
        &self,
        key: &ResourceKey,
        session: &SessionId,
    ) -> Result<Release, ProviderError> {
        self.get().await?.cancel_bootstrap(key, session).await
    }

    async fn destroy_lease(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<Release, ProviderError> {
        self.get().await?.destroy_lease(key, lease).await
    }

    async fn list(&self, run_id: &RunId) -> Result<Inventory, ProviderError> {
        if !self.in_use.load(Ordering::SeqCst) {
            return Ok(Inventory::new());
        }
        self.get().await?.list(run_id).await
    }

    async fn agent_log(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        follow: bool,
    ) -> Result<AgentLogSource, ProviderError> {
        self.get().await?.agent_log(key, lease, follow).await
    }

    fn describe_lease(&self, lease: &LeaseId) -> Option<String> {
        self.ready.get()?.describe_lease(lease)
    }

    fn foreign(&self) -> Vec<crate::ForeignResource> {
        self.ready.get().map(Provider::foreign).unwrap_or_default()
    }

    /// Only a shape that uses Docker waits for it after a restart.
    fn listing_lag(&self) -> std::time::Duration {
        if self.in_use.load(Ordering::SeqCst) {
            super::LISTING_LAG
        } else {
            std::time::Duration::ZERO
        }
    }

    fn owns_lease(&self, lease: &LeaseId) -> bool {
        lease.0.starts_with("docker:")
    }

    fn owns_session(&self, session: &SessionId) -> bool {
        session.0.starts_with("docker:")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(dir: &std::path::Path, host: &str) -> DockerConfig {
        let binary = dir.join("agent");
        std::fs::write(&binary, b"not run").unwrap();
        DockerConfig {
            daemon_ticket: "ticket".into(),
            token_secret: [7; 32],
            docker_host: Some(host.to_owned()),
            ..DockerConfig::new(binary)
        }
    }

    #[tokio::test]
    async fn an_unused_provider_lists_nothing_and_never_dials() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("no-engine.sock");
        let p = DockerOnDemand::new(config(dir.path(), &format!("unix://{}", socket.display())))
            .unwrap();
        assert!(p.list(&RunId::new("r")).await.unwrap().is_empty());
        // Once a docker group exists, the listing asks the engine, and an
        // absent engine is a definite failure that names it and says what to check.
        p.mark_in_use();
        let err = p.list(&RunId::new("r")).await.unwrap_err();
        let ProviderError::Definite(text) = err else {
            panic!("expected a definite failure, got {err:?}");
        };
        assert_eq!(text.kind(), FaultKind::Unreachable, "{text}");
        // The words name the engine and what to check.
        assert!(text.message().contains("no-engine.sock"), "{text}");
        assert!(text.message().contains("is dockerd running"), "{text}");
    }

    #[test]
    fn a_bad_configuration_is_refused_before_any_node_needs_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = config(dir.path(), "unix:///nowhere");
        c.token_secret = [0; 32];
        assert!(matches!(
            DockerOnDemand::new(c),
            Err(DockerError::ZeroTokenSecret)
        ));
    }
}
