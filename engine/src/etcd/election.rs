//! Leader election on etcd, with the bound a leader must stop acting at.
//!
//! Every replica of a run campaigns for one key: it holds an etcd lease of
//! `ttl` and tries to create the key attached to that lease, in a
//! transaction that only succeeds while the key does not exist. The one
//! that created it leads; the others stand by and try again every
//! `retry`. A leader renews its lease every third of `ttl`.
//!
//! # The bound
//! etcd counts a lease's time to live from when it receives the grant or
//! the renewal, which is after the replica sent it. So from a renewal
//! *sent* at `t`, the lease (and with it the key) cannot be gone, and no
//! other replica can have created the key, before `t + ttl` on any clock
//! that runs at the same rate. A leader therefore holds its leadership
//! until `t + ttl − margin` of its own monotonic clock, where `t` is when
//! it sent the last renewal that was answered, and acts on nothing from
//! then on (the host decides that; see `Host::handle_leadership`). The
//! margin covers clock rate differences and the time an effect already
//! under way takes to reach the provider. A leader frozen past the bound
//! (a stopped process, a sleeping machine) wakes to a bound already
//! passed: it acts on nothing until a renewal is answered, and a renewal
//! of a lease that expired meanwhile is answered "gone", which ends its
//! leadership for good.
//!
//! Each leadership comes with the key's `create_revision`: the
//! [`Fence`] every journal write of that leader is conditioned on, so a
//! deposed leader's write fails even if it was sent in time.

use super::{Client, Compare, EtcdError, Fence, Op, OpResponse, Range, Txn};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// How a replica campaigns.
#[derive(Clone, Debug)]
pub struct ElectionConfig {
    /// The key the replicas compete for.
    pub key: String,
    /// What the leader writes there (who it is, for the others to show).
    pub identity: Vec<u8>,
    /// The lease's time to live.
    pub ttl: Duration,
    /// How much sooner than the lease could end a leader stops acting.
    pub margin: Duration,
    /// How often a standby tries again.
    pub retry: Duration,
}

impl ElectionConfig {
    /// A campaign for `key` as `identity`, with a 10 s lease, a 2 s margin
    /// and a try every second.
    pub fn new(key: impl Into<String>, identity: impl Into<Vec<u8>>) -> Self {
        Self {
            key: key.into(),
            identity: identity.into(),
            ttl: Duration::from_secs(10),
            margin: Duration::from_secs(2),
            retry: Duration::from_secs(1),
        }
    }
}

/// Where a replica stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// Not leading: `leader` is what the leader wrote, when there is one,
    /// and `error` why etcd could not be asked, when it could not.
    Standby {
        /// The leader's identity.
        leader: Option<Vec<u8>>,
        /// The last failure to reach etcd.
        error: Option<String>,
    },
    /// Leading until `until` (exclusive) on this process's monotonic
    /// clock, with `fence` for every journal write.
    Leading {
        /// When to stop acting unless renewed.
        until: Instant,
        /// The key and its create revision.
        fence: Fence,
    },
}

impl Role {
    /// Whether this replica may act at `now`.
    pub fn leads_at(&self, now: Instant) -> bool {
        matches!(self, Self::Leading { until, .. } if now < *until)
    }
}

/// A campaign running on its own task; dropping it steps down (the lease
/// is revoked, so a standby takes over at once).
pub struct Election {
    role: watch::Receiver<Role>,
    task: tokio::task::JoinHandle<()>,
    client: Client,
    lease: watch::Receiver<Option<i64>>,
}

impl Election {
    /// Starts campaigning.
    pub fn start(client: Client, config: ElectionConfig) -> Self {
        let (role_tx, role) = watch::channel(Role::Standby {
            leader: None,
            error: None,
        });
        let (lease_tx, lease) = watch::channel(None);
        let task = tokio::spawn(campaign(client.clone(), config, role_tx, lease_tx));
        Self {
            role,
            task,
            client,
            lease,
        }
    }

    /// Where this replica stands, as it changes.
    pub fn role(&self) -> watch::Receiver<Role> {
        self.role.clone()
    }

    /// The id of the lease this replica campaigns with, as it changes
    /// (`None` between leases): keys this replica keeps only while it
    /// lives (its address, say) are attached to it.
    pub fn lease(&self) -> watch::Receiver<Option<i64>> {
        self.lease.clone()
    }

