//! Desired state: the declared cluster shape, its validation and its expansion into slots.
//!
//! Over 1,000 lines in one file because each shape type keeps its validation
//! rule next to it.

use crate::id::{Generation, GroupId, IdError, LogicalNodeId, RunId, validate_id};
use crate::rollout::{GroupPolicy, OnPreempt, PERCENT_MAX, Quantity};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// Most slots one group may declare.
pub const GROUP_COUNT_MAX: u32 = 100_000;
/// Most slots a whole shape may declare.
pub const SHAPE_NODES_MAX: u64 = 1_000_000;
/// Most groups a shape may declare.
pub const GROUPS_MAX: usize = 1_024;

/// A declared cluster: what the run should look like at one generation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterShape {
    /// The run this shape belongs to.
    pub run_id: RunId,
    /// The revision of this shape.
    pub generation: Generation,
    /// The node groups.
    #[serde(default)]
    pub groups: Vec<GroupShape>,
    /// The most nodes the operator lets this shape hold, overriding the
    /// provider's own estimate of what it can hold; `None` keeps the estimate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u64>,
    /// What the run may spend on rented machines, and what happens when it
    /// has (see [`crate::budget`]); `None`: no budget. Changing it replaces
    /// no node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<crate::budget::Budget>,
    /// How long the run may live: torn down a set time after the apply
    /// that sets it, or after a set time with no job running (see
    /// [`crate::lifetime`]); off by default. Changing it replaces no node.
    #[serde(default, skip_serializing_if = "crate::lifetime::Lifetime::is_off")]
    pub lifetime: crate::lifetime::Lifetime,
}

/// A set of identical slots.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GroupShape {
    /// The group's id; slots are named `{id}-{index}`.
    pub id: String,
    /// The run the group was declared for, when the group names one; it must
    /// match the shape's run (a group copied from another run is rejected).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<RunId>,
    /// How many slots the group has.
    pub count: u32,
    /// Where and how machines are leased.
    pub provider: ProviderShape,
    /// How the agent is started on a leased machine.
    #[serde(default)]
    pub boot: BootParams,
    /// The role nodes of this group play in the swarm.
    #[serde(default = "default_role")]
    pub role: String,
    /// How nodes of this group join the swarm.
    #[serde(default)]
    pub join: SwarmJoin,
    /// How long each step of a node of this group may take.
    #[serde(default)]
    pub limits: NodeLimits,
    /// Rollout and remediation budgets; not part of the template, so
    /// changing them replaces no node.
    #[serde(default, flatten)]
    pub policy: PolicyShape,
}

/// A group's change budgets as written; `None` keeps the default (see
/// [`GroupPolicy`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyShape {
    /// Most desired slots that may be unavailable while ready nodes of an
    /// outdated template are replaced (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_unavailable: Option<Quantity>,
    /// Extra nodes a rollout may make (default 0; only 0 is supported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_surge: Option<Quantity>,
    /// Most unhealthy slots before lost nodes stop being replaced
    /// (default: no limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_unhealthy: Option<Quantity>,
    /// What a node whose machine the provider paused becomes (default:
    /// replaced).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_preempt: Option<PreemptChoice>,
    /// With [`PreemptChoice::Wait`], seconds a paused machine is waited for
    /// (default [`OnPreempt::WAIT_DEFAULT_S`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preempt_wait_s: Option<u32>,
    /// Seconds an agent keeps its node once its daemon stops renewing its
    /// lease (default [`GroupPolicy::ORPHAN_AFTER_DEFAULT_S`]; 0: never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub orphan_after_s: Option<u32>,
    /// Whether a node running a job waits for it before its lease counts
    /// (default [`crate::OrphanPolicy::Always`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub orphan_policy: Option<crate::OrphanPolicy>,
    /// Jobs one node of the group runs at once (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jobs_per_node: Option<u32>,
    /// GPUs each node of the group has, as its author declares them (a
    /// job is told this before what the node reports).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<u32>,
}

/// `on_preempt` as written in a shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PreemptChoice {
    /// Replace the node (the default).
    Replace,
    /// Wait for the machine to resume, up to `preempt_wait_s`.
    Wait,
}

