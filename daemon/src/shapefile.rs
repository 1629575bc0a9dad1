//! Shape files: the TOML a user writes, turned into a cluster shape.
//!
//! Over 1,000 lines in one file with its tests: the code is about 810 lines;
//! the rest are the unit tests of every refusal's wording, kept next to the
//! code they check.

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use swactor_provisioning::budget::{Budget, OnBudget};
use swactor_provisioning::lifetime::Lifetime;
use swactor_provisioning::{
    BootParams, Capacity, CapacityBasis, ClusterShape, DesiredState, GROUP_COUNT_MAX, Generation,
    GroupField, GroupShape, NodeLimits, ParamValue, PolicyShape, PreemptChoice, ProviderShape,
    Quantity, RunId, ShapeError, SwarmJoin, UpdateError,
};
use toml::Spanned;

use crate::words::{cut, cut_long_words};
use swactor_actors::{ApplyError, ClusterError};

/// Provider kinds whose groups list the hosts their nodes go to.
pub const PLACED_ON_HOSTS: &[&str] = &["ssh"];

/// Provider kinds this daemon can drive.
pub const SUPPORTED_PROVIDERS: &[&str] = &["process", "ssh", "docker", "vast"];

/// A shape as written in a file: the generation is optional (the daemon
/// assigns the next one on apply, as a Kubernetes API server does).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShapeFile {
    /// The run; required ([`ShapeFile::check`] refuses a file without one),
    /// optional here so that its absence gets a message of its own.
    #[serde(default)]
    pub run: Option<String>,
    /// An explicit generation, if the author wants one.
    #[serde(default)]
    pub generation: Option<u64>,
    /// The most nodes this shape may hold, overriding the provider's own
    /// estimate (e.g. this machine's memory for local processes).
    #[serde(default)]
    pub capacity: Option<u64>,
    /// Dollars the run may spend on rented machines (Vast.ai), storage
    /// included; at the budget the run is torn down, or paused.
    #[serde(default)]
    pub budget_usd: Option<f64>,
    /// What reaching `budget_usd` does: `"down"` (the default) or `"pause"`.
    #[serde(default)]
    pub on_budget: Option<String>,
    /// Seconds after the apply that sets it at which the run tears itself
    /// down (0 or absent: never); every later apply that sets it starts
    /// it again.
    #[serde(default)]
    pub max_lifetime_s: Option<f64>,
    /// Seconds with no job running after which the run tears itself down
    /// (0 or absent: never), counted from the later of the last apply and
    /// the end of the last job.
    #[serde(default)]
    pub idle_teardown_s: Option<f64>,
    /// The node groups.
    #[serde(default, rename = "group")]
    pub groups: Vec<GroupFile>,
    /// Provider kinds its groups may name besides the built-in ones: those
    /// of the providers an embedding program brings
    /// ([`crate::daemon::EmbeddedProvider`]). Set by the daemon that reads
    /// the file, never written in it.
    #[serde(skip)]
    pub(crate) more_providers: Vec<&'static str>,
}

/// One group as written in a file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupFile {
    /// Group id; nodes are named `{id}-{index}`.
    pub id: String,
    /// How many nodes.
    pub count: u32,
    /// The provider kind (`process`).
    pub provider: String,
    /// Provider parameters.
    #[serde(default)]
    pub params: BTreeMap<String, ParamValue>,
    /// The role (`worker` by default); recorded with the template.
    #[serde(default)]
    pub role: Option<String>,
    /// A command the agent runs to check the node is fit, as argv.
    #[serde(default)]
    pub boot_check: Vec<String>,
    /// A machine image, for providers that take one.
    #[serde(default)]
    pub image: Option<String>,
    /// Environment for the agent.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Tags recorded with the template (nothing acts on them yet).
    #[serde(default)]
    pub tags: BTreeSet<String>,
    /// Seconds a joined agent may be gone before its node is replaced.
    #[serde(default)]
    pub lost_grace_s: Option<f64>,
    /// Seconds a leased machine may take to report a reachable endpoint.
    #[serde(default)]
    pub endpoint_timeout_s: Option<f64>,
    /// Seconds the boot check may run before the agent stops it.
    #[serde(default)]
    pub boot_timeout_s: Option<f64>,
    /// Where nodes may be placed (`ssh`: the pool's hosts, `user@host:port`,
    /// each maybe with labels). Changing it moves no node already placed.
    #[serde(default)]
    pub hosts: Vec<HostEntry>,
    /// Most nodes a template change may have unavailable at once: a count
    /// or `"25%"` (default 1). Changing it replaces no node.
    #[serde(default)]
    pub max_unavailable: Option<Quantity>,
    /// Extra nodes a rollout may make; only 0 is supported.
    #[serde(default)]
    pub max_surge: Option<Quantity>,
    /// Most unhealthy nodes before lost ones stop being replaced: a count
    /// or `"40%"` (default: no limit). Changing it replaces no node.
    #[serde(default)]
    pub max_unhealthy: Option<Quantity>,
    /// What becomes of a node whose rented machine the provider paused (an
    /// interruptible Vast.ai instance that was outbid): `"replace"` (the
    /// default) or `"wait"`. Changing it replaces no node.
    #[serde(default)]
    pub on_preempt: Option<PreemptChoice>,
    /// With `on_preempt = "wait"`: seconds a paused machine is waited for
    /// before its node is replaced (default 600).
    #[serde(default)]
    pub preempt_wait_s: Option<u32>,
    /// Seconds a node's agent keeps the node once its daemon has stopped
    /// renewing its lease, then ends it by itself (default 3600; 0: never).
    /// Changing it replaces no node.
    #[serde(default)]
    pub orphan_after_s: Option<u32>,
    /// `"always"` (the default): the lease counts from the last renewal;
    /// `"idle"`: a node running a job waits for it to end and counts from
    /// then. Changing it replaces no node.
    #[serde(default)]
    pub orphan_policy: Option<swactor_provisioning::OrphanPolicy>,
    /// Jobs one node runs at once (default 1); a job that finds every
    /// node it may use busy waits in the queue. Changing it replaces no node.
    #[serde(default)]
    pub jobs_per_node: Option<u32>,
    /// GPUs each node has, told to jobs as `SWACTOR_GPUS_PER_NODE` (else
    /// what each node reports). Changing it replaces no node.
    #[serde(default)]
    pub gpus: Option<u32>,
}

