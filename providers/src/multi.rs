//! Several providers behind one: a daemon whose shape mixes kinds (local
//! processes and SSH hosts, say) drives them all through [`Providers`].
//!
//! Calls that carry a template go to the provider of its kind; calls that
//! name only a lease or a session go to the provider that owns it
//! ([`Provider::owns_lease`], [`Provider::owns_session`]); a listing is the
//! union of every provider's.

use crate::Release;
use crate::{
    AgentLogSource, BootstrapSession, FaultKind, Inventory, LeaseGrant, Provider, ProviderError,
    async_trait,
};
use std::sync::Arc;
use std::time::Duration;
use swactor_provisioning::{
    Capacity, LeaseId, NodeEndpoint, NodeTemplate, ResourceKey, RunId, SessionId,
};

/// Every provider a daemon can drive, by kind.
#[derive(Clone)]
pub struct Providers {
    all: Vec<Arc<dyn Provider>>,
}

impl std::fmt::Debug for Providers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.all.iter().map(|p| p.kind()))
            .finish()
    }
}

impl Providers {
    /// The given providers, one per kind (a later one of a kind already
    /// given is ignored).
    pub fn new(providers: Vec<Arc<dyn Provider>>) -> Self {
        let mut all: Vec<Arc<dyn Provider>> = Vec::new();
        for p in providers {
            if all.iter().all(|q| q.kind() != p.kind()) {
                all.push(p);
            }
        }
        Self { all }
    }

    /// The kinds it can drive, in the order given.
    pub fn kinds(&self) -> Vec<&'static str> {
        self.all.iter().map(|p| p.kind()).collect()
    }

    /// The kind of the provider that owns `lease`, if one does.
    pub fn kind_of_lease(&self, lease: &LeaseId) -> Option<&'static str> {
        self.of_lease(lease).ok().map(|p| p.kind())
    }

    /// Each provider's own capacity, where it has one.
    pub fn capacities(&self) -> Vec<Capacity> {
        self.all.iter().filter_map(|p| p.capacity()).collect()
    }

    fn of_kind(&self, kind: &str) -> Result<&Arc<dyn Provider>, ProviderError> {
        self.all.iter().find(|p| p.kind() == kind).ok_or_else(|| {
            ProviderError::definite(
                FaultKind::Invalid,
                format!(
                    "this daemon cannot drive provider {kind:?}; it drives: {}",
                    self.kinds().join(", ")
                ),
            )
        })
    }

    fn of_lease(&self, lease: &LeaseId) -> Result<&Arc<dyn Provider>, ProviderError> {
        self.all
            .iter()
            .find(|p| p.owns_lease(lease))
            .ok_or_else(|| {
                ProviderError::definite(
                    FaultKind::Invalid,
                    format!("no provider owns lease {}", lease.0),
                )
            })
    }

    fn of_session(&self, session: &SessionId) -> Result<&Arc<dyn Provider>, ProviderError> {
        self.all
            .iter()
            .find(|p| p.owns_session(session))
            .ok_or_else(|| {
                ProviderError::definite(
                    FaultKind::Invalid,
                    format!("no provider owns session {}", session.0),
                )
            })
    }
}