impl PolicyShape {
    /// The policy with every default filled in.
    pub fn resolve(&self) -> GroupPolicy {
        let d = GroupPolicy::default();
        GroupPolicy {
            max_unavailable: self.max_unavailable.unwrap_or(d.max_unavailable),
            max_surge: self.max_surge.unwrap_or(d.max_surge),
            max_unhealthy: self.max_unhealthy,
            on_preempt: match self.on_preempt {
                Some(PreemptChoice::Wait) => OnPreempt::Wait {
                    wait_s: self.preempt_wait_s.unwrap_or(OnPreempt::WAIT_DEFAULT_S),
                },
                Some(PreemptChoice::Replace) | None => OnPreempt::Replace,
            },
            orphan_after_s: self.orphan_after_s.unwrap_or(d.orphan_after_s),
            orphan_policy: self.orphan_policy.unwrap_or(d.orphan_policy),
            jobs_per_node: self.jobs_per_node.unwrap_or(d.jobs_per_node).max(1),
            gpus: self.gpus,
        }
    }
}

fn default_role() -> String {
    "worker".to_owned()
}

/// A provider kind plus parameters the reconciler compares but never interprets.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProviderShape {
    /// The provider kind, e.g. `process`, `docker`, `vast`, `ssh`.
    pub kind: String,
    /// Provider-specific parameters: how a node is made. Changing one
    /// replaces the group's nodes.
    #[serde(default)]
    pub params: BTreeMap<String, ParamValue>,
    /// Provider-specific placement: where new nodes may go (say, the hosts
    /// of an SSH pool). Changing it reaches the provider with the next
    /// shape but replaces no node already placed: it is not part of what
    /// makes two templates the same ([`same_template`],
    /// [`NodeTemplate::digest`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub placement: BTreeMap<String, ParamValue>,
}

/// A provider parameter value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ParamValue {
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A finite floating-point number.
    Float(f64),
    /// A string.
    Str(String),
    /// A list of values.
    List(Vec<ParamValue>),
}

/// Most items of a list a [`ParamValue`] shows; the rest are said as `…`.
const PARAM_LIST_SHOWN: usize = 8;

/// As it would be written in a TOML shape file (`"gpu"`, `2`, `0.5`,
/// `true`, `[1, 2]`), for messages: a list shows its first
/// [`PARAM_LIST_SHOWN`] items and then `…`.
impl std::fmt::Display for ParamValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Bool(b) => write!(f, "{b}"),
            Self::Int(i) => write!(f, "{i}"),
            // `{:?}` keeps the point of a whole float (`1.0`), as TOML does.
            Self::Float(x) => write!(f, "{x:?}"),
            Self::Str(s) => write!(f, "{s:?}"),
            Self::List(items) => {
                f.write_str("[")?;
                for (i, item) in items.iter().take(PARAM_LIST_SHOWN).enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{item}")?;
                }
                if items.len() > PARAM_LIST_SHOWN {
                    write!(f, ", … ({} items)", items.len())?;
                }
                f.write_str("]")
            }
        }
    }
}

/// How the agent is started and checked on a leased machine.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BootParams {
    /// A machine image, for providers that take one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// A command (argv) the agent runs to decide the machine is fit; empty for none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub boot_check: Vec<String>,
    /// Environment passed to the agent.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
}

/// Swarm-join settings for a group.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SwarmJoin {
    /// Tags the node announces when it joins.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub tags: BTreeSet<String>,
    /// Seconds a joined agent may be gone before its node counts as lost.
    #[serde(default = "default_lost_grace_s")]
    pub lost_grace_s: f64,
}

fn default_lost_grace_s() -> f64 {
    5.0
}

impl SwarmJoin {
    /// [`SwarmJoin::lost_grace_s`] in whole milliseconds (saturating).
    pub fn lost_grace_ms(&self) -> u64 {
        seconds_to_ms(self.lost_grace_s)
    }
}

impl Default for SwarmJoin {
    fn default() -> Self {
        Self {
            tags: BTreeSet::new(),
            lost_grace_s: default_lost_grace_s(),
        }
    }
}

/// Per-group time limits. Part of the template: changing one replaces the
/// group's nodes, like any other change to how they are made.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeLimits {
    /// Seconds a leased machine may take to report a reachable endpoint
    /// (e.g. a rented instance still loading its image). Past it, the attempt
    /// fails and the machine is replaced instead of probed (and paid for) forever.
    #[serde(default = "default_endpoint_timeout_s")]
    pub endpoint_timeout_s: f64,
    /// Seconds the boot check may run. The agent stops a check that runs
    /// longer and fails the attempt, saying so.
    #[serde(default = "default_boot_timeout_s")]
    pub boot_timeout_s: f64,
}

fn default_endpoint_timeout_s() -> f64 {
    900.0
}

fn default_boot_timeout_s() -> f64 {
    300.0
}

impl Default for NodeLimits {
    fn default() -> Self {
        Self {
            endpoint_timeout_s: default_endpoint_timeout_s(),
            boot_timeout_s: default_boot_timeout_s(),
        }
    }
}