/// One host of a pool: `"user@host:port"`, or
/// `{ host = "user@host:port", labels = ["gpu", …] }`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum HostEntry {
    /// A host without labels.
    Plain(String),
    /// A host with labels, handed to its agents in `SWACTOR_HOST_LABELS`.
    Labelled(LabelledHost),
}

/// A host of an `ssh` group's `hosts`, with the labels its agents get.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LabelledHost {
    host: String,
    #[serde(default)]
    labels: Vec<String>,
}

impl HostEntry {
    fn host(&self) -> &str {
        match self {
            Self::Plain(h) => h,
            Self::Labelled(l) => &l.host,
        }
    }

    fn labels(&self) -> &[String] {
        match self {
            Self::Plain(_) => &[],
            Self::Labelled(l) => &l.labels,
        }
    }
}

/// A group's placement: `hosts`, and `labels` (a list per host) when any
/// host has labels.
fn placement(hosts: &[HostEntry]) -> BTreeMap<String, ParamValue> {
    let mut placement = BTreeMap::new();
    if hosts.is_empty() {
        return placement;
    }
    let list = |items: Vec<ParamValue>| ParamValue::List(items);
    placement.insert(
        "hosts".to_owned(),
        list(
            hosts
                .iter()
                .map(|h| ParamValue::Str(h.host().to_owned()))
                .collect(),
        ),
    );
    if hosts.iter().any(|h| !h.labels().is_empty()) {
        let labels = hosts
            .iter()
            .map(|h| list(h.labels().iter().cloned().map(ParamValue::Str).collect()))
            .collect();
        placement.insert("labels".to_owned(), list(labels));
    }
    placement
}

impl ShapeFile {
    /// Parses TOML; errors name the line and column and, for a value of
    /// the wrong type or an unknown key, the group and the key as the file
    /// writes them (`group "worker": count must be a whole number, not "lots"`).
    ///
    /// # Errors
    /// Malformed TOML, an unknown key or a value of the wrong type.
    pub fn parse(text: &str, origin: &str) -> Result<Self> {
        toml::from_str(text).map_err(|e| {
            let (line, col) = e.span().map(|s| line_col(text, s.start)).unwrap_or((0, 0));
            let message =
                in_file_words(text, &e).unwrap_or_else(|| e.message().trim_end().to_owned());
            anyhow::anyhow!(
                "{origin}:{line}:{col}: {message} (the shape file is not valid; nothing was changed)"
            )
        })
    }