    /// Stops campaigning without stepping down: the lease is left to
    /// expire, as when the process is killed. For tests.
    pub fn abandon(self) {
        self.task.abort();
    }

    /// Stops campaigning and steps down: the lease is revoked, so the key
    /// goes at once and a standby can lead.
    pub async fn step_down(self) {
        self.task.abort();
        let lease = *self.lease.borrow();
        if let Some(id) = lease {
            let _ = self.client.lease_revoke(id).await;
        }
    }
}

impl Drop for Election {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The campaign: hold a lease, try for the key while standing by, renew
/// while leading; start over with a new lease when the old one is gone.
async fn campaign(
    client: Client,
    config: ElectionConfig,
    role: watch::Sender<Role>,
    lease_id: watch::Sender<Option<i64>>,
) {
    loop {
        let sent = Instant::now();
        let lease = match client.lease_grant(ttl_s(config.ttl)).await {
            Ok(lease) => lease,
            Err(e) => {
                stand_by(&role, None, Some(&e));
                tokio::time::sleep(config.retry).await;
                continue;
            }
        };
        lease_id.send_replace(Some(lease.id));
        let granted = Duration::from_secs(u64::try_from(lease.ttl_s).unwrap_or(0));
        hold(&client, &config, &role, lease.id, sent, granted).await;
        lease_id.send_replace(None);
    }
}

/// Campaigns with lease `id` (sent for at `sent`, granted for `granted`)
/// until it is gone.
async fn hold(
    client: &Client,
    config: &ElectionConfig,
    role: &watch::Sender<Role>,
    id: i64,
    mut sent: Instant,
    mut granted: Duration,
) {
    let mut fence = None;
    loop {
        if fence.is_none() {
            match try_lead(client, config, id).await {
                Ok(Ok(f)) => fence = Some(f),
                Ok(Err(leader)) => stand_by(role, leader, None),
                Err(e) => stand_by(role, None, Some(&e)),
            }
        }
        if let Some(f) = &fence {
            let until = (sent + granted).checked_sub(config.margin).unwrap_or(sent);
            role.send_replace(Role::Leading {
                until,
                fence: f.clone(),
            });
        }
        let wait = if fence.is_some() {
            config.ttl / 3
        } else {
            config.retry
        };
        tokio::time::sleep(wait).await;
        // Renew: a standby keeps its lease too, so that winning needs no
        // new grant.
        let at = Instant::now();
        match client.lease_keep_alive(id).await {
            Ok(Some(ttl)) => {
                sent = at;
                granted = Duration::from_secs(u64::try_from(ttl).unwrap_or(0));
            }
            Ok(None) => {
                // Gone (expired while this replica was frozen or cut off):
                // whatever it led, it leads no more.
                stand_by(role, None, None);
                return;
            }
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "cannot renew the leadership lease; acting stops at its bound unless a renewal is answered"
                );
                // The bound stays where the last answered renewal put it.
                if fence.is_none() {
                    stand_by(role, None, Some(&e));
                }
            }
        }
    }
}

/// One try for the key: `Ok(Ok(fence))` when this replica created it,
/// `Ok(Err(leader))` when another holds it.
async fn try_lead(
    client: &Client,
    config: &ElectionConfig,
    lease: i64,
) -> Result<Result<Fence, Option<Vec<u8>>>, EtcdError> {
    let key = config.key.as_bytes().to_vec();
    let answer = client
        .txn(&Txn {
            compare: vec![Compare::created_at(key.clone(), 0)],
            success: vec![Op::Put {
                key: key.clone(),
                value: config.identity.clone(),
                lease,
            }],
            failure: vec![Op::Get(Range::key(key))],
        })
        .await?;
    if answer.succeeded {
        return Ok(Ok(Fence {
            key: config.key.clone(),
            create_revision: answer.revision,
        }));
    }
    let leader = answer.responses.into_iter().find_map(|r| match r {
        OpResponse::Get(page) => page.kvs.into_iter().next().map(|kv| kv.value),
        _ => None,
    });
    Ok(Err(leader))
}

fn stand_by(role: &watch::Sender<Role>, leader: Option<Vec<u8>>, error: Option<&EtcdError>) {
    role.send_replace(Role::Standby {
        leader,
        error: error.map(ToString::to_string),
    });
}