impl NodeLimits {
    /// [`NodeLimits::endpoint_timeout_s`] in whole milliseconds (saturating).
    pub fn endpoint_timeout_ms(&self) -> u64 {
        seconds_to_ms(self.endpoint_timeout_s)
    }

    /// [`NodeLimits::boot_timeout_s`] in whole milliseconds (saturating).
    pub fn boot_timeout_ms(&self) -> u64 {
        seconds_to_ms(self.boot_timeout_s)
    }
}

/// Seconds as whole milliseconds; negative and NaN become 0, huge values saturate.
pub(crate) fn seconds_to_ms(s: f64) -> u64 {
    // `as` saturates and maps NaN to 0, which is what a deadline wants.
    (s * 1000.0) as u64
}

/// Why a shape was rejected. Each variant names the offending field, in
/// the names of [`ClusterShape`] (`groups[2].join.lost_grace_s`); a group's
/// problem carries the group's position and id, and the field as a
/// [`GroupField`], so a front end can say it in the names its users write.
#[derive(Clone, Debug, PartialEq, thiserror::Error, Serialize)]
pub enum ShapeError {
    /// The run id is malformed.
    #[error("run_id {value:?} {source}")]
    RunId {
        /// The rejected value.
        value: String,
        /// What is wrong with it.
        source: IdError,
    },
    /// A group id is malformed.
    #[error("groups[{index}].id {value:?} {source}")]
    GroupId {
        /// Position of the group in the shape.
        index: usize,
        /// The rejected value.
        value: String,
        /// What is wrong with it.
        source: IdError,
    },
    /// Two groups share an id.
    #[error("groups[{index}].id {id:?} is already used by groups[{first}]")]
    DuplicateGroup {
        /// Position of the second group.
        index: usize,
        /// Position of the first group with this id.
        first: usize,
        /// The duplicated id.
        id: String,
    },
    /// A group names a different run than the shape.
    #[error("groups[{index}].run_id {group_run:?} does not match the shape's run_id {run:?}")]
    ForeignGroup {
        /// Position of the group.
        index: usize,
        /// The group's run.
        group_run: String,
        /// The shape's run.
        run: String,
    },
    /// A group declares more slots than [`GROUP_COUNT_MAX`].
    #[error("groups[{index}].count is {count}; the limit is {GROUP_COUNT_MAX}")]
    CountTooLarge {
        /// Position of the group.
        index: usize,
        /// The group's id.
        id: String,
        /// The declared count.
        count: u32,
    },
    /// The shape declares more slots than [`SHAPE_NODES_MAX`] in total.
    #[error("the shape declares {total} nodes in all; the limit is {SHAPE_NODES_MAX}")]
    TooManyNodes {
        /// The total slot count.
        total: u64,
    },
    /// The shape declares more groups than [`GROUPS_MAX`].
    #[error("the shape declares {count} groups; the limit is {GROUPS_MAX}")]
    TooManyGroups {
        /// The number of groups.
        count: usize,
    },
    /// A number is NaN or infinite, or out of its range.
    #[error("groups[{index}].{field} is {value}; it must be a finite number{range}")]
    BadNumber {
        /// Position of the group.
        index: usize,
        /// The group's id.
        id: String,
        /// The field.
        field: GroupField,
        /// The rejected value, as text.
        value: String,
        /// Extra range requirement, e.g. " >= 0".
        range: &'static str,
    },
    /// A required string is empty.
    #[error("groups[{index}].{field} must not be empty")]
    EmptyField {
        /// Position of the group.
        index: usize,
        /// The group's id.
        id: String,
        /// The field.
        field: GroupField,
    },
    /// A percentage above 100.
    #[error("groups[{index}].{field} is {value}; a percentage must be between 0% and 100%")]
    BadPercent {
        /// Position of the group.
        index: usize,
        /// The group's id.
        id: String,
        /// The field.
        field: GroupField,
        /// The rejected value, as text.
        value: String,
    },
}

/// A field of a [`GroupShape`] that validation can refuse. It displays as
/// its path in the group (`join.lost_grace_s`, `provider.params.xs[1]`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum GroupField {
    /// `provider.kind`.
    ProviderKind,
    /// `role`.
    Role,
    /// A provider parameter: `provider.params.{0}`, where the path names
    /// an item of a list as `name[i]`.
    Param(String),
    /// A placement entry: `provider.placement.{0}`, paths as for
    /// [`GroupField::Param`].
    Placement(String),
    /// `join.lost_grace_s`.
    LostGraceS,
    /// `limits.endpoint_timeout_s`.
    EndpointTimeoutS,
    /// `limits.boot_timeout_s`.
    BootTimeoutS,
    /// `max_unavailable`.
    MaxUnavailable,
    /// `max_surge`.
    MaxSurge,
    /// `max_unhealthy`.
    MaxUnhealthy,
}