    /// Reads and parses a shape file.
    ///
    /// # Errors
    /// The file cannot be read or parsed.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the shape file {}", path.display()))?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Lets its groups name `kinds` too: the providers an embedding program
    /// brings to the daemon that reads this file.
    pub(crate) fn allow_providers(&mut self, kinds: &[&'static str]) {
        self.more_providers = kinds.to_vec();
    }

    /// The run this file is for (empty when it names none, which
    /// [`ShapeFile::check`] refuses).
    pub fn run_id(&self) -> RunId {
        RunId::new(self.run.clone().unwrap_or_default())
    }

    /// The cluster shape at `generation` (the file's own one wins if it has one).
    ///
    /// # Errors
    /// A provider kind this daemon cannot drive.
    pub fn to_shape(&self, generation: u64) -> Result<ClusterShape> {
        let budget = match (self.budget_usd, self.on_budget.as_deref()) {
            (None, None) => None,
            (None, Some(_)) => bail!(
                "on_budget is set but budget_usd is not: name the budget (`budget_usd = 50.0`), \
                 or drop on_budget"
            ),
            (Some(usd), on) => {
                let on = on
                    .map(OnBudget::parse)
                    .transpose()
                    .map_err(anyhow::Error::msg)?
                    .unwrap_or_default();
                Some(Budget::of_usd(usd, on).map_err(anyhow::Error::msg)?)
            }
        };
        let lifetime = Lifetime::of_seconds(self.max_lifetime_s, self.idle_teardown_s)
            .map_err(anyhow::Error::msg)?;
        for (i, g) in self.groups.iter().enumerate() {
            let kind = g.provider.as_str();
            if !SUPPORTED_PROVIDERS.contains(&kind) && !self.more_providers.contains(&kind) {
                let supported: Vec<&str> = SUPPORTED_PROVIDERS
                    .iter()
                    .chain(&self.more_providers)
                    .copied()
                    .collect();
                bail!(
                    "{}: provider {:?} is not one this daemon can drive; supported: {}",
                    group_name(i, Some(&g.id)),
                    cut(&g.provider),
                    supported.join(", ")
                );
            }
            if g.jobs_per_node == Some(0) {
                bail!(
                    "{}: jobs_per_node = 0 would never run a job; it must be at least 1",
                    group_name(i, Some(&g.id)),
                );
            }
            if !g.hosts.is_empty() && !PLACED_ON_HOSTS.contains(&g.provider.as_str()) {
                bail!(
                    "{}: lists `hosts`, which provider {:?} does not use (only {} does)",
                    group_name(i, Some(&g.id)),
                    cut(&g.provider),
                    PLACED_ON_HOSTS.join(", ")
                );
            }
        }
        let groups = self
            .groups
            .iter()
            .map(|g| GroupShape {
                id: g.id.clone(),
                run_id: None,
                count: g.count,
                provider: ProviderShape {
                    kind: g.provider.clone(),
                    params: g.params.clone(),
                    placement: placement(&g.hosts),
                },
                boot: BootParams {
                    image: g.image.clone(),
                    boot_check: g.boot_check.clone(),
                    env: g.env.clone(),
                },
                role: g.role.clone().unwrap_or_else(|| "worker".to_owned()),
                join: SwarmJoin {
                    tags: g.tags.clone(),
                    lost_grace_s: g.lost_grace_s.unwrap_or(SwarmJoin::default().lost_grace_s),
                },
                limits: NodeLimits {
                    endpoint_timeout_s: g
                        .endpoint_timeout_s
                        .unwrap_or(NodeLimits::default().endpoint_timeout_s),
                    boot_timeout_s: g
                        .boot_timeout_s
                        .unwrap_or(NodeLimits::default().boot_timeout_s),
                },
                policy: PolicyShape {
                    max_unavailable: g.max_unavailable,
                    max_surge: g.max_surge,
                    max_unhealthy: g.max_unhealthy,
                    on_preempt: g.on_preempt,
                    preempt_wait_s: g.preempt_wait_s,
                    orphan_after_s: g.orphan_after_s,
                    orphan_policy: g.orphan_policy,
                    jobs_per_node: g.jobs_per_node,
                    gpus: g.gpus,
                },
            })
            .collect();
        Ok(ClusterShape {
            run_id: self.run_id(),
            generation: Generation(self.generation.unwrap_or(generation)),
            groups,
            capacity: self.capacity,
            budget,
            lifetime,
        })
    }
}

impl ShapeFile {
    /// Everything about the file that needs no daemon: it names its run, every
    /// provider kind is one this daemon drives, the shape is valid, and it
    /// asks for at least one node. Returns the shape at `generation` (the
    /// file's own generation wins).
    ///
    /// An empty shape is refused rather than taken to mean "remove
    /// everything": a truncated or half-written file must never tear a
    /// cluster down. `swactor down` is how to do that.
    ///
    /// # Errors
    /// The first of those that fails, in words that name the field; nothing
    /// was changed.
    pub fn check(&self, generation: u64) -> Result<ClusterShape> {
        if self.run.is_none() {
            bail!(
                "the shape names no run: add a top-level `run = \"NAME\"` (a daemon serves \
                 one run, and the name must match it); nothing was changed"
            );
        }
        let shape = self.to_shape(generation)?;
        let desired = shape.validate().map_err(|e| {
            anyhow::anyhow!(
                "the shape is invalid: {}; nothing was changed",
                shape_error(&e)
            )
        })?;
        // The spend cap is the run's: every vast group that names one must
        // name the same.
        let mut spend_cap: Option<(f64, String)> = None;
        for g in &desired.groups {
            let checked = match g.template.provider.kind.as_str() {
                "process" => swactor_providers::process::check_template(&g.template),
                "ssh" => swactor_providers::ssh::check_template(&g.template),
                "docker" => swactor_providers::docker::check_template(&g.template),
                "vast" => swactor_providers::vast::check_template(&g.template),
                _ => Ok(()),
            };
            checked.map_err(|e| {
                anyhow::anyhow!("group {:?}: {e}; nothing was changed", cut(g.id.as_str()))
            })?;
            if g.template.provider.kind == "vast"
                && let Some(cap) = swactor_providers::vast::spend_cap_of(&g.template)
            {
                match &spend_cap {
                    Some((first, by)) if (first - cap).abs() > 1e-9 => bail!(
                        "group {:?} sets spend_cap_dph = {cap} but group {by:?} sets {first}: the cap \
                         covers the whole run, so every vast group that sets it must set the \
                         same value; nothing was changed",
                        cut(g.id.as_str())
                    ),
                    Some(_) => {}
                    None => spend_cap = Some((cap, cut(g.id.as_str()).to_string())),
                }
            }
        }
        for g in &self.groups {
            let interruptible = g.provider == "vast"
                && g.params.get("rental") == Some(&ParamValue::Str("interruptible".to_owned()));
            match (g.on_preempt, g.preempt_wait_s) {
                (Some(PreemptChoice::Wait), _) if !interruptible => bail!(
                    "group {:?}: on_preempt = \"wait\" is for machines a provider pauses and \
                     resumes, and only vast's interruptible rentals are (`provider = \"vast\"` \
                     with `params.rental = \"interruptible\"`); drop it or rent interruptible \
                     machines; nothing was changed",
                    cut(&g.id)
                ),
                (Some(PreemptChoice::Wait), _) | (_, None) => {}
                (_, Some(_)) => bail!(
                    "group {:?}: preempt_wait_s is how long on_preempt = \"wait\" waits, and \
                     on_preempt is not \"wait\" here; set on_preempt = \"wait\" or drop \
                     preempt_wait_s; nothing was changed",
                    cut(&g.id)
                ),
            }
        }
        if shape.budget.is_some()
            && !desired
                .groups
                .iter()
                .any(|g| g.template.provider.kind == "vast")
        {
            bail!(
                "budget_usd counts what machines rented by the hour cost, and this shape rents \
                 none (no vast group): drop budget_usd, or add a vast group; nothing was changed"
            );
        }
        if desired.node_count() == 0 {
            let why = if self.groups.is_empty() {
                "it declares no group"
            } else {
                "every group's count is 0"
            };
            bail!(
                "the shape asks for no nodes ({why}); it is refused so that an empty or \
                 truncated file never tears a cluster down. To remove every node, use \
                 `swactor down`. Nothing was changed"
            );
        }
        Ok(shape)
    }
}

/// What a shape is checked against before any daemon is asked: the
/// capacities providers set of their own accord, as a daemon's providers
/// report them ([`swactor_providers::Provider::capacity`]). Only `process`
/// sets one (this machine's memory); the others leave the limit to the
/// shape's own `capacity`.
pub fn offline_capacities() -> Vec<Capacity> {
    swactor_providers::process::machine_capacity()
        .into_iter()
        .collect()
}

/// A refusal from the cluster in words: an over-capacity shape names its
/// numbers, ids echoed back are cut.
pub fn refusal(e: &ClusterError) -> String {
    match e {
        ClusterError::Apply(ApplyError::OverCapacity {
            nodes,
            surge,
            capacity,
            basis: CapacityBasis::Shape,
        }) => format!(
            "the shape asks for {nodes} nodes{surge}, more than its own `capacity` of \
             {capacity}; nothing was changed"
        ),
        ClusterError::Apply(ApplyError::OverCapacity {
            nodes,
            surge,
            capacity,
            basis: CapacityBasis::Provider(basis),
        }) => format!(
            "the shape asks for {nodes} nodes{surge}, but {basis} allows at most {capacity}; \
             nothing was changed (a top-level `capacity = N` in the shape allows more)"
        ),
        ClusterError::Apply(ApplyError::Update(UpdateError::Invalid(e))) => {
            format!(
                "the shape is invalid: {}; nothing was changed",
                shape_error(e)
            )
        }
        other => cut_long_words(&other.to_string()),
    }
}

/// The refusal, if `shape` would grow a cluster that holds `current` (a
/// journal's shape; `None` for a new cluster) past its own `capacity` or
/// past one of `capacities`: the check a running daemon makes of every
/// shape ([`swactor_provisioning::check_capacity`]), in the words it
/// answers with. A shape may always shrink.
pub fn capacity_refusal(
    shape: &ClusterShape,
    current: Option<&ClusterShape>,
    capacities: &[Capacity],
) -> Option<String> {
    let now = current
        .and_then(|s| s.validate().ok())
        .unwrap_or_else(|| DesiredState::empty(shape.run_id.clone(), Generation(0)));
    let refused = swactor_provisioning::check_capacity(shape, &now, capacities).err()?;
    Some(refusal(&swactor_actors::ClusterError::Apply(
        refused.into(),
    )))
}

/// A group as messages name it: `group "worker"`, or by its place in the
/// file when it has no id to go by (`the 2nd [[group]]`).
fn group_name(index: usize, id: Option<&str>) -> String {
    match id {
        Some(id) if !id.is_empty() => format!("group {:?}", cut(id)),
        _ => format!("the {} [[group]]", ordinal(index + 1)),
    }
}

/// `1st`, `2nd`, `3rd`, `4th`, …, `11th`, `21st`.
fn ordinal(n: usize) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

/// A group's field as the shape file writes it, where [`GroupField`] names
/// it as [`GroupShape`] holds it (`join.lost_grace_s` is `lost_grace_s`).
fn file_key(field: &GroupField) -> String {
    match field {
        GroupField::ProviderKind => "provider".to_owned(),
        GroupField::Role => "role".to_owned(),
        GroupField::Param(path) => format!("params.{path}"),
        // `hosts` (and labels, which only strings fill) are written in the group.
        GroupField::Placement(path) => path.clone(),
        GroupField::LostGraceS => "lost_grace_s".to_owned(),
        GroupField::EndpointTimeoutS => "endpoint_timeout_s".to_owned(),
        GroupField::BootTimeoutS => "boot_timeout_s".to_owned(),
        GroupField::MaxUnavailable => "max_unavailable".to_owned(),
        GroupField::MaxSurge => "max_surge".to_owned(),
        GroupField::MaxUnhealthy => "max_unhealthy".to_owned(),
    }
}

/// A shape error in the shape file's words: a group by its id, a field by
/// its key in the file, any value it echoes cut to a readable length.
pub fn shape_error(e: &ShapeError) -> String {
    match e {
        ShapeError::RunId { value, source } => format!("run {:?} {source}", cut(value)),
        ShapeError::GroupId {
            index,
            value,
            source,
        } => format!(
            "the id {:?} of the {} [[group]] {source}",
            cut(value),
            ordinal(index + 1)
        ),
        ShapeError::DuplicateGroup { index, first, id } => format!(
            "group {:?} is declared twice (the {} and the {} [[group]]); each group needs an id \
             of its own",
            cut(id),
            ordinal(first + 1),
            ordinal(index + 1)
        ),
        ShapeError::CountTooLarge { index, id, count } => format!(
            "{}: count is {count}; a group may have at most {GROUP_COUNT_MAX}",
            group_name(*index, Some(id))
        ),
        ShapeError::BadNumber {
            index,
            id,
            field,
            value,
            range,
        } => {
            let finite = value.parse::<f64>().is_ok_and(f64::is_finite);
            format!(
                "{}: {} must be a {}number{range} (got {})",
                group_name(*index, Some(id)),
                file_key(field),
                if finite { "" } else { "finite " },
                value.to_lowercase()
            )
        }
        ShapeError::EmptyField { index, id, field } => format!(
            "{}: {} must not be empty",
            group_name(*index, Some(id)),
            file_key(field)
        ),
        ShapeError::BadPercent {
            index,
            id,
            field,
            value,
        } => format!(
            "{}: {} must be a percentage from 0% to 100% (got {value})",
            group_name(*index, Some(id)),
            file_key(field)
        ),
        other => crate::words::cut_long_words(&other.to_string()),
    }
}

/// A TOML document as where each of its keys and values is, read again
/// after a typed parse failed to find what its error points at.
enum Spot {
    Table(Vec<(Spanned<String>, Spanned<Spot>)>),
    List(Vec<Spanned<Spot>>),
    Str(String),
    Other,
}

impl<'de> Deserialize<'de> for Spot {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Any;
        impl<'de> serde::de::Visitor<'de> for Any {
            type Value = Spot;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("any TOML value")
            }
            fn visit_bool<E>(self, _: bool) -> Result<Spot, E> {
                Ok(Spot::Other)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Spot, E> {
                Ok(Spot::Other)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Spot, E> {
                Ok(Spot::Other)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Spot, E> {
                Ok(Spot::Other)
            }
            fn visit_str<E>(self, s: &str) -> Result<Spot, E> {
                Ok(Spot::Str(s.to_owned()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Spot, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Spot::List(items))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Spot, A::Error> {
                let mut entries = Vec::new();
                while let Some(key) = map.next_key()? {
                    entries.push((key, map.next_value()?));
                }
                Ok(Spot::Table(entries))
            }
        }
        d.deserialize_any(Any)
    }
}

/// One step of a path into a document: a key, or an item of a list.
enum Step<'a> {
    Key(&'a str),
    Item(usize),
}

/// The path to the innermost key or value that holds `span`. A table's
/// span may leave out its sub-tables (`[group.params]` lies outside the
/// span of its `[[group]]`), so every branch is searched, not only those
/// whose span holds it.
fn path_to<'a>(spot: &'a Spot, span: &std::ops::Range<usize>) -> Option<Vec<Step<'a>>> {
    let holds = |s: std::ops::Range<usize>| s.start <= span.start && span.end <= s.end;
    let within = |step: Step<'a>, value: &'a Spanned<Spot>| {
        let deeper = path_to(value.get_ref(), span);
        if deeper.is_none() && !holds(value.span()) {
            return None;
        }
        let mut path = vec![step];
        path.extend(deeper.unwrap_or_default());
        Some(path)
    };
    match spot {
        Spot::Table(entries) => entries.iter().find_map(|(k, v)| {
            if holds(k.span()) {
                // The key itself (an unknown one): nothing further in.
                Some(vec![Step::Key(k.get_ref())])
            } else {
                within(Step::Key(k.get_ref()), v)
            }
        }),
        Spot::List(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, v)| within(Step::Item(i), v)),
        Spot::Str(_) | Spot::Other => None,
    }
}

/// The string at `key` of table `spot`, if there is one.
fn str_at<'a>(spot: &'a Spot, key: &str) -> Option<&'a str> {
    let Spot::Table(entries) = spot else {
        return None;
    };
    entries
        .iter()
        .find(|(k, _)| k.get_ref() == key)
        .and_then(|(_, v)| match v.get_ref() {
            Spot::Str(s) => Some(s.as_str()),
            _ => None,
        })
}