#[async_trait]
impl Provider for Providers {
    fn kind(&self) -> &'static str {
        "providers"
    }

    async fn create_lease(
        &self,
        key: &ResourceKey,
        template: &NodeTemplate,
    ) -> Result<LeaseGrant, ProviderError> {
        self.of_kind(&template.provider.kind)?
            .create_lease(key, template)
            .await
    }

    async fn lookup_endpoint(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<NodeEndpoint, ProviderError> {
        self.of_lease(lease)?.lookup_endpoint(key, lease).await
    }

    async fn start_bootstrap(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        endpoint: &NodeEndpoint,
        template: &NodeTemplate,
    ) -> Result<BootstrapSession, ProviderError> {
        self.of_lease(lease)?
            .start_bootstrap(key, lease, endpoint, template)
            .await
    }

    async fn cancel_bootstrap(
        &self,
        key: &ResourceKey,
        session: &SessionId,
    ) -> Result<Release, ProviderError> {
        self.of_session(session)?
            .cancel_bootstrap(key, session)
            .await
    }

    async fn destroy_lease(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<Release, ProviderError> {
        self.of_lease(lease)?.destroy_lease(key, lease).await
    }

    async fn destroy_failed_lease(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        reason: &str,
    ) -> Result<Release, ProviderError> {
        self.of_lease(lease)?
            .destroy_failed_lease(key, lease, reason)
            .await
    }

    async fn paused(&self, key: &ResourceKey, lease: &LeaseId) -> Result<bool, ProviderError> {
        self.of_lease(lease)?.paused(key, lease).await
    }

    async fn list(&self, run_id: &RunId) -> Result<Inventory, ProviderError> {
        let mut all = Inventory::new();
        for p in &self.all {
            for (key, owned) in p.list(run_id).await? {
                // Attempt ids are unique per run, so two providers never hold
                // one key; if they did, the first listing is kept and the
                // other's resources stay for a later sweep to report.
                if all.contains_key(&key) {
                    tracing::warn!(%key, kind = p.kind(), "two providers list the same key");
                    continue;
                }
                all.insert(key, owned);
            }
        }
        Ok(all)
    }

    async fn agent_log(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        follow: bool,
    ) -> Result<AgentLogSource, ProviderError> {
        self.of_lease(lease)?.agent_log(key, lease, follow).await
    }

    fn listing_lag(&self) -> Duration {
        self.all
            .iter()
            .map(|p| p.listing_lag())
            .max()
            .unwrap_or(Duration::ZERO)
    }

    fn describe_lease(&self, lease: &LeaseId) -> Option<String> {
        self.of_lease(lease).ok()?.describe_lease(lease)
    }

    fn foreign(&self) -> Vec<crate::ForeignResource> {
        self.all.iter().flat_map(|p| p.foreign()).collect()
    }

    fn owns_lease(&self, lease: &LeaseId) -> bool {
        self.all.iter().any(|p| p.owns_lease(lease))
    }

    fn owns_session(&self, session: &SessionId) -> bool {
        self.all.iter().any(|p| p.owns_session(session))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BootstrapEvents, OwnedResources};
    use std::sync::Mutex;
    use swactor_provisioning::{LogicalNodeId, NodeAttemptId};

    /// A provider that owns leases and sessions starting with its kind and
    /// records which calls reached it.
    struct Prefixed {
        kind: &'static str,
        calls: Mutex<Vec<&'static str>>,
    }

    impl Prefixed {
        fn new(kind: &'static str) -> Arc<Self> {
            Arc::new(Self {
                kind,
                calls: Mutex::new(Vec::new()),
            })
        }
        fn saw(&self, call: &'static str) {
            self.calls.lock().unwrap().push(call);
        }
        fn calls(&self) -> Vec<&'static str> {
            self.calls.lock().unwrap().clone()
        }
    }

    #[async_trait]
    impl Provider for Prefixed {
        fn kind(&self) -> &'static str {
            self.kind
        }
        async fn create_lease(
            &self,
            _: &ResourceKey,
            _: &NodeTemplate,
        ) -> Result<LeaseGrant, ProviderError> {
            self.saw("create");
            Ok(LeaseGrant {
                lease: LeaseId::from(format!("{}:lease", self.kind)),
                endpoint: None,
            })
        }
        async fn lookup_endpoint(
            &self,
            _: &ResourceKey,
            _: &LeaseId,
        ) -> Result<NodeEndpoint, ProviderError> {
            self.saw("lookup");
            Err(ProviderError::NotReady)
        }
        async fn start_bootstrap(
            &self,
            _: &ResourceKey,
            _: &LeaseId,
            _: &NodeEndpoint,
            _: &NodeTemplate,
        ) -> Result<BootstrapSession, ProviderError> {
            self.saw("start");
            let (_tx, events): (_, BootstrapEvents) = swactor_engine::stream::channel(1);
            Ok(BootstrapSession {
                session: SessionId::from(format!("{}:session", self.kind)),
                events,
            })
        }
        async fn cancel_bootstrap(
            &self,
            _: &ResourceKey,
            _: &SessionId,
        ) -> Result<Release, ProviderError> {
            self.saw("cancel");
            Ok(Release::Done)
        }
        async fn destroy_lease(
            &self,
            _: &ResourceKey,
            _: &LeaseId,
        ) -> Result<Release, ProviderError> {
            self.saw("destroy");
            Ok(Release::Done)
        }
        async fn list(&self, run: &RunId) -> Result<Inventory, ProviderError> {
            self.saw("list");
            let key = ResourceKey {
                run_id: run.clone(),
                node: LogicalNodeId::parse(&format!("{}-0", self.kind)).unwrap(),
                attempt: NodeAttemptId(1),
            };
            Ok(Inventory::from([(
                key,
                OwnedResources {
                    lease: Some(LeaseId::from(format!("{}:lease", self.kind))),
                    session: None,
                },
            )]))
        }
        fn owns_lease(&self, lease: &LeaseId) -> bool {
            lease.0.starts_with(self.kind)
        }
        fn owns_session(&self, session: &SessionId) -> bool {
            session.0.starts_with(self.kind)
        }
    }

    fn template(kind: &str) -> NodeTemplate {
        let shape = swactor_provisioning::ClusterShape {
            run_id: RunId::new("r"),
            generation: swactor_provisioning::Generation(1),
            groups: vec![swactor_provisioning::GroupShape {
                id: "w".into(),
                run_id: None,
                count: 1,
                provider: swactor_provisioning::ProviderShape {
                    kind: kind.into(),
                    params: Default::default(),
                    placement: Default::default(),
                },
                boot: Default::default(),
                role: "worker".into(),
                join: Default::default(),
                limits: Default::default(),
                policy: Default::default(),
            }],
            capacity: None,
            budget: None,
            lifetime: Default::default(),
        };
        let desired = shape.validate().unwrap();
        (*desired.groups[0].template).clone()
    }

    #[tokio::test]
    async fn calls_reach_the_provider_of_the_kind_or_of_the_lease_and_listings_are_merged() {
        let (a, b) = (Prefixed::new("alpha"), Prefixed::new("beta"));
        let all = Providers::new(vec![a.clone(), b.clone()]);
        let key = ResourceKey {
            run_id: RunId::new("r"),
            node: LogicalNodeId::parse("w-0").unwrap(),
            attempt: NodeAttemptId(3),
        };
        let grant = all.create_lease(&key, &template("beta")).await.unwrap();
        assert_eq!(grant.lease.0, "beta:lease");
        let _ = all.lookup_endpoint(&key, &grant.lease).await;
        all.destroy_lease(&key, &LeaseId::from("alpha:lease"))
            .await
            .unwrap();
        all.cancel_bootstrap(&key, &SessionId::from("beta:session"))
            .await
            .unwrap();
        assert_eq!(a.calls(), ["destroy"]);
        assert_eq!(b.calls(), ["create", "lookup", "cancel"]);

        let listed = all.list(&RunId::new("r")).await.unwrap();
        assert_eq!(listed.len(), 2);
        let err = all
            .create_lease(&key, &template("gamma"))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), Some(FaultKind::Invalid), "{err:?}");
        assert!(err.to_string().contains("drives: alpha, beta"), "{err}");
        assert!(
            all.destroy_lease(&key, &LeaseId::from("gamma:lease"))
                .await
                .is_err()
        );
    }
}