impl std::fmt::Display for GroupField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ProviderKind => f.write_str("provider.kind"),
            Self::Role => f.write_str("role"),
            Self::Param(path) => write!(f, "provider.params.{path}"),
            Self::Placement(path) => write!(f, "provider.placement.{path}"),
            Self::LostGraceS => f.write_str("join.lost_grace_s"),
            Self::EndpointTimeoutS => f.write_str("limits.endpoint_timeout_s"),
            Self::BootTimeoutS => f.write_str("limits.boot_timeout_s"),
            Self::MaxUnavailable => f.write_str("max_unavailable"),
            Self::MaxSurge => f.write_str("max_surge"),
            Self::MaxUnhealthy => f.write_str("max_unhealthy"),
        }
    }
}

/// Everything about a slot that an attempt is created from. Immutable per
/// attempt: any change means the attempt is replaced, never patched.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeTemplate {
    /// Where and how the machine is leased.
    pub provider: ProviderShape,
    /// How the agent is started.
    pub boot: BootParams,
    /// The node's role.
    pub role: String,
    /// Swarm-join settings.
    pub join: SwarmJoin,
    /// Time limits.
    #[serde(default)]
    pub limits: NodeLimits,
}

impl NodeTemplate {
    /// Equal in everything but [`ProviderShape::placement`].
    pub fn makes_same_node_as(&self, other: &NodeTemplate) -> bool {
        self.provider.kind == other.provider.kind
            && self.provider.params == other.provider.params
            && self.boot == other.boot
            && self.role == other.role
            && self.join == other.join
            && self.limits == other.limits
    }

    /// A stable 64-bit digest of the template's content, for recording which
    /// template an attempt was made from (a journal compares it after a
    /// restart). Equal templates have equal digests; the encoding is fixed
    /// (FNV-1a over length-prefixed fields), so a change to it needs a new
    /// journal format.
    pub fn digest(&self) -> u64 {
        let mut h = Fnv::new();
        h.str(&self.provider.kind);
        h.u64(self.provider.params.len() as u64);
        for (k, v) in &self.provider.params {
            h.str(k);
            h.param(v);
        }
        h.u64(u64::from(self.boot.image.is_some()));
        h.str(self.boot.image.as_deref().unwrap_or(""));
        h.u64(self.boot.boot_check.len() as u64);
        for a in &self.boot.boot_check {
            h.str(a);
        }
        h.u64(self.boot.env.len() as u64);
        for (k, v) in &self.boot.env {
            h.str(k);
            h.str(v);
        }
        h.str(&self.role);
        h.u64(self.join.tags.len() as u64);
        for t in &self.join.tags {
            h.str(t);
        }
        h.u64(self.join.lost_grace_s.to_bits());
        h.u64(self.limits.endpoint_timeout_s.to_bits());
        // Hashed only when set, so templates recorded before the field
        // existed keep their digest (and their nodes).
        if self.limits.boot_timeout_s != default_boot_timeout_s() {
            h.u64(self.limits.boot_timeout_s.to_bits());
        }
        h.0
    }
}

/// FNV-1a, 64 bits.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
    fn bytes(&mut self, b: &[u8]) {
        for byte in b {
            self.0 ^= u64::from(*byte);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.bytes(s.as_bytes());
    }
    fn param(&mut self, v: &ParamValue) {
        match v {
            ParamValue::Bool(b) => {
                self.u64(1);
                self.u64(u64::from(*b));
            }
            ParamValue::Int(i) => {
                self.u64(2);
                self.u64(*i as u64);
            }
            ParamValue::Float(f) => {
                self.u64(3);
                self.u64(f.to_bits());
            }
            ParamValue::Str(s) => {
                self.u64(4);
                self.str(s);
            }
            ParamValue::List(items) => {
                self.u64(5);
                self.u64(items.len() as u64);
                for i in items {
                    self.param(i);
                }
            }
        }
    }
}

/// True when two templates make the same node (pointer fast path first):
/// equal in everything but the provider's placement, so a node placed under
/// one is not replaced for the other.
#[inline]
pub fn same_template(a: &Arc<NodeTemplate>, b: &Arc<NodeTemplate>) -> bool {
    Arc::ptr_eq(a, b) || a.makes_same_node_as(b)
}