/// What a failed typed parse of `text` means, in the file's words: which
/// group (by its id), which key (`count`, `params.xs[1]`), and what it
/// must be. `None` when the error points nowhere, or the text is not TOML
/// at all: then toml's own words are the ones that help.
fn in_file_words(text: &str, e: &toml::de::Error) -> Option<String> {
    let span = e.span()?;
    let root: Spot = toml::from_str(text).ok()?;
    let path = path_to(&root, &span).unwrap_or_default();
    let (who, rest) = match path.as_slice() {
        [Step::Key("group"), Step::Item(i), rest @ ..] => {
            let i = *i;
            let Spot::Table(top) = &root else {
                return None;
            };
            let id = top
                .iter()
                .find(|(k, _)| k.get_ref() == "group")
                .and_then(|(_, groups)| match groups.get_ref() {
                    Spot::List(groups) => groups.get(i),
                    _ => None,
                })
                .and_then(|g| str_at(g.get_ref(), "id"));
            (Some(group_name(i, id)), rest)
        }
        rest => (None, rest),
    };
    let mut key = String::new();
    for step in rest {
        match step {
            Step::Key(k) if key.is_empty() => key.push_str(k),
            Step::Key(k) => {
                key.push('.');
                key.push_str(k);
            }
            Step::Item(i) => key.push_str(&format!("[{i}]")),
        }
    }
    let message = e.message().trim_end();
    let what = if let Some((got, want)) = message
        .strip_prefix("invalid type: ")
        .or_else(|| message.strip_prefix("invalid value: "))
        .and_then(|m| m.split_once(", expected "))
    {
        let out_of_range = message.starts_with("invalid value: ");
        format!(
            "{key} must be {}, not {}",
            expected_words(want, out_of_range),
            got_words(got)
        )
    } else if let Some(name) = message
        .strip_prefix("missing field `")
        .and_then(|m| m.strip_suffix('`'))
    {
        format!("{name} is required")
    } else if let Some(known) = message
        .strip_prefix("unknown field `")
        .and_then(|m| m.split_once("`, expected "))
    {
        let (name, expected) = known;
        let expected = expected.strip_prefix("one of ").unwrap_or(expected);
        format!("unknown key `{name}`; the keys here are {expected}")
    } else if message.contains("untagged enum HostEntry") {
        format!(
            "{key}: a host is \"user@host:port\" or {{ host = \"user@host:port\", labels = \
             [\"…\"] }}, with no other keys"
        )
    } else if message.contains("untagged enum ParamValue") {
        format!("{key} must be a string, a number, true or false, or a list of those")
    } else if key.is_empty() {
        message.to_owned()
    } else {
        format!("{key}: {message}")
    };
    Some(match who {
        Some(who) => format!("{who}: {what}"),
        None => what,
    })
}