/// A lease's time to live in whole seconds, at least one.
fn ttl_s(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::etcd::testing::{EtcdCluster, unique_prefix};

    fn config(key: &str, who: &str) -> ElectionConfig {
        ElectionConfig {
            ttl: Duration::from_secs(2),
            margin: Duration::from_millis(500),
            retry: Duration::from_millis(100),
            ..ElectionConfig::new(key, who.as_bytes())
        }
    }

    async fn until_leading(role: &mut watch::Receiver<Role>, within: Duration) -> (Instant, Fence) {
        let deadline = Instant::now() + within;
        loop {
            if let Role::Leading { until, fence } = &*role.borrow_and_update()
                && *until > Instant::now()
            {
                return (*until, fence.clone());
            }
            tokio::time::timeout_at(deadline, role.changed())
                .await
                .expect("leads in time")
                .expect("the campaign runs");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_replica_leads_and_a_killed_leaders_successor_never_overlaps_its_bound() {
        let Some(cluster) = EtcdCluster::shared() else {
            return;
        };
        let key = format!("{}/leader", unique_prefix("election"));
        let a = Election::start(cluster.client(), config(&key, "a"));
        let mut a_role = a.role();
        let (_, a_fence) = until_leading(&mut a_role, Duration::from_secs(5)).await;
        let b = Election::start(cluster.client(), config(&key, "b"));
        let b_role = b.role();
        // b stands by and names a.
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(
            *b_role.borrow(),
            Role::Standby {
                leader: Some(b"a".to_vec()),
                error: None
            }
        );
        assert!(a_role.borrow().leads_at(Instant::now()));
        // a dies without stepping down: its lease runs out. b may lead only
        // once a's bound has passed, and then within a lease and a retry.
        let a_until = match &*a_role.borrow() {
            Role::Leading { until, .. } => *until,
            other => panic!("{other:?}"),
        };
        let killed = Instant::now();
        a.abandon();
        let mut b_role = b_role;
        loop {
            let now = Instant::now();
            let leading = matches!(&*b_role.borrow(), Role::Leading { .. });
            if leading {
                assert!(now >= a_until, "b led {:?} before a's bound", a_until - now);
                break;
            }
            assert!(
                now < killed + Duration::from_secs(5),
                "b never led: {:?}",
                b_role.borrow()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let (b_until, b_fence) = until_leading(&mut b_role, Duration::from_secs(1)).await;
        let took = killed.elapsed();
        assert!(took <= Duration::from_millis(3_000), "{took:?}");
        assert!(b_fence.create_revision > a_fence.create_revision);
        assert!(b_until > Instant::now());
        eprintln!(
            "b led {took:?} after a was killed (a's bound was {:?} after)",
            a_until.saturating_duration_since(killed)
        );
        b.step_down().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_leader_that_steps_down_is_followed_at_once() {
        let Some(cluster) = EtcdCluster::shared() else {
            return;
        };
        let key = format!("{}/leader", unique_prefix("election"));
        let a = Election::start(cluster.client(), config(&key, "a"));
        until_leading(&mut a.role(), Duration::from_secs(5)).await;
        let b = Election::start(cluster.client(), config(&key, "b"));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!b.role().borrow().leads_at(Instant::now()));
        let stepped = Instant::now();
        a.step_down().await;
        until_leading(&mut b.role(), Duration::from_secs(2)).await;
        let took = stepped.elapsed();
        assert!(took < Duration::from_secs(1), "{took:?}");
        b.step_down().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_leader_whose_etcd_is_gone_stops_at_its_bound() {
        let Some(mut cluster) = EtcdCluster::start(1) else {
            return;
        };
        let key = format!("{}/leader", unique_prefix("election"));
        let a = Election::start(cluster.client(), config(&key, "a"));
        let mut role = a.role();
        until_leading(&mut role, Duration::from_secs(5)).await;
        cluster.kill_all();
        let lost = Instant::now();
        // The bound is at most a lease (less the margin) after the last
        // answered renewal, so the leader stops acting within the lease.
        loop {
            if !role.borrow().leads_at(Instant::now()) {
                break;
            }
            assert!(lost.elapsed() < Duration::from_secs(2), "still leading");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        eprintln!("stopped acting {:?} after etcd went", lost.elapsed());
        cluster.restart_all();
        until_leading(&mut role, Duration::from_secs(10)).await;
        assert!(
            role.borrow().leads_at(Instant::now()),
            "leads again once etcd is back"
        );
        a.step_down().await;
    }
}