/// One validated, expanded group.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DesiredGroup {
    /// The group id.
    pub id: GroupId,
    /// How many slots it has.
    pub count: u32,
    /// The template every slot of the group is created from.
    pub template: Arc<NodeTemplate>,
    /// Its rollout and remediation budgets.
    #[serde(default)]
    pub policy: GroupPolicy,
}

/// One desired slot and the template it must run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LogicalNodeSpec {
    /// The slot.
    pub node: LogicalNodeId,
    /// What the slot must run.
    pub template: Arc<NodeTemplate>,
}

/// A validated shape, groups sorted by id; the form the decider reads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DesiredState {
    /// The run.
    pub run_id: RunId,
    /// The shape's generation.
    pub generation: Generation,
    /// Groups sorted by id.
    pub groups: Vec<DesiredGroup>,
}

impl DesiredState {
    /// An empty shape (no slots) for `run_id`, e.g. before the first apply or for teardown.
    pub fn empty(run_id: RunId, generation: Generation) -> Self {
        Self {
            run_id,
            generation,
            groups: Vec::new(),
        }
    }

    /// The template slot `node` must run, or `None` when the slot is not desired.
    pub fn slot(&self, node: &LogicalNodeId) -> Option<&Arc<NodeTemplate>> {
        let g = self.group(&node.group)?;
        (node.index < g.count).then_some(&g.template)
    }

    /// The desired group `id`, if there is one.
    pub fn group(&self, id: &GroupId) -> Option<&DesiredGroup> {
        self.groups
            .binary_search_by(|g| g.id.cmp(id))
            .ok()
            .map(|i| &self.groups[i])
    }

    /// Total number of desired slots.
    pub fn node_count(&self) -> u64 {
        self.groups.iter().map(|g| u64::from(g.count)).sum()
    }

    /// The most slots this desired state may have at once: every group's
    /// `count` and its whole `max_surge` (see [`surge`](crate::surge)).
    pub fn peak_node_count(&self) -> u64 {
        self.groups
            .iter()
            .map(|g| u64::from(g.count) + u64::from(g.policy.max_surge_of(g.count)))
            .sum()
    }

    /// Every desired slot, in slot order.
    pub fn specs(&self) -> impl Iterator<Item = LogicalNodeSpec> + '_ {
        self.groups.iter().flat_map(|g| {
            (0..g.count).map(move |i| LogicalNodeSpec {
                node: LogicalNodeId::new(g.id, i),
                template: g.template.clone(),
            })
        })
    }

    /// True when both describe the same slots with equal templates, placement
    /// included (generation ignored): a shape that only moves the placement
    /// is still a change, and needs its own generation.
    pub fn same_content(&self, other: &DesiredState) -> bool {
        self.run_id == other.run_id
            && self.groups.len() == other.groups.len()
            && self.groups.iter().zip(&other.groups).all(|(a, b)| {
                a.id == b.id
                    && a.count == b.count
                    && a.policy == b.policy
                    && (Arc::ptr_eq(&a.template, &b.template) || a.template == b.template)
            })
    }

    /// Reuses `previous`'s template allocations for unchanged groups, so that
    /// drift checks on a settled cluster stay pointer comparisons.
    pub fn share_templates_with(&mut self, previous: &DesiredState) {
        for g in &mut self.groups {
            if let Ok(i) = previous.groups.binary_search_by(|p| p.id.cmp(&g.id)) {
                let p = &previous.groups[i];
                if *p.template == *g.template {
                    g.template = p.template.clone();
                    g.id = p.id;
                }
            }
        }
    }
}

impl ClusterShape {
    /// Nodes the shape asks for, over all groups.
    pub fn node_count(&self) -> u64 {
        self.groups.iter().map(|g| u64::from(g.count)).sum()
    }

    /// Validates the shape and expands it into the decider's form.
    ///
    /// # Errors
    /// The first problem found, naming the field (`groups[2].count`, ...).
    pub fn validate(&self) -> Result<DesiredState, ShapeError> {
        validate_id(self.run_id.as_str()).map_err(|source| ShapeError::RunId {
            value: self.run_id.as_str().to_owned(),
            source,
        })?;
        if self.groups.len() > GROUPS_MAX {
            return Err(ShapeError::TooManyGroups {
                count: self.groups.len(),
            });
        }
        let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
        let mut total = 0u64;
        let mut groups = Vec::with_capacity(self.groups.len());
        for (index, g) in self.groups.iter().enumerate() {
            self.check_group_identity(index, g, &mut seen)?;
            groups.push(g.validate_at(index)?);
            total += u64::from(g.count);
        }
        if total > SHAPE_NODES_MAX {
            return Err(ShapeError::TooManyNodes { total });
        }
        groups.sort_by_key(|a| a.id);
        Ok(DesiredState {
            run_id: self.run_id.clone(),
            generation: self.generation,
            groups,
        })
    }