/// What serde expected, as a shape's author would say it.
fn expected_words(want: &str, out_of_range: bool) -> String {
    let whole = |max: u64| {
        if out_of_range {
            format!("a whole number from 0 to {max}")
        } else {
            "a whole number".to_owned()
        }
    };
    match want {
        "u8" => whole(u8::MAX.into()),
        "u16" => whole(u16::MAX.into()),
        "u32" => whole(u32::MAX.into()),
        "u64" | "usize" => whole(u64::MAX),
        "i8" | "i16" | "i32" | "i64" | "isize" => "a whole number".to_owned(),
        "f32" | "f64" => "a number".to_owned(),
        "a boolean" => "true or false".to_owned(),
        "a sequence" => "a list".to_owned(),
        "a map" => "a table".to_owned(),
        w if w.starts_with("struct ") => "a table".to_owned(),
        w => w.to_owned(),
    }
}

/// A value serde did not take, as TOML writes it: `"lots"`, `-1`, `true`,
/// `a list`.
fn got_words(got: &str) -> String {
    if let Some(quoted) = got.strip_prefix("string ") {
        return quoted.to_owned();
    }
    match got {
        "sequence" => return "a list".to_owned(),
        "map" => return "a table".to_owned(),
        _ => {}
    }
    // `integer `-1``, `floating point `1.5``, `boolean `true``.
    match got.split_once(" `") {
        Some((_, value)) => value.trim_end_matches('`').to_owned(),
        None => got.to_owned(),
    }
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shape_file_parses_with_an_optional_generation() {
        let f = ShapeFile::parse(
            "run = \"demo\"\n[[group]]\nid = \"worker\"\ncount = 3\nprovider = \"process\"\n",
            "x.toml",
        )
        .unwrap();
        assert_eq!(f.generation, None);
        let shape = f.to_shape(7).unwrap();
        assert_eq!(shape.generation, Generation(7));
        assert_eq!(shape.run_id, RunId::new("demo"));
        assert_eq!(shape.validate().unwrap().node_count(), 3);
    }

    #[test]
    fn malformed_toml_names_the_line_and_column() {
        let e = ShapeFile::parse("[[group]]\nid = \"w\"\ncount = three\n", "bad.toml").unwrap_err();
        assert!(e.to_string().starts_with("bad.toml:3:9:"), "{e}");
        let e = ShapeFile::parse("[[group]]\nid = \"w\"\ncuont = 3\n", "typo.toml").unwrap_err();
        assert!(e.to_string().contains("typo.toml:3:1"), "{e}");
        assert!(e.to_string().contains("cuont"), "{e}");
    }

    #[test]
    fn budgets_reach_the_shape_and_survive_the_journals_json() {
        let file = ShapeFile::parse(
            "run = \"r\"\n[[group]]\nid = \"w\"\ncount = 6\nprovider = \"process\"\nmax_unavailable = \"50%\"\nmax_unhealthy = 2\n",
            "x",
        )
        .unwrap();
        let shape = file.check(1).unwrap();
        let policy = shape.groups[0].policy;
        assert_eq!(policy.max_unavailable, Some(Quantity::Percent(50)));
        assert_eq!(policy.max_unhealthy, Some(Quantity::Count(2)));
        assert_eq!(policy.max_surge, None);
        // The journal keeps the shape as JSON; a shape without budgets
        // (as journals written before them hold) reads back with none.
        let json = serde_json::to_string(&shape).unwrap();
        assert!(json.contains("\"max_unavailable\":\"50%\""), "{json}");
        let back: ClusterShape = serde_json::from_str(&json).unwrap();
        assert_eq!(back, shape);
        let mut plain = shape.clone();
        plain.groups[0].policy = PolicyShape::default();
        let json = serde_json::to_string(&plain).unwrap();
        assert!(!json.contains("max_"), "{json}");
        assert_eq!(serde_json::from_str::<ClusterShape>(&json).unwrap(), plain);
    }

    #[test]
    fn on_preempt_reaches_the_policy_and_is_refused_where_nothing_is_paused() {
        let group = |policy: &str, params: &str| {
            format!(
                "run = \"r\"\n[[group]]\nid = \"g\"\ncount = 1\nprovider = \"vast\"\n\
                 image = \"pytorch/pytorch:latest\"\n{policy}\n[group.params]\nmax_dph = 1.0\n{params}"
            )
        };
        let bid = "rental = \"interruptible\"\nbid_dph = 0.5\n";
        let check = |body: &str| ShapeFile::parse(body, "p.toml").unwrap().check(1);
        let shape = check(&group("on_preempt = \"wait\"\npreempt_wait_s = 90", bid)).unwrap();
        let policy = shape.groups[0].policy.resolve();
        assert_eq!(
            policy.on_preempt,
            swactor_provisioning::OnPreempt::Wait { wait_s: 90 }
        );
        let json = serde_json::to_string(&shape).unwrap();
        assert!(json.contains("\"on_preempt\":\"wait\""), "{json}");
        assert_eq!(serde_json::from_str::<ClusterShape>(&json).unwrap(), shape);
        let shape = check(&group("on_preempt = \"wait\"", bid)).unwrap();
        assert_eq!(
            shape.groups[0].policy.resolve().on_preempt.wait_ms(),
            Some(600_000)
        );
        let shape = check(&group("on_preempt = \"replace\"", "")).unwrap();
        assert_eq!(
            shape.groups[0].policy.resolve().on_preempt,
            swactor_provisioning::OnPreempt::Replace
        );
        let e = check(&group("on_preempt = \"wait\"", ""))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("interruptible") && e.contains("nothing was changed"),
            "{e}"
        );
        let e = check(&group("preempt_wait_s = 60", bid))
            .unwrap_err()
            .to_string();
        assert!(e.contains("on_preempt is not \"wait\""), "{e}");
        let e = ShapeFile::parse(&group("on_preempt = \"later\"", bid), "p.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("on_preempt") || e.contains("later"), "{e}");
    }

    #[test]
    fn a_dollar_budget_reaches_the_shape_and_is_refused_where_it_means_nothing() {
        let vast = "[[group]]\nid = \"g\"\ncount = 1\nprovider = \"vast\"\n\
                    image = \"pytorch/pytorch:latest\"\n[group.params]\nmax_dph = 1.0\n";
        let f = ShapeFile::parse(
            &format!("run = \"r\"\nbudget_usd = 12.5\non_budget = \"pause\"\n{vast}"),
            "b.toml",
        )
        .unwrap();
        let shape = f.check(1).unwrap();
        assert_eq!(
            shape.budget,
            Some(Budget {
                usd_micros: 12_500_000,
                on_reached: OnBudget::Pause
            })
        );
        let json = serde_json::to_string(&shape).unwrap();
        let back: ClusterShape = serde_json::from_str(&json).unwrap();
        assert_eq!(back.budget, shape.budget);
        let refused = |body: &str| {
            ShapeFile::parse(body, "b.toml")
                .unwrap()
                .check(1)
                .unwrap_err()
                .to_string()
        };
        let e = refused(&format!("run = \"r\"\non_budget = \"down\"\n{vast}"));
        assert!(e.contains("budget_usd is not"), "{e}");
        let e = refused(&format!("run = \"r\"\nbudget_usd = -1.0\n{vast}"));
        assert!(e.contains("positive number of dollars"), "{e}");
        let e = refused(&format!(
            "run = \"r\"\nbudget_usd = 5.0\non_budget = \"stop\"\n{vast}"
        ));
        assert!(e.contains("\"pause\""), "{e}");
        let e = refused(
            "run = \"r\"\nbudget_usd = 5.0\n[[group]]\nid = \"w\"\ncount = 1\nprovider = \"process\"\n",
        );
        assert!(e.contains("rents") && e.contains("no vast group"), "{e}");
    }

    #[test]
    fn lifetimes_reach_the_shape_and_bad_ones_are_refused_in_words() {
        let process = "[[group]]\nid = \"w\"\ncount = 1\nprovider = \"process\"\n";
        let check = |top: &str| {
            ShapeFile::parse(&format!("run = \"r\"\n{top}\n{process}"), "l.toml")
                .map_err(|e| e.to_string())
                .and_then(|f| f.check(1).map_err(|e| format!("{e:#}")))
        };
        let shape = check("max_lifetime_s = 7200\nidle_teardown_s = 600").unwrap();
        assert_eq!(
            shape.lifetime,
            Lifetime {
                max_lifetime_s: 7_200,
                idle_teardown_s: 600
            }
        );
        // Kept as JSON in the journal; a shape without them writes none.
        let json = serde_json::to_string(&shape).unwrap();
        assert!(json.contains("\"max_lifetime_s\":7200"), "{json}");
        assert_eq!(serde_json::from_str::<ClusterShape>(&json).unwrap(), shape);
        let plain = check("").unwrap();
        assert!(plain.lifetime.is_off());
        assert!(!serde_json::to_string(&plain).unwrap().contains("lifetime"));
        // Written as a float, 0 (off), or idle on a run that runs no job yet.
        assert_eq!(
            check("max_lifetime_s = 60.0")
                .unwrap()
                .lifetime
                .max_lifetime_s,
            60
        );
        assert!(check("max_lifetime_s = 0").unwrap().lifetime.is_off());
        assert!(check("idle_teardown_s = 30").is_ok());
        for (bad, field) in [
            ("max_lifetime_s = -5", "max_lifetime_s = -5"),
            ("idle_teardown_s = 1.5", "idle_teardown_s = 1.5"),
            ("max_lifetime_s = 1e9", "max_lifetime_s = 1000000000"),
        ] {
            let e = check(bad).unwrap_err();
            assert!(
                e.contains(field) && e.contains("whole number of seconds"),
                "{bad}: {e}"
            );
        }
        let e = check("max_lifetime_s = \"2h\"").unwrap_err();
        assert!(e.contains("max_lifetime_s"), "{e}");
    }

    #[test]
    fn a_shape_without_a_run_or_without_nodes_is_refused_and_names_down() {
        let no_run = ShapeFile::parse(
            "[[group]]\nid = \"w\"\ncount = 1\nprovider = \"process\"\n",
            "x",
        )
        .unwrap();
        let e = no_run.check(1).unwrap_err().to_string();
        assert!(e.contains("names no run"), "{e}");
        for body in [
            "run = \"r\"\n",
            "run = \"r\"\n[[group]]\nid = \"w\"\ncount = 0\nprovider = \"process\"\n",
        ] {
            let e = ShapeFile::parse(body, "x")
                .unwrap()
                .check(1)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("no nodes") && e.contains("`swactor down`"),
                "{e}"
            );
        }
        let ok = ShapeFile::parse(
            "run = \"r\"\n[[group]]\nid = \"w\"\ncount = 2\nprovider = \"process\"\n",
            "x",
        )
        .unwrap();
        assert_eq!(ok.check(1).unwrap().node_count(), 2);
    }

    #[test]
    fn a_long_id_in_a_shape_is_cut_in_the_error() {
        let long = "a".repeat(5_000);
        let f = ShapeFile::parse(
            &format!(
                "run = \"{long}\"\n[[group]]\nid = \"w\"\ncount = 1\nprovider = \"process\"\n"
            ),
            "x",
        )
        .unwrap();
        let e = f.check(1).unwrap_err().to_string();
        assert!(e.contains("(5000 characters)") && e.len() < 300, "{e}");
    }

    #[test]
    fn own_capacity_refuses_growth_only() {
        let body = |count: u32| {
            format!(
                "run = \"r\"\ncapacity = 5\n[[group]]\nid = \"w\"\ncount = {count}\nprovider = \"process\"\n"
            )
        };
        let shape = ShapeFile::parse(&body(8), "x").unwrap().check(1).unwrap();
        let e = capacity_refusal(&shape, None, &[]).unwrap();
        assert_eq!(
            e,
            "the shape asks for 8 nodes, more than its own `capacity` of 5; nothing was changed"
        );
        let ten = ShapeFile::parse(&body(10), "x").unwrap().check(1).unwrap();
        assert_eq!(
            capacity_refusal(&shape, Some(&ten), &[]),
            None,
            "shrinking from 10"
        );
    }

    #[test]
    fn a_shape_past_this_machines_memory_is_refused_offline_as_a_daemon_would() {
        let body = |capacity: &str| {
            format!(
                "run = \"r\"\n{capacity}[[group]]\nid = \"w\"\ncount = 100000\nprovider = \"process\"\n\
                 [[group]]\nid = \"far\"\ncount = 5\nprovider = \"ssh\"\nhosts = [\"root@192.0.2.1\"]\n"
            )
        };
        let memory = Capacity {
            kind: "process".to_owned(),
            nodes: 300,
            basis: "this machine's memory".to_owned(),
        };
        let shape = ShapeFile::parse(&body(""), "x").unwrap().check(1).unwrap();
        let e = capacity_refusal(&shape, None, std::slice::from_ref(&memory)).unwrap();
        assert_eq!(
            e,
            "the shape asks for 100000 nodes, but this machine's memory allows at most 300; \
             nothing was changed (a top-level `capacity = N` in the shape allows more)"
        );
        // A provider's estimate is said as one, whatever its description
        // mentions.
        let described = Capacity {
            basis: "the `capacity` file of this test".to_owned(),
            ..memory.clone()
        };
        let e = capacity_refusal(&shape, None, &[described]).unwrap();
        assert_eq!(
            e,
            "the shape asks for 100000 nodes, but the `capacity` file of this test allows at \
             most 300; nothing was changed (a top-level `capacity = N` in the shape allows more)"
        );
        // The shape's own capacity goes past the estimate on purpose.
        let own = ShapeFile::parse(&body("capacity = 200000\n"), "x")
            .unwrap()
            .check(1)
            .unwrap();
        assert_eq!(capacity_refusal(&own, None, &[memory]), None);
        // What `validate` checks against is what the process provider reports.
        assert_eq!(
            offline_capacities().first().map(|c| c.kind.as_str()),
            swactor_providers::process::machine_capacity()
                .as_ref()
                .map(|c| c.kind.as_str())
        );
    }

    #[test]
    fn validation_names_groups_by_id_and_keys_as_the_file_writes_them() {
        let group = |extra: &str| {
            format!(
                "run = \"r\"\n[[group]]\nid = \"worker\"\ncount = 1\nprovider = \"process\"\n{extra}"
            )
        };
        let refused = |body: String| match ShapeFile::parse(&body, "s.toml") {
            Ok(file) => file.check(1).unwrap_err().to_string(),
            Err(e) => e.to_string(),
        };
        for (extra, want) in [
            (
                "lost_grace_s = -1\n",
                "group \"worker\": lost_grace_s must be a number >= 0 (got -1)",
            ),
            (
                "boot_timeout_s = inf\n",
                "group \"worker\": boot_timeout_s must be a finite number > 0 (got inf)",
            ),
            ("role = \"\"\n", "group \"worker\": role must not be empty"),
            (
                "max_surge = \"150%\"\n",
                "group \"worker\": max_surge must be a percentage from 0% to 100% (got 150%)",
            ),
            (
                "[group.params]\nratio = nan\n",
                "group \"worker\": params.ratio must be a finite number (got nan)",
            ),
            (
                "[group.params]\nmemory_mb = 256\n",
                "group \"worker\": unknown parameter `memory_mb` (the process provider takes none)",
            ),
            (
                "[[group]]\nid = \"worker\"\ncount = 1\nprovider = \"process\"\n",
                "group \"worker\" is declared twice (the 1st and the 2nd [[group]])",
            ),
        ] {
            let e = refused(group(extra));
            assert!(e.contains(want), "{extra}: {e}");
            assert!(!e.contains("groups["), "{extra}: {e}");
        }
        let e = refused(group("").replace("count = 1", "count = \"lots\""));
        assert!(
            e.starts_with(
                "s.toml:4:9: group \"worker\": count must be a whole number, not \"lots\""
            ),
            "{e}"
        );
        let e = refused(group("").replace("count = 1", "count = -1"));
        assert!(
            e.contains(
                "group \"worker\": count must be a whole number from 0 to 4294967295, not -1"
            ),
            "{e}"
        );
        let e = refused(group("env = { A = 1 }\nboot_check = [\"true\"]\n"));
        assert!(
            e.contains("group \"worker\": env.A must be a string, not 1"),
            "{e}"
        );
        let e = refused(group("[group.params]\nxs = [1, { a = 1 }]\n"));
        assert!(
            e.contains("group \"worker\": params.xs must be a string, a number"),
            "{e}"
        );
        let e = refused(group("").replace("provider = \"process\"\n", ""));
        assert!(e.contains("group \"worker\": provider is required"), "{e}");
        let e = refused(
            group("")
                .replace("id = \"worker\"\n", "")
                .replace("count = 1", "count = 1.5"),
        );
        assert!(
            e.contains("the 1st [[group]]: count must be a whole number, not 1.5"),
            "{e}"
        );
        let e = refused(group("").replace("provider = \"process\"", "provider = \"aws\""));
        assert!(
            e.starts_with("group \"worker\": provider \"aws\" is not one this daemon can drive"),
            "{e}"
        );
        let e = refused(group("").replace("id = \"worker\"", "id = \"Worker\""));
        assert!(
            e.contains("the id \"Worker\" of the 1st [[group]] must start with a lowercase letter"),
            "{e}"
        );
        // Values of provider parameters are shown as the file writes them.
        let e = refused(
            group("").replace(
                "provider = \"process\"",
                "provider = \"docker\"\nimage = \"a\"",
            ) + "[group.params]\nimage = \"b\"\n",
        );
        assert!(
            e.contains("the group's `image` is \"a\"") && !e.contains("boot.image"),
            "{e}"
        );
        let e = refused(
            group("").replace("provider = \"process\"", "provider = \"docker\"")
                + "[group.params]\nmemory_mb = \"lots\"\n",
        );
        assert!(
            e.contains(
                "group \"worker\": `memory_mb` must be a whole number of megabytes, not \"lots\""
            ),
            "{e}"
        );
    }

    #[test]
    fn vast_groups_are_checked_and_must_agree_on_the_spend_cap() {
        let group = |id: &str, params: &str| {
            format!(
                "[[group]]\nid = \"{id}\"\ncount = 1\nprovider = \"vast\"\nimage = \"img\"\n\
                 [group.params]\n{params}\n"
            )
        };
        let check = |body: String| {
            ShapeFile::parse(&format!("run = \"r\"\n{body}"), "x")
                .unwrap()
                .check(1)
        };
        check(group("a", "max_dph = 0.5\nspend_cap_dph = 2.0")).unwrap();
        let e = check(group("a", "max_dph = 0")).unwrap_err().to_string();
        assert!(
            e.contains("group \"a\"") && e.contains("`max_dph` must be more than 0"),
            "{e}"
        );
        let e = check(group("a", "max_dph = 1.0\nnum_gpu = 2"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown parameter `num_gpu`"), "{e}");
        let two = format!(
            "{}{}",
            group("a", "max_dph = 0.5\nspend_cap_dph = 2.0"),
            group("b", "max_dph = 0.5\nspend_cap_dph = 3.0")
        );
        let e = check(two).unwrap_err().to_string();
        assert!(
            e.contains("spend_cap_dph = 3 but group \"a\" sets 2"),
            "{e}"
        );
    }

    #[test]
    fn an_unknown_provider_kind_is_refused() {
        let f = ShapeFile::parse(
            "[[group]]\nid = \"g\"\ncount = 1\nprovider = \"aws\"\n",
            "x",
        )
        .unwrap();
        let e = f.to_shape(1).unwrap_err();
        assert!(e.to_string().contains("\"aws\""), "{e}");
        assert!(e.to_string().contains("supported: process"), "{e}");
    }

    #[test]
    fn jobs_per_node_and_gpus_are_read_and_zero_jobs_per_node_is_refused() {
        let body = |extra: &str| {
            format!(
                "run = \"r\"\n[[group]]\nid = \"g\"\ncount = 1\nprovider = \"process\"\n{extra}"
            )
        };
        let shape = ShapeFile::parse(&body("jobs_per_node = 3\ngpus = 8\n"), "x")
            .unwrap()
            .check(1)
            .unwrap();
        let policy = shape.groups[0].policy.resolve();
        assert_eq!((policy.jobs_per_node, policy.gpus), (3, Some(8)));
        let shape = ShapeFile::parse(&body(""), "x").unwrap().check(1).unwrap();
        let policy = shape.groups[0].policy.resolve();
        assert_eq!((policy.jobs_per_node, policy.gpus), (1, None));
        let e = ShapeFile::parse(&body("jobs_per_node = 0\n"), "x")
            .unwrap()
            .check(1)
            .unwrap_err();
        assert!(
            format!("{e:#}").contains("jobs_per_node = 0 would never run a job"),
            "{e:#}"
        );
    }

    #[test]
    fn a_groups_orphan_lease_is_read_and_a_bad_policy_is_refused() {
        let body = |extra: &str| {
            format!(
                "run = \"r\"\n[[group]]\nid = \"g\"\ncount = 1\nprovider = \"process\"\n{extra}"
            )
        };
        let shape = ShapeFile::parse(
            &body("orphan_after_s = 30\norphan_policy = \"idle\"\n"),
            "x",
        )
        .unwrap()
        .check(1)
        .unwrap();
        let policy = shape.groups[0].policy.resolve();
        assert_eq!(policy.orphan_after_s, 30);
        assert_eq!(
            policy.orphan_policy,
            swactor_provisioning::OrphanPolicy::Idle
        );
        let shape = ShapeFile::parse(&body(""), "x").unwrap().check(1).unwrap();
        let policy = shape.groups[0].policy.resolve();
        assert_eq!(policy.orphan_after_s, 3_600, "an hour by default");
        assert_eq!(
            policy.orphan_policy,
            swactor_provisioning::OrphanPolicy::Always
        );
        let e = ShapeFile::parse(&body("orphan_policy = \"later\"\n"), "x").unwrap_err();
        assert!(e.to_string().contains("orphan_policy"), "{e}");
        let e = ShapeFile::parse(&body("orphan_after_s = -1\n"), "x").unwrap_err();
        assert!(e.to_string().contains("orphan_after_s"), "{e}");
    }

    #[test]
    fn a_provider_the_embedder_brings_may_be_named_and_is_listed_as_supported() {
        let body = "run = \"r\"\n[[group]]\nid = \"g\"\ncount = 1\nprovider = \"own\"\n";
        let mut f = ShapeFile::parse(body, "x").unwrap();
        let e = f.check(1).unwrap_err().to_string();
        assert!(
            e.contains("provider \"own\" is not one this daemon can drive"),
            "{e}"
        );
        f.allow_providers(&["own"]);
        let shape = f.check(1).unwrap();
        assert_eq!(shape.groups[0].provider.kind, "own");
        // Another unknown kind names the embedder's among the supported.
        let mut other = ShapeFile::parse(&body.replace("\"own\"", "\"aws\""), "x").unwrap();
        other.allow_providers(&["own"]);
        let e = other.check(1).unwrap_err().to_string();
        assert!(
            e.contains("supported: process, ssh, docker, vast, own"),
            "{e}"
        );
        // The kinds a daemon allows never travel with the file.
        let sent = serde_json::to_string(&f).unwrap();
        let got: ShapeFile = serde_json::from_str(&sent).unwrap();
        assert!(got.more_providers.is_empty());
    }
}
