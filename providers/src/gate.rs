//! A provider that acts only while this daemon leads.
//!
//! The host already hands out nothing past its leadership bound; this gate
//! is the last check, right before a call leaves the process: an effect
//! handed out just before the bound and picked up by an executor just
//! after it is refused here, without reaching the provider. Reads that
//! change nothing (`describe_lease`, `agent_log`, `foreign`) pass.

use crate::{
    AgentLogSource, BootstrapSession, FaultKind, ForeignResource, Inventory, LeaseGrant,
    NodeEndpoint, Provider, ProviderError, Release,
};
use async_trait::async_trait;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use swactor_engine::{EngineInstant, LeadBound};
use swactor_provisioning::{LeaseId, NodeTemplate, ResourceKey, RunId, SessionId};

/// `inner`, gated on `bound`, counting what it let through and refused.
pub struct LeaderGated {
    inner: Arc<dyn Provider>,
    bound: LeadBound,
    counts: Arc<GateCounts>,
}

/// What a [`LeaderGated`] let through and refused, for `/metrics` and for
/// tests that count a deposed leader's calls.
#[derive(Debug, Default)]
pub struct GateCounts {
    /// Calls that went to the provider.
    pub passed: AtomicU64,
    /// Calls refused because leadership did not hold.
    pub refused: AtomicU64,
}

impl GateCounts {
    /// Calls that went to the provider so far.
    pub fn passed(&self) -> u64 {
        self.passed.load(Ordering::Relaxed)
    }

    /// Calls refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

impl LeaderGated {
    /// `inner`, acting only while `bound` holds.
    pub fn new(inner: Arc<dyn Provider>, bound: LeadBound) -> Self {
        Self {
            inner,
            bound,
            counts: Arc::default(),
        }
    }

    /// The counts, shared.
    pub fn counts(&self) -> Arc<GateCounts> {
        self.counts.clone()
    }

    fn check(&self, what: &str) -> Result<(), ProviderError> {
        if self.bound.holds_at(EngineInstant::now()) {
            self.counts.passed.fetch_add(1, Ordering::Relaxed);
            Ok(())
        } else {
            self.counts.refused.fetch_add(1, Ordering::Relaxed);
            Err(ProviderError::definite(
                FaultKind::Refused,
                format!(
                    "not sent: this daemon's leadership lapsed before the {what} could go out \
                     (another daemon may lead now)"
                ),
            ))
        }
    }
}

#[async_trait]
impl Provider for LeaderGated {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    async fn create_lease(
        &self,
        key: &ResourceKey,
        template: &NodeTemplate,
    ) -> Result<LeaseGrant, ProviderError> {
        self.check("create")?;
        self.inner.create_lease(key, template).await
    }

    async fn lookup_endpoint(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<NodeEndpoint, ProviderError> {
        self.check("lookup")?;
        self.inner.lookup_endpoint(key, lease).await
    }

    async fn start_bootstrap(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        endpoint: &NodeEndpoint,
        template: &NodeTemplate,
    ) -> Result<BootstrapSession, ProviderError> {
        self.check("bootstrap")?;
        self.inner
            .start_bootstrap(key, lease, endpoint, template)
            .await
    }

    async fn cancel_bootstrap(
        &self,
        key: &ResourceKey,
        session: &SessionId,
    ) -> Result<Release, ProviderError> {
        self.check("stop of a bootstrap")?;
        self.inner.cancel_bootstrap(key, session).await
    }

    async fn destroy_lease(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<Release, ProviderError> {
        self.check("destroy")?;
        self.inner.destroy_lease(key, lease).await
    }

    async fn destroy_failed_lease(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        reason: &str,
    ) -> Result<Release, ProviderError> {
        self.check("destroy")?;
        self.inner.destroy_failed_lease(key, lease, reason).await
    }

    async fn list(&self, run_id: &RunId) -> Result<Inventory, ProviderError> {
        self.check("listing")?;
        self.inner.list(run_id).await
    }

    fn listing_lag(&self) -> std::time::Duration {
        self.inner.listing_lag()
    }

    fn capacity(&self) -> Option<swactor_provisioning::Capacity> {
        self.inner.capacity()
    }

    fn describe_lease(&self, lease: &LeaseId) -> Option<String> {
        self.inner.describe_lease(lease)
    }

    async fn agent_log(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        follow: bool,
    ) -> Result<AgentLogSource, ProviderError> {
        self.inner.agent_log(key, lease, follow).await
    }

    async fn paused(&self, key: &ResourceKey, lease: &LeaseId) -> Result<bool, ProviderError> {
        self.check("pause check")?;
        self.inner.paused(key, lease).await
    }

    fn foreign(&self) -> Vec<ForeignResource> {
        self.inner.foreign()
    }

    fn owns_lease(&self, lease: &LeaseId) -> bool {
        self.inner.owns_lease(lease)
    }

    fn owns_session(&self, session: &SessionId) -> bool {
        self.inner.owns_session(session)
    }
}

#[cfg(all(test, feature = "fake"))]
mod tests {
    use super::*;
    use crate::fake::{FakeConfig, FakeProvider};
    use std::time::Duration;
    use swactor_engine::Clock;

    #[tokio::test]
    async fn calls_go_out_only_while_the_bound_holds() {
        let bound = LeadBound::new();
        let gated = LeaderGated::new(
            Arc::new(FakeProvider::new(FakeConfig::default(), Clock::new())),
            bound.clone(),
        );
        let run = RunId::new("r");
        let err = gated.list(&run).await.unwrap_err();
        assert!(err.to_string().contains("leadership lapsed"), "{err}");
        bound.set(Some(EngineInstant::now() + Duration::from_secs(60)));
        gated.list(&run).await.unwrap();
        bound.set(Some(EngineInstant::now()));
        assert!(gated.list(&run).await.is_err());
        let counts = gated.counts();
        assert_eq!((counts.passed(), counts.refused()), (1, 2));
    }
}