    /// Refuses a malformed group id, one an earlier group has (`seen`), or another run's group.
    fn check_group_identity<'a>(
        &self,
        index: usize,
        g: &'a GroupShape,
        seen: &mut BTreeMap<&'a str, usize>,
    ) -> Result<(), ShapeError> {
        validate_id(&g.id).map_err(|source| ShapeError::GroupId {
            index,
            value: g.id.clone(),
            source,
        })?;
        if let Some(&first) = seen.get(g.id.as_str()) {
            return Err(ShapeError::DuplicateGroup {
                index,
                first,
                id: g.id.clone(),
            });
        }
        seen.insert(&g.id, index);
        if let Some(r) = g.run_id.as_ref().filter(|r| **r != self.run_id) {
            return Err(ShapeError::ForeignGroup {
                index,
                group_run: r.as_str().to_owned(),
                run: self.run_id.as_str().to_owned(),
            });
        }
        Ok(())
    }
}

impl GroupShape {
    /// Validates this group, the shape's `index`th, and expands it into the decider's form.
    fn validate_at(&self, index: usize) -> Result<DesiredGroup, ShapeError> {
        let id = || self.id.clone();
        if self.count > GROUP_COUNT_MAX {
            return Err(ShapeError::CountTooLarge {
                index,
                id: id(),
                count: self.count,
            });
        }
        let empty = |field| ShapeError::EmptyField {
            index,
            id: id(),
            field,
        };
        if self.provider.kind.is_empty() {
            return Err(empty(GroupField::ProviderKind));
        }
        if self.role.is_empty() {
            return Err(empty(GroupField::Role));
        }
        self.check_numbers(index)?;
        self.check_percents(index)?;
        Ok(DesiredGroup {
            id: GroupId::new(&self.id),
            count: self.count,
            policy: self.policy.resolve(),
            template: Arc::new(NodeTemplate {
                provider: self.provider.clone(),
                boot: self.boot.clone(),
                role: self.role.clone(),
                join: self.join.clone(),
                limits: self.limits.clone(),
            }),
        })
    }

    /// Refuses a non-finite parameter or placement number, and a grace or timeout out of range.
    fn check_numbers(&self, index: usize) -> Result<(), ShapeError> {
        let bad_number = |field, value: f64, range| ShapeError::BadNumber {
            index,
            id: self.id.clone(),
            field,
            value: value.to_string(),
            range,
        };
        for (k, v) in &self.provider.params {
            check_param(k.clone(), v, &|path, f| {
                bad_number(GroupField::Param(path), f, "")
            })?;
        }
        for (k, v) in &self.provider.placement {
            check_param(k.clone(), v, &|path, f| {
                bad_number(GroupField::Placement(path), f, "")
            })?;
        }
        let grace = self.join.lost_grace_s;
        if !grace.is_finite() || grace < 0.0 {
            return Err(bad_number(GroupField::LostGraceS, grace, " >= 0"));
        }
        let endpoint_timeout = self.limits.endpoint_timeout_s;
        if !endpoint_timeout.is_finite() || endpoint_timeout <= 0.0 {
            return Err(bad_number(
                GroupField::EndpointTimeoutS,
                endpoint_timeout,
                " > 0",
            ));
        }
        let boot_timeout = self.limits.boot_timeout_s;
        if !boot_timeout.is_finite() || boot_timeout <= 0.0 {
            return Err(bad_number(GroupField::BootTimeoutS, boot_timeout, " > 0"));
        }
        Ok(())
    }

    /// Refuses a policy percentage above [`PERCENT_MAX`].
    fn check_percents(&self, index: usize) -> Result<(), ShapeError> {
        let policy = [
            (GroupField::MaxUnavailable, self.policy.max_unavailable),
            (GroupField::MaxSurge, self.policy.max_surge),
            (GroupField::MaxUnhealthy, self.policy.max_unhealthy),
        ];
        for (field, q) in policy {
            if let Some(Quantity::Percent(p)) = q
                && p > PERCENT_MAX
            {
                return Err(ShapeError::BadPercent {
                    index,
                    id: self.id.clone(),
                    field,
                    value: format!("{p}%"),
                });
            }
        }
        Ok(())
    }
}

/// Refuses a NaN or infinite number anywhere in `v`, found at `path`
/// (`name`, or `name[i]` for an item of a list), with `bad`'s error.
fn check_param(
    path: String,
    v: &ParamValue,
    bad: &dyn Fn(String, f64) -> ShapeError,
) -> Result<(), ShapeError> {
    match v {
        ParamValue::Float(f) if !f.is_finite() => Err(bad(path, *f)),
        ParamValue::List(items) => items
            .iter()
            .enumerate()
            .try_for_each(|(i, item)| check_param(format!("{path}[{i}]"), item, bad)),
        _ => Ok(()),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn group(id: &str, count: u32) -> GroupShape {
        GroupShape {
            id: id.to_owned(),
            run_id: None,
            count,
            provider: ProviderShape {
                kind: "fake".to_owned(),
                params: BTreeMap::new(),
                placement: Default::default(),
            },
            boot: BootParams::default(),
            role: "worker".to_owned(),
            join: SwarmJoin::default(),
            limits: NodeLimits::default(),
            policy: PolicyShape::default(),
        }
    }

    pub(crate) fn shape(generation: u64, groups: Vec<GroupShape>) -> ClusterShape {
        ClusterShape {
            run_id: RunId::new("run"),
            generation: Generation(generation),
            groups,
            capacity: None,
            budget: None,
            lifetime: Default::default(),
        }
    }

    #[test]
    fn a_shape_expands_to_one_spec_per_slot_named_group_dash_index() {
        let d = shape(1, vec![group("worker", 3), group("coord", 1)])
            .validate()
            .unwrap();
        let names: Vec<String> = d.specs().map(|s| s.node.to_string()).collect();
        assert_eq!(names, ["coord-0", "worker-0", "worker-1", "worker-2"]);
        assert_eq!(d.node_count(), 4);
        assert!(d.slot(&LogicalNodeId::parse("worker-2").unwrap()).is_some());
        assert!(d.slot(&LogicalNodeId::parse("worker-3").unwrap()).is_none());
        assert!(d.slot(&LogicalNodeId::parse("other-0").unwrap()).is_none());
    }

    #[test]
    fn validation_names_the_offending_field() {
        let mut s = shape(1, vec![group("ok", 1), group("Bad", 1)]);
        let e = s.validate().unwrap_err();
        assert!(e.to_string().starts_with("groups[1].id \"Bad\""), "{e}");

        s.groups[1].id = "ok".into();
        assert!(matches!(
            s.validate(),
            Err(ShapeError::DuplicateGroup {
                index: 1,
                first: 0,
                ..
            })
        ));

        s.groups[1].id = "two".into();
        s.groups[1].run_id = Some(RunId::new("elsewhere"));
        let e = s.validate().unwrap_err();
        assert!(
            matches!(e, ShapeError::ForeignGroup { index: 1, .. }),
            "{e}"
        );

        s.groups[1].run_id = None;
        s.groups[1].count = GROUP_COUNT_MAX + 1;
        assert!(matches!(
            s.validate(),
            Err(ShapeError::CountTooLarge { index: 1, .. })
        ));

        s.groups[1].count = 1;
        s.groups[1]
            .provider
            .params
            .insert("gpu_ram".into(), ParamValue::Float(f64::NAN));
        let e = s.validate().unwrap_err();
        assert_eq!(
            e.to_string(),
            "groups[1].provider.params.gpu_ram is NaN; it must be a finite number"
        );

        s.groups[1].provider.params.clear();
        s.groups[1].join.lost_grace_s = f64::INFINITY;
        let e = s.validate().unwrap_err();
        assert!(
            e.to_string()
                .starts_with("groups[1].join.lost_grace_s is inf"),
            "{e}"
        );

        s.groups[1].join.lost_grace_s = 1.0;
        s.groups[1].limits.boot_timeout_s = 0.0;
        assert!(
            s.validate()
                .unwrap_err()
                .to_string()
                .starts_with("groups[1].limits.boot_timeout_s is 0"),
        );
        s.groups[1].limits.boot_timeout_s = 30.0;
        s.groups[1].provider.kind.clear();
        assert_eq!(
            s.validate().unwrap_err().to_string(),
            "groups[1].provider.kind must not be empty"
        );

        let mut s = shape(1, vec![]);
        s.run_id = RunId::new("");
        assert_eq!(
            s.validate().unwrap_err().to_string(),
            "run_id \"\" is empty"
        );
    }

    #[test]
    fn a_group_error_carries_the_groups_id_and_the_field_apart_from_its_path() {
        let mut s = shape(1, vec![group("ok", 1), group("worker", 1)]);
        s.groups[1].join.lost_grace_s = -1.0;
        let e = s.validate().unwrap_err();
        assert_eq!(
            e,
            ShapeError::BadNumber {
                index: 1,
                id: "worker".into(),
                field: GroupField::LostGraceS,
                value: "-1".into(),
                range: " >= 0",
            }
        );
        // Programmatic users keep the shape's own path.
        assert!(
            e.to_string()
                .starts_with("groups[1].join.lost_grace_s is -1"),
            "{e}"
        );
        s.groups[1].join.lost_grace_s = 1.0;
        s.groups[1].provider.params.insert(
            "xs".into(),
            ParamValue::List(vec![ParamValue::Float(f64::NAN)]),
        );
        assert!(matches!(
            s.validate(),
            Err(ShapeError::BadNumber { field: GroupField::Param(p), id, .. })
                if p == "xs[0]" && id == "worker"
        ));
        s.groups[1].provider.params.clear();
        s.groups[1].role.clear();
        assert!(matches!(
            s.validate(),
            Err(ShapeError::EmptyField {
                index: 1,
                field: GroupField::Role,
                ..
            })
        ));
    }

    #[test]
    fn a_param_value_shows_as_toml_and_a_long_list_is_cut() {
        let v = ParamValue::List(vec![
            ParamValue::Str("gpu".into()),
            ParamValue::Int(2),
            ParamValue::Float(1.0),
            ParamValue::Bool(true),
        ]);
        assert_eq!(v.to_string(), r#"["gpu", 2, 1.0, true]"#);
        let long = ParamValue::List((0..1000).map(ParamValue::Int).collect());
        assert_eq!(long.to_string(), "[0, 1, 2, 3, 4, 5, 6, 7, … (1000 items)]");
    }

    #[test]
    fn a_default_boot_timeout_leaves_the_digest_as_it_was_before_the_field() {
        let mut s = shape(1, vec![group("w", 1)]);
        let before = s.validate().unwrap().groups[0].template.digest();
        s.groups[0].limits.boot_timeout_s = 300.0;
        assert_eq!(s.validate().unwrap().groups[0].template.digest(), before);
        s.groups[0].limits.boot_timeout_s = 30.0;
        assert_ne!(s.validate().unwrap().groups[0].template.digest(), before);
    }

    #[test]
    fn budgets_are_checked_and_a_surge_may_keep_every_node_up() {
        let mut s = shape(1, vec![group("w", 4)]);
        assert_eq!(
            s.validate().unwrap().groups[0].policy,
            GroupPolicy::default()
        );
        s.groups[0].policy.max_unavailable = Some(Quantity::Percent(101));
        assert_eq!(
            s.validate().unwrap_err().to_string(),
            "groups[0].max_unavailable is 101%; a percentage must be between 0% and 100%"
        );
        s.groups[0].policy.max_unavailable = Some(Quantity::Count(0));
        s.groups[0].policy.max_surge = Some(Quantity::Count(1));
        let d = s.validate().unwrap();
        assert_eq!(d.groups[0].policy.max_unavailable_of(4), 0);
        assert_eq!(d.groups[0].policy.max_surge_of(4), 1);
        s.groups[0].policy.max_surge = Some(Quantity::Percent(101));
        assert_eq!(
            s.validate().unwrap_err().to_string(),
            "groups[0].max_surge is 101%; a percentage must be between 0% and 100%"
        );
        s.groups[0].policy.max_unavailable = Some(Quantity::Percent(50));
        s.groups[0].policy.max_surge = Some(Quantity::Percent(0));
        let d = s.validate().unwrap();
        assert_eq!(d.groups[0].policy.max_unavailable_of(4), 2);
    }

    #[test]
    fn a_budget_change_is_a_change_of_content_but_not_of_template() {
        let a = shape(1, vec![group("w", 2)]).validate().unwrap();
        let mut s = shape(2, vec![group("w", 2)]);
        s.groups[0].policy.max_unhealthy = Some(Quantity::Count(1));
        let b = s.validate().unwrap();
        assert!(!a.same_content(&b));
        assert!(same_template(&a.groups[0].template, &b.groups[0].template));
    }

    #[test]
    fn total_node_count_is_limited() {
        let groups = (0..11)
            .map(|i| group(&format!("g{i}"), GROUP_COUNT_MAX))
            .collect();
        assert!(matches!(
            shape(1, groups).validate(),
            Err(ShapeError::TooManyNodes { total: 1_100_000 })
        ));
    }

    #[test]
    fn nested_list_params_are_checked_for_finiteness() {
        let mut s = shape(1, vec![group("g", 1)]);
        s.groups[0].provider.params.insert(
            "xs".into(),
            ParamValue::List(vec![
                ParamValue::Int(1),
                ParamValue::Float(f64::NEG_INFINITY),
            ]),
        );
        assert!(
            s.validate()
                .unwrap_err()
                .to_string()
                .starts_with("groups[0].provider.params.xs[1]")
        );
    }
}
